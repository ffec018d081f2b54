"""Process set-up of a run: the one place where msjax changes process-wide state, and only when asked.

`setup()` changes exactly this, each for a reason below and each with an opt-out. Importing msjax or any of its
modules changes nothing (a dry run, `import msjax.config` in a user's program); `setup()` runs where a run starts:
`msjax.train.main` (the train command every launcher's workers run) and `msjax.train.run`, the launch command, the
benchmark scripts, the notebook's first cell and the test suite's conftest (tests/msjax/test_runtime.py checks
both):

- glibc malloc (`tune_malloc`), on CPU runs only (`cpu_run`): mmap threshold 1 GiB, heap trimming off, one arena.
  On a GPU or TPU host the data loader's threads would contend on that one arena, and XLA:CPU's per-step buffers,
  the reason for the tuning, are not there. glibc hands XLA:CPU's large
  per-step buffers back to the OS (munmap/trim, and whole per-thread arena heaps when they fall empty) and
  page-faults them in again on the next step: a large share of a CPU run's wall time went to system time and
  minor faults (docs/cpu_speed.md). `mallopt` through ctypes needs nothing set before Python starts, unlike
  GLIBC_TUNABLES or LD_PRELOAD. The price: the process keeps its peak heap. `MSJAX_MALLOPT=0` leaves malloc alone.
- jax's persistent compilation cache (`enable_compilation_cache`): `jax_compilation_cache_dir` set to
  `cache_home()/jax`, so a repeated run skips most of the seconds of compiling its step, and
  `jax_persistent_cache_min_compile_time_secs` lowered from jax's 1 s to `MIN_COMPILE_TIME_S`, so it skips the
  programs that compile in a fraction of a second too (initialisation, evaluation, checkpoint checksums). A
  directory the user chose (`JAX_COMPILATION_CACHE_DIR`, or `jax.config.update` before import) wins and keeps
  jax's floor, as does a floor the user set; `MSJAX_COMPILATION_CACHE=0` turns both defaults off.
- jax's cache writer (`cache_on_every_process`): with several CPU processes jax caches only process 0's
  executables and no other process ever hits, so a restarted job's other processes compile everything again.
  `MSJAX_CACHE_EVERY_PROCESS=0` leaves jax's writer alone.
- `PJRT_NPROC` and `XLA_FLAGS` in os.environ, only when this process asks for several CPU devices
  (`--xla_force_host_platform_device_count=N`, as tests and CPU layout runs do): two ways XLA:CPU's in-process
  collectives can deadlock (`size_cpu_thread_pools`, `order_cpu_collectives`). A value the user set wins.
- Log noise of a failed asynchronous checkpoint write (`quiet_failed_checkpoint_writes`): a filter on the `absl`
  logger drops the tracebacks Orbax's own files log (msjax.checkpoint reports the failure once, as
  CheckpointWriteError) and two notes Orbax logs on every per-host save, and a warnings filter ignores "coroutine
  ... was never awaited" RuntimeWarnings, which Python prints at exit for the coroutines of the save Orbax
  abandoned.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import re
import sys
import warnings
from pathlib import Path

# glibc <malloc.h>: mallopt parameter numbers.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
# 1 GiB, the value measured with GLIBC_TUNABLES (glibc 2.36 accepts it from mallopt too): blocks above it are still
# mmapped, but XLA:CPU's per-step buffers for any model that fits a CPU are far smaller.
MMAP_THRESHOLD_MAX = 1 << 30
# Trimming off: LONG_MAX-ish (mallopt takes an int; 2**31-1 bytes is beyond any free top chunk we produce).
TRIM_THRESHOLD_OFF = (1 << 31) - 1
# One arena, the main one (grown with brk and trimmed only past the threshold above); see the module docstring.
ARENAS = 1

_state: dict[str, object] = {}
_POOLS_MARK = "MSJAX_PJRT_NPROC"  # the PJRT_NPROC value msjax set (size_cpu_thread_pools), so children can tell


def cache_home() -> Path:
    """msjax's cache directory: `$MSJAX_CACHE_HOME`, else `$XDG_CACHE_HOME/msjax`, else `~/.cache/msjax`
    (XDG Base Directory Specification). Not created here."""
    if os.environ.get("MSJAX_CACHE_HOME"):
        return Path(os.environ["MSJAX_CACHE_HOME"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "msjax"


def cpu_run() -> bool:
    """Whether this process will run on CPU devices, decided before jax starts a backend: `JAX_PLATFORMS` when it
    is set (its first platform), else the absence of accelerator device files (NVIDIA's `/dev/nvidiactl`, a TPU
    VM's `/dev/accel0` or `/dev/vfio/0`), which is what jax's GPU and TPU plugins would find."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip().lower() == "cpu"
    return not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/accel0", "/dev/vfio/0"))


def tune_malloc() -> bool:
    """Raises glibc's mmap threshold to 1 GiB, disables heap trimming and keeps malloc to one arena (see module
    docstring). Must run before other threads allocate (`setup` calls it first, before jax starts any).

    Returns True when glibc accepted all three settings; False on another C library, with `MSJAX_MALLOPT=0`, or when
    glibc refused. Idempotent.
    """
    if "malloc" in _state:
        return bool(_state["malloc"])
    ok = False
    if os.environ.get("MSJAX_MALLOPT", "1") != "0" and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt
        except (OSError, AttributeError):  # musl and others have no mallopt
            mallopt = None
        if mallopt is not None:
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(
                mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_OFF)) and bool(mallopt(M_ARENA_MAX, ARENAS))
    _state["malloc"] = ok
    return ok


