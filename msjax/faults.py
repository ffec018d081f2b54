"""Fault handling that joins the loop through `msjax.hooks`: stop cleanly on SIGTERM/SIGINT, and the
`train.nonfinite=stop` policy.

SIGTERM (a preemption notice, a scheduler's kill) or SIGINT (Ctrl-C): the first asks the loop to stop after the
current step; the loop then saves, waits for the checkpoint to be complete and returns, and the train command
exits with 128 + the signal number (130 for SIGINT, 143 for SIGTERM: stopped, resumable with --resume; never 0,
which means finished). A second signal exits at once with the same status: a checkpoint in flight then has no
integrity record and is never taken for complete (msjax.checkpoint). In a multi-process run the handlers are not
installed: one process stopping alone would hang the others in a collective. Under a launcher, the control plane's
hook relays the signal as a stop command every process applies after the same step (msjax.control.hook);
otherwise jax's preemption service
takes SIGTERM and the processes stop at the step it agrees on (`Checkpointer.reached_preemption`).

Non-finite loss or gradient norm: the update is never applied (optax.apply_if_finite in msjax.optim); with
`train.nonfinite=skip` the loop goes on and counts it (`skipped`), with `stop` `NonFiniteStop` ends the run with
`NonFiniteLossError`, and `--resume` rolls back to the newest verified checkpoint.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from typing import Any

import jax

# The error a non-finite loss ends the loop with and the duplicate-signal rule belong to the hook contract
# (msjax.hooks): the control plane's hook reads both without knowing this module.
from msjax.hooks import (DUPLICATE_WINDOW_S, Hook, LoopControl, NonFiniteLossError, RunContext,  # noqa: F401
                         is_duplicate_delivery)


class StopOnSignal(Hook):
    """Installs SIGTERM/SIGINT handlers for the run (main thread only; restored at the end).

    Args:
      signals: the signals to handle.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
        self.signals = signals
        self._previous: dict[int, Any] = {}
        self._control: LoopControl | None = None
        self._received = 0
        self._first_at: float | None = None  # time.monotonic() of the first signal

    def on_start(self, ctx: RunContext) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # Python delivers signals to the main thread only; a run in another thread keeps its handlers
        if jax.process_count() > 1:
            # One process stopping alone would leave the others waiting in a collective: jax's preemption service
            # takes SIGTERM instead and agrees on a step with all processes (Checkpointer.reached_preemption).
            return
        self._control = ctx.control
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if is_duplicate_delivery(self._first_at):
            return
        self._received += 1
        self._first_at = self._first_at or time.monotonic()
        if self._received > 1:
            sys.stderr.write(f"msjax: second signal ({name}): exiting now without waiting for the checkpoint\n")
            sys.stderr.flush()
            os._exit(128 + signum)
        sys.stderr.write(f"msjax: {name} received: finishing the step, saving, then exiting "
                         f"(send it again to exit at once)\n")
        sys.stderr.flush()
        self._control.request_stop(f"received {name}", signal=signum)

    def on_end(self, ctx: RunContext, error: BaseException | None) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()


class NonFiniteStop(Hook):
    """`train.nonfinite=stop`: raises NonFiniteLossError at the first step whose loss or gradient norm is not
    finite (that step's update was already left out by the optimizer).

    Reads the step's loss and gradient norm on every step, a host sync per step: the price of stopping at the
    exact step (the `skip` policy reads its counter only at logging steps).
    """

    def on_step_end(self, ctx: RunContext, step: int, metrics: dict[str, Any]) -> None:
        loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            raise NonFiniteLossError(
                f"step {step}: the loss ({loss}) or gradient norm ({grad_norm}) is not finite; the update was not "
                "applied and the run stops (train.nonfinite=stop). --resume rolls back to the newest verified "
                "checkpoint; train.nonfinite=skip would skip such steps instead.", step=step, loss=loss)
