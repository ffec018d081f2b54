"""How subsystems join the training loop: one small interface, so `msjax.train.run` stays readable top to bottom.

The metrics writer, the control plane, observability, fault handling and the supervisor each add a `Hook` (in the
spirit of Levanter's trainer hooks and Keras callbacks); the loop calls every hook at the same fixed points. A run
with no hooks runs the same code path as one with them. Hooks ask things of the loop (stop after this step,
checkpoint now, profile some steps) through the shared `LoopControl`, which any thread may write (a signal handler,
a control-plane poller) and the loop reads once per step without touching the device.

Rules for hooks: `on_step_end` runs on every step and must not block on the device (its `metrics` are device arrays
still being computed; reading them forces a host sync); `on_log` runs at logging steps with host floats, `on_eval`
after each evaluation. A hook gets what it shares with another hook through its constructor (the step observer gets
the control plane's metrics sink as an argument), and what it may read about the run through `RunContext`'s typed
fields; the run's hook list is built in one place, `msjax.train.build_hooks`, from the config.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence



class LoopControl:
    """Requests to the loop, set from any thread, read by the loop between steps (no device sync).

    Attributes (read them through the methods below):
      stop_reason: why the loop should stop after the current step (it saves first), or None.
      stop_signal: the signal number behind the stop (received, or relayed by a launcher), or None: the train
        command then exits with 128 + it (msjax.train.main).
      checkpoint_requested: save at the end of the current step even if it is not a checkpoint step.
      profile_request: (first_step, num_steps) of a profiler trace to capture, or None.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.stop_reason: str | None = None
        self.stop_signal: int | None = None
        self.checkpoint_requested = False
        self.profile_request: tuple[int, int] | None = None

    def request_stop(self, reason: str, signal: int | None = None) -> None:
        """Ask the loop to finish its step, save, and return. The first reason (and its signal) given is kept."""
        with self._lock:
            if self.stop_reason is None:
                self.stop_reason, self.stop_signal = reason, signal

    def request_checkpoint(self) -> None:
        with self._lock:
            self.checkpoint_requested = True

    def take_checkpoint_request(self) -> bool:
        """True once per `request_checkpoint` (the request is consumed)."""
        with self._lock:
            requested, self.checkpoint_requested = self.checkpoint_requested, False
            return requested

    def request_profile(self, first_step: int, num_steps: int) -> None:
        """Ask for a profiler trace of steps first_step .. first_step + num_steps - 1.

        Raises ValueError for num_steps < 1 or first_step < 0."""
        if num_steps < 1 or first_step < 0:
            raise ValueError(f"profile request steps {first_step}:{num_steps}: allowed is first >= 0, count >= 1")
        with self._lock:
            self.profile_request = (first_step, num_steps)

    def take_profile_request(self) -> tuple[int, int] | None:
        with self._lock:
            request, self.profile_request = self.profile_request, None
            return request


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm was not finite and `train.nonfinite=stop` (raised by `msjax.faults.NonFiniteStop`;
    a hook sees it in `on_end`).

    Attributes:
      step: the step whose loss or gradient norm was not finite (None when not given).
      loss: that step's loss (float; may be finite when only the gradient norm was not).
    """

    def __init__(self, message: str, step: int | None = None, loss: float = float("nan")):
        super().__init__(message)
        self.step, self.loss = step, loss


# One stop notice can arrive twice within milliseconds: SLURM's `scancel --signal` signals every process of a job
# step, and the task wrapper that runs the worker forwards the same signal to it (msjax.launch.slurm). A second
# signal means "exit now" only when it comes later than this, as a person pressing Ctrl-C again does.
DUPLICATE_WINDOW_S = 0.5


def is_duplicate_delivery(first_at: float | None) -> bool:
    """Whether a signal arriving now repeats the one first received at `first_at` (time.monotonic(), None: no
    signal yet) rather than being a second request."""
    return first_at is not None and time.monotonic() - first_at < DUPLICATE_WINDOW_S


class DataWait:
    """The loop's waits for its batches, as the host saw them and as the devices did, over the steps whose device
    work is done. The step observer's watcher thread adds each step once its outputs are ready; the goodput ledger
    reads the totals (`msjax.goodput`).

    A wait in `next(loader)` idles the devices only for the part of it after the previous step's outputs were
    ready: before that they were still running queued steps. Per step (seconds, perf_counter clock):
    device = max(0, got - max(fetch, previous step done)), the whole wait for a run's first step.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._host_s = self._device_s = 0.0

    def add(self, host_s: float, device_s: float) -> None:
        with self._lock:
            self._host_s += host_s
            self._device_s += device_s

    def totals(self) -> tuple[float, float]:
        """(host seconds, device seconds) of the steps added so far; device <= host."""
        with self._lock:
            return self._host_s, self._device_s


