"""Eight fake CPU devices for every test, so parallel layouts run in one process (set before jax is imported).

The eight fake devices are threads sharing the machine's cores. XLA:CPU aborts the whole process when a
collective's participants do not all reach its rendezvous within a termination timeout (40 s by default;
measured here: a data x sequence x tensor step aborted that way while other jobs loaded the 2 cores). The tests
raise that timeout to 300 s. It is still a timeout, and XLA's message still names the collective it waited for.

Most of the suite's time is XLA:CPU compiling small programs (each parallel layout, each subprocess run), and most
of a compile is LLVM optimising the generated code. The tests compile with `--xla_backend_optimization_level=0`:
measured here, test_parallel.py's rule-set equivalence (4 layouts, cold compilation cache) took 98 s at the default
level and 53 s at 0. The flag sets the optimisation level of XLA:CPU's code generation; the SPMD partitioner, which
decides shardings and collectives, runs before it, and the suite's compiled-memory checks pass at this level. Every
comparison in the suite (one device against a layout, a run against its resume) compiles both sides at the same
level. Nothing outside the tests is compiled this way.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_cpu_collective_call_terminate_timeout_seconds=300"
                           " --xla_cpu_collective_timeout_seconds=300"
                           " --xla_backend_optimization_level=0").strip()
