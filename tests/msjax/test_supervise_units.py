"""The supervisor's pure parts: failure detection rules and blame, restart policy, and the figures read off an
event log (detection latency, recovery time, effective training time), on made-up times."""

import json
import signal
import time

import pytest

from msjax.config import Config, ConfigError, apply_overrides
from msjax.supervise.detect import (Failure, WorkerState, blame, detect_failures, died, finished,
                                   needs_diagnosis)
from msjax.events import EventLog, read_events
from msjax.supervise.figures import fault_figures, recovery_phases
from msjax.supervise.policy import RestartBudgetExhausted, RestartPolicy

T = dict(heartbeat_timeout=3.0, startup_timeout=30.0, stall_timeout=5.0)


def _w(rank, **kw):
    base = dict(rank=rank, host=f"host{rank}", started_at=0.0, last_beat=99.0, step=10, step_changed_at=99.0)
    return WorkerState(**{**base, **kw})


def test_healthy_workers_have_no_failures():
    assert detect_failures([_w(0), _w(1)], now=100.0, **T) == []


@pytest.mark.parametrize("code, kind, text", [
    (-9, "exit", "killed by SIGKILL"), (-15, "exit", "killed by SIGTERM"), (3, "exit", "exit code 3"),
    (143, "stopped", "stopped by SIGTERM (exit code 143)"), (130, "stopped", "stopped by SIGINT (exit code 130)"),
    (75, "peer_lost", "left because a peer failed (exit code 75)")])
def test_nonzero_exit_is_a_failure_of_its_kind(code, kind, text):
    (f,) = detect_failures([_w(0), _w(1, exit_code=code)], now=100.0, **T)
    assert (f.rank, f.kind, f.detail) == (1, kind, text)


def test_the_dead_worker_is_blamed_not_the_ones_that_left_because_of_it():
    """A survivor that left because its peer died (status 75, or jax's runtime aborting it: `peer_lost`) is never
    blamed while the peer's own failure shows; alone, nothing is blamed yet (the caller waits for the peer)."""
    survivor = _w(0, exit_code=75)
    aborted = _w(1, exit_code=-6, peer_lost=True)
    dead = _w(2, last_beat=90.0)  # a node failure: no exit status, its heartbeat expired
    failures = detect_failures([survivor, aborted, dead], now=100.0, **T)
    assert [(f.rank, f.kind) for f in failures] == [(0, "peer_lost"), (1, "peer_lost"), (2, "heartbeat")]
    assert [f.rank for f in blame(failures)] == [2]
    assert blame(detect_failures([survivor, aborted, _w(2)], now=100.0, **T)) == []
    # an abort whose output does not show the distributed runtime's verdict is the worker's own failure
    (own,) = detect_failures([_w(0), _w(1, exit_code=-6)], now=100.0, **T)
    assert own.kind == "exit" and blame([own]) == [own]


def test_exit_zero_is_not_a_failure_and_all_zero_is_finished():
    workers = [_w(0, exit_code=0), _w(1)]
    assert detect_failures(workers, now=100.0, **T) == [] and not finished(workers)
    assert finished([_w(0, exit_code=0), _w(1, exit_code=0)])


def test_missed_heartbeats_fail_only_past_the_timeout():
    assert detect_failures([_w(0, last_beat=97.1)], now=100.0, **T) == []  # 2.9 s < 3 s
    (f,) = detect_failures([_w(0, last_beat=96.9)], now=100.0, **T)
    assert f.kind == "heartbeat" and "3.1 s ago" in f.detail


def test_a_worker_past_its_loop_gets_the_startup_timeout_to_exit():
    assert detect_failures([_w(0, last_beat=80.0, loop_done=True)], now=100.0, **T) == []
    (f,) = detect_failures([_w(0, last_beat=60.0, loop_done=True)], now=100.0, **T)
    assert f.kind == "heartbeat" and "after the loop ended" in f.detail


