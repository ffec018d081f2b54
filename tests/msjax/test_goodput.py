"""The goodput ledger (msjax.goodput): a supervised run's ledger from a hand-made event log, the straggler bucket
from window rows, and a real training run with a real Redis: its ledger read live from Redis mid-run, its buckets
matching the loop's own time and adding up to the wall time, goodput.json written at the end.

The supervised run with a kill -9 and restarts is tests/msjax/test_supervise_e2e.py (its goodput assertions)."""

import json
import time
from pathlib import Path

import pytest

from msjax.control.metrics import live_goodput
from msjax.control.server import RedisServer
from msjax.control.store import Store, connect
from msjax.control.worker import WorkerContext
from msjax.control.rendezvous import Assignment
from msjax.events import read_events
from msjax import goodput
from msjax.goodput import BUCKETS, read_ledger, run_ledger, straggler_seconds
from msjax.hooks import DataWait, Hook
from msjax.train import run


def _snap(loop_start, until, step, steps, **buckets):
    b = dict.fromkeys(("productive", "startup", "compilation", "data_wait", "checkpoint", "evaluation", "straggler",
                       "teardown"), 0.0)
    b.update(buckets)
    return {"kind": "goodput", "rank": 0, "loop_start": loop_start, "until": until, "step": step, "steps": steps,
            "buckets": b}


def test_a_supervised_runs_ledger_splits_every_second_of_its_wall_time():
    t = 1000.0
    events = [
        {"time": t, "kind": "run_start"},
        {"time": t + 1, "kind": "launch", "attempt": 0},
        {"time": t + 5, "kind": "worker_start", "attempt": 0, "start_step": 0},
        # rank 0's ledgers of attempt 0: loop from t+6; the last one covers up to t+30 at step 20
        {"time": t + 20, **_snap(t + 6, t + 20, 10, 10, compilation=3.0, data_wait=1.0, productive=10.0)},
        {"time": t + 30, **_snap(t + 6, t + 30, 20, 20, compilation=3.0, data_wait=1.0, checkpoint=2.0,
                                 productive=18.0)},
        {"time": t + 31, "kind": "fault_injected", "attempt": 0},
        {"time": t + 33, "kind": "attempt_end", "attempt": 0, "finished": False},
        {"time": t + 35, "kind": "launch", "attempt": 1},
        {"time": t + 38, "kind": "worker_start", "attempt": 1, "start_step": 16},
        {"time": t + 60, **_snap(t + 40, t + 60, 30, 14, compilation=2.0, evaluation=4.0, productive=13.0,
                                 teardown=1.0)},
        {"time": t + 61, "kind": "attempt_end", "attempt": 1, "finished": True},
        {"time": t + 62, "kind": "run_end", "status": "finished"},
    ]
    ledger = run_ledger(events)
    b = ledger["buckets"]
    assert ledger["wall_s"] == 62 and set(b) == set(BUCKETS)
    # attempt 0 ran steps 1..20; attempt 1 restored step 16: 4 of its 20 steps' productive time was thrown away
    want = {"startup": 1 + 5 + 5, "compilation": 5, "data_wait": 1, "checkpoint": 2, "evaluation": 4,
            "productive": 18 * 16 / 20 + 13, "recomputed": 18 * 4 / 20, "straggler": 0,
            "restart": 3 + 2, "teardown": 1 + 1 + 1}
    for k, v in want.items():
        assert b[k] == pytest.approx(v), k
    assert sum(b.values()) == pytest.approx(62) and ledger["unaccounted_s"] == pytest.approx(0, abs=1e-9)
    assert ledger["ettr"] == pytest.approx(b["productive"] / 62)
    assert [a["recomputed_steps"] for a in ledger["attempts"]] == [4, 0]
    # an attempt killed before rank 0 wrote any ledger is all restart time
    ledger = run_ledger([e for e in events if not (e["kind"] == "goodput" and e["time"] < t + 35)])
    assert ledger["attempts"][0]["buckets"]["restart"] == pytest.approx(32 + 2)
    assert sum(ledger["buckets"].values()) == pytest.approx(62)
    # a job snapshot whose productive comes from a longer-lived rank's wall (a warm standby started before the
    # launch): the attempt's productive is rank 0's loop time less the job's badput, and the wall still adds up
    job = [dict(e, buckets={**e["buckets"], "productive": 40.0}) if e["kind"] == "goodput" and e["time"] == t + 60
           else e for e in events]
    ledger = run_ledger(job)
    assert ledger["buckets"]["productive"] == pytest.approx(want["productive"])
    assert sum(ledger["buckets"].values()) == pytest.approx(62)
    with pytest.raises(ValueError, match="no run_start event"):
        run_ledger(events[1:])


