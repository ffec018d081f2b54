"""The straggler proof through scripts/launch.py: 4 worker processes (2 CPU devices each, mesh data 4 x tensor 2)
train through the control plane (a Redis started by the test, so it can be read after the run).

Slowed run: once worker 3 has compiled (its first row is written), the test throttles it from outside with the
kernel's CFS bandwidth control: it moves the worker's process into a fresh cgroup (v1 `cpu` controller) allowed
1 ms of CPU per 10 ms period, i.e. a tenth of one core. Nothing in msjax's code knows. Why this way, on a 2-core
machine shared with other work: CPU burners pinned to a worker's core need a core per worker (4 workers on 2
cores share cores, so burners slow a neighbour too) and their effect shrinks with the machine's load; SIGSTOP/
SIGCONT cycling from a Python thread is coarse, and its phase lines up with the window end (a stopped worker
finishes its step, and starts its probe, just after a SIGCONT), so a probe of a few ms slips through whole (seen
here: scores 1.0-1.6). The kernel throttles every 10 ms whatever the phase and the load: the worker's
collective-free probe (a few ms of CPU) takes ~10x its CPU time, while the others' take ~1-2.5x under this
machine's load. Measured here with the fixed 18 ms probe: the slowed worker's probe scores 9.1, 11.9, 13.8; the
unslowed runs' highest single-window score 2.1. With the budgeted probe (observe.probe_budget 0.5%: calls of
~4 ms, median; it grows with the throttled run's longer windows), at load 7-11: the slowed worker's scores in
windows 4, 8, 12: 14.3, 10.9, 16.8 and 41.7, 11.9, 9.4 (2 runs); the unslowed run's highest score per window
22.7 (window 4: before any step time is known the probe is a single 1-matmul call, and one preemption shows
whole), 2.2, 4.9 (a healthy worker preempted through every call of a short probe), by different workers: never
the same one in 2 consecutive windows, but closer to the threshold than with the fixed probe. CI then flagged a
healthy worker in the unslowed run, most likely from windows 4 and 8 (no step-12 probe score reached 3: 2.43,
1.22, 0.39, 0.82; CI's log kept only that window), and here,
with test_parallel.py running beside it, window 4 gave a healthy worker 8.9. So the first window's single-call
probe is recorded but not scored (msjax.observe.timing), and the slowed worker is flagged at window 12, after
two scored windows. CI later flagged two healthy workers of the unslowed run at once (1 and 2, probing at 3.37 and
2.61 ms per matmul against 0.38 for the others, in consecutive windows): four processes probing at the same moment
on 2 cores, the last served looking slow. Since then processes that share a host take turns to probe
(`msjax.observe.timing.host_probe_turn`). The test's threshold is 3.0 for 2 consecutive windows. Process 3 must be flagged, with
its host and mesh coordinates, in the log, events.jsonl, the report and the heatmap (a red box around its cells).

Unslowed run (the same flags): nobody is flagged, no red box, and every rank's per-step rows are in the run's
Redis metrics stream with the same values as in its JSONL file (msjax.control.metrics).

The runs do not share jax's persistent compilation cache (one less difference between workers). On this loaded
machine (load ~10) gloo failed to connect the first step's collectives in 3 of 6 launches while this test was
written ("Gloo context initialization failed: ... Connect timeout", gloo's 30 s; the cause is not established:
the workers compile the step separately and may reach it far apart). The workers that fail then wait in
jax.distributed's shutdown and the others in the step, so the launcher never sees an exit: the test stops the
launch on that line and launches once more (GLOO_FLAKE); nothing it asserts is relaxed.
"""

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from msjax.control.server import RedisServer
from msjax.control.store import Store, connect

ROOT = Path(__file__).resolve().parents[2]
NPROC, SLOW = 4, 3  # worker processes; the process slowed from outside
# jax.make_mesh orders devices by process: process p drives data coordinate p and both tensor coordinates.
SLOW_COORDS = {"pipeline": [0], "data": [SLOW], "fsdp": [0], "sequence": [0], "tensor": [0, 1]}
CGROUP_CPU = Path("/sys/fs/cgroup/cpu")  # cgroup v1 cpu controller
PERIOD_US, QUOTA_US = 10_000, 1_000  # the slowed worker's CPU: 1 ms per 10 ms
THRESHOLD = 3.0
# gloo sometimes fails to connect the first step's collectives on this loaded machine (see the module docstring):
# the launch is retried once when this is in its output.
GLOO_FLAKE_TEXT = "Gloo context initialization failed"
GLOO_FLAKE = "gloo-flake"


