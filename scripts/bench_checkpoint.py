"""Checkpoint benchmark: how long the loop is blocked per checkpoint, restore speed per tier, integrity cost;
with `--remote`, the same for a persistent tier on object storage; with `--kill_trials`, kill -9 during saves.

python scripts/bench_checkpoint.py [--gib=1.0] [--saves=3] [--restores=3] [--devices=8] [--dir=/tmp/...]
                                   [--local_dir=/dev/shm/...] [--remote=moto|s3://bucket/prefix]
                                   [--s3_endpoint=URL] [--kill_trials=N] [--json PATH]

For a train-state-like pytree of `--gib` GiB of float32 arrays sharded over `--devices` CPU devices:
  blocked_s       the time `Checkpointer.save` blocks the loop (stage 1: device -> host copy, checksum dispatch),
                  two tiers (local `--local_dir` then persistent `--dir`), mean over saves after the first;
  sync_save_s     a synchronous Orbax save of the same state to the persistent tier (what the loop would wait
                  for without the two stages); the target is blocked_s <= 10% of it;
  background_s    how long the write, record and copy go on after `save` returned;
  restore_*_s     a verified restore from the local tier and from the persistent tier (the persistent files were
                  just written, so they may come from the page cache: an upper bound on its speed), median of
                  `--restores`; restore_*_unverified_s the same restore without the checksum comparison
                  (`Checkpointer.restore(verify=False)`), interleaved with the verified ones; *_cpu_s: process
                  CPU seconds (all threads) of the same restores, less disturbed by other jobs than wall time;
  verify_cost_*   the cost of integrity checking: the extra time of a verified restore over an unverified one,
                  as a fraction of the unverified one (verify_cost_cpu_*: the same in CPU seconds); the target is
                  under 20%. It can come out slightly negative: the noise of the medians.
  verify_in_restore_*_s  the checksum pass timed inside the verified restores (Checkpointer.last_restore_timing),
                  and verify_fraction_of_restore_* its share of the restore; verify_s: the same pass alone, on the
                  saved state.
  blocked_*_s     where the blocked time goes (Checkpointer.last_save_timing): waiting for the previous save,
                  dispatching the checksums, Orbax's save call (stage 1).
  remote_*        with `--remote`: the same state saved with the local tier in front of a persistent tier on object
                  storage (`moto`: a local S3-compatible server started here, moto's, from the dev extra; or an
                  `s3://` / `gs://` prefix, reached through `--s3_endpoint` or the environment), in the same run
                  as the rows above: remote_blocked_s (what the loop waits per save), remote_background_s (write,
                  record, upload with the record last), remote_restore_s (download into an empty local tier, read,
                  verify: a new machine's restore), remote_restore_unverified_s, remote_verify_cost and
                  remote_verify_fraction_of_restore (the integrity check's share of that restore), remote_fetch_s.

Several hosts (`--processes=N`, N > 1, with `--remote`): N processes of one jax job on this machine, `--devices / N`
devices each, every one a "host" with its local tier on a tmpfs of its own (its own mount namespace: root and
util-linux's unshare; `--shared_disk` puts them all on one /dev/shm directory instead, as code before per-host
tiers needs), sharing only the bucket. For two layouts of the state over a (data = N, fsdp) mesh, `sharded` (every
array split over all devices: each host holds 1/N) and `replicated` (split over fsdp, replicated over data: each
host holds a whole data-parallel replica), per host: the blocked time and background time per save (mean after the
first), the bytes it uploaded, and a restore on new hosts (empty local tiers) with single-replica restore on and
off (median wall time; the bytes each host downloaded). Rows give the slowest host's time and every host's bytes.

Kill -9 during saves (`--kill_trials=N`, N > 0, instead of the timings): N trials, split over three phases of a
save, each in a fresh directory: a process saves a small state in a loop (`SAVER`), and is killed with SIGKILL as
soon as this process sees the phase's unfinished directory of a save after the first: `write` (Orbax's temporary
directory), `commit` (the step's directory before its integrity record), `upload` (the step's prefix in the
bucket before its record object; a moto server). A trial counts as landed when that step has no record after the
kill. Then `latest_verified` is asked, a fresh Checkpointer restores, and the table says, per phase, how many
trials landed mid-write, how often the restored step equalled latest_verified's answer, how often the state was
bit-identical to what was saved for that step, and how often the unfinished step was restored (must be never).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from msjax import cli, runtime
from msjax.config import ConfigError

# An entry point: the process set-up of a run (malloc on CPU, compilation cache, XLA:CPU collective flags),
# before jax starts a backend; importing msjax itself changes nothing (msjax.runtime).
runtime.setup()


@dataclasses.dataclass(frozen=True)
class CheckpointBenchOptions:
    """bench_checkpoint.py's flags (`--local-dir`, the old spelling of `--local_dir`, is accepted too).

    Attributes:
      gib: size of the train-state-like pytree, in GiB of float32.
      saves: checkpoints to time (>= 2; the first is reported apart).
      restores: restores timed per tier, verified and not (medians).
      devices: fake CPU devices the state is sharded over.
      dir: the persistent tier's directory; empty: a fresh one under /tmp, removed at the end.
      local_dir: the local tier's directory; empty: a fresh one under /dev/shm. Removed at the end either way.
      remote: also measure a persistent tier on object storage: "moto" (a local S3-compatible server started
        here) or an s3:// / gs:// prefix (its checkpoints are removed at the end); empty: none.
      s3_endpoint: the S3-compatible server of an s3:// --remote (empty: AWS, or AWS_ENDPOINT_URL).
      kill_trials: run this many kill -9 trials instead of the timings (see the module docstring); 0: none.
      processes: > 1: the several-hosts benchmark instead (see the module docstring; needs --remote).
      shared_disk: with --processes: the hosts' local tiers in one shared directory, not a tmpfs each.
      json: also write the results as JSON to this path.
    """

    gib: float = 1.0
    saves: int = 3
    restores: int = 3
    devices: int = 8
    dir: str = ""
    local_dir: str = ""
    remote: str = ""
    s3_endpoint: str = ""
    kill_trials: int = 0
    processes: int = 1
    shared_disk: bool = False
    json: str = ""


def main(argv: list[str]) -> int:
    def body() -> int:
        common, args = cli.parse_options(argv, CheckpointBenchOptions(), prog="bench_checkpoint.py",
                                         description=__doc__)
        cli.setup_logging(common)
        for flag, value, ok, allowed in (("--gib", args.gib, args.gib > 0, "> 0"),
                                         ("--saves", args.saves, args.saves >= 2, ">= 2"),
                                         ("--restores", args.restores, args.restores >= 1, ">= 1"),
                                         ("--devices", args.devices, args.devices >= 1, ">= 1"),
                                         ("--kill_trials", args.kill_trials, args.kill_trials >= 0, ">= 0"),
                                         ("--processes", args.processes, args.processes >= 1
                                          and args.devices % args.processes == 0 and (args.processes == 1
                                                                                       or bool(args.remote)),
                                          "a divisor of --devices, above 1 only with --remote")):
            if not ok:
                raise ConfigError(f"{flag}={value}: allowed is {allowed}")
        if args.remote and args.remote != "moto":
            from msjax import paths

            if not paths.is_remote(paths.check(args.remote, "--remote")):
                raise ConfigError(f"--remote={args.remote!r}: allowed is moto, s3://bucket/prefix or "
                                  "gs://bucket/prefix")
        if args.json:
            cli.check_writable(args.json, "--json")
        if args.kill_trials:
            return run_kill_trials(args)
        return run_hosts(args) if args.processes > 1 else run(args)

    return cli.main_guard(body)


# ---- kill -9 during saves ---------------------------------------------------------------------------------------

KILL_PHASES = ("write", "commit", "upload")
_ORBAX_TMP = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")

# The victim: saves `kill_state(k)` for k = 1, 2, ... forever, each save followed by `polls` steps of `step_s`
# seconds (each ending in Checkpointer.poll, as the loop's steps do). argv: directory, local_dir ("" for none),
# s3_endpoint, s3_region, size, step_s, polls.
SAVER = r"""
import sys, time
import jax.numpy as jnp
import numpy as np
from msjax import paths
from msjax.checkpoint import Checkpointer
from msjax.config import CheckpointConfig, StorageConfig
directory, local, endpoint, region = sys.argv[1:5]
size, step_s, polls = int(sys.argv[5]), float(sys.argv[6]), int(sys.argv[7])
paths.configure(StorageConfig(s3_endpoint=endpoint, s3_region=region))
ckpt = Checkpointer(CheckpointConfig(every=0, keep=2, local_keep=1, timeout_s=120), directory, local or None)
step = 0
while True:
    step += 1
    w = np.random.default_rng(step).standard_normal(size, dtype=np.float32)
    ckpt.save(step, {"w": jnp.asarray(w), "step": jnp.int32(step)}, {"step": step}, force=True)
    for _ in range(polls):
        time.sleep(step_s)
        ckpt.poll(step)