def test_straggler_time_is_what_the_synchronous_step_waited_for_the_slowest_rank():
    rows = [{"stragglers": [], "figures": {"own_compute_s": [0.1, 0.1, 0.3], "step_median_s": [0.3, 0.3, 0.3]}},
            {"stragglers": [2], "figures": {"own_compute_s": [0.1, 0.1, 0.2], "host_lag_s": [0.0, 0.01, 0.05],
                                            "step_median_s": [0.2, 0.2, 0.2]}},
            {"stragglers": [0], "figures": {"own_compute_s": [0.1, 0.1, 0.1], "host_lag_s": [0.3, 0.0, 0.0],
                                            "step_median_s": [0.25, 0.25, 0.25]}},
            {"stragglers": [1], "figures": {"probe_s": [0.01, 0.04, 0.01], "step_median_s": [0.4, 0.4, 0.4]}}]
    # flagged windows only, 10 steps each: own compute's excess 0.1 s over host lag's 0.04 s; a host lag of 0.3 s
    # capped at the 0.25 s step; no per-step figures: 0.4 s x (1 - 0.01 / 0.04)
    assert straggler_seconds(rows, 10) == pytest.approx(10 * 0.1 + 10 * 0.25 + 10 * 0.3)


class _FakeTime:
    def __init__(self, t):
        self.t = t

    def time(self):
        return self.t


