"""The loop's hook interface: hooks are called at the documented points, and LoopControl requests are honoured
(a stop request saves a checkpoint of the step it stopped after and ends the run there)."""

import json
import threading

import pytest

from msjax.hooks import Hook, LoopControl
from msjax.train import run


class Recorder(Hook):
    def __init__(self, stop_at: int | None = None):
        self.calls: list[tuple] = []
        self.stop_at = stop_at

    def on_start(self, ctx):
        self.calls.append(("start", ctx.start_step))

    def on_step_end(self, ctx, step, metrics):
        self.calls.append(("step", step))
        if step == self.stop_at:
            ctx.control.request_stop("test asked")

    def on_log(self, ctx, step, scalars):
        self.calls.append(("log", step, sorted(scalars)))

    def on_eval(self, ctx, step, scalars):
        self.calls.append(("eval", step, sorted(scalars)))

    def on_checkpoint(self, ctx, step):
        self.calls.append(("ckpt", step))

    def on_end(self, ctx, error):
        self.calls.append(("end", error))


def test_hooks_are_called_and_a_stop_request_saves_and_ends(tmp_path, small_corpus, make_tiny_config):
    """Steps 1-4 of an 8-step run (log every 2, evaluate and checkpoint every 4), stopped by a hook after step 4.
    The metrics file holds what the hooks were given: the metrics writer is one of them."""
    rec = Recorder(stop_at=4)
    summary = run(make_tiny_config(tmp_path, small_corpus), hooks=[rec])
    assert rec.calls[0] == ("start", 0)
    assert [c[1] for c in rec.calls if c[0] == "step"] == [1, 2, 3, 4]
    logged = [c for c in rec.calls if c[0] == "log"]
    assert [c[1] for c in logged] == [2, 4] and {"grad_norm", "loss", "mfu", "tokens_per_s"} <= set(logged[0][2])
    assert [c for c in rec.calls if c[0] == "eval"] == [("eval", 4, ["val_loss", "wall_s"])]
    assert ("ckpt", 4) in rec.calls and rec.calls[-1] == ("end", None)
    assert summary.final_step == 4 and summary.stop_reason == "test asked"
    assert summary.checkpoints == [4]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    written = [(s, sorted(["step", *keys])) for _, s, keys in logged] + [(4, ["step", "val_loss", "wall_s"])]
    assert [(r["step"], sorted(r)) for r in rows] == written
    assert rows[-1]["val_loss"] == summary.val_loss[-1][1]


def test_loop_control_is_thread_safe_and_consumes_requests():
    control = LoopControl()
    threads = [threading.Thread(target=control.request_stop, args=(f"r{i}",)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=5)
    assert control.stop_reason in {f"r{i}" for i in range(8)}
    control.request_checkpoint()
    assert control.take_checkpoint_request() and not control.take_checkpoint_request()
    control.request_profile(5, 2)
    assert control.take_profile_request() == (5, 2) and control.take_profile_request() is None
    with pytest.raises(ValueError, match="count >= 1"):
        control.request_profile(5, 0)


def test_the_hook_list_is_built_from_the_config_and_shares_through_constructor_arguments():
    """build_hooks: the metrics writer, then fault handling, then observability, then the control plane, then the caller's, then the
    goodput ledger; the step observer gets the control plane's metrics sink and straggler exclusion as
    constructor arguments, and the ledger the sinks that take a goodput ledger."""
    from msjax.config import Config, apply_overrides
    from msjax.faults import NonFiniteStop, StopOnSignal
    from msjax.goodput import LoopLedger
    from msjax.metrics import MetricsWriter
    from msjax.observe import ProfileHook, StepObserver
    from msjax.train import build_hooks

    class Plane(Hook):  # what build_hooks reads of msjax.control.hook.ControlPlaneHook: its metrics sink
        def __init__(self):
            self.metrics = Sink()

    class Sink:
        def publish(self, rank, step, values):
            pass

        def exclude_host(self, host, reason=""):
            pass

        def publish_goodput(self, rank, ledger):
            pass

    class StepSink:  # a sink of step rows only
        def publish(self, rank, step, values):
            pass

    mine, own_sink, plane = Recorder(), StepSink(), Plane()
    hooks = build_hooks(apply_overrides(Config(), {"train.nonfinite": "stop"}), plane, sinks=[own_sink],
                        extra=[mine])
    assert [type(h) for h in hooks] == [MetricsWriter, StopOnSignal, NonFiniteStop, StepObserver, ProfileHook, Plane,
                                        Recorder, LoopLedger]
    assert hooks[0].loggers == Config().train.loggers
    observer = hooks[3]
    assert observer.sinks == [own_sink, plane.metrics] and observer.exclude_host == plane.metrics.exclude_host
    assert hooks[-1].sinks == [plane.metrics]
    alone = build_hooks(apply_overrides(Config(), {"train.nonfinite": "skip"}))
    assert [type(h) for h in alone] == [MetricsWriter, StopOnSignal, StepObserver, ProfileHook, LoopLedger]
    assert alone[2].sinks == [] and alone[2].exclude_host is None and alone[-1].sinks == []