def _can_throttle() -> bool:
    probe = CGROUP_CPU / f"msjax-probe-{os.getpid()}"
    try:
        probe.mkdir()
        (probe / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (probe / "cpu.cfs_quota_us").write_text(str(QUOTA_US))
        return True
    except OSError:
        return False
    finally:
        try:
            probe.rmdir()
        except OSError:
            pass


pytestmark = pytest.mark.skipif(not _can_throttle(), reason=f"needs a writable cgroup v1 cpu controller at "
                                                            f"{CGROUP_CPU} (CFS bandwidth control) to slow a worker")


def _flags(tmp: Path, corpus: Path) -> list[str]:
    return ["--config=gpt_tiny", "--model.num_layers=2", "--model.d_model=64", "--model.num_heads=2",
            "--model.max_seq_len=32", f"--data.paths={corpus}", "--data.tokenizer=char", "--data.val_fraction=0.2",
            f"--data.cache_dir={tmp.parent / 'data_cache'}", "--train.seq_len=32", "--train.global_batch=8",
            "--train.steps=12", "--train.eval_every=0", "--train.eval_batches=1", "--train.sample_tokens=0",
            "--train.log_every=4", f"--train.run_dir={tmp / 'run'}", "--train.progress=false",
            "--checkpoint.every=1000", "--mesh.data=4", "--mesh.tensor=2",
            "--observe.window=4", f"--observe.threshold={THRESHOLD}", "--observe.persist=2"]


class _Throttle:
    """A cgroup holding one process at QUOTA_US of CPU per PERIOD_US (see the module docstring)."""

    def __init__(self, pid: int):
        self.path = CGROUP_CPU / f"msjax-slow-{os.getpid()}-{pid}"
        self.path.mkdir()
        (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (self.path / "cpu.cfs_quota_us").write_text(str(QUOTA_US))
        (self.path / "cgroup.procs").write_text(str(pid))  # the whole process: every thread, present and future

    def close(self) -> None:
        for _ in range(100):  # the cgroup can go once its process has exited
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def _launch(tmp: Path, corpus: Path, redis_url: str, run_id: str, slow: bool) -> tuple[str, Path, str]:
    """Runs launch.py to the end (throttling worker SLOW after its first step when `slow`); returns its output,
    the run directory and the run id. Launched again, once, in a fresh directory when gloo fails to set up the first step's
    collectives (GLOO_FLAKE: see the module docstring); any other failure fails the test."""
    for attempt in range(2):
        rid = f"{run_id}-{attempt}"
        out, run_dir, code = _launch_once(tmp / f"try{attempt}", corpus, redis_url, rid, slow)
        if code is not GLOO_FLAKE:
            break
    assert code == 0, f"launch.py exited {code}; its output is in {run_dir.parent / 'launch.log'}; the end:\n" \
                      f"{out[-4000:]}"
    return out, run_dir, rid


def _launch_once(tmp: Path, corpus: Path, redis_url: str, run_id: str, slow: bool):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "MSJAX_"))}
    env.update(PYTHONUNBUFFERED="1")
    run_dir = tmp / "run"
    proc = subprocess.Popen([sys.executable, "scripts/launch.py", "--backend=local", f"--num_processes={NPROC}",
                             "--devices_per_process=2", f"--redis_url={redis_url}", f"--run_id={run_id}", "--",
                             *_flags(tmp, corpus)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    throttle, code = None, None
    rows = run_dir / "ranks" / f"rank{SLOW}.jsonl"
    try:
        deadline = time.monotonic() + 500
        while proc.poll() is None:
            assert time.monotonic() < deadline, f"launch.py still running after 500 s: {''.join(lines)[-3000:]}"
            if any(GLOO_FLAKE_TEXT in line for line in lines):
                code = GLOO_FLAKE  # the run cannot go on: its workers wait for a peer that failed
                break
            if slow and throttle is None and rows.exists() and rows.read_text().count("\n") >= 1:
                # step 1 (compilation) is done: throttle the worker from now on
                throttle = _Throttle(json.loads((run_dir / "ranks" / f"rank{SLOW}.meta.json").read_text())["pid"])
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()  # its workers die with it (PR_SET_PDEATHSIG)
        proc.wait(30)
        if throttle is not None:
            throttle.close()
        reader.join(10)
    out = "".join(lines)
    (tmp / "launch.log").write_text(out)
    if code is None:
        code = proc.returncode
        assert not slow or throttle is not None, f"worker {SLOW} was never throttled: {out[-3000:]}"
    return out, run_dir, code


def _report(run_dir: Path) -> tuple[str, int]:
    """Runs scripts/report.py; returns index.html and the count of pure-red pixels (straggler boxes) in the
    probe heatmap (viridis has no red, so any red pixel is a box)."""
    import matplotlib.image

    proc = subprocess.run([sys.executable, "scripts/report.py", str(run_dir)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    img = matplotlib.image.imread(run_dir / "report" / "heatmap_probe.png")
    red = int(((img[..., 0] > 0.9) & (img[..., 1] < 0.1) & (img[..., 2] < 0.1)).sum())
    return (run_dir / "report" / "index.html").read_text(), red


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as srv:
        yield srv


@pytest.mark.slow
def test_the_same_run_unslowed_flags_nobody_and_streams_every_rank_to_redis(tmp_path, small_corpus,
                                                                            redis_server):
    _, run_dir, run_id = _launch(tmp_path / "plain", small_corpus, redis_server.url, "obs-plain", slow=False)
    windows = [json.loads(line) for line in (run_dir / "ranks" / "windows.jsonl").read_text().splitlines()]
    assert [w["step"] for w in windows] == [4, 8, 12]
    assert all(w["stragglers"] == [] for w in windows), windows
    events = (run_dir / "events.jsonl").read_text() if (run_dir / "events.jsonl").exists() else ""
    assert '"straggler"' not in events
    page, red = _report(run_dir)
    assert red == 0 and "heatmap_probe.png" in page
    # Live metrics: every rank's rows reached the run's Redis stream, equal to its JSONL rows.
    store = Store(connect(redis_server.url), run_id)
    streamed = [row for _, row in store.metrics()]
    store.client.close()
    for rank in range(NPROC):
        local = [json.loads(line) for line in (run_dir / "ranks" / f"rank{rank}.jsonl").read_text().splitlines()]
        mine = [{k: v for k, v in r.items() if k != "rank"} for r in streamed if r["rank"] == rank]
        assert [r["step"] for r in local] == list(range(1, 13))
        assert mine == local, (rank, mine[:2], local[:2])


@pytest.mark.slow
def test_a_worker_slowed_from_outside_is_flagged_with_its_coordinates(tmp_path, small_corpus, redis_server):
    out, run_dir, _ = _launch(tmp_path / "slowed", small_corpus, redis_server.url, "obs-slowed", slow=True)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    flagged = [e for e in events if e["kind"] == "straggler"]
    windows = [json.loads(line) for line in (run_dir / "ranks" / "windows.jsonl").read_text().splitlines()]
    assert flagged, ("no straggler flagged", windows)
    assert {e["process"] for e in flagged} == {SLOW}, flagged
    meta = json.loads((run_dir / "ranks" / f"rank{SLOW}.meta.json").read_text())
    assert flagged[0]["coords"] == SLOW_COORDS == meta["coords"]
    assert flagged[0]["host"] == socket.gethostname()
    assert max(flagged[0]["scores"].values()) >= THRESHOLD
    print("slowed run, per-window scores:", [(w["step"], w["scores"]) for w in windows])
    line = f"[rank 0] observe: straggler at step {flagged[0]['step']}: process {SLOW} on {socket.gethostname()} " \
           f"(pipeline 0, data {SLOW}, fsdp 0, sequence 0, tensor 0-1)"
    assert line in out, out[-4000:]
    page, red = _report(run_dir)
    assert f"<td>{flagged[0]['step']}</td><td>{SLOW}</td>" in page
    assert red > 0, "no red straggler box in heatmap_probe.png"