"""


def kill_state(step: int, size: int) -> dict:
    """What SAVER saves at `step` (host arrays): w (size,) float32 from a generator seeded by the step, and the
    step as int32."""
    import numpy as np

    return {"w": np.random.default_rng(step).standard_normal(size, dtype=np.float32), "step": np.int32(step)}


@dataclasses.dataclass(frozen=True)
class KillTrial:
    """One kill: the phase aimed at, the step whose save was seen unfinished, what was seen (a path or URL), and
    whether the kill landed inside that save (after the kill the step has no integrity record and no later step
    has one)."""

    phase: str
    step: int
    seen: str
    landed: bool


def _unfinished(phase: str, directory: str, local_dir: str, min_step: int) -> tuple[int, str] | None:
    """(step, what was seen) of a save of step >= `min_step` that is in `phase` and unfinished, else None."""
    from msjax import paths
    from msjax.checkpoint.integrity import RECORD_NAME

    if phase == "upload":
        for name in sorted((n for n in paths.listdir(directory) if n.isdigit()), key=int, reverse=True):
            if int(name) < min_step:
                continue
            where = paths.join(directory, name)
            inside = paths.listdir(where)  # one request: the kill follows the look as closely as it can
            if inside and RECORD_NAME not in inside:
                return int(name), where
        return None
    root = Path(local_dir or directory)
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return None
    for name in names:
        m = _ORBAX_TMP.match(name)
        if phase == "write" and m and int(m.group(1)) >= min_step:
            return int(m.group(1)), str(root / name)
        if (phase == "commit" and name.isdigit() and int(name) >= min_step and (root / name).is_dir()
                and not (root / name / RECORD_NAME).exists()):
            return int(name), str(root / name)
    return None


def kill_during_save(phase: str, directory: str, local_dir: str = "", s3_endpoint: str = "", s3_region: str = "",
                     size: int = 1 << 20, min_step: int = 2, step_s: float = 0.05, polls: int = 3,
                     timeout_s: float = 120.0) -> KillTrial:
    """Starts SAVER on `directory` (the persistent tier: a fresh local directory, or for `upload` a fresh bucket
    prefix, with `local_dir` in front), watches for the unfinished directory of `phase` of the save of a step >=
    `min_step` (>= 2, so an older verified one exists), and sends SIGKILL the moment it is seen.

    Raises:
      RuntimeError: the saver exited by itself (the end of its stderr in the message).
      TimeoutError: `phase` was not seen within `timeout_s` seconds (names the phase and directory).
    """
    import subprocess

    from msjax.checkpoint.tiers import make_tier

    if phase not in KILL_PHASES:
        raise ValueError(f"phase={phase!r}: allowed are {KILL_PHASES}")
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-c", SAVER, directory, local_dir, s3_endpoint, s3_region, str(size),
                             str(step_s), str(polls)], stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            seen = _unfinished(phase, directory, local_dir, min_step)
            if seen is not None:
                proc.kill()
                break
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"the saver exited with status {proc.returncode} before a {phase} was seen: "
                                   f"{log.read().decode(errors='replace')[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no unfinished {phase} of a save seen in {directory} within {timeout_s:.0f} s")
            time.sleep(0.001)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        log.close()
    step, where = seen
    tier = make_tier("persistent", directory if phase == "upload" else Path(local_dir or directory))
    # Landed inside that save: the step has no record, and no later save completed (rotation could have removed
    # the step's record otherwise).
    recorded = [s for s in tier.steps() if tier.record(s) is not None]
    return KillTrial(phase, step, where, landed=tier.record(step) is None and all(s < step for s in recorded))


def run_kill_trials(args: CheckpointBenchOptions) -> int:
    """`--kill_trials`: the trials, their verification and the table (see the module docstring). Exit status 1
    when any trial restored an unfinished step, or restored another step than `latest_verified` named, or state
    that differs from what was saved."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1").strip()
    import jax
    import numpy as np

    from msjax import paths
    from msjax.checkpoint import Checkpointer, latest_verified
    from msjax.config import CheckpointConfig

    size = 1 << 20
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), kill_state(1, size))
    root = Path(tempfile.mkdtemp(prefix="msjax-bench-kill-", dir="/tmp"))
    counts = {p: {"trials": 0, "landed": 0, "restored_equals_latest_verified": 0, "bit_identical": 0,
                  "unfinished_restored": 0} for p in KILL_PHASES}
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    try:
        with _object_store(args.remote or "moto", args.s3_endpoint) as (bucket, storage):
            for i in range(args.kill_trials):
                phase = KILL_PHASES[i % len(KILL_PHASES)]
                remote = phase == "upload"
                directory = paths.join(bucket, f"kill-{os.getpid()}-{i}") if remote else str(root / str(i))
                trial = kill_during_save(phase, directory, str(root / f"{i}-local") if remote else "",
                                         storage.s3_endpoint, storage.s3_region, size,
                                         min_step=int(rng.integers(2, 6)))
                # What a new machine (an empty local tier) restores from the persistent tier.
                fresh = root / f"{i}-fresh" if remote else None
                answer = latest_verified(directory, fresh)
                c = Checkpointer(CheckpointConfig(timeout_s=120), directory, fresh)
                step, state, _ = c.restore(abstract)
                c.close()
                expected = kill_state(step, size)
                row = counts[phase]
                row["trials"] += 1
                row["landed"] += trial.landed
                row["restored_equals_latest_verified"] += step == answer
                row["bit_identical"] += all(np.array_equal(np.asarray(state[k]), expected[k]) for k in expected)
                row["unfinished_restored"] += trial.landed and step == trial.step
                if remote:
                    paths.remove_tree(directory)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    lines = [f"kill -9 during saves: {args.kill_trials} trials in {time.perf_counter() - t0:.0f} s, load average "
             f"{os.getloadavg()[0]:.1f}",
             f"{'phase':<8} {'trials':>7} {'landed':>7} {'restored=latest':>16} {'bit-identical':>14} "
             f"{'unfinished restored':>20}"]
    for phase, row in counts.items():
        lines.append(f"{phase:<8} {row['trials']:>7} {row['landed']:>7} {row['restored_equals_latest_verified']:>16} "
                     f"{row['bit_identical']:>14} {row['unfinished_restored']:>20}")
    cli.print_result("\n".join(lines), {"kill_trials": counts, "load_average_1min": os.getloadavg()[0]},
                     args.json)
    ok = all(r["restored_equals_latest_verified"] == r["bit_identical"] == r["trials"] and not
             r["unfinished_restored"] for r in counts.values())
    return 0 if ok else 1


