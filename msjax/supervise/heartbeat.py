"""The worker side of supervision: a loop Hook that sends heartbeats and reports non-finite losses.

A daemon thread sends a heartbeat every `period_s` seconds with the newest step the loop has dispatched (a
host-side counter set in `on_step_end`: no device sync) and a TTL of the supervisor's heartbeat timeout, so a
worker that hangs or is stopped (SIGSTOP stops every thread) goes silent and its key expires. A thread rather than
a beat per step, so a long step (compilation, a checkpoint) is not taken for a hang: the step counter, not the
heartbeat, shows progress (MegaScale sec. 5.1 runs its heartbeat in a daemon beside the training process).

At logging steps, a non-finite loss is reported to the supervisor (the loop's own handling of it, if any, is the
checkpoint subsystem's concern).

Workers learn where to send from the environment the supervisor sets (`supervisor_hooks`):
  MSJAX_SUPERVISED        1 when a supervisor watches this worker
  MSJAX_REDIS_URL         the control plane's Redis (msjax.control.worker)
  MSJAX_RUN_ID            the run's namespace in Redis
  MSJAX_SLOT              this worker's place in the supervisor's host list (default: its jax process index)
  MSJAX_HOST              this worker's host name (default: the machine's)
"""

from __future__ import annotations

import atexit
import math
import os
import socket
import sys
import threading
import time
import uuid
from typing import Any

from msjax.hooks import Hook, RunContext
from msjax.supervise import phases
from msjax.supervise.store import RESTART_EXIT_CODE, HeartbeatStore


class HeartbeatHook(Hook):
    """Sends `{seq, step, time, pid, host, state, start_step}` every `period_s` with a TTL of `ttl_s`.

    Args:
      store: where beats go (a HeartbeatStore, or anything with `beat(rank, payload, ttl_s)` and
        `report(rank, kind, **fields)`).
      rank: this worker's slot (its place in the supervisor's host list).
      host: this worker's host name.
      period_s: seconds between beats.
      ttl_s: seconds a beat stays visible (the supervisor's heartbeat timeout).
    """

    def __init__(self, store: Any, rank: int, host: str, period_s: float, ttl_s: float):
        self.store, self.rank, self.host = store, rank, host
        self.period_s, self.ttl_s = period_s, ttl_s
        self._step: int | None = None
        self._start_step: int | None = None
        self._seq = 0
        self._state = "starting"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False
        self._lock = threading.Lock()  # the beat thread and the loop's first-step beat share `_seq`
        self.boot = uuid.uuid4().hex  # this process's identity: a restarted container may get the same pid

    def _beat(self) -> None:
        with self._lock:
            self._send()

    def _send(self) -> None:
        self._seq += 1
        payload = {"seq": self._seq, "step": self._step, "start_step": self._start_step, "time": time.time(),
                   "pid": os.getpid(), "host": self.host, "state": self._state, "boot": self.boot,
                   "phases": phases.marks()}
        try:
            self.store.beat(self.rank, payload, self.ttl_s)
            if getattr(self.store, "restart_requested", None) and self.store.restart_requested(self.boot):
                # The supervisor restarts the job through the cluster (a JobSet's failurePolicy): leave at once,
                # without waiting on collectives a failed peer will never join.
                print(f"msjax heartbeat: rank {self.rank}: the supervisor asked for a restart; exiting with "
                      f"{RESTART_EXIT_CODE}", file=sys.stderr, flush=True)
                self.store.clear_heartbeats([self.rank])  # gone now, not at the TTL's end
                os._exit(RESTART_EXIT_CODE)
        except Exception as e:  # noqa: BLE001 - a lost supervisor must not stop training; say it once
            if not self._warned:
                self._warned = True
                print(f"msjax heartbeat: rank {self.rank} cannot reach the supervisor's store: {e!r}",
                      file=sys.stderr, flush=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._beat()

    def start(self, start_step: int | None = None) -> None:
        """Starts the beating thread (idempotent); the first beat is sent at once."""
        self._start_step = start_step
        self._step = start_step
        self._state = "running"
        self._beat()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"msjax-heartbeat-{self.rank}", daemon=True)
            self._thread.start()

    def stop(self, state: str = "finished") -> None:
        """Stops the thread (joined within one period) after a last beat with `state`."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.period_s + 5.0)
            self._thread = None
        self._state = state
        self._beat()

    # Hook interface ---------------------------------------------------------------------------------------------
    def on_start(self, ctx: RunContext) -> None:
        self.start(ctx.start_step)

    def on_step_end(self, ctx: RunContext, step: int, metrics: dict[str, Any]) -> None:
        first = self._step == self._start_step
        self._step = step  # an int store: atomic under the GIL, read by the beat thread
        if first:
            phases.mark("first_step")
            # Beat now, not at the next period: the supervisor's recovery time ends when it sees every worker's
            # first step, and waiting for the timer added half a period on average to every restart (1.7 s
            # measured with a 2.5 s period). One Redis write per process and run.
            self._beat()

    def on_log(self, ctx: RunContext, step: int, scalars: dict[str, float]) -> None:
        loss = scalars.get("loss")
        if loss is not None and not math.isfinite(loss):
            try:
                self.store.report(self.rank, "nonfinite", step=step, loss=repr(loss))
            except Exception as e:  # noqa: BLE001
                print(f"msjax heartbeat: rank {self.rank} could not report a non-finite loss: {e!r}",
                      file=sys.stderr, flush=True)

    def on_end(self, ctx: RunContext, error: BaseException | None) -> None:
        # Keep beating through what follows the loop (the last checkpoint's write, the sample, jax.distributed's
        # shutdown barrier), with a state that tells the supervisor the loop is over; stop at interpreter exit.
        self._state = "finished" if error is None else "failed"
        self._beat()
        atexit.register(self.stop, self._state)


def supervisor_hooks(cfg: Any) -> list[Hook]:
    """The supervision hooks for this worker: a HeartbeatHook when the supervisor launched it (MSJAX_SUPERVISED=1
    with the control plane's MSJAX_REDIS_URL and MSJAX_RUN_ID), else none (an unsupervised run is unchanged).

    Args:
      cfg: the run's Config (its `supervisor` section gives the period and the TTL).
    Raises:
      msjax.control.ControlError: MSJAX_RUN_ID missing, a bad slot, or Redis unreachable.
    """
    if os.environ.get("MSJAX_SUPERVISED") != "1":
        return []
    from msjax.control import ControlError

    url, run_id = os.environ.get("MSJAX_REDIS_URL"), os.environ.get("MSJAX_RUN_ID")
    if not url or not run_id:
        raise ControlError("MSJAX_SUPERVISED=1 needs MSJAX_REDIS_URL and MSJAX_RUN_ID (the supervisor sets them)")
    slot_text = os.environ.get("MSJAX_SLOT")
    if slot_text is None:
        import jax

        slot_text = str(jax.process_index())
    try:
        slot = int(slot_text)
    except ValueError:
        raise ControlError(f"MSJAX_SLOT={slot_text!r}: allowed is an integer") from None
    host = os.environ.get("MSJAX_HOST") or socket.gethostname()
    s = cfg.supervisor
    return [HeartbeatHook(HeartbeatStore.from_url(url, run_id), slot, host, s.heartbeat_period_s,
                          s.heartbeat_timeout_s)]
