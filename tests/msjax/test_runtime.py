"""Process set-up (msjax/runtime.py): malloc keeps freed large buffers, caches live in the user's cache dir."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# glibc malloc/free through ctypes, after `msjax.runtime.setup()` when the first argument says so.
_PREAMBLE = r"""
import ctypes, resource, sys
if sys.argv[1] == "msjax":
    import msjax.runtime
    msjax.runtime.setup()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def faults_of_20_rounds(n):  # allocate n bytes, touch every page, free; once to warm up, then 20 times counted
    def once():
        p = libc.malloc(n)
        ctypes.memset(p, 1, n)
        libc.free(p)
    once()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        once()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
"""

# Allocates and frees a 64 MiB buffer 20 times, touching every page, and prints the minor page faults that took.
# With glibc defaults each allocation is a fresh mmap (64 MiB > the dynamic mmap threshold's 32 MiB cap) and
# faults all 16,384 pages in again; with msjax's mallopt the freed block stays in the heap and is reused.
_FAULTS = _PREAMBLE + r"""
print(faults_of_20_rounds(64 << 20))
"""


# The same from a second thread, which glibc serves from a per-thread arena of 64 MiB heaps: a 40 MiB block is
# kept, and a second 40 MiB block, allocated and freed 20 times, needs a heap of its own; by default glibc unmaps
# that heap whole each time it falls empty (trim threshold or not) and faults it in again.
_THREAD_FAULTS = _PREAMBLE + r"""
import threading
n = 40 << 20
out = []
def worker():
    kept = libc.malloc(n)
    ctypes.memset(kept, 1, n)
    out.append(faults_of_20_rounds(n))
    libc.free(kept)
t = threading.Thread(target=worker)
t.start()
t.join(60)
print(out[0])
"""


def _faults(mode: str, tmp_path: Path, program: str = _FAULTS) -> int:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "MSJAX_COMPILATION_CACHE": "0"}
    env.pop("GLIBC_TUNABLES", None)
    out = subprocess.run([sys.executable, "-c", program, mode], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_setup_stops_malloc_returning_large_buffers_to_the_os(tmp_path):
    plain, tuned = _faults("plain", tmp_path), _faults("msjax", tmp_path)
    pages = 20 * (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert plain >= 0.9 * pages, plain  # the default really does fault every page back in
    assert tuned < 0.05 * pages, tuned


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_setup_keeps_worker_threads_heaps_mapped(tmp_path):
    plain = _faults("plain", tmp_path, _THREAD_FAULTS)
    tuned = _faults("msjax", tmp_path, _THREAD_FAULTS)
    pages = 20 * (40 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert plain >= 0.9 * pages, plain  # the default unmaps the emptied heap and faults it in again
    assert tuned < 0.05 * pages, tuned


def test_caches_default_to_the_xdg_cache_dir(tmp_path):
    """A jitted function's executable lands in $XDG_CACHE_HOME/msjax/jax and the token cache in .../tokens; the
    working directory stays clean."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world, a tiny corpus for the char tokenizer\n" * 50)
    work = tmp_path / "cwd"
    work.mkdir()
    code = f"""
import json, jax, jax.numpy as jnp
from msjax import runtime
runtime.setup()
from msjax.config import DataConfig
from msjax.data import prepare_data
ds = prepare_data(DataConfig(paths=({str(corpus)!r},), tokenizer="char"))
jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((64, 64))).block_until_ready()
print(json.dumps({{"cache": jax.config.jax_compilation_cache_dir, "tokens": ds.meta["cache_path"]}}))
"""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg"), "PYTHONPATH": str(REPO),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    env.pop("MSJAX_CACHE_HOME", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=work, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["cache"] == str(tmp_path / "xdg" / "msjax" / "jax")
    assert any((tmp_path / "xdg" / "msjax" / "jax").iterdir()), "no executable was written to the cache"
    assert Path(got["tokens"]).parent == tmp_path / "xdg" / "msjax" / "tokens"
    assert list(work.iterdir()) == []