@contextlib.contextmanager
def _removed(*dirs: Path):
    """Removes `dirs` when the block ends, however it ends."""
    try:
        yield
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def _object_store(remote: str, s3_endpoint: str):
    """(bucket URL, StorageConfig) of `--remote`, with msjax.paths configured for it: "moto" starts moto's
    S3-compatible server (the dev extra) on a free loopback port with a fresh bucket and stops it at the end; a URL
    is used as it is."""
    from msjax import paths
    from msjax.config import StorageConfig

    if remote != "moto":
        storage = StorageConfig(s3_endpoint=s3_endpoint)
        paths.configure(storage)
        yield remote, storage
        return
    import socket
    import subprocess

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):  # moto wants them present, whatever their value
        os.environ.setdefault(key, "msjax-bench")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto's server did not start on 127.0.0.1:{port} within 60 s (exit status "
                                       f"{proc.poll()}); is the dev extra installed?") from None
                time.sleep(0.1)
        storage = StorageConfig(s3_endpoint=f"http://127.0.0.1:{port}", s3_region="us-west-2")
        paths.configure(storage)
        fs, _ = paths.filesystem("s3://msjax-bench")
        fs.mkdir("msjax-bench")
        yield "s3://msjax-bench", storage
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def timed_saves(ckpt, state, step_fn, saves: int) -> tuple:
    """(state, blocked s, background s, Checkpointer.last_save_timing) of each of `saves` asynchronous saves by
    `ckpt` (closed at the end), `state` advanced by `step_fn` before each."""
    import jax

    blocked, background, parts = [], [], []
    for i in range(1, saves + 1):
        state = step_fn(state)
        jax.block_until_ready(state)  # the step's own compute is not the checkpoint's cost
        t0 = time.perf_counter()
        ckpt.save(i, state, {"step": i}, force=True)
        t1 = time.perf_counter()
        ckpt.wait()
        blocked.append(t1 - t0)
        background.append(time.perf_counter() - t1)
        parts.append(ckpt.last_save_timing)
    ckpt.close()
    return state, blocked, background, parts