def test_no_first_heartbeat_within_the_startup_timeout():
    assert detect_failures([_w(0, last_beat=None, step=None, step_changed_at=None)], now=29.0, **T) == []
    (f,) = detect_failures([_w(0, last_beat=None, step=None, step_changed_at=None)], now=31.0, **T)
    assert f.kind == "heartbeat" and "no heartbeat" in f.detail


def test_nonfinite_loss_report_is_a_failure():
    (f,) = detect_failures([_w(0), _w(1, nonfinite=(8, float("nan")))], now=100.0, **T)
    assert (f.rank, f.kind) == (1, "nonfinite") and "step 8" in f.detail
    # train.nonfinite=stop: the worker reported it, then exited 1; the report says why, not the bare status
    (f,) = detect_failures([_w(0), _w(1, nonfinite=(8, float("nan")), exit_code=1)], now=100.0, **T)
    assert (f.rank, f.kind) == (1, "nonfinite") and "step 8" in f.detail and "exit code 1" in f.detail


def test_a_step_that_stops_while_others_advance_is_stalled():
    # rank 1 still beats (its heartbeat thread lives) but its step has not moved for 10 s; rank 0 moved at 99.
    (f,) = detect_failures([_w(0), _w(1, step_changed_at=90.0)], now=100.0, **T)
    assert (f.rank, f.kind) == (1, "stalled")
    # everyone stopped together for less than the timeout (a checkpoint, an eval): no failure
    assert detect_failures([_w(0, step_changed_at=96.0), _w(1, step_changed_at=96.0)], now=100.0, **T) == []
    # ... for longer, with heartbeats still coming: a job-wide hang (a deadlocked collective), every worker failed
    hung = detect_failures([_w(0, step_changed_at=90.0), _w(1, step_changed_at=90.0)], now=100.0, **T)
    assert [(f.rank, f.kind) for f in hung] == [(0, "stalled"), (1, "stalled")] and "job-wide" in hung[0].detail
    # ... unless some workers' step is behind the others': the others wait for a step those never dispatched
    hung = detect_failures([_w(0, step_changed_at=90.0), _w(1, step=9, step_changed_at=89.0),
                            _w(2, step_changed_at=90.5), _w(3, step=9, step_changed_at=89.5)], now=100.0, **T)
    assert [(f.rank, f.kind) for f in hung] == [(1, "stalled"), (3, "stalled")], hung
    assert "at step 9, the others at 10): it holds the job up" in hung[0].detail
    # the rule is off with stall_timeout 0
    assert detect_failures([_w(0), _w(1, step_changed_at=90.0)], now=100.0,
                           **{**T, "stall_timeout": 0.0}) == []


def test_restart_policy_backoff_and_budget_report():
    p = RestartPolicy(budget=3, backoff_s=0.5, backoff_max_s=1.5)
    assert [p.next_restart("rank 1: exit: killed by SIGKILL") for _ in range(3)] == [0.5, 1.0, 1.5]
    with pytest.raises(RestartBudgetExhausted) as err:
        p.next_restart("rank 1: exit: killed by SIGKILL")
    text = str(err.value)
    assert "restart_budget=3" in text and text.count("killed by SIGKILL") == 4 and "fault loop" in text
    with pytest.raises(RestartBudgetExhausted, match="0 restart"):
        RestartPolicy(budget=0).next_restart("x")


def test_backoff_starts_over_after_an_attempt_that_trained():
    """Independent faults each restart after the base delay; only failures in a row (no step between) back off."""
    p = RestartPolicy(budget=6, backoff_s=0.5, backoff_max_s=60.0)
    delays = [p.next_restart("a", trained=t) for t in (True, False, False, True, True, False)]
    assert delays == [0.5, 1.0, 2.0, 0.5, 0.5, 1.0]
    with pytest.raises(RestartBudgetExhausted):
        p.next_restart("a", trained=True)  # the budget still counts every restart


def test_supervisor_config_is_checked():
    with pytest.raises(ConfigError, match="supervisor.heartbeat_timeout_s=1.0 must be longer"):
        apply_overrides(Config(), {"supervisor.heartbeat_timeout_s": 1.0}).validate()
    with pytest.raises(ConfigError, match="supervisor.restart_budget=-1"):
        apply_overrides(Config(), {"supervisor.restart_budget": -1}).validate()