# jax writes an executable to its persistent cache only when compiling it took at least
# `jax_persistent_cache_min_compile_time_secs` (jax's default 1 s, so that tiny programs do not fill the cache).
# A CPU run's own small programs fall under that floor and were compiled again on every start: parameter
# initialisation, evaluation, the checkpoint checksums (one per leaf shape), the learning-rate table, 0.05-0.3 s
# each. With this floor a repeated shakespeare_char run (20 steps, warm cache) took 4.7-5.0 s instead of 5.4-5.6 s
# (docs/cpu_speed.md); reading an entry back takes milliseconds. Eager jax operations (one small program per
# primitive and shape, compiled in milliseconds) stay under it.
MIN_COMPILE_TIME_S = 0.1
JAX_MIN_COMPILE_TIME_S = 1.0  # jax's own default


def enable_compilation_cache() -> str | None:
    """Points jax's persistent compilation cache at `cache_home()/jax` and writes programs that compiled in
    `MIN_COMPILE_TIME_S` or more, unless the user chose a directory (or set `MSJAX_COMPILATION_CACHE=0`); a
    floor the user set (`JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`, or `jax.config.update` before import)
    stays. Returns the directory in use, or None. Idempotent.
    """
    if "cache" in _state:
        return _state["cache"]  # type: ignore[return-value]
    import jax

    current = jax.config.jax_compilation_cache_dir
    if current or os.environ.get("MSJAX_COMPILATION_CACHE", "1") == "0":
        _state["cache"] = current or None
        return _state["cache"]  # type: ignore[return-value]
    path = cache_home() / "jax"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: run without the cache rather than fail
        _state["cache"] = None
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    if ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ
            and jax.config.jax_persistent_cache_min_compile_time_secs == JAX_MIN_COMPILE_TIME_S):
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
    _state["cache"] = str(path)
    return str(path)


def cache_on_every_process() -> bool:
    """Lets every process of a multi-process CPU job write its own entries to jax's persistent compilation cache,
    so that a restarted job loads every process's executables instead of only process 0's. Returns whether the
    change is in place. Idempotent; `MSJAX_CACHE_EVERY_PROCESS=0` turns it off.

    Why (jax 0.10.2, jax/_src/compiler.py and cache_key.py, read and measured here):
    - jax writes cache entries only from process 0 (`_cache_write`: "contention for writes on some
      filesystems"), and relies on every process computing the same cache key, so that the others read process
      0's entry. On GPU jax makes keys agree across processes by stripping the device assignment.
    - On CPU they never agree: the key hashes the backend's topology (`_hash_accelerator_config`), and a CPU
      client's topology is its own process's devices, so process k's key differs from process 0's for the same
      program (jax_explain_cache_misses showed `jit_train_step-b2f7...` on process 0 and `-0f7c...` on process
      1, each the same on every restart). Process k > 0 therefore misses on every start, for every program.
    - jax's public alternative, `jax_share_binary_between_hosts` (process 0 compiles and sends the executable
      through the coordination service under its cache key), deadlocks on CPU for the same reason: process 1
      waits for its own key, which process 0 never sets ("GetKeyValue() timed out with key: jit_step-7480...",
      2 local processes). No public option writes from other processes (jax GitHub issue 18819).
    So on the CPU backend, a process k > 0 writes its own entry, under its own key, with jax's own writer
    (`compilation_cache.put_executable_and_time`) and jax's own conditions (no host callbacks; at least
    `jax_persistent_cache_min_compile_time_secs` of compiling; the entry-size floor is checked by the writer).
    Keys differ per process, so no two processes write the same file. Other platforms keep jax's behaviour.
    The wrapper and the private names it touches are in `msjax.compat.cache_every_process`; when the writer's
    signature is not the one read (another jax version), nothing is changed and False is returned.
    """
    if "every_process" in _state:
        return bool(_state["every_process"])
    _state["every_process"] = False
    if os.environ.get("MSJAX_CACHE_EVERY_PROCESS", "1") == "0":
        return False
    from msjax import compat

    _state["every_process"] = compat.cache_every_process()
    return bool(_state["every_process"])