# ---- several hosts -----------------------------------------------------------------------------------------------

# One host of the job (argv: process index, processes, coordinator port, devices, GiB, saves, restores, bucket URL,
# storage settings as JSON, local directory, this script's path): saves and restores for each layout, prints one
# JSON object.
HOST = r"""
import importlib.util, json, os, shutil, statistics, sys, time
from pathlib import Path
pid, n, port, devices = (int(a) for a in sys.argv[1:5])
gib, saves, restores = float(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
url, storage, local = sys.argv[8], json.loads(sys.argv[9]), Path(sys.argv[10])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
spec = importlib.util.spec_from_file_location("bench_checkpoint", sys.argv[11])  # its timed_saves
bench = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
spec.loader.exec_module(bench)
import jax, jax.numpy as jnp
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
from msjax import paths
from msjax.checkpoint import Checkpointer
from msjax.config import CheckpointConfig, StorageConfig
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=pid, initialization_timeout=300)
paths.configure(StorageConfig(**storage))
mesh = jax.make_mesh((n, devices), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
n_arrays, cols, total = 8, 8192, n * devices
rows = max(total, int(gib * 2**30 / 4 / n_arrays / cols) // total * total)
def size(d):
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file()) if d.is_dir() else 0
out = {"process": pid}
for layout, spec in (("sharded", P(("data", "fsdp"))), ("replicated", P("fsdp"))):
    sharding = NamedSharding(mesh, spec)
    make = jax.jit(lambda k: {f"w{i}": jax.random.normal(jax.random.fold_in(k, i), (rows, cols), jnp.float32)
                              for i in range(n_arrays)}, out_shardings=sharding)
    step_fn = jax.jit(lambda s: {"params": jax.tree.map(lambda x: x * 1.0001 + 1e-4, s["params"]),
                                 "step": s["step"] + 1}, donate_argnums=0)
    state = {"params": make(jax.random.key(0)), "step": jax.device_put(jnp.zeros((), jnp.int32),
                                                                      NamedSharding(mesh, P()))}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    where = f"{url}/{layout}"
    ckpt = Checkpointer(CheckpointConfig(every=1, keep=2, local_keep=1, timeout_s=900), where, local / layout)
    state, blocked, background, _ = bench.timed_saves(ckpt, state, step_fn, saves)
    row = {"state_bytes": sum(x.nbytes for x in jax.tree.leaves(state)),
           "blocked_s": statistics.mean(blocked[1:]), "background_s": statistics.mean(background[1:]),
           "uploaded_bytes": getattr(ckpt, "last_upload", {}).get("bytes")}
    for replica in (True, False):
        times, got = [], []
        for r in range(restores):
            fresh = local / f"fresh-{layout}-{replica}-{r}"
            multihost_utils.sync_global_devices(f"restore {layout} {replica} {r}")
            c = Checkpointer(CheckpointConfig(keep=2, local_keep=1, replica_restore=replica, timeout_s=900),
                             where, fresh)
            t0 = time.perf_counter()
            _, restored, _ = c.restore(abstract)
            jax.block_until_ready(restored)
            times.append(time.perf_counter() - t0)
            download = getattr(c, "last_download", None)  # code before per-host tiers: process 0 downloads all
            got.append(download["bytes"] if download is not None else (size(fresh) if pid == 0 else 0))
            c.close()
            del restored
            multihost_utils.sync_global_devices(f"restored {layout} {replica} {r}")
            shutil.rmtree(fresh, ignore_errors=True)
        key = "single_replica" if replica else "every_replica"
        row[f"restore_{key}_s"] = statistics.median(times)
        row[f"downloaded_{key}_bytes"] = got[-1]
    out[layout] = row
    del state
print(json.dumps(out), flush=True)
jax.distributed.shutdown()
"""