# One process of a 2-process CPU job (2 devices each): a jitted SGD step on a weight sharded across all 4 devices,
# with the persistent cache at argv[3]. Prints the persistent-cache hits of the step's compilation (jax.monitoring)
# and the result's checksum.
_TWO_PROCESS_STEP = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import msjax.runtime
msjax.runtime.setup()
import jax, jax.numpy as jnp, numpy as np
pid, port, cache = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.config.update("jax_compilation_cache_dir", cache)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
hits = []
jax.monitoring.register_event_listener(lambda name, **kw: hits.append(name)
                                       if name == "/jax/compilation_cache/cache_hits" else None)
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid, initialization_timeout=120)
mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
rng = np.random.default_rng(0)
w_np, x_np = rng.normal(size=(64, 32)).astype(np.float32), rng.normal(size=(16, 32)).astype(np.float32)
w = jax.make_array_from_process_local_data(spec, w_np[pid * 32:(pid + 1) * 32])
x = jax.make_array_from_process_local_data(jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), x_np)

@jax.jit
def step(w, x):
    loss = lambda w: jnp.mean(jnp.tanh(x @ w.T) ** 2)
    return w - 0.1 * jax.grad(loss)(w)

before = len(hits)
out = step(w, x)
n_hits = len(hits) - before
total = float(jax.jit(lambda o: jnp.sum(o ** 2))(out).addressable_data(0))  # replicated: every process has it
print(n_hits, repr(total), flush=True)
jax.distributed.shutdown()
"""


def _two_process_step(cache: Path, every_process: bool) -> list[tuple[int, float]]:
    """Runs _TWO_PROCESS_STEP on 2 processes; returns (persistent-cache hits, checksum) per process."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "MSJAX_CACHE_EVERY_PROCESS": "1" if every_process else "0"}
    procs = [subprocess.Popen([sys.executable, "-c", _TWO_PROCESS_STEP, str(i), str(port), str(cache)], env=env,
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=180)
            assert p.returncode == 0, err[-3000:]
            hits, total = out.strip().splitlines()[-1].split()
            results.append((int(hits), float(total)))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def test_every_process_of_a_cpu_job_loads_its_step_from_the_persistent_cache(tmp_path):
    """jax writes persistent-cache entries from process 0 only and a CPU process's cache key differs per process
    (msjax.runtime.cache_on_every_process): with jax's behaviour a repeated 2-process run's process 1 still
    compiles; with msjax's, every process of the third run loads its step from the cache, with the same result."""
    cache = tmp_path / "jax_cache"
    cold = _two_process_step(cache, every_process=False)  # jax's own behaviour: only process 0 writes
    assert [h for h, _ in cold] == [0, 0]
    plain = _two_process_step(cache, every_process=True)
    assert [h for h, _ in plain] == [1, 0], plain  # process 1 misses: its key is not process 0's
    warm = _two_process_step(cache, every_process=True)
    assert [h for h, _ in warm] == [1, 1], warm
    totals = {t for _, t in cold + plain + warm}
    assert len(totals) == 1, totals  # executables loaded from the cache compute what compiled ones do


_POOLS = r"""
import json, os, msjax.runtime
msjax.runtime.setup()
print(json.dumps(os.environ.get("PJRT_NPROC")))
"""


@pytest.mark.parametrize("env, want", [
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}, str(max(os.cpu_count() or 1, 16))),
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_force_host_platform_device_count=32"},
     str(max(os.cpu_count() or 1, 64))),  # the last flag wins, as in XLA
    ({"JAX_NUM_CPU_DEVICES": "4"}, str(max(os.cpu_count() or 1, 8))),
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "PJRT_NPROC": "3"}, "3"),  # the user's choice
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "NPROC": "3"}, None),
    ({"XLA_FLAGS": ""}, None),  # one device: left alone
    # inherited from a parent msjax process that had 8 devices: recomputed for this one's 32
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=32", "PJRT_NPROC": "16", "MSJAX_PJRT_NPROC": "16"},
     str(max(os.cpu_count() or 1, 64))),
])
def test_cpu_thread_pools_get_two_threads_per_device(env, want):
    """`msjax.runtime.setup()` sizes XLA:CPU's pools at two threads per CPU device (a rendezvous deadlock otherwise; see
    `msjax.runtime.size_cpu_thread_pools`), and leaves a user's PJRT_NPROC/NPROC alone."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("XLA_FLAGS", "PJRT_NPROC", "NPROC", "MSJAX_PJRT_NPROC", "JAX_NUM_CPU_DEVICES")}
    out = subprocess.run([sys.executable, "-c", _POOLS], env={**base, "MSJAX_COMPILATION_CACHE": "0", **env},
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == want


_ORDER = r"""
import json, os, msjax.runtime
msjax.runtime.setup()
print(json.dumps(os.environ.get("XLA_FLAGS")))
"""
_OFF = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


@pytest.mark.parametrize("env, want", [
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}, f"--xla_force_host_platform_device_count=8 {_OFF}"),
    ({"JAX_NUM_CPU_DEVICES": "4"}, _OFF),
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_cpu_enable_concurrency_optimized_scheduler=true"},
     "--xla_force_host_platform_device_count=8 --xla_cpu_enable_concurrency_optimized_scheduler=true"),  # the user's
    ({"XLA_FLAGS": "--xla_backend_optimization_level=0"}, "--xla_backend_optimization_level=0"),  # one device
    ({}, None),
])
def test_several_cpu_devices_get_the_collective_safe_scheduler(env, want):
    """`msjax.runtime.setup()` turns XLA:CPU's concurrency-optimised scheduler off when a process has several CPU devices
    (a collective-order deadlock otherwise; see `msjax.runtime.order_cpu_collectives`), unless the user chose."""
    base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    out = subprocess.run([sys.executable, "-c", _ORDER], env={**base, "MSJAX_COMPILATION_CACHE": "0", **env},
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == want


@pytest.mark.parametrize("flags, on", [
    ("", True), ("--xla_backend_optimization_level=0", True), (_OFF, False),
    (f"{_OFF} --xla_cpu_enable_concurrency_optimized_scheduler=true", True),  # the last one wins, as in XLA
])
def test_concurrent_scheduler_on_reads_the_last_flag(monkeypatch, flags, on):
    """What `msjax.planner.compile_check` asks before compiling in-process (the flag may come from a parent)."""
    from msjax.runtime import concurrent_scheduler_on

    monkeypatch.setenv("XLA_FLAGS", flags)
    assert concurrent_scheduler_on() is on


# Imports msjax's dependencies, then msjax, then every module of the package, then calls msjax.runtime.setup() (the
# one place that changes process-wide state, where a run starts) twice, and prints what changed at each stage:
# environment variables, warnings filters, jax's config, loggers' levels, filters and handlers, signal handlers, the
# recursion limit and live threads.
_IMPORT_STATE = r"""
import importlib, json, logging, os, pkgutil, signal, sys, threading, warnings

