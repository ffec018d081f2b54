"""The goodput ledger (msjax.goodput): a supervised run's ledger from a hand-made event log, the straggler bucket
from window rows, and a real training run with a real Redis: its ledger read live from Redis mid-run, its buckets
matching the loop's own time and adding up to the wall time, goodput.json written at the end.

The supervised run with a kill -9 and restarts is tests/msjax/test_supervise_e2e.py (its goodput assertions)."""

import time

import pytest

from msjax.control.metrics import live_goodput
from msjax.control.server import RedisServer
from msjax.control.store import Store, connect
from msjax.control.worker import WorkerContext
from msjax.control.rendezvous import Assignment
from msjax.events import read_events
from msjax.goodput import BUCKETS, read_ledger, run_ledger, straggler_seconds
from msjax.hooks import Hook
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
    ctx = SimpleNamespace(run_dir=tmp_path, extra={}, timings={}, start_step=10,
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
    out = ledger.finish(checkpoint_close_s=2.0)
    want = {"startup": 10.0, "compilation": 7.0 - 0.5, "data_wait": 0.5 + 0.25 + 0.25,
            "checkpoint": 1.0 + 1.5 + 2.0, "evaluation": 0.5 + 0.75, "straggler": 0.0,
            "productive": (2.0 - 0.25) + (3.0 - 0.25 - 1.0 - 0.5) + 2.0 + (4.0 - 1.5 - 0.75), "teardown": 1.0}
    assert out["buckets"] == pytest.approx(want)
    assert out["wall_s"] == pytest.approx(31.0) == pytest.approx(sum(out["buckets"].values()))
    assert (out["step"], out["steps"], out["final"]) == (14, 4, True)
    assert read_ledger(tmp_path)["buckets"]["productive"] == pytest.approx(want["productive"])
    assert [e["final"] for e in read_events(tmp_path, "goodput")] == [False, True]


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
