"""The straggler proof through scripts/launch.py: 4 worker processes (2 CPU devices each, mesh data 4 x tensor 2)
train through the control plane (a Redis started by the test, so it can be read after the run).

Slowed run: once a worker has compiled (its first row is written), the test slows it from outside with real
signals, as an operator, a debugger or the OS would: nothing in msjax's code knows.
  - worker THROTTLED runs 2 ms in every 20 (SIGSTOP, 18 ms, SIGCONT): a CPU throttled to a tenth, the way a CFS
    quota cuts a process (it runs out its quota, then waits for the next period), with no cgroup needed;
  - worker STALLED is paused now and then, 0.6 s in every 1.2 s, in whatever phase of the step it happens to be.
Both must be flagged, each with its host and mesh coordinates, in the log, events.jsonl, the report's table and its
heatmap, whose boxed cells must be exactly the flagged processes' devices, holding their values. What decides is
what the steps show per rank (msjax.observe.timing): the host lag each process accumulates during its steps (a
paused process holds up every collective of the step it is in) and its own compute timed inside the step; the
collective-free probe is reported beside them and decides nothing. The runs time own compute
(observe.own_compute); on this machine the workers share two cores, so it follows how the OS shares them and is
reported, not scored (ibid.).

Unslowed run (the same flags): nobody is flagged, no cell is boxed, and every rank's per-step rows are in the run's
Redis metrics stream with the same values as in its JSONL file (msjax.control.metrics).

The runs do not share jax's persistent compilation cache (one less difference between workers).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from msjax.control.server import RedisServer
from msjax.control.store import Store, connect
from msjax.events import read_events

ROOT = Path(__file__).resolve().parents[2]
NPROC, STEPS, WINDOW = 4, 24, 4
THROTTLED, STALLED = 3, 1  # the processes slowed from outside
THROTTLE_STOP_S, THROTTLE_RUN_S = 0.018, 0.002
STALL_STOP_S, STALL_RUN_S = 0.6, 0.6
THRESHOLD = 3.0


def _coords(process: int) -> dict[str, list[int]]:
    # jax.make_mesh orders devices by process: process p drives data coordinate p and both tensor coordinates.
    return {"pipeline": [0], "data": [process], "fsdp": [0], "expert": [0], "sequence": [0], "tensor": [0, 1]}


def _flags(tmp: Path, corpus: Path) -> list[str]:
    return ["--config=gpt_tiny", "--model.num_layers=2", "--model.d_model=64", "--model.num_heads=2",
            "--model.max_seq_len=32", f"--data.paths={corpus}", "--data.tokenizer=char", "--data.val_fraction=0.2",
            f"--data.cache_dir={tmp.parent / 'data_cache'}", "--train.seq_len=32", "--train.global_batch=8",
            f"--train.steps={STEPS}", "--train.eval_every=0", "--train.eval_batches=1", "--train.sample_tokens=0",
            "--train.log_every=4", f"--train.run_dir={tmp / 'run'}", "--train.progress=false",
            "--checkpoint.every=1000", "--mesh.data=4", "--mesh.tensor=2",
            f"--observe.window={WINDOW}", f"--observe.threshold={THRESHOLD}", "--observe.persist=2",
            "--observe.own_compute=true"]


class Slowdown:
    """A thread that stops process `pid` for `stop_s`, lets it run `run_s`, and again, until `close()`, which
    leaves the process running. A process that has exited ends the thread."""

    def __init__(self, pid: int, stop_s: float, run_s: float):
        self.pid, self.stop_s, self.run_s = pid, stop_s, run_s
        self.cycles = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._done.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                self._done.wait(self.stop_s)
                os.kill(self.pid, signal.SIGCONT)
                self.cycles += 1
                self._done.wait(self.run_s)
        except ProcessLookupError:
            return

    def close(self) -> None:
        self._done.set()
        self._thread.join(10)
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def _launch(tmp: Path, corpus: Path, redis_url: str, run_id: str, slow: bool) -> tuple[str, Path]:
    """Runs launch.py to the end, slowing THROTTLED and STALLED once each has compiled when `slow`; returns its
    output and the run directory. Any failure fails the test (its output is kept in launch.log)."""
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
    todo = {THROTTLED: (THROTTLE_STOP_S, THROTTLE_RUN_S), STALLED: (STALL_STOP_S, STALL_RUN_S)} if slow else {}
    slowdowns: dict[int, Slowdown] = {}
    try:
        deadline = time.monotonic() + 500
        while proc.poll() is None:
            assert time.monotonic() < deadline, f"launch.py still running after 500 s: {''.join(lines)[-3000:]}"
            for p, (stop_s, run_s) in todo.items():
                rows = run_dir / "ranks" / f"rank{p}.jsonl"
                if p not in slowdowns and rows.exists() and rows.read_text().count("\n") >= 1:
                    pid = json.loads((run_dir / "ranks" / f"rank{p}.meta.json").read_text())["pid"]
                    slowdowns[p] = Slowdown(pid, stop_s, run_s)  # step 1 (compilation) is done: from now on
            time.sleep(0.1)
    finally:
        for s in slowdowns.values():
            s.close()
        if proc.poll() is None:
            proc.kill()  # its workers die with it (PR_SET_PDEATHSIG)
        proc.wait(30)
        reader.join(10)
    out = "".join(lines)
    (tmp / "launch.log").write_text(out)
    assert proc.returncode == 0, f"launch.py exited {proc.returncode}; the end of its output:\n{out[-4000:]}"
    assert sorted(slowdowns) == sorted(todo) and all(s.cycles >= 2 for s in slowdowns.values()), slowdowns
    return out, run_dir


def _report(run_dir: Path, monkeypatch) -> tuple[str, dict]:
    """Runs scripts/report.py (index.html), then draws the host-lag heatmap again in this process to read what it
    shows: {"values": (data, tensor) ms in each cell, "boxed": [(data, tensor)] of the red straggler boxes}."""
    import matplotlib.figure

    from msjax.observe.report import load_run, plot_heatmap

    proc = subprocess.run([sys.executable, "scripts/report.py", str(run_dir)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (run_dir / "report" / "heatmap_host_lag.png").stat().st_size > 10_000
    drawn = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
    assert plot_heatmap(load_run(run_dir), "host_lag_s", run_dir / "unused.png")
    (panel,) = [ax for ax in drawn[0].axes if ax.get_title() == "pipeline stage 0"]
    boxed = sorted((round(p.get_y() + 0.5), round(p.get_x() + 0.5)) for p in panel.patches
                   if p.get_edgecolor()[:3] == (1.0, 0.0, 0.0))
    return (run_dir / "report" / "index.html").read_text(), {"values": np.asarray(panel.get_images()[0].get_array()),
                                                             "boxed": boxed}


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as srv:
        yield srv


@pytest.mark.slow
def test_the_same_run_unslowed_flags_nobody_and_streams_every_rank_to_redis(tmp_path, small_corpus, redis_server,
                                                                            monkeypatch):
    _, run_dir = _launch(tmp_path / "plain", small_corpus, redis_server.url, "obs-plain", slow=False)
    windows = [json.loads(line) for line in (run_dir / "ranks" / "windows.jsonl").read_text().splitlines()]
    print("per-window scores:", [(w["step"], w["scores"]) for w in windows])
    assert [w["step"] for w in windows] == list(range(WINDOW, STEPS + 1, WINDOW))
    assert all(w["stragglers"] == [] for w in windows), [(w["step"], w["scores"]) for w in windows]
    assert all(len(w["figures"]["own_compute_s"]) == NPROC and min(w["figures"]["own_compute_s"]) > 0
               for w in windows)  # every rank's steps were timed from inside
    assert not read_events(run_dir, "straggler")
    ledger = json.loads((run_dir / "goodput.json").read_text())
    assert ledger["buckets"]["straggler"] == 0
    # The job's ledger: every rank's final one reached rank 0 through the coordination service, and each badput
    # bucket is the largest rank's.
    assert [(r["rank"], r["step"], r["final"]) for r in ledger["ranks"]] == [(p, STEPS, True) for p in range(NPROC)]
    for name, rank in ledger["slowest"].items():
        assert ledger["buckets"][name] == max(r["buckets"][name] for r in ledger["ranks"]) == \
            ledger["ranks"][rank]["buckets"][name]
    assert ledger["wall_s"] == max(r["wall_s"] for r in ledger["ranks"])
    page, heatmap = _report(run_dir, monkeypatch)
    assert heatmap["boxed"] == [] and "none flagged" in page
    # Live metrics: every rank's rows reached the run's Redis stream, equal to its JSONL rows.
    store = Store(connect(redis_server.url), "obs-plain")
    streamed = [row for _, row in store.metrics()]
    store.client.close()
    for rank in range(NPROC):
        local = [json.loads(line) for line in (run_dir / "ranks" / f"rank{rank}.jsonl").read_text().splitlines()]
        mine = [{k: v for k, v in r.items() if k != "rank"} for r in streamed if r["rank"] == rank]
        assert [r["step"] for r in local] == list(range(1, STEPS + 1))
        assert mine == local, (rank, mine[:2], local[:2])


@pytest.mark.slow
def test_a_throttled_and_a_stalling_worker_are_flagged_with_their_coordinates(tmp_path, small_corpus, redis_server,
                                                                              monkeypatch):
    out, run_dir = _launch(tmp_path / "slowed", small_corpus, redis_server.url, "obs-slowed", slow=True)
    windows = [json.loads(line) for line in (run_dir / "ranks" / "windows.jsonl").read_text().splitlines()]
    print("per-window scores:", [(w["step"], w["scores"]) for w in windows])
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    flagged = {e["process"]: e for e in events if e["kind"] == "straggler"}
    assert sorted(flagged) == sorted([THROTTLED, STALLED]), (flagged, [(w["step"], w["scores"]) for w in windows])
    host = socket.gethostname()
    for p, e in flagged.items():
        meta = json.loads((run_dir / "ranks" / f"rank{p}.meta.json").read_text())
        assert e["coords"] == _coords(p) == meta["coords"] and e["host"] == host
        assert e["scores"]["host_lag_s"] >= THRESHOLD  # the figure that decided
        line = f"[rank 0] observe: straggler at step {e['step']}: process {p} on {host} " \
               f"(pipeline 0, data {p}, fsdp 0, expert 0, sequence 0, tensor 0-1)"
        assert line in out, out[-4000:]
    # the goodput ledger counts the steps' wait for them, and its buckets still add up to the wall time
    ledger = json.loads((run_dir / "goodput.json").read_text())
    assert ledger["buckets"]["straggler"] > 0, ledger
    assert abs(sum(ledger["buckets"].values()) - ledger["wall_s"]) <= 0.01 * ledger["wall_s"], ledger
    page, heatmap = _report(run_dir, monkeypatch)
    for p, e in flagged.items():
        assert f"<td>{e['step']}</td><td>{p}</td>" in page
    # The boxes sit exactly on the flagged processes' devices (data coordinate = process, both tensor cells), and
    # those cells hold a host lag over THRESHOLD times the healthy processes' median (means over the run).
    values = heatmap["values"]
    assert heatmap["boxed"] == sorted((p, t) for p in flagged for t in range(2))
    healthy = [p for p in range(NPROC) if p not in flagged]
    for p in flagged:
        assert (values[p] == values[p, 0]).all()  # one process, one value on its devices
        assert values[p, 0] >= THRESHOLD * np.median([values[h, 0] for h in healthy]), values
