"""Observability: seeing inside a run, per rank, in numbers and pictures.

Owns: per-step per-process timing without a host sync per step (`timing`: step, data, checkpoint, compute and
host-stall time, tokens/s, MFU, loss, grad norm, lr, to JSONL, TensorBoard and a pluggable live sink), Python GC
control (collection off during training, every rank collects at the same steps), straggler detection with mesh
coordinates (`stragglers`: pure scoring functions; `timing` gathers the figures at window ends), run events
(written through `msjax.events`: `<run_dir>/events.jsonl`), profiling on demand (`profile`: jax.profiler traces
of chosen steps, on request, at start or on SIGUSR1), a mixture of experts' load per layer and expert
(`experts`), reports (`report`: heatmaps over the mesh and of the expert load, loss/MFU curves, per-rank
timelines as PNGs + index.html) and Weights & Biases as a sink of the loop's metrics (`wandb_logger`, used by
`msjax.metrics` when `train.loggers` names it).

Everything joins the loop through `msjax.hooks` (`loop_hooks(config)`), so a run without it runs the same code.
Seams for the control plane: a `MetricsSink` (`publish(rank, step, values)`) and an `exclude_host` callable passed
to `loop_hooks` for live metrics and straggler exclusion, `LoopControl.request_profile` for traces, and the pure
functions of `stragglers` for scoring figures that arrive through a store instead of jax's all-gather.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from msjax.hooks import Hook
from msjax.observe.experts import ExpertLoadLog
from msjax.observe.profile import ProfileHook, traced_steps
from msjax.observe.stragglers import (RankPlace, StragglerDetector, WindowVerdict, mesh_places,
                                      persistent_stragglers, slowdown_scores)
from msjax.observe.timing import MetricsSink, StepObserver


def loop_hooks(config: Any, sinks: Sequence[MetricsSink] = (),
               exclude_host: Callable[[str, str], None] | None = None) -> list[Hook]:
    """The observability hooks for a run of `config` (its `observe` section): step observer, then profiler, and
    for a mixture of experts the expert-load log (`experts`).

    Args:
      sinks: live metric sinks that get every per-step row (`StepObserver`).
      exclude_host: records a straggler's host for exclusion at the next restart (`StepObserver`).
    """
    o = config.observe
    return [StepObserver(o, sinks=sinks, exclude_host=exclude_host),
            ProfileHook(o.profile_steps, signal_steps=o.profile_signal_steps),
            *([ExpertLoadLog()] if config.model.moe.num_experts else [])]


__all__ = ["MetricsSink", "ProfileHook", "RankPlace", "StepObserver", "loop_hooks", "mesh_places",
           "persistent_stragglers", "slowdown_scores", "StragglerDetector", "traced_steps",
           "WindowVerdict"]