def run_hosts(args: CheckpointBenchOptions) -> int:
    """The several-hosts benchmark (see the module docstring): prints the table, writes --json; returns 0."""
    import socket
    import subprocess

    devices = args.devices // args.processes
    root = Path(args.local_dir or tempfile.mkdtemp(prefix="msjax-bench-hosts-", dir="/dev/shm"))
    with _object_store(args.remote, args.s3_endpoint) as (bucket, storage), _removed(root):
        url = f"{bucket}/bench-hosts-{os.getpid()}"
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        private = ([] if args.shared_disk else  # a tmpfs of its own in a mount namespace of its own: a host's disk
                   ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                    'mount -t tmpfs msjax-bench-host "$0" && exec "$@"', str(root)])
        common = [str(args.processes), str(port), str(devices), str(args.gib), str(args.saves), str(args.restores),
                  url, json.dumps(dataclasses.asdict(storage)), str(root), str(Path(__file__).resolve())]
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        # Output to files: a pipe read only after another host ends could fill and stall its writer mid-job.
        logs = [tempfile.TemporaryFile("w+") for _ in range(args.processes)]
        procs = [subprocess.Popen([*private, sys.executable, "-c", HOST, str(i), *common], env=env, stdout=log,
                                  stderr=subprocess.STDOUT, text=True) for i, log in enumerate(logs)]
        outs, failed = [], []
        try:
            for i, (proc, log) in enumerate(zip(procs, logs)):
                proc.wait(timeout=3600)
                log.seek(0)
                lines = [line for line in log.read().splitlines() if not line.startswith("    @ ")]  # C++ frames
                if proc.returncode != 0:
                    failed.append(f"host {i} failed (exit status {proc.returncode}): " + "\n".join(lines[-40:]))
                else:
                    outs.append(json.loads(lines[-1]))
            if failed:
                raise RuntimeError("\n".join(failed))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        from msjax import paths

        paths.remove_tree(url)
    results: dict = {"processes": args.processes, "devices_per_process": devices, "shared_disk": args.shared_disk,
                     "hosts": outs}
    lines = [f"checkpoint benchmark, {args.processes} hosts x {devices} CPU devices, local tiers "
             f"{'in one shared directory' if args.shared_disk else 'on a tmpfs each'}, bucket {args.remote}, load "
             f"average {os.getloadavg()[0]:.1f}",
             f"{'layout':<11} {'GiB':>5} {'blocked s':>9} {'backgr s':>8} {'restore 1-replica s':>19} "
             f"{'restore all s':>13}  uploaded / downloaded 1-replica / downloaded all (MiB per host)"]
    for layout in ("sharded", "replicated"):
        rows = [o[layout] for o in outs]
        row = {key: max(r[key] for r in rows) for key in ("blocked_s", "background_s", "restore_single_replica_s",
                                                          "restore_every_replica_s")}
        for key in ("uploaded_bytes", "downloaded_single_replica_bytes", "downloaded_every_replica_bytes"):
            row[key] = [r[key] for r in rows]
        row["state_bytes"] = rows[0]["state_bytes"]
        results[layout] = row

        def mib(xs):
            return "/".join("?" if x is None else f"{x / 2**20:.0f}" for x in xs)

        lines.append(f"{layout:<11} {row['state_bytes'] / 2**30:>5.2f} {row['blocked_s']:>9.3f} "
                     f"{row['background_s']:>8.2f} {row['restore_single_replica_s']:>19.2f} "
                     f"{row['restore_every_replica_s']:>13.2f}  {mib(row['uploaded_bytes'])} / "
                     f"{mib(row['downloaded_single_replica_bytes'])} / {mib(row['downloaded_every_replica_bytes'])}")
    results["load_average_1min"] = os.getloadavg()[0]
    cli.print_result("\n".join(lines), results, args.json)
    return 0