def snapshot():
    jax = sys.modules.get("jax")
    loggers = {name: lg for name, lg in logging.root.manager.loggerDict.items() if isinstance(lg, logging.Logger)}
    loggers[""] = logging.root
    return {
        "env": dict(os.environ),
        "warnings": [repr(f) for f in warnings.filters],
        "jax_config": {k: repr(v) for k, v in jax.config.values.items()} if jax else {},
        "loggers": {name: [lg.level, [type(f).__name__ for f in lg.filters], [type(h).__name__ for h in lg.handlers],
                           lg.propagate, lg.disabled, type(lg).__name__] for name, lg in loggers.items()},
        "signals": {s.name: repr(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1,
                                                                 signal.SIGUSR2, signal.SIGHUP)},
        "recursion": sys.getrecursionlimit(),
        "threads": sorted(t.name for t in threading.enumerate()),
    }

def diff(a, b):
    out = {}
    for key in a:
        if isinstance(a[key], dict):
            changed = {k: [a[key].get(k), b[key].get(k)] for k in set(a[key]) | set(b[key])
                       if a[key].get(k) != b[key].get(k)}
            # a logger created by an import (getLogger(__name__)) at its defaults is not a change of state
            if key == "loggers":
                changed = {k: v for k, v in changed.items()
                           if not (v[0] is None and v[1] == [0, [], [], True, False, "Logger"])}
        else:
            changed = [a[key], b[key]] if a[key] != b[key] else None
        if changed:
            out[key] = changed
    return out

# What msjax's dependencies change when imported is theirs (seen: orbax.checkpoint adds a StreamHandler to the root
# logger; flax.nnx imports treescope, which imports IPython, which raises the recursion limit and adds a warnings
# filter): they are imported first, so that what follows is msjax's own doing.
for name in ("jax", "jax.numpy", "flax.nnx", "optax", "orbax.checkpoint", "tensorstore", "grain", "tokenizers",
             "numpy", "pyarrow", "tensorboardX", "tqdm", "redis", "yaml", "matplotlib", "tyro", "fsspec",
             "safetensors"):
    importlib.import_module(name)
