"""The loop's side of the control plane: the one heartbeat, the command channel, reports, newest checkpoint, events.

`ControlPlaneHook` joins `msjax.train.run` through `msjax.hooks.Hook`. A background thread does all Redis work, so
the loop never waits on Redis and no step adds a host sync. Every `period_s` it:
  - sets this worker's heartbeat `hb:{rank}` (msjax.control.store), the one heartbeat of the run, read by the
    launcher, the supervisor and the Kubernetes liveness probe alike: {seq, time, pid, host, boot, generation,
    step (the last dispatched step), start_step (the step the loop resumed from), state (starting, running,
    finished, failed), phases (start-up marks, msjax.control.phases)} with a TTL of `ttl_s`, so a worker that hangs
    or is stopped (SIGSTOP stops every thread) goes silent and its key expires. A thread rather than a beat per
    step, so a long step (compilation, a checkpoint) is not taken for a hang: the step, not the beat, shows
    progress (MegaScale sec. 5.1 runs its heartbeat in a daemon beside the training process);
  - in the same round trip, reads whether this process was asked to leave (`Store.request_exit`: a peer died and
    the job is being restarted, or a Kubernetes controller restarts the JobSet): if so it prints the reason in one
    line and exits at once with EXIT_REQUESTED, without waiting on collectives a dead peer will never join;
  - sends the per-rank metric rows buffered since the last beat (msjax.control.metrics);
  - on rank 0, records the newest verified checkpoint (tier "persistent") while one is awaited: the restored step
    at the loop's start, a save the loop started (`on_checkpoint`) until `newest_checkpoint` (passed in) shows
    it, and again after Redis restarts. Listing the checkpoint directory (an object store's bucket, perhaps) only then, not
    every period, keeps slow storage from delaying the heartbeat that follows it; then it blocks on the command
    stream (XREAD BLOCK, one period at a time), queueing what arrives.
The first step's beat goes out at once (the supervisor's recovery time ends when it sees every worker's first
step); a non-finite loss at a logging step is reported (`Store.report`), and so is the one that ends the loop
with `train.nonfinite=stop` (at `on_end`, before the process exits).

Signals, with several processes: SIGTERM or SIGINT to any worker (a scheduler's preemption of one pod or task, a
step's scancel) becomes a stop command naming the signal, sent by this thread (never from the signal handler), so
every process stops after the same step, saves and exits 128 + the signal (msjax.train.main): one process
stopping alone would leave the others waiting in a collective. A second signal exits at once with that status.
(jax's own preemption service, which this replaces for a worker of a control plane, needs every process to see
the signal: one worker's notice did not stop the others.) With one process msjax.faults.StopOnSignal does it.

Commands must take effect at the same step on every process, or an SPMD job deadlocks (one process would save
or stop while another steps). With one process the thread applies them to `LoopControl` at once. With several,
rank 0's queue is broadcast to all processes at logging steps (`on_log`, where the loop has just read the loss,
so the device queue is already drained) by `multihost_utils.broadcast_one_to_all`: a tiny collective every
`train.log_every` steps, and every process applies the same request after the same step. A stop command may
name the signal it relays (the launcher's Ctrl-C): the loop then ends as if it had received that signal.

Per-rank metrics: the hook's `metrics` (a `RedisMetricsSink`) is the step observer's live sink, and its
`metrics.exclude_host` records straggler exclusions; `msjax.train.build_hooks` passes both to the observer.

Redis going away (a restart) is survived: redis-py retries each command with bounded backoff; past that the
thread logs once, keeps retrying with its own backoff (capped at `max_backoff_s`), and logs again when Redis is
back. A restarted Redis has lost its state (no persistence): each heartbeat also re-creates the rank's members
record if it is missing, and says so. Training never waits for Redis.

After the loop the heartbeat goes on (state "finished" or "failed") through what follows it (the last
checkpoint's write, the sample) until the process exits, so an exiting worker is not taken for a hung one.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import signal
import sys
import threading
import time
import uuid
from typing import Any, Callable

import numpy as np

from msjax.control import phases
from msjax.control.store import EXIT_REQUESTED
from msjax.hooks import Hook, NonFiniteLossError, RunContext, is_duplicate_delivery

log = logging.getLogger(__name__)

# Broadcast layout: [stop, checkpoint, profile_first_step, profile_num_steps, stop_signal] as int32.
_NO_PROFILE = -1


def _empty() -> np.ndarray:
    return np.array([0, 0, _NO_PROFILE, 0, 0], np.int32)


class ControlPlaneHook(Hook):
    """Connects one training process to its run's control plane (see the module docstring).

    Args:
      worker: the process's `msjax.control.worker.WorkerContext` (store, assignment, host, commands_after).
      period_s: heartbeat period and the longest single blocking read of the command stream (seconds).
      ttl_s: heartbeat time-to-live (seconds): a rank silent this long counts as dead (> period_s).
      max_backoff_s: the longest pause between reconnect attempts while Redis is away (seconds).
      newest_checkpoint: `(persistent tier, local tier or None) -> the newest verified step or None`, what rank 0
        publishes (the train command passes `msjax.checkpoint.latest_verified`; the tiers are the loop's,
        `RunContext.checkpoint_dir` and `.local_checkpoint_dir`). None: no checkpoint is published. Passed in, so
        the transport knows no checkpoint format.
    Raises:
      ValueError: ttl_s not longer than period_s.
    """

    def __init__(self, worker, period_s: float = 1.0, ttl_s: float = 5.0, max_backoff_s: float = 5.0,
                 newest_checkpoint: Callable[[Any, Any], int | None] | None = None):
        if ttl_s <= period_s:
            raise ValueError(f"heartbeat ttl_s={ttl_s} must be longer than period_s={period_s}")
        self.worker = worker
        self.store = worker.store
        a = worker.assignment
        self.rank, self.world, self.generation = a.rank, a.world_size, a.generation
        self.period_s, self.ttl_s, self.max_backoff_s = period_s, ttl_s, max_backoff_s
        self.boot = uuid.uuid4().hex  # this process's identity: a restarted container may get the same pid
        self.step: int | None = None  # last dispatched step (an int written by the loop thread, read by ours)
        self.start_step: int | None = None
        self.state = "starting"
        self.reconnects = 0  # times this rank re-registered with a restarted Redis
        self._seq = 0
        self._pending = _empty()
        self._lock = threading.Lock()  # the pending commands
        self._beat_lock = threading.Lock()  # the beat thread and the loop's first-step beat share `_seq`
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx: RunContext | None = None
        self._newest_checkpoint = newest_checkpoint
        self._ckpt_dir = None  # the persistent tier (a local Path or a URL) and the local tier (or None)
        self._local_ckpt_dir = None
        # rank 0: the checkpoint step waiting to be published (0: the newest, whatever it is), None when none is
        # (under `_lock`: the loop raises it, the control thread clears it)
        self._awaited: int | None = None
        self._signal: int | None = None  # a signal received, to be sent as a stop command (several processes)
        self._signal_at: float | None = None  # time.monotonic() of that signal
        self._signal_sent = False
        self._previous: dict[int, Any] = {}
        from msjax.control.metrics import RedisMetricsSink

        self.metrics = RedisMetricsSink(self.store)
        self._member = {"worker_id": worker.worker_id, "rank": a.rank, "generation": a.generation,
                        "host": worker.host, "pid": os.getpid()}

    # -- loop side -----------------------------------------------------------------------------------------------
    def on_start(self, ctx: RunContext) -> None:
        self._ctx = ctx
        self.step = self.start_step = ctx.start_step
        self.state = "running"
        self._await_checkpoint(0)  # the restored step, if any
        self._ckpt_dir, self._local_ckpt_dir = ctx.checkpoint_dir, ctx.local_checkpoint_dir
        self._safe(lambda: self.store.post_event("loop_start", rank=self.rank, step=ctx.start_step,
                                                 generation=self.generation))
        # The handlers before the beat: a signal sent once the loop is seen to have started is always a stop
        # command, never the default action.
        if self.world > 1 and threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        self._safe(self._beat)  # the supervisor learns the restore step at once
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._serve, name=f"msjax-control-rank{self.rank}", daemon=True)
            self._thread.start()

    def on_step_end(self, ctx: RunContext, step: int, metrics: dict[str, Any]) -> None:
        first = self.step == self.start_step
        self.step = step  # an int store: atomic under the GIL, read by the beat thread
        if first:
            phases.mark("first_step")
            # Beat now, not at the next period: the supervisor's recovery time ends when it sees every worker's
            # first step, and waiting for the timer added half a period on average to every restart. One Redis
            # write per process and run.
            self._safe(self._beat)

    def on_checkpoint(self, ctx: RunContext, step: int) -> None:
        self._await_checkpoint(step)

    def on_log(self, ctx: RunContext, step: int, scalars: dict[str, float]) -> None:
        loss = scalars.get("loss")
        if loss is not None and not math.isfinite(loss):
            self._safe(lambda: self.store.report(self.rank, "nonfinite", self.generation, step=step, loss=repr(loss)))
        if self.world == 1:
            return  # the thread applied commands directly
        from jax.experimental import multihost_utils

        with self._lock:
            mine, self._pending = self._pending, _empty()
        decided = np.asarray(multihost_utils.broadcast_one_to_all(mine))
        self._apply(ctx, decided, step)

    def _on_signal(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if is_duplicate_delivery(self._signal_at):
            return
        if self._signal is not None:
            sys.stderr.write(f"msjax: rank {self.rank}: second signal ({name}): exiting now without waiting for the "
                             "checkpoint\n")
            sys.stderr.flush()
            os._exit(128 + signum)
        sys.stderr.write(f"msjax: rank {self.rank}: {name} received: every process finishes the same step, saves, "
                         "then exits (send it again to exit at once)\n")
        sys.stderr.flush()
        self._signal_at = time.monotonic()
        self._signal = signum  # sent as a stop command by the control thread within a period

    def on_end(self, ctx: RunContext, error: BaseException | None) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
        if isinstance(error, NonFiniteLossError):
            # train.nonfinite=stop raised at the step itself, before any logging step could report it: report it
            # now, before the process exits, so the supervisor reads "non-finite loss", not a bare exit status 1.
            self._safe(lambda: self.store.report(self.rank, "nonfinite", self.generation, step=error.step,
                                                        loss=repr(error.loss)))
        self._publish_checkpoint()
        self._safe(lambda: self.store.post_event("loop_end", rank=self.rank, step=self.step,
                                                 error=None if error is None else repr(error)[:500]))
        self.state = "finished" if error is None else "failed"
        self._safe(self._beat)
        # Keep beating (with a state that tells the loop is over) until the process exits.
        atexit.register(self.close)

    def close(self) -> None:
        """Stops the heartbeat thread (joined within one period) after a last beat. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.period_s + 5.0)
            self._thread = None
            self._safe(self._beat)
        atexit.unregister(self.close)

    def exit_request(self) -> str | None:
        """The reason this process was asked to leave (`Store.request_exit`), or None. One Redis read; None when
        Redis cannot be reached."""
        try:
            return self.store.client.hget(self.store.key("exit"), self.boot)
        except Exception:  # noqa: BLE001 - a lost control plane means no request could arrive
            return None

    def peer_failure(self) -> str | None:
        """After this process failed in a multi-process run: whether a peer's death is the cause, as one sentence.

        A launcher or supervisor that saw a worker die asks the others to leave (`Store.request_exit`), with the
        dead worker named in the reason: that reason is returned as soon as it arrives. Without one, the peers'
        heartbeats tell: any rank whose heartbeat has expired by the time one TTL has passed is named. None when
        every peer still beats (the failure is this process's own) or Redis cannot be reached.
        """
        deadline = time.monotonic() + self.ttl_s + self.period_s
        while True:
            reason = self.exit_request()
            if reason:
                return reason
            if time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        try:
            beats = self.store.heartbeats(range(self.world))
        except Exception:  # noqa: BLE001 - nothing to go on
            return None
        gone = [r for r in range(self.world) if r != self.rank and r not in beats]
        if not gone:
            return None
        ranks = f"rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))}"
        return f"{ranks} stopped sending heartbeats (dead or hung)"

    # -- commands ------------------------------------------------------------------------------------------------
    def _apply(self, ctx: RunContext, decided: np.ndarray, step: int | None) -> None:
        stop, ckpt, first, count, sig = (int(x) for x in decided)
        at = "" if step is None else f" at step {step}"
        if stop:
            ctx.control.request_stop("control plane: stop command" + (f" ({_signal_name(sig)})" if sig else ""),
                                     signal=sig or None)
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
                self._pending[4] = int(command.get("signal") or 0)
            elif kind == "checkpoint":
                self._pending[1] = 1
            elif kind == "profile":
                self._pending[2], self._pending[3] = int(command["first_step"]), int(command["num_steps"])
            else:
                return
            if self.world == 1 and self._ctx is not None:
                decided, self._pending = self._pending, _empty()
                self._apply(self._ctx, decided, None)

    # -- background thread ---------------------------------------------------------------------------------------
    def _beat(self) -> bool:
        """Sends one heartbeat; leaves the process if it was asked to. Returns whether the members record had to
        be re-created (a restarted Redis)."""
        with self._beat_lock:
            self._seq += 1
            beat = {"seq": self._seq, "time": time.time(), "pid": os.getpid(), "host": self.worker.host,
                    "boot": self.boot, "generation": self.generation, "step": self.step,
                    "start_step": self.start_step, "state": self.state, "phases": phases.marks()}
            recreated, reason = self.store.heartbeat(self.rank, self.ttl_s, beat, member=self._member)
        if reason is not None:
            # Asked to leave: a peer died, or the job is restarted by a controller. Collectives would wait for a
            # peer that never comes, so leave now, saying why in one line.
            # Straight to stderr, as train.main's own "stopping" line: the process ends in os._exit next, and this
            # line must read the same whatever logging the program configured (the launcher shows it for every rank).
            sys.stderr.write(f"msjax: rank {self.rank} stopping: {reason}\n")
            sys.stderr.flush()
            self._safe(lambda: self.store.clear_heartbeats([self.rank]))  # gone now, not at the TTL's end
            sys.stdout.flush()
            os._exit(EXIT_REQUESTED)
        return recreated

    def _serve(self) -> None:
        import redis

        last_id = self.worker.commands_after
        backoff, down = 0.1, False
        while not self._stop.is_set():
            try:
                # One period between beats (on_start sent the first): rank 0 spends it waiting for commands.
                if self.rank == 0:
                    if self._awaited is not None:
                        self._publish_checkpoint(raise_errors=True)
                    for entry_id, command in self.store.read_commands(last_id, block_s=self.period_s):
                        last_id = entry_id
                        if command.get("generation") == self.generation:
                            self._queue(command)
                elif self._stop.wait(self.period_s):
                    break
                if self._signal is not None and not self._signal_sent:
                    self.store.send_command("stop", signal=self._signal, source=f"rank {self.rank}")
                    self._signal_sent = True
                if self._beat():
                    # Our members record was gone: Redis restarted (it keeps nothing on disk).
                    self.reconnects += 1
                    self._await_checkpoint(0)  # the record went with the rest
                    self._log(f"msjax.control: rank {self.rank} re-registered with a restarted Redis")
                    self.store.post_event("reregistered", rank=self.rank, step=self.step)
                self.metrics.flush()
                if down:
                    down, backoff = False, 0.1
                    self._log(f"msjax.control: rank {self.rank} reconnected to Redis")
                    self.store.post_event("reconnected", rank=self.rank, step=self.step)
            except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
                if not down:
                    down = True
                    log.warning(f"msjax.control: rank {self.rank} lost Redis ({e}); training goes on, retrying "
                                f"with backoff up to {self.max_backoff_s:g} s")
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)
            except Exception as e:  # a bug here must not kill training: say it and keep serving
                log.exception("control-plane thread error")
                log.warning(f"msjax.control: rank {self.rank} control thread error: {e!r}")
                self._stop.wait(self.period_s)

    def _await_checkpoint(self, step: int) -> None:
        """Rank 0: asks the control thread to publish checkpoint `step` once it is verified (0: the newest)."""
        if self.rank == 0:
            with self._lock:
                self._awaited = max(self._awaited or 0, step)

    def _publish_checkpoint(self, raise_errors: bool = False) -> None:
        """Records the newest verified checkpoint (`newest_checkpoint` of the run's tiers: the step a restore
        resumes from, never a step whose integrity record is missing) as tier "persistent", and stops
        awaiting one once it is the awaited step or newer; the checkpoint directory may be a local path or a gs:// /
        s3:// URL."""
        if self.rank != 0 or self._ckpt_dir is None or self._newest_checkpoint is None:
            return
        from msjax import paths

        def publish() -> None:
            with self._lock:
                awaited = self._awaited
            newest = self._newest_checkpoint(self._ckpt_dir, self._local_ckpt_dir)
            if newest is not None:
                self.store.set_checkpoint("persistent", newest, paths.join(self._ckpt_dir, str(newest)))
            with self._lock:
                if self._awaited == awaited and (newest or 0) >= (awaited or 0):
                    self._awaited = None  # an unverified save stays awaited: listed again next period

        if raise_errors:
            publish()
        else:
            self._safe(publish)

    def _safe(self, fn) -> None:
        """Runs a best-effort Redis call with no retries beyond redis-py's own."""
        try:
            fn()
        except Exception as e:
            log.warning(f"msjax.control: rank {self.rank}: Redis write skipped ({e})")

    @staticmethod
    def _log(msg: str) -> None:
        log.info(msg)


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"
