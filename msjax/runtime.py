"""Process set-up applied once on `import msjax`: the C allocator, jax's persistent compilation cache, and the size
of XLA:CPU's thread pools when one process drives several CPU devices.

Both exist because of measurements on a 2-core CPU machine (shared/FIELD_NOTES.md, "CPU speed: the allocator"):

- glibc malloc hands XLA:CPU's large per-step buffers (above its dynamic mmap threshold) back to the OS with
  munmap/trim and page-faults them in again on the next step: on shakespeare_char ~25% of the wall time was system
  time and ~12,000 minor faults per step. `mallopt` (through ctypes, so nothing has to be set before Python
  starts, unlike GLIBC_TUNABLES or LD_PRELOAD) raises the mmap threshold to 1 GiB and turns trimming off,
  so freed buffers stay in the heap and are reused. The price is that the process keeps its peak heap.
  It also caps glibc at one arena: memory freed by XLA's worker threads lives in per-thread arenas, whose 64 MiB
  heaps glibc unmaps whole when they fall empty whatever the trim threshold says (and maps again on the next
  step). That starts at random well into a run: a shakespeare_char step loop ran 0 faults per step for 1,800
  steps, then 2,215 (a 2000-step job: 22.8 s system time, 8.4 million faults, against 3.7 s and 0.16 million);
  under strace, 45,123 mprotect + 5,487 munmap calls in 2000 steps with the default arenas, 822 + 4,124 (mostly
  start-up) and 0 faults per step after the first 200 with one arena. The one arena's lock cost no step time
  measurable here (2 cores; shakespeare_char, 100-step windows after the first: 37.0-42.8 ms with one arena,
  35.5-47.1 ms with the default arenas, 2 alternating processes each; no finer A/B was made).
- Compiling the train step takes seconds of every run; jax's persistent compilation cache keeps the compiled
  executables in the user's cache directory (XDG), so a repeated run skips most of that.
- With several CPU processes jax caches only process 0's executables, and no other process ever hits: see
  `cache_on_every_process` (measured: a restarted 2-process run's process 1 compiled its whole first step again,
  28-55 s on the loaded 2-core machine, while process 0 loaded it from the cache).

- Several CPU devices in one process (`--xla_force_host_platform_device_count=N`, as the tests and CPU layout runs
  use) can deadlock XLA:CPU's in-process collectives in two ways: see `size_cpu_thread_pools` and
  `order_cpu_collectives`.

Opt-outs, for a user who wants the plain defaults: `MSJAX_MALLOPT=0` leaves malloc alone; an explicit
`JAX_COMPILATION_CACHE_DIR` (or `jax.config.update("jax_compilation_cache_dir", ...)` before import) wins, and
`MSJAX_COMPILATION_CACHE=0` turns our default off; `MSJAX_CACHE_EVERY_PROCESS=0` leaves jax's process-0-only
cache writes alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import sys
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


def tune_malloc() -> bool:
    """Raises glibc's mmap threshold to 1 GiB, disables heap trimming and keeps malloc to one arena (see module
    docstring). Must run before other threads allocate (msjax calls it on import, before jax starts any).

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


def enable_compilation_cache() -> str | None:
    """Points jax's persistent compilation cache at `cache_home()/jax` unless the user chose a directory (or set
    `MSJAX_COMPILATION_CACHE=0`). Returns the directory in use, or None. Idempotent.

    Only executables that took more than `jax_persistent_cache_min_compile_time_secs` (jax's default 1 s) to
    compile are written, so small jitted helpers do not fill the cache.
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
    deadlock, which XLA ends with an abort after `xla_cpu_collective_call_terminate_timeout_seconds`. Measured on
    a 2-core machine with another process loading it, 8 devices, a loop of matmul + psum + ppermute in
    `shard_map`: at 8 threads it deadlocked within 60 s in each of 3 runs (2 to 5 of 8 devices arrived); at 16
    and 32 threads 60 s ran clean (1,092 and 734-770 steps). CI saw it once as an abort in an 8-device test.
    The extra threads sleep unless there is parallel work; a single-device process is left alone.
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
    after the loop. Measured on the 2-core machine with a second process loading it, that layout's 4-step run
    repeated for 120 s: scheduler on, the process aborted within 5 runs in each of 4 tries (3 at 16 pool threads,
    1 at 64); off, 6 tries ran clean (66 to 97 runs each). The scheduler changes the order of the program,
    not what it computes; on fake CPU devices there is no link whose time it could hide (docs/overlap.md). It
    does change compiled temp memory (the planner's estimate, within 10% of the default's bytes, came out
    1.12-1.40x those compiled with it off on its 12 test layouts), so the compile-only check whose figures the
    planner is fitted to (`msjax.planner.compile_check`) compiles in a subprocess that keeps the default. The
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


def setup() -> None:
    """All of the above; called from `msjax/__init__.py` so every entry point (scripts, notebooks, tests) gets
    them. malloc is tuned first, before jax is imported and allocates; the thread pools are sized before jax
    creates its CPU client (on first use, not on import)."""
    tune_malloc()
    size_cpu_thread_pools()
    order_cpu_collectives()
    enable_compilation_cache()
    cache_on_every_process()