def _log(tmp_path, rows):
    log = EventLog(tmp_path / "events.jsonl")
    for kind, t, fields in rows:
        log.emit(kind, **fields)
    log.close()
    events = read_events(tmp_path / "events.jsonl")
    for e, (_, t, _) in zip(events, rows):  # put the made-up times in
        e["time"] = t
    return events


def test_figures_from_an_event_log(tmp_path):
    events = _log(tmp_path, [
        ("run_start", 0.0, {}),
        ("launch", 0.0, {"attempt": 0}),
        ("worker_start", 5.0, {"attempt": 0, "rank": 0, "start_step": 0}),
        ("first_step", 10.0, {"attempt": 0, "rank": 0, "step": 1}),
        ("fault_injected", 40.0, {"fault": "kill", "rank": 1, "step": 31, "attempt": 0}),
        ("detected", 40.5, {"attempt": 0, "failures": []}),
        ("attempt_end", 40.5, {"attempt": 0, "start_step": 0, "last_step": 31, "step_s": 1.0}),
        ("launch", 45.0, {"attempt": 1}),
        ("worker_start", 50.0, {"attempt": 1, "rank": 0, "start_step": 30}),
        ("first_step", 55.0, {"attempt": 1, "rank": 0, "step": 31}),
        ("attempt_end", 125.0, {"attempt": 1, "start_step": 30, "last_step": 100, "step_s": 1.0}),
        ("run_end", 125.0, {"status": "finished"}),
    ])
    (f,) = fault_figures(events)
    assert f["detection_s"] == pytest.approx(0.5) and f["recovery_s"] == pytest.approx(15.0)
    assert f["restored_step"] == 30 and f["recomputed_steps"] == 1


def test_recomputed_steps_count_the_steps_rank_0_ledgered_past_the_last_heartbeat(tmp_path):
    """The survivor of a kill dispatched steps 32 and 33 after the beat the supervisor last saw (step 31); its
    goodput ledger, written as its loop ended, says so. A later attempt's ledger is not this fault's."""
    events = _log(tmp_path, [
        ("run_start", 0.0, {}),
        ("launch", 0.0, {"attempt": 0}),
        ("worker_start", 5.0, {"attempt": 0, "rank": 0, "start_step": 0}),
        ("goodput", 30.0, {"rank": 0, "step": 20}),
        ("fault_injected", 40.0, {"fault": "kill", "rank": 1, "step": 31, "attempt": 0}),
        ("goodput", 40.2, {"rank": 0, "step": 33}),
        ("goodput", 40.3, {"rank": 0, "step": 32}),  # out of order: the largest counts
        ("detected", 40.5, {"attempt": 0, "failures": []}),
        ("attempt_end", 40.5, {"attempt": 0, "start_step": 0, "last_step": 31, "step_s": 1.0}),
        ("launch", 45.0, {"attempt": 1}),
        ("worker_start", 50.0, {"attempt": 1, "rank": 0, "start_step": 30}),
        ("goodput", 80.0, {"rank": 0, "step": 60}),
        ("run_end", 125.0, {"status": "finished"}),
    ])
    (f,) = fault_figures(events)
    assert f["reached_step"] == 33 and f["restored_step"] == 30 and f["recomputed_steps"] == 3


def test_event_log_is_json_lines_and_feeds_a_sink(tmp_path):
    got = []
    log = EventLog(tmp_path / "run" / "events.jsonl", sink=got.append)
    log.emit("detected", failures=[{"rank": 1}])
    log.close()
    (line,) = (tmp_path / "run" / "events.jsonl").read_text().splitlines()
    assert json.loads(line)["kind"] == "detected" and got[0]["failures"] == [{"rank": 1}]


