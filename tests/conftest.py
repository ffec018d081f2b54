"""Eight fake CPU devices for every test, so parallel layouts run in one process (set before jax is imported).

The eight fake devices share XLA:CPU's thread pools, and their collectives can deadlock in two ways, after which
XLA aborts the process when a rendezvous times out (CI lost a worker each way): pools too small for the devices,
and collectives that XLA's concurrency-optimised scheduler moves ahead of a while loop that holds collectives.
`msjax.runtime.setup()`, which the suite calls here as every entry point does, sizes the pools at two threads per
device and turns that scheduler off (msjax/runtime.py, `size_cpu_thread_pools` and `order_cpu_collectives`, with
the measurements). The tests also raise XLA's
rendezvous timeout from 40 s to 300 s, so a collective that is merely slow on a loaded machine is not taken for a
deadlock; a real one still ends, and XLA's message names the collective it waited for.

Most of the suite's time is XLA:CPU compiling small programs (each parallel layout, each subprocess run), and most
of a compile is LLVM optimising the generated code. The tests compile with `--xla_backend_optimization_level=0`:
measured here, test_parallel.py's rule-set equivalence (4 layouts, cold compilation cache) took 98 s at the default
level and 53 s at 0. The flag sets the optimisation level of XLA:CPU's code generation; the SPMD partitioner, which
decides shardings and collectives, runs before it, and the suite's compiled-memory checks pass at this level. Every
comparison in the suite (one device against a layout, a run against its resume) compiles both sides at the same
level. Nothing outside the tests is compiled this way.
"""

import os

from tests.xdist_scheduling import pytest_xdist_make_scheduler  # noqa: F401  (a worker crash must not hang the run)

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_cpu_collective_call_terminate_timeout_seconds=300"
                           " --xla_cpu_collective_timeout_seconds=300"
                           " --xla_backend_optimization_level=0").strip()


import logging  # noqa: E402

import pytest  # noqa: E402

from msjax import runtime  # noqa: E402

runtime.setup()  # the process set-up of a run, as every entry point does (importing msjax changes nothing)


@pytest.fixture(autouse=True)
def _logging_restored():
    """Restores the root logger's handlers and level after each test. A script's main() run in-process
    (msjax.cli.setup_logging: `logging.basicConfig(stream=sys.stderr, force=True)`) binds a handler to the test's
    captured stderr, which pytest closes when the test ends; left in place, a later test's log records would go to
    that closed stream ("I/O operation on closed file")."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