def cpu_device_count() -> int:
    """The CPU device count this process asked XLA for: `--xla_force_host_platform_device_count=N` in `XLA_FLAGS`
    or `JAX_NUM_CPU_DEVICES` (the last one given wins, as XLA parses flags), else 1."""
    n = 1
    env = os.environ.get("JAX_NUM_CPU_DEVICES", "")
    if env.strip().lstrip("-").isdigit():
        n = int(env)
    for m in re.finditer(r"--xla_force_host_platform_device_count=(-?\d+)", os.environ.get("XLA_FLAGS", "")):
        n = int(m.group(1))
    return max(n, 1)


def size_cpu_thread_pools() -> int | None:
    """Gives XLA:CPU at least two intra-op threads per local CPU device (through `PJRT_NPROC`, which jaxlib reads
    when it creates the CPU client) unless the user set `PJRT_NPROC` or `NPROC`. Returns the size set, or None.

    Why: the CPU client sizes both of its pools (intra-op "XLAEigen" and "XLAPjRtCpuClient") at
    max(cores, devices). A device program resumes on an intra-op thread after an asynchronous thunk and may then
    block that thread in a collective's rendezvous; another device's parallel matmul queues its pieces on the same
    pool. With as many threads as devices, the blocked rendezvous can hold every thread those pieces need: a
    deadlock, which XLA ends with an abort after `xla_cpu_collective_call_terminate_timeout_seconds`. On a loaded
    2-core machine a loop of matmul + psum + ppermute in `shard_map` over 8 devices deadlocked with 8 pool threads
    and ran clean with 16 or 32. The extra threads sleep unless there is parallel work; a single-device process is
    left alone.
    """
    if "pools" in _state:
        return _state["pools"]  # type: ignore[return-value]
    n = cpu_device_count()
    # A value we set in a parent process (subprocesses inherit the environment) is recomputed for this process's
    # device count; a value the user set is theirs.
    ours = os.environ.get("PJRT_NPROC") is not None and os.environ.get("PJRT_NPROC") == os.environ.get(_POOLS_MARK)
    if ours:
        del os.environ["PJRT_NPROC"]
    size = None
    if n > 1 and not (os.environ.get("PJRT_NPROC") or os.environ.get("NPROC")):
        size = max(os.cpu_count() or 1, 2 * n)
        os.environ["PJRT_NPROC"] = os.environ[_POOLS_MARK] = str(size)
    _state["pools"] = size
    return size


# XLA:CPU's scheduler that moves independent work (collectives included) ahead of loops to run it concurrently.
CPU_CONCURRENT_SCHEDULER = "xla_cpu_enable_concurrency_optimized_scheduler"