def test_self_checks_are_skipped_only_when_every_failure_is_a_stop_from_outside():
    kill, term, sigint, abort = -signal.SIGKILL, -signal.SIGTERM, -signal.SIGINT, -signal.SIGABRT
    exit_ = [Failure(0, "h0", "exit", "killed"), Failure(1, "h1", "exit", "killed")]
    assert not needs_diagnosis(exit_, {0: term, 1: sigint})  # an operator, a preemption: no host implicated
    assert needs_diagnosis(exit_, {0: kill, 1: term})  # SIGKILL: the OOM killer or a dying node, maybe the host
    assert needs_diagnosis(exit_, {0: term, 1: abort})  # an abort (XLA/CUDA checks) may be a device
    assert needs_diagnosis(exit_, {0: term, 1: 1})  # an error exit
    assert needs_diagnosis([Failure(0, "h0", "exit", "restarted")], {0: None})  # exit code unknown
    assert needs_diagnosis([exit_[0], Failure(1, "h1", "heartbeat", "silent")], {0: term, 1: None})  # a hang
    # a worker that saved and left on a preemption's SIGTERM (143): stopped from outside, not a device
    assert not needs_diagnosis([Failure(0, "h0", "stopped", "stopped by SIGTERM")], {0: 143})


def test_a_death_is_an_exit_nobody_asked_for():
    dead = Failure(0, "h0", "exit", "x")
    assert died(dead, -signal.SIGKILL) and died(dead, -signal.SIGABRT) and died(dead, 1)
    assert died(dead, -(signal.SIGRTMIN + 2))  # a signal number with no Signals member
    assert not died(dead, -signal.SIGTERM) and not died(dead, -signal.SIGINT)
    assert not died(dead, 0) and not died(dead, None)
    for kind in ("stopped", "heartbeat", "stalled", "peer_lost", "nonfinite"):
        assert not died(Failure(0, "h0", kind, "x"), -signal.SIGKILL), kind


def test_recovery_phases_split_the_recovery_time_in_order():
    t = 1000.0
    events = [
        {"time": t, "kind": "fault_injected", "fault": "kill", "rank": 1, "step": 7, "attempt": 0},
        {"time": t + 0.5, "kind": "detected", "attempt": 0},
        {"time": t + 1.5, "kind": "stopped", "attempt": 0},
        {"time": t + 2.0, "kind": "restart", "attempt": 1},
        {"time": t + 2.5, "kind": "launch", "attempt": 1},
        # two workers: the slowest one's mark ends each phase
        {"time": t + 9.0, "kind": "worker_phases", "attempt": 1, "rank": 0, "phases": {
            "process_start": t + 2.6, "imports": t + 4.0, "rendezvous": t + 4.5, "distributed": t + 5.0,
            "prepared": t + 6.0, "restored": t + 6.5, "first_step": t + 8.0}},
        {"time": t + 9.1, "kind": "worker_phases", "attempt": 1, "rank": 1, "phases": {
            "process_start": t + 2.7, "imports": t + 4.2, "rendezvous": t + 4.5, "distributed": t + 5.0,
            "prepared": t + 6.1, "restored": t + 6.6, "first_step": t + 8.5}},
        {"time": t + 9.0, "kind": "first_step", "attempt": 1, "step": 6},
    ]
    (r,) = recovery_phases(events)
    want = {"detect": 0.5, "stop": 1.0, "backoff": 1.0, "process_start": 0.2, "imports": 1.5, "rendezvous": 0.3,
            "distributed": 0.5, "prepare": 1.1, "restore": 0.5, "compile_first_step": 1.9, "heartbeat_lag": 0.5}
    assert list(r["phases"]) == list(want)  # no diagnose phase: none ran
    for k, v in want.items():
        assert r["phases"][k] == pytest.approx(v), k
    assert sum(r["phases"].values()) == pytest.approx(9.0)  # the fault's recovery time
    # a warm standby started before the launch; the supervisor saw the fast worker's first step early
    events[5]["phases"]["process_start"] = events[6]["phases"]["process_start"] = t - 50.0
    events[-1]["time"] = t + 8.2
    (r,) = recovery_phases(events)
    assert r["phases"]["process_start"] == 0.0 and r["phases"]["imports"] == pytest.approx(1.7)
    assert r["phases"]["heartbeat_lag"] == 0.0 and sum(r["phases"].values()) == pytest.approx(8.5)