def run(args: CheckpointBenchOptions) -> int:
    """The benchmark (see the module docstring): prints the table, writes --json; returns the exit status."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.devices}").strip()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from msjax.checkpoint import Checkpointer
    from msjax.checkpoint.integrity import checksum_state
    from msjax.config import CheckpointConfig

    persistent = Path(args.dir or tempfile.mkdtemp(prefix="msjax-bench-ckpt-", dir="/tmp"))
    local = Path(args.local_dir or tempfile.mkdtemp(prefix="msjax-bench-ckpt-", dir="/dev/shm"))
    sync_dir = Path(tempfile.mkdtemp(prefix="msjax-bench-sync-", dir=str(persistent.parent)))
    mesh = jax.make_mesh((len(jax.devices()),), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, P("d"))
    n_arrays, cols = 8, 8192
    rows = max(len(jax.devices()), int(args.gib * 2**30 / 4 / n_arrays / cols) // len(jax.devices())
               * len(jax.devices()))
    make = jax.jit(lambda k: {f"w{i}": jax.random.normal(jax.random.fold_in(k, i), (rows, cols), jnp.float32)
                              for i in range(n_arrays)}, out_shardings=sharding)
    step_fn = jax.jit(lambda s: {"params": jax.tree.map(lambda x: x * 1.0001 + 1e-4, s["params"]),
                                 "step": s["step"] + 1}, donate_argnums=0)
    state = {"params": make(jax.random.key(0)),
             "step": jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(mesh, P()))}
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    results: dict = {"state_bytes": nbytes, "devices": len(jax.devices()), "persistent_dir": str(persistent),
                     "local_dir": str(local)}
    remote_local = Path(tempfile.mkdtemp(prefix="msjax-bench-ckpt-", dir="/dev/shm"))
    store = _object_store(args.remote, args.s3_endpoint) if args.remote else contextlib.nullcontext((None, None))
    tiers = ("local", "persistent", "remote") if args.remote else ("local", "persistent")

    with store as (bucket, _), _removed(local, sync_dir, remote_local, *(() if args.dir else (persistent,))):
        remote = f"{bucket}/bench-{os.getpid()}" if bucket else None
        # Two tiers, asynchronous: what the loop pays per checkpoint.
        state, blocked, background, parts = timed_saves(
            Checkpointer(CheckpointConfig(every=1, keep=2, local_keep=1), persistent, local), state, step_fn,
            args.saves)
        results.update(blocked_first_s=blocked[0], blocked_s=float(np.mean(blocked[1:])),
                       background_s=float(np.mean(background[1:])))
        for key in parts[-1]:  # where the blocked time goes (Checkpointer.last_save_timing)
            results[f"blocked_{key}"] = float(np.mean([p[key] for p in parts[1:]]))
        if remote:
            # The local tier in front of object storage: the upload (record last) runs in the background.
            results["remote_dir"] = remote
            state, blocked, background, _ = timed_saves(
                Checkpointer(CheckpointConfig(every=1, keep=2, local_keep=1), remote, remote_local), state, step_fn,
                args.saves)
            results.update(remote_blocked_s=float(np.mean(blocked[1:])),
                           remote_background_s=float(np.mean(background[1:])))

        # The same state saved synchronously (Orbax, no async), persistent tier only.
        sync = Checkpointer(CheckpointConfig(every=1, keep=1, async_save=False), sync_dir)
        times = []
        for i in range(1, 3):
            t0 = time.perf_counter()
            sync.save(i, state, {"step": i}, force=True)
            sync.wait()
            times.append(time.perf_counter() - t0)
        sync.close()
        results["sync_save_s"] = times[-1]
        results["blocked_fraction_of_sync"] = results["blocked_s"] / results["sync_save_s"]

        # Restores: local tier (newest there), then persistent only; each verified and unverified, interleaved
        # (V U / U V alternately per round) so both see the same load and page cache.
        def timed_restore(tier: str, verify: bool) -> tuple[float, float, float, float]:
            """(wall s, process CPU s, verification s, download s inside it) of one restore, until the arrays
            are ready. The remote tier is restored as a new machine would: into an empty local tier."""
            fresh = Path(tempfile.mkdtemp(prefix="msjax-bench-fresh-", dir="/dev/shm"))
            c = (Checkpointer(CheckpointConfig(keep=2, local_keep=1), persistent, local) if tier == "local"
                 else Checkpointer(CheckpointConfig(keep=2, local_keep=1), remote, fresh) if tier == "remote"
                 else Checkpointer(CheckpointConfig(keep=2), persistent))
            t0, c0 = time.perf_counter(), time.process_time()
            _, restored, _ = c.restore(abstract, verify=verify)
            jax.block_until_ready(restored)
            timing = c.last_restore_timing
            out = time.perf_counter() - t0, time.process_time() - c0, timing["verify_s"], timing["fetch_s"]
            c.close()
            shutil.rmtree(fresh, ignore_errors=True)
            return out

        # The verification kernels (one per shard shape and device) compiled outside the timings, as the save's
        # were by the first save: a resumed process compiles them once, like every program it runs.
        checksum_state(state, check_finite=False)()
        timed_restore("local", False)  # and Orbax's first restore in this process (its set-up), untimed
        runs: dict[tuple[str, bool], list[tuple[float, float, float, float]]] = {}
        for r in range(args.restores):
            for tier in tiers:
                for verify in ((True, False) if r % 2 == 0 else (False, True)):
                    runs.setdefault((tier, verify), []).append(timed_restore(tier, verify))
        for tier in tiers:
            med = {v: np.median(np.array(runs[tier, v]), axis=0) for v in (True, False)}
            results[f"restore_{tier}_s"], results[f"restore_{tier}_cpu_s"] = float(med[True][0]), float(med[True][1])
            results[f"restore_{tier}_unverified_s"] = float(med[False][0])
            results[f"restore_{tier}_unverified_cpu_s"] = float(med[False][1])
            results[f"verify_in_restore_{tier}_s"] = float(med[True][2])
            results[f"fetch_in_restore_{tier}_s"] = float(med[True][3])
            # The cost of integrity checking: what a verified restore takes beyond an unverified one, as a
            # fraction of the unverified restore (wall, and process CPU, the figure load disturbs least).
            results[f"verify_cost_{tier}"] = (results[f"restore_{tier}_s"] / results[f"restore_{tier}_unverified_s"]
                                              - 1)
            results[f"verify_cost_cpu_{tier}"] = (results[f"restore_{tier}_cpu_s"]
                                                  / results[f"restore_{tier}_unverified_cpu_s"] - 1)
            results[f"verify_fraction_of_restore_{tier}"] = (results[f"verify_in_restore_{tier}_s"]
                                                            / results[f"restore_{tier}_s"])
        t0 = time.perf_counter()
        checksum_state(state, check_finite=False)()  # compiled already by the restores
        results["verify_s"] = time.perf_counter() - t0
        if remote:
            from msjax import paths

            paths.remove_tree(remote)

    lines = [f"checkpoint benchmark: {nbytes / 2**30:.2f} GiB state over {len(jax.devices())} CPU devices, "
             f"load average {os.getloadavg()[0]:.1f}", f"{'quantity':<40} {'value':>10}"]
    for key in ("blocked_first_s", "blocked_s", *(k for k in results if k.startswith("blocked_") and
                                                   k.endswith("_s") and k not in ("blocked_first_s", "blocked_s")),
                "background_s", "sync_save_s", "blocked_fraction_of_sync",
                *(("remote_blocked_s", "remote_background_s") if args.remote else ()),
                *(f"{k}_{tier}{suffix}" for tier in tiers for k, suffix in (
                    ("restore", "_s"), ("restore", "_unverified_s"), ("restore", "_cpu_s"),
                    ("restore", "_unverified_cpu_s"), ("fetch_in_restore", "_s"), ("verify_in_restore", "_s"),
                    ("verify_cost", ""), ("verify_cost_cpu", ""), ("verify_fraction_of_restore", ""))),
                "verify_s"):
        lines.append(f"{key:<40} {results[key]:>10.3f}")
    results["load_average_1min"] = os.getloadavg()[0]
    cli.print_result("\n".join(lines), results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