def order_cpu_collectives() -> bool:
    """Turns XLA:CPU's concurrency-optimised scheduler off (`--xla_cpu_enable_concurrency_optimized_scheduler=false`
    appended to `XLA_FLAGS`) when this process asks for several CPU devices, unless the user set that flag.
    Returns True when it appended the flag.

    Why: XLA:CPU runs a program's thunks as a dataflow graph on its intra-op pool; collectives, and while loops
    holding collectives, only *start* in program order on every device (a start may just queue the work), they
    may overlap, and each blocks a thread in a rendezvous until every participant arrives. The
    concurrency-optimised scheduler (on by default) moves collectives that do not depend on the layer loop ahead
    of it, to overlap them with it. Seen on a (data 2, sequence 2, tensor 2) mesh of 8 CPU devices, in the
    gradient program: the loss's resharding of the targets (a collective-permute over all 8 devices) was
    scheduled before the scanned layers' while loop, whose body all-gathers over the tensor axis; 7 devices
    waited in the permute, the eighth in the loop's all-gather for its partner, one of the 7, and XLA aborted at
    its rendezvous timeout (CI lost a worker this way, in `test_layouts_match_single_device`). Why the eighth
    never reached the permute it started first is not established. With the scheduler off the permute comes
    after the loop, and that layout's repeated runs no longer aborted. The scheduler changes the order of the
    program, not what it computes; on fake CPU devices there is no link whose time it could hide
    (docs/overlap.md). It does change compiled temp memory, so the compile-only check whose figures the planner
    is fitted to (`msjax.planner.compile_check`) compiles in a subprocess that keeps the default. The
    flag is read per process, not per compilation: `compiler_options` did not change the schedule. One CPU
    device has no collectives and is left alone; GPU and TPU compilers do not read the flag.
    """
    if "order" in _state:
        return bool(_state["order"])
    flags = os.environ.get("XLA_FLAGS", "")
    ordered = cpu_device_count() > 1 and f"--{CPU_CONCURRENT_SCHEDULER}" not in flags
    if ordered:
        os.environ["XLA_FLAGS"] = f"{flags} --{CPU_CONCURRENT_SCHEDULER}=false".strip()
    _state["order"] = ordered
    return ordered


def concurrent_scheduler_on() -> bool:
    """Whether this process compiles with XLA:CPU's concurrency-optimised scheduler: the last
    `--xla_cpu_enable_concurrency_optimized_scheduler=` in `XLA_FLAGS` (XLA's default, on, when there is none).
    `order_cpu_collectives` may have set it here or in a parent process whose environment this one inherited."""
    values = re.findall(rf"--{CPU_CONCURRENT_SCHEDULER}=(\w+)", os.environ.get("XLA_FLAGS", ""))
    return not values or values[-1].lower() not in ("false", "0")


# Warnings Orbax logs on every save of a process that writes its own directory (msjax.checkpoint's per-host
# tier, `primary_host=None`, zarr without OCDBT): they describe that configuration, not a fault.
ORBAX_PER_HOST_NOTES = ("Global object size logging disabled for `primary_host=None`",
                        "Skipping merge of OCDBT checkpoints: No per-process OCDBT checkpoint subdirs found")


class OrbaxTracebacks(logging.Filter):
    """Drops the log records with a traceback that Orbax's own files log: Orbax logs every failed background write
    with its whole traceback (hundreds of lines) before it re-raises it (and again on every later wait), and
    msjax.checkpoint reports it once, as CheckpointWriteError. Also drops `ORBAX_PER_HOST_NOTES`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if f"{os.sep}orbax{os.sep}" not in record.pathname:
            return True
        return not (record.exc_info or any(note in str(record.msg) for note in ORBAX_PER_HOST_NOTES))


# The coroutines of a save Orbax abandoned after a failed write are never awaited; Python warns of each at exit.
UNAWAITED_COROUTINE = r"coroutine .* was never awaited"


def quiet_failed_checkpoint_writes() -> None:
    """Adds `OrbaxTracebacks` to absl's logger (Orbax logs through absl) and ignores RuntimeWarnings matching
    `UNAWAITED_COROUTINE`. Idempotent.

    absl's logger is taken from absl itself (`absl.logging`, which Orbax depends on), never made first with
    `logging.getLogger("absl")`: absl would then adopt a plain Logger, whose records name absl's wrapper as their
    file instead of Orbax's, and the filter would let Orbax's tracebacks through."""
    if "quiet" in _state:
        return
    from absl import logging as absl_logging

    absl_logging.get_absl_logger().addFilter(OrbaxTracebacks())
    warnings.filterwarnings("ignore", message=UNAWAITED_COROUTINE, category=RuntimeWarning)
    _state["quiet"] = True


def setup() -> None:
    """Everything of the module docstring, once per process (every step is idempotent): call it first where a run
    starts. malloc is tuned first (CPU runs only, `cpu_run`), before jax allocates; the thread pools are sized
    before jax creates its CPU client (on first use, not on import)."""
    if cpu_run():
        tune_malloc()
    size_cpu_thread_pools()
    order_cpu_collectives()
    enable_compilation_cache()
    cache_on_every_process()
    quiet_failed_checkpoint_writes()