def test_straggler_exclusion_is_soft():
    """A recorded straggler is left out when a spare or re-planning replaces it, and kept (not the run stopped)
    when nothing can; hosts not running or already excluded are not decided again."""
    from msjax.supervise.exclusion import StragglerExclusion, straggler_exclusions

    all_hosts = ["host0", "host1", "host2", "host3", "host4"]  # host4 a spare
    running = all_hosts[:4]
    got = straggler_exclusions({"host2"}, running, all_hosts, {}, needed=4, replan=False)
    assert got == StragglerExclusion(["host2"], [])  # the spare takes its place
    got = straggler_exclusions({"host2", "host4"}, running, all_hosts, {"host4": "diag"}, needed=4, replan=True)
    assert got == StragglerExclusion(["host2"], [])  # no spare left: re-plan onto 3 hosts
    got = straggler_exclusions({"host2"}, running, all_hosts, {"host4": "diag"}, needed=4, replan=False)
    assert got == StragglerExclusion([], ["host2"])  # nothing can replace it: kept
    got = straggler_exclusions({"host0"}, ["host0"], ["host0"], {}, needed=1, replan=True)
    assert got == StragglerExclusion([], ["host0"])  # the last host is never left out
    got = straggler_exclusions({"host1", "host4"}, running, all_hosts, {"host1": "diag"}, needed=4, replan=True)
    assert got == StragglerExclusion([], [])  # host1 already excluded, host4 not running


def test_flagged_straggler_reaches_the_next_restarts_excluded_hosts(tmp_path):
    """observe.exclude_stragglers end to end on the pure parts: the detector flags process 2 (random figures, its
    host lag 3x the others') -> its host is queued on the control plane's sink -> written to the excluded set ->
    the supervisor's restart leaves it out (a spare replaces it); with the option off nothing is recorded."""

    import numpy as np

    from msjax.config import ObserveConfig
    from msjax.control.metrics import RedisMetricsSink
    from msjax.observe.stragglers import RankPlace
    from msjax.observe.timing import WINDOW_FIGURES, StepObserver
    from msjax.supervise.supervisor import Supervisor

    class FakeStore:  # the two Store methods the sink and the supervisor use
        def __init__(self):
            self.excluded = {}

        def exclude_host(self, host, reason=""):
            self.excluded[host] = reason

        def excluded_hosts(self):
            return set(self.excluded)

    rng = np.random.default_rng(0)
    for enabled in (True, False):
        store = FakeStore()
        sink = RedisMetricsSink(store)
        obs = StepObserver(ObserveConfig(window=4, persist=2, exclude_stragglers=enabled),
                           exclude_host=sink.exclude_host)
        obs.rank, obs.run_dir = 0, tmp_path / str(enabled)
        obs.run_dir.joinpath("ranks").mkdir(parents=True)
        obs.places = {p: RankPlace(p, f"host{p}", {"data": [p]}, [p]) for p in range(4)}
        for step in (4, 8):
            every = 0.01 * (1 + 0.05 * rng.standard_normal((4, len(WINDOW_FIGURES))))
            every[2, WINDOW_FIGURES.index("host_lag_s")] *= 3
            obs._compare(None, step, {k: every[:, i] for i, k in enumerate(WINDOW_FIGURES)}, probe_plan=None)
        assert [s["process"] for s in obs.stragglers] == [2]
        sink.flush()
        assert store.excluded_hosts() == ({"host2"} if enabled else set())
        sup = Supervisor.__new__(Supervisor)
        sup.cfg = apply_overrides(Config(), {"observe.exclude_stragglers": enabled, "observe.window": 4})
        sup.s, sup.control, sup.out = sup.cfg.supervisor, store, open(tmp_path / f"sup{enabled}.txt", "w")
        sup.hosts, sup.excluded = ["host0", "host1", "host2", "host3", "host4"], {}
        sup.events = EventLog(tmp_path / f"sup{enabled}.jsonl")
        newly = sup._exclude_stragglers(sup.hosts[:4], 4)
        sup.events.close()
        sup.out.close()
        assert newly == (["host2"] if enabled else []) and list(sup.excluded) == newly
        assert [h for h in sup.hosts if h not in sup.excluded][:4] == (
            ["host0", "host1", "host3", "host4"] if enabled else sup.hosts[:4])
    with pytest.raises(ConfigError, match="exclude_stragglers=true needs observe.window"):
        apply_overrides(Config(), {"observe.exclude_stragglers": True, "observe.window": 0}).validate()


