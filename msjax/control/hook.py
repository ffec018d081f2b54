"""The loop's side of the control plane: heartbeats, the command channel, newest checkpoint, events.

`ControlPlaneHook` joins `msjax.train.run` through `msjax.hooks.Hook`. A background thread does all Redis work, so
the loop never waits on Redis and no step adds a host sync:
  - every `interval_s` it sets this rank's heartbeat (the last dispatched step; a TTL of `ttl_s`), and on rank 0
    records the newest finalized checkpoint directory (tier "persistent");
  - rank 0 blocks on the command stream (XREAD BLOCK, `interval_s` at a time) and queues what arrives.

Commands must take effect at the same step on every process, or an SPMD job deadlocks (one process would save
or stop while another steps). With one process the thread applies them to `LoopControl` at once. With several,
rank 0's queue is broadcast to all processes at logging steps (`on_log`, where the loop has just read the loss,
so the device queue is already drained) by `multihost_utils.broadcast_one_to_all`: a tiny collective every
`train.log_every` steps, and every process applies the same request after the same step.

Per-rank metrics: the hook hands the step observer a `RedisMetricsSink` (`ctx.extra["metrics_sink"]`, see
msjax.control.metrics): rows are buffered in memory by the observer's thread and written by this hook's thread
once per `interval_s`, in one pipelined round trip, after the heartbeat; the observer makes the last flush when
its last row is written. Straggler exclusions (`observe.exclude_stragglers`) travel the same way.

Redis going away (a restart) is survived: redis-py retries each command with bounded backoff; past that the
thread logs once, keeps retrying with its own backoff (capped at `max_backoff_s`), and logs again when Redis is
back. A restarted Redis has lost its state (no persistence): each heartbeat also re-creates the rank's members
record if it is missing, and says so. Training never waits for Redis.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from typing import Any

import numpy as np

from msjax.hooks import Hook, RunContext

log = logging.getLogger(__name__)

# Broadcast layout: [stop, checkpoint, profile_first_step, profile_num_steps] as int32.
_NO_PROFILE = -1


class ControlPlaneHook(Hook):
    """Connects one training process to its run's control plane (see the module docstring).

    Args:
      worker: the process's `msjax.control.worker.WorkerContext` (store, assignment, commands_after).
      interval_s: heartbeat period and the longest single blocking read of the command stream (seconds).
      ttl_s: heartbeat time-to-live (seconds): a rank silent this long counts as dead to the supervisor.
      max_backoff_s: the longest pause between reconnect attempts while Redis is away (seconds).
    """

    def __init__(self, worker, interval_s: float = 1.0, ttl_s: float = 10.0, max_backoff_s: float = 5.0):
        self.worker = worker
        self.store = worker.store
        self.rank = worker.assignment.rank
        self.world = worker.assignment.world_size
        self.generation = worker.assignment.generation
        self.interval_s, self.ttl_s, self.max_backoff_s = interval_s, ttl_s, max_backoff_s
        self.step = 0  # last dispatched step (an int written by the loop thread, read by ours)
        self._pending = np.array([0, 0, _NO_PROFILE, 0], np.int32)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx: RunContext | None = None
        self._ckpt_dir = None
        self.reconnects = 0  # times this rank re-registered with a restarted Redis
        from msjax.control.metrics import RedisMetricsSink

        self.metrics = RedisMetricsSink(self.store)
        a = worker.assignment
        self._member = {"worker_id": getattr(worker, "worker_id", None), "rank": a.rank, "generation": a.generation,
                        "host": socket.gethostname(), "pid": os.getpid()}

    # -- loop side -----------------------------------------------------------------------------------------------
    def on_start(self, ctx: RunContext) -> None:
        from msjax.checkpoint import checkpoint_dir

        self._ctx = ctx
        self.step = ctx.start_step
        self._ckpt_dir = checkpoint_dir(ctx.config.checkpoint, str(ctx.run_dir))
        ctx.extra["metrics_sink"] = self.metrics  # msjax.observe publishes every per-step row to it
        ctx.extra["exclude_host"] = self.metrics.exclude_host
        self._safe(lambda: self.store.post_event("loop_start", rank=self.rank, step=ctx.start_step,
                                                 generation=self.generation))
        self._thread = threading.Thread(target=self._serve, name=f"msjax-control-rank{self.rank}", daemon=True)
        self._thread.start()

    def on_step_end(self, ctx: RunContext, step: int, metrics: dict[str, Any]) -> None:
        self.step = step

    def on_log(self, ctx: RunContext, step: int, scalars: dict[str, float]) -> None:
        if self.world == 1:
            return  # the thread applied commands directly
        from jax.experimental import multihost_utils

        with self._lock:
            mine, self._pending = self._pending, np.array([0, 0, _NO_PROFILE, 0], np.int32)
        decided = np.asarray(multihost_utils.broadcast_one_to_all(mine))
        self._apply(ctx, decided, step)

    def on_end(self, ctx: RunContext, error: BaseException | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5.0)
        self._publish_checkpoint()
        self._safe(lambda: self.store.post_event("loop_end", rank=self.rank, step=self.step,
                                                 error=None if error is None else repr(error)[:500]))
        self._safe(lambda: self.store.clear_heartbeat(self.rank))

    # -- commands ------------------------------------------------------------------------------------------------
    def _apply(self, ctx: RunContext, decided: np.ndarray, step: int | None) -> None:
        stop, ckpt, first, count = (int(x) for x in decided)
        at = "" if step is None else f" at step {step}"
        if stop:
            ctx.control.request_stop("control plane: stop command")
            self._log(f"msjax.control: stop command applied{at}")
        if ckpt:
            ctx.control.request_checkpoint()
            self._log(f"msjax.control: checkpoint command applied{at}")
        if count > 0:
            ctx.control.request_profile(first, count)
            self._log(f"msjax.control: profile command applied{at}: steps {first}..{first + count - 1}")

    def _queue(self, command: dict) -> None:
        kind = command.get("kind")
        with self._lock:
            if kind == "stop":
                self._pending[0] = 1
            elif kind == "checkpoint":
                self._pending[1] = 1
            elif kind == "profile":
                self._pending[2], self._pending[3] = int(command["first_step"]), int(command["num_steps"])
            else:
                return
            if self.world == 1 and self._ctx is not None:
                decided, self._pending = self._pending, np.array([0, 0, _NO_PROFILE, 0], np.int32)
                self._apply(self._ctx, decided, None)

    # -- background thread ---------------------------------------------------------------------------------------
    def _serve(self) -> None:
        import redis

        last_id = self.worker.commands_after
        backoff, down, beats = 0.1, False, 0
        while not self._stop.is_set():
            try:
                recreated = self.store.heartbeat(self.rank, self.ttl_s, member=self._member, step=self.step,
                                                 generation=self.generation)
                beats += 1
                self.metrics.flush()
                if recreated and beats > 1:
                    # Our members record was gone: Redis restarted (it keeps nothing on disk).
                    self.reconnects += 1
                    self._log(f"msjax.control: rank {self.rank} re-registered with a restarted Redis")
                    self.store.post_event("reregistered", rank=self.rank, step=self.step)
                if self.rank == 0:
                    self._publish_checkpoint(raise_errors=True)
                    for entry_id, command in self.store.read_commands(last_id, block_s=self.interval_s):
                        last_id = entry_id
                        if command.get("generation") == self.generation:
                            self._queue(command)
                else:
                    self._stop.wait(self.interval_s)
                if down:
                    down, backoff = False, 0.1
                    self._log(f"msjax.control: rank {self.rank} reconnected to Redis")
                    self.store.post_event("reconnected", rank=self.rank, step=self.step)
            except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
                if not down:
                    down = True
                    self._log(f"msjax.control: rank {self.rank} lost Redis ({e}); training goes on, retrying "
                              f"with backoff up to {self.max_backoff_s:g} s")
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)
            except Exception as e:  # a bug here must not kill training: say it and keep serving
                log.exception("control-plane thread error")
                self._log(f"msjax.control: rank {self.rank} control thread error: {e!r}")
                self._stop.wait(self.interval_s)

    def _publish_checkpoint(self, raise_errors: bool = False) -> None:
        """Records the newest finalized (renamed from Orbax's temporary name) checkpoint step as tier persistent."""
        if self.rank != 0 or self._ckpt_dir is None or not self._ckpt_dir.is_dir():
            return
        steps = [int(p.name) for p in self._ckpt_dir.iterdir() if p.name.isdigit() and p.is_dir()]
        if not steps:
            return
        newest = max(steps)
        if raise_errors:
            self.store.set_checkpoint("persistent", newest, str(self._ckpt_dir / str(newest)))
        else:
            self._safe(lambda: self.store.set_checkpoint("persistent", newest, str(self._ckpt_dir / str(newest))))

    def _safe(self, fn) -> None:
        """Runs a best-effort Redis write from the loop thread with no retries beyond redis-py's own."""
        try:
            fn()
        except Exception as e:
            self._log(f"msjax.control: rank {self.rank}: Redis write skipped ({e})")

    @staticmethod
    def _log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)