def test_the_loop_ledger_splits_each_step_interval_by_the_loops_own_timings(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import msjax.goodput as goodput

    clock = _FakeTime(100.0)
    monkeypatch.setattr(goodput, "time", clock)
    ctx = SimpleNamespace(run_dir=tmp_path, extra={}, timings={}, start_step=10, data_wait=DataWait(),
                          config=SimpleNamespace(observe=SimpleNamespace(window=0)))
    ledger = goodput.LoopLedger(process_start=90.0, rank=0)
    ledger.on_start(ctx)  # 10 s of start-up
    # (time since the previous mark, data_s, checkpoint_s and eval_s after the previous step) per step
    steps = [(7.0, 0.5, 0.0, 0.0), (2.0, 0.25, 0.0, 0.0), (3.0, 0.25, 1.0, 0.5), (2.0, 0.0, 0.0, 0.0)]
    for i, (dt, data, ckpt, ev) in enumerate(steps):
        clock.t += dt
        ctx.timings.update(data_s=data, checkpoint_s=ckpt, eval_s=ev)
        ledger.on_step_end(ctx, 11 + i, {})
    clock.t += 4.0
    ctx.timings.update(checkpoint_s=1.5, eval_s=0.75)  # the last step's save and evaluation
    ledger.on_end(ctx, None)
    clock.t += 3.0
    # The step observer's watcher: the first batch's wait idled the devices whole, the second's not at all (the
    # first step still ran), the third's for 0.1 s of its 0.25 s.
    for host_s, device_s in [(0.5, 0.5), (0.25, 0.0), (0.25, 0.1), (0.0, 0.0)]:
        ctx.data_wait.add(host_s, device_s)
    out = ledger.finish(checkpoint_close_s=2.0)
    hidden = 0.25 + 0.15
    want = {"startup": 10.0, "compilation": 7.0 - 0.5, "data_wait": 0.5 + 0.25 + 0.25 - hidden,
            "checkpoint": 1.0 + 1.5 + 2.0, "evaluation": 0.5 + 0.75, "straggler": 0.0,
            "productive": (2.0 - 0.25) + (3.0 - 0.25 - 1.0 - 0.5) + 2.0 + (4.0 - 1.5 - 0.75) + hidden,
            "teardown": 1.0}
    assert out["buckets"] == pytest.approx(want)
    assert out["data_wait_host_s"] == pytest.approx(1.0) and out["slowest"]["data_wait"] == 0
    assert out["wall_s"] == pytest.approx(31.0) == pytest.approx(sum(out["buckets"].values()))
    assert (out["step"], out["steps"], out["final"]) == (14, 4, True)
    assert read_ledger(tmp_path)["buckets"]["productive"] == pytest.approx(want["productive"])
    assert [e["final"] for e in read_events(tmp_path, "goodput")] == [False, True]


def test_the_job_ledger_takes_each_badput_from_the_rank_that_had_most_of_it():
    """Rank 1 waited longest for data, rank 0 longest in checkpoints: the job's step waited for both."""
    def rank(r, wall, **buckets):
        full = {**dict.fromkeys(goodput.LOOP_BUCKETS, 0.0), **buckets}
        return {"rank": r, "wall_s": wall, "buckets": full, "ettr": full["productive"] / wall, "step": 9}

    ranks = [rank(0, 100.0, startup=10.0, checkpoint=6.0, data_wait=1.0, productive=83.0),
             rank(1, 98.0, startup=8.0, checkpoint=2.0, data_wait=9.0, productive=79.0)]
    job = goodput.job_ledger(ranks)
    assert job["wall_s"] == 100.0 and job["step"] == 9
    assert job["buckets"] == pytest.approx({**dict.fromkeys(goodput.LOOP_BUCKETS, 0.0), "startup": 10.0,
                                            "checkpoint": 6.0, "data_wait": 9.0, "productive": 75.0})
    assert job["ettr"] == pytest.approx(0.75) and sum(job["buckets"].values()) == pytest.approx(job["wall_s"])
    assert (job["slowest"]["startup"], job["slowest"]["checkpoint"], job["slowest"]["data_wait"]) == (0, 0, 1)
    assert [(r["rank"], r["step"], r["ettr"]) for r in job["ranks"]] == [(0, 9, 0.83), (1, 9, pytest.approx(79 / 98))]
    summary = goodput.loop_summary({**job, "start_step": 0, "steps": 9})
    assert summary["ranks"] == job["ranks"] and summary["unaccounted_s"] == pytest.approx(0.0)


class _Clock(Hook):
    """Records when the loop started and ended, and reads the live ledger from Redis once mid-run."""

    def __init__(self, store: Store, at_step: int):
        self.store, self.at_step, self.live = store, at_step, None

    def on_start(self, ctx):
        self.start = time.time()

    def on_step_end(self, ctx, step, metrics):
        if step == self.at_step:  # the ledger of the previous logging step, flushed by the control thread
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                live = live_goodput(self.store).get(0)
                if live and live["step"] >= self.at_step - 2:
                    self.live = live
                    return
                time.sleep(0.05)
            raise TimeoutError(f"no goodput ledger of step {self.at_step - 2} in Redis within 30 s")

    def on_end(self, ctx, error):
        self.end = time.time()


def test_a_run_publishes_its_ledger_live_and_writes_one_that_adds_up(tmp_path, small_corpus, make_tiny_config):
    from msjax.control.hook import ControlPlaneHook

    cfg = make_tiny_config(tmp_path, small_corpus, **{"train.sample_tokens": 0, "observe.window": 4})
    with RedisServer() as srv:
        client = connect(srv.url)
        store = Store(client, "goodput")
        worker = WorkerContext(store=store, assignment=Assignment(0, 1, "h:1", 0), commands_after="0-0",
                               worker_id="w0", host="h0")
        plane = ControlPlaneHook(worker, period_s=0.1, ttl_s=5)
        clock = _Clock(store, at_step=6)
        try:
            summary = run(cfg, hooks=[clock], control_plane=plane)
        finally:
            plane.close()
            client.close()
    live = clock.live
    assert live is not None and live["rank"] == 0 and not live["final"]
    assert live["until"] <= clock.end and live["buckets"]["compilation"] > 0
    ledger = read_ledger(cfg.train.run_dir)
    assert ledger["source"] == "loop"
    b = ledger["buckets"]
    wall = ledger["wall_s"]
    # the buckets add up to the wall time (process start -> end of run) within 1%
    assert abs(sum(b.values()) - wall) <= 0.01 * wall, (b, wall)
    # the loop's buckets cover what an outside clock saw between on_start and on_end, within 1% of the wall time
    # (less closing the checkpointer, which the ledger counts as checkpoint time after every hook has ended)
    loop = sum(b[k] for k in ("compilation", "data_wait", "checkpoint", "evaluation", "straggler", "productive"))
    loop -= summary.goodput["checkpoint_close_s"]
    assert abs(loop - (clock.end - clock.start)) <= 0.01 * wall, (loop, clock.end - clock.start)
    assert b["startup"] > 0 and b["compilation"] > 0 and b["productive"] > 0
    assert b["evaluation"] > 0 and b["checkpoint"] > 0  # eval_every 4 and checkpoint.every 4 of 8 steps
    assert b["restart"] == b["recomputed"] == 0
    assert ledger["steps"] == {"start": 0, "end": 8, "run": 8}
    assert summary.goodput["buckets"]["productive"] == pytest.approx(b["productive"])
    events = read_events(cfg.train.run_dir, "goodput")
    assert [e["step"] for e in events][:4] == [2, 4, 6, 8] and events[-1]["final"]


@pytest.mark.parametrize("step_width, expect", [(32, "seen"), (384, "hidden")])
def test_a_batch_wait_is_badput_only_while_the_devices_idle(tmp_path, small_corpus, make_tiny_config, monkeypatch,
                                                            step_width, expect):
    """Every batch arrives 0.1 s late (the real loader, then a sleep). With a step of a few tens of milliseconds the
    devices sit idle through most of each wait. With a step of about half a second (width 384 on these CPUs) the
    loop waits while the previous step still runs, and that part of the wait is productive. The loop's own wait
    (data_wait_host_s) is the same 0.1 s a step in both; the ledger's data_wait is held to the per-step rows' own
    figures: at least the wait less the previous step's device time, at most the time the devices waited for the
    host (host_stall_s) plus the first batch's wait."""
    from msjax.data.loader import BatchLoader

    late_s, steps = 0.1, 10
    real_next = BatchLoader.__next__

    def late_next(self):
        batch = real_next(self)
        time.sleep(late_s)
        return batch

    monkeypatch.setattr(BatchLoader, "__next__", late_next)
    cfg = make_tiny_config(tmp_path, small_corpus, **{
        "model.d_model": step_width, "model.num_heads": 4, "train.global_batch": 16, "train.steps": steps,
        "optimizer.decay_steps": steps, "train.eval_every": 0, "train.sample_tokens": 0, "checkpoint.every": 0})
    run(cfg)
    ledger = read_ledger(cfg.train.run_dir)
    (only,) = ledger["ranks"]
    host, device = only["data_wait_host_s"], ledger["buckets"]["data_wait"]
    rows = [json.loads(line) for line in (Path(cfg.train.run_dir) / "ranks" / "rank0.jsonl").read_text().splitlines()]
    compute = [r["compute_s"] for r in rows]
    print(f"width {step_width}: median step compute {sorted(compute)[steps // 2]:.3f} s, data wait: loop {host:.3f} "
          f"s, devices idle {device:.3f} s")
    assert host == pytest.approx(sum(r["data_s"] for r in rows)) and host >= steps * late_s
    lower = rows[0]["data_s"] + sum(max(0.0, r["data_s"] - c) for r, c in zip(rows[1:], compute))
    upper = rows[0]["data_s"] + sum(r["host_stall_s"] for r in rows[1:])
    assert lower - 1e-3 <= device <= upper + 1e-3, (lower, device, upper)
    if expect == "seen":
        assert device >= 0.5 * host
    else:
        assert sorted(compute)[steps // 2] > 2 * late_s  # the premise: each step outlasts the wait behind it
        assert device <= 0.8 * host