def test_the_first_step_is_beaten_at_once_later_steps_at_the_period():
    """The supervisor's recovery time ends when it sees every worker's first step: the one heartbeat
    (msjax.control.hook) sends the restore step at the loop's start and the first step at once, instead of at the
    next period (here 1 hour, so only the immediate beats can arrive); after the loop it says the loop is over."""
    from pathlib import Path
    from types import SimpleNamespace

    from msjax.control.hook import ControlPlaneHook
    from msjax.control.rendezvous import Assignment
    from msjax.control.worker import WorkerContext
    from msjax.hooks import LoopControl, RunContext

    class Store:  # the Store methods the hook calls, recording the beats
        def __init__(self):
            self.beats = []

        def heartbeat(self, rank, ttl_s, beat, member=None):
            self.beats.append(beat)
            return False, None

        def post_event(self, kind, **fields):
            pass

        def publish_metrics(self, rows):
            pass

    store = Store()
    hook = ControlPlaneHook(WorkerContext(store, Assignment(1, 2, "h:1", 0), "0-0", "host1", "host1"),
                            period_s=3600.0, ttl_s=7200.0)
    ctx = RunContext(config=Config(), run_dir=Path("/nonexistent"), mesh=None, program=None, start_step=40,
                     control=LoopControl())
    hook.on_start(ctx)
    try:
        assert [b["step"] for b in store.beats] == [40] and store.beats[0]["start_step"] == 40
        hook.on_step_end(ctx, 41, {})
        assert [b["step"] for b in store.beats] == [40, 41]
        assert store.beats[-1]["state"] == "running" and "first_step" in store.beats[-1]["phases"]
        hook.on_step_end(ctx, 42, SimpleNamespace())
        hook.on_step_end(ctx, 43, {})
        assert [b["step"] for b in store.beats] == [40, 41]  # later steps wait for the period
        assert [b["seq"] for b in store.beats] == [1, 2] and store.beats[0]["host"] == "host1"
        hook.on_end(ctx, None)
        assert store.beats[-1]["step"] == 43 and store.beats[-1]["state"] == "finished"
    finally:
        hook.close()


def test_rank_0_publishes_the_newest_verified_checkpoint_of_a_local_or_object_store_directory(tmp_path):
    """The control plane's "newest checkpoint" is `latest_verified`'s answer, the step a restore resumes from: a
    newer step without an integrity record (an interrupted write) is passed over, and a gs:// / s3:// checkpoint
    directory (here a real S3 server) is named by its URL. Rank 0's hook publishes it to a real Redis."""
    from msjax import paths
    from msjax.checkpoint import latest_verified
    from msjax.checkpoint.integrity import RECORD_FORMAT, RECORD_NAME
    from msjax.control.hook import ControlPlaneHook
    from msjax.control.rendezvous import Assignment
    from msjax.control.server import RedisServer
    from msjax.control.store import Store, connect
    from msjax.control.worker import WorkerContext
    from msjax.hooks import LoopControl, RunContext
    from tests.msjax.object_store import S3Server

    record = json.dumps({"format": RECORD_FORMAT, "checksums": {}}).encode()
    with RedisServer() as server, S3Server() as s3:
        bucket = s3.make_bucket("hook")
        for where in (str(tmp_path / "ckpt"), f"{bucket}/run"):
            for step in (2, 4):
                if not paths.is_remote(where):
                    (tmp_path / "ckpt" / str(step) / "state").mkdir(parents=True)
            paths.write_bytes(paths.join(where, "2", "state", "data"), b"x")
            paths.write_bytes(paths.join(where, "2", RECORD_NAME), record)
            paths.write_bytes(paths.join(where, "4", "state", "data"), b"x")  # committed, no record yet
            assert latest_verified(where) == 2
            store = Store(connect(server.url), f"hook-{len(where)}")
            hook = ControlPlaneHook(WorkerContext(store, Assignment(0, 1, "h:1", 0), "0-0", "host0", "host0"),
                                    period_s=0.1, ttl_s=5.0, newest_checkpoint=latest_verified)
            cfg = apply_overrides(Config(), {"checkpoint.dir": where, **s3.overrides()})
            ctx = RunContext(config=cfg, run_dir=tmp_path / "run", mesh=None, program=None, start_step=0,
                             control=LoopControl(), checkpoint_dir=where)
            hook.on_start(ctx)
            try:
                hook.on_end(ctx, None)
            finally:
                hook.close()
            got = store.checkpoint("persistent")
            assert (got["step"], got["path"]) == (2, paths.join(where, "2")), got


