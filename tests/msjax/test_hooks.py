"""The loop's hook interface: hooks are called at the documented points, and LoopControl requests are honoured
(a stop request saves a checkpoint of the step it stopped after and ends the run there)."""

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

    def on_checkpoint(self, ctx, step):
        self.calls.append(("ckpt", step))

    def on_end(self, ctx, error):
        self.calls.append(("end", error))


def test_hooks_are_called_and_a_stop_request_saves_and_ends(tmp_path, small_corpus, make_tiny_config):
    rec = Recorder(stop_at=3)
    summary = run(make_tiny_config(tmp_path, small_corpus), hooks=[rec])
    assert rec.calls[0] == ("start", 0)
    assert [c[1] for c in rec.calls if c[0] == "step"] == [1, 2, 3]
    logged = [c for c in rec.calls if c[0] == "log"]
    assert logged[0][1] == 2 and {"grad_norm", "loss", "mfu", "tokens_per_s"} <= set(logged[0][2])
    assert ("ckpt", 3) in rec.calls and rec.calls[-1] == ("end", None)
    assert summary.final_step == 3 and summary.stop_reason == "test asked"
    assert summary.checkpoints == [3]


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
    """build_hooks: fault handling, then observability, then the control plane, then the caller's, then the
    goodput ledger; the step observer gets the control plane's metrics sink and straggler exclusion as
    constructor arguments, and the ledger the sinks that take a goodput ledger."""
    from msjax.config import Config, apply_overrides
    from msjax.faults import NonFiniteStop, StopOnSignal
    from msjax.goodput import LoopLedger
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
    assert [type(h) for h in hooks] == [StopOnSignal, NonFiniteStop, StepObserver, ProfileHook, Plane, Recorder,
                                        LoopLedger]
    observer = hooks[2]
    assert observer.sinks == [own_sink, plane.metrics] and observer.exclude_host == plane.metrics.exclude_host
    assert hooks[-1].sinks == [plane.metrics]
    alone = build_hooks(apply_overrides(Config(), {"train.nonfinite": "skip"}))
    assert [type(h) for h in alone] == [StopOnSignal, StepObserver, ProfileHook, LoopLedger]
    assert alone[1].sinks == [] and alone[1].exclude_host is None and alone[-1].sinks == []