@dataclass
class RunContext:
    """What a hook may read about the run. Filled in by `msjax.train.run` before `on_start`.

    Attributes:
      config: the validated Config (model.vocab_size filled in).
      run_dir: the run directory (metrics, checkpoints, events).
      mesh: the jax Mesh the step runs on.
      program: the TrainProgram (msjax.train_step).
      start_step: the step the run starts from (0, or the restored checkpoint's step).
      control: the loop's LoopControl.
      timings: host times of the current step, written by the loop before `on_step_end`: `issue_t` (perf_counter
        seconds when the step was called), `data_s` (waiting for the batch), `dispatch_s` (inside the step call),
        `checkpoint_s` (blocked in the checkpoint save after the previous step), `eval_s` (evaluating after the
        previous step; 0 when it did not). Seconds. And `steps`: how many steps the call ran (1, or
        `train.steps_per_execution`); the step `on_step_end` gets is the last of them, the times are the call's.
      checkpoint_dir: the persistent checkpoint tier as the loop resolved it (a local path or a gs:// / s3://
        URL), or None.
      local_checkpoint_dir: the local tier (`checkpoint.local_dir` resolved), or None when there is none.
      data_wait: the batch waits as the devices saw them (`DataWait`): the step observer writes, the goodput
        ledger reads.
    """

    config: Any
    run_dir: Path
    mesh: Any
    program: Any
    start_step: int
    control: LoopControl
    timings: dict[str, float] = field(default_factory=dict)
    checkpoint_dir: Any = None
    local_checkpoint_dir: Any = None
    data_wait: DataWait = field(default_factory=DataWait)


class Hook:
    """Base class: every method is a no-op; override the ones you need."""

    def on_start(self, ctx: RunContext) -> None:
        """Once, after the state is initialised or restored and before the first step."""

    def on_step_end(self, ctx: RunContext, step: int, metrics: dict[str, Any]) -> None:
        """After step `step` was dispatched. `metrics` are device arrays: do not read them here."""

    def on_log(self, ctx: RunContext, step: int, scalars: dict[str, float]) -> None:
        """At a logging step, with host values (loss, grad_norm, tokens_per_s, mfu, ...)."""

    def on_eval(self, ctx: RunContext, step: int, scalars: dict[str, float]) -> None:
        """After an evaluation at step `step`, with host values: `val_loss` (mean nats per token) and `wall_s`
        (seconds since the run started)."""

    def on_checkpoint(self, ctx: RunContext, step: int) -> None:
        """After a checkpoint of `step` was started."""

    def on_end(self, ctx: RunContext, error: BaseException | None) -> None:
        """Once, when the loop ends: `error` is None after a normal end (including a requested stop)."""


class Hooks(Hook):
    """Calls a sequence of hooks in order (on_end in reverse order, so the first started is the last ended)."""

    def __init__(self, hooks: Sequence[Hook] = ()):
        self.hooks = list(hooks)

    def on_start(self, ctx: RunContext) -> None:
        for h in self.hooks:
            h.on_start(ctx)

    def on_step_end(self, ctx: RunContext, step: int, metrics: dict[str, Any]) -> None:
        for h in self.hooks:
            h.on_step_end(ctx, step, metrics)

    def on_log(self, ctx: RunContext, step: int, scalars: dict[str, float]) -> None:
        for h in self.hooks:
            h.on_log(ctx, step, scalars)

    def on_eval(self, ctx: RunContext, step: int, scalars: dict[str, float]) -> None:
        for h in self.hooks:
            h.on_eval(ctx, step, scalars)

    def on_checkpoint(self, ctx: RunContext, step: int) -> None:
        for h in self.hooks:
            h.on_checkpoint(ctx, step)

    def on_end(self, ctx: RunContext, error: BaseException | None) -> None:
        for h in reversed(self.hooks):
            h.on_end(ctx, error)