def test_rank_0_lists_the_checkpoint_directory_only_while_a_save_awaits_its_verification(tmp_path, monkeypatch):
    """Listing the checkpoint directory (a bucket, perhaps) sits on the heartbeat thread's path, so rank 0 lists it
    only while a checkpoint is awaited: the restored step at the loop's start, then a save the loop started
    (`on_checkpoint`), listed every period until its integrity record shows, then no more. A real Redis; the
    listing counted where the hook calls it."""
    import msjax.checkpoint
    from msjax.checkpoint.integrity import RECORD_FORMAT, RECORD_NAME
    from msjax.control.hook import ControlPlaneHook
    from msjax.control.rendezvous import Assignment
    from msjax.control.server import RedisServer
    from msjax.control.store import Store, connect
    from msjax.control.worker import WorkerContext
    from msjax.hooks import LoopControl, RunContext

    listed = []
    real = msjax.checkpoint.latest_verified
    monkeypatch.setattr(msjax.checkpoint, "latest_verified", lambda *a, **k: listed.append(1) or real(*a, **k))
    record = json.dumps({"format": RECORD_FORMAT, "checksums": {}})
    ckpt = tmp_path / "ckpt"

    def save(step: int, verified: bool) -> None:
        (ckpt / str(step) / "state").mkdir(parents=True)
        (ckpt / str(step) / "state" / "data").write_bytes(b"x")
        if verified:
            (ckpt / str(step) / RECORD_NAME).write_text(record)

    def wait_for(what, predicate, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
            time.sleep(0.02)

    period = 0.05
    save(2, verified=True)
    with RedisServer() as server:
        store = Store(connect(server.url), "hook-listing")
        hook = ControlPlaneHook(WorkerContext(store, Assignment(0, 1, "h:1", 0), "0-0", "host0", "host0"),
                                period_s=period, ttl_s=5.0, newest_checkpoint=msjax.checkpoint.latest_verified)
        ctx = RunContext(config=apply_overrides(Config(), {"checkpoint.dir": str(ckpt)}), run_dir=tmp_path / "run",
                         mesh=None, program=None, start_step=2, control=LoopControl(), checkpoint_dir=ckpt)
        hook.on_start(ctx)
        try:
            wait_for("the restored step's record", lambda: (store.checkpoint("persistent") or {}).get("step") == 2)
            settled = len(listed)
            time.sleep(10 * period)
            assert len(listed) == settled <= 2  # nothing awaited: no listing, whatever the heartbeats do
            save(4, verified=False)  # a save started; its integrity record comes later (an asynchronous save)
            hook.on_checkpoint(ctx, 4)
            wait_for("3 listings while step 4 is unverified", lambda: len(listed) >= settled + 3)
            assert store.checkpoint("persistent")["step"] == 2  # never a step without its record
            (ckpt / "4" / RECORD_NAME).write_text(record)
            wait_for("step 4's record", lambda: store.checkpoint("persistent")["step"] == 4)
            settled = len(listed)
            time.sleep(10 * period)
            assert len(listed) == settled
        finally:
            hook.close()