s0 = snapshot()
import msjax
s1 = snapshot()
failed = []
for m in pkgutil.walk_packages(msjax.__path__, "msjax."):
    if m.name.endswith("__main__"):
        continue
    try:
        importlib.import_module(m.name)
    except ImportError as e:  # an optional dependency that is not installed: that module cannot change anything
        failed.append(f"{m.name}: {e}")
s2 = snapshot()
msjax.runtime.setup()
s3 = snapshot()
msjax.runtime.setup()
s4 = snapshot()
print(json.dumps({"msjax": diff(s0, s1), "modules": diff(s1, s2), "setup": diff(s2, s3), "again": diff(s3, s4),
                  "failed": failed, "count": len([n for n in sys.modules if n.startswith("msjax.")])}))
"""


def _import_state(env_extra: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC", "MSJAX_PJRT_NPROC", "XLA_FLAGS")}
    env.update(env_extra)
    proc = subprocess.run([sys.executable, "-c", _IMPORT_STATE], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_importing_changes_no_process_state_and_setup_changes_what_runtime_names(tmp_path):
    """Importing msjax and every module of the package changes nothing at all (a dry run, `import msjax.config`);
    `msjax.runtime.setup()` changes exactly what msjax/runtime.py's docstring lists, once."""
    state = _import_state({"XLA_FLAGS": "--xla_force_host_platform_device_count=4",
                           "MSJAX_CACHE_HOME": str(tmp_path / "cache")})
    assert state["count"] > 100 and state["failed"] == [], state["failed"]
    assert state["msjax"] == {}, state["msjax"]
    assert state["modules"] == {}, state["modules"]
    assert state["again"] == {}, state["again"]
    changed = state["setup"]
    assert sorted(changed) == ["env", "jax_config", "loggers", "warnings"], changed
    assert sorted(changed["env"]) == ["MSJAX_PJRT_NPROC", "PJRT_NPROC", "XLA_FLAGS"]  # 4 CPU devices asked for
    assert changed["env"]["XLA_FLAGS"][1].endswith("--xla_cpu_enable_concurrency_optimized_scheduler=false")
    assert changed["jax_config"] == {"jax_compilation_cache_dir": ["None", repr(str(tmp_path / "cache" / "jax"))],
                                     "jax_persistent_cache_min_compile_time_secs": ["1.0", "0.1"]}
    assert changed["loggers"]["absl"][1][1] == ["OrbaxTracebacks"]
    before, after = changed["warnings"]
    assert after[1:] == before and "never awaited" in after[0]


def test_with_one_device_and_the_opt_outs_setup_leaves_env_and_jax_config_alone():
    state = _import_state({"MSJAX_COMPILATION_CACHE": "0", "MSJAX_CACHE_EVERY_PROCESS": "0",
                           "JAX_PLATFORMS": "cpu"})
    assert "env" not in state["setup"] and "jax_config" not in state["setup"], state["setup"]
    assert state["msjax"] == {} and state["modules"] == {}, (state["msjax"], state["modules"])


@pytest.mark.slow
@pytest.mark.parametrize("user_setting", ["floor", "directory"])
def test_a_cache_floor_or_directory_the_user_chose_keeps_jax_floor(tmp_path, user_setting):
    """msjax lowers jax's 1 s floor for writing to the persistent cache only in the directory it chose itself."""
    user_env = ({"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "2.5"} if user_setting == "floor"
                else {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "user")})
    state = _import_state({"JAX_PLATFORMS": "cpu", "MSJAX_CACHE_HOME": str(tmp_path / "cache"), **user_env})
    assert "jax_persistent_cache_min_compile_time_secs" not in state["setup"].get("jax_config", {}), state["setup"]


@pytest.mark.parametrize("platforms, cpu", [("cpu", True), ("cpu,cuda", True), ("cuda", False), ("tpu", False),
                                             ("cuda,cpu", False)])
def test_malloc_is_tuned_for_cpu_runs_only(monkeypatch, platforms, cpu):
    """On a GPU or TPU host one malloc arena would make the data loader's threads contend: setup tunes malloc
    only where the run's first platform is the CPU."""
    from msjax import runtime

    calls = []
    monkeypatch.setenv("JAX_PLATFORMS", platforms)
    monkeypatch.setattr(runtime, "tune_malloc", lambda: calls.append(1) or True)
    assert runtime.cpu_run() is cpu
    runtime.setup()
    assert calls == ([1] if cpu else [])
