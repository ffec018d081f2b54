"""Failure detection: pure functions of what the supervisor has observed about each worker.

The supervisor's loop fills a `WorkerState` per worker from the process table (exit codes) and the store
(heartbeats, reports), and asks `detect_failures` what is wrong. Keeping the rules free of I/O makes every one
of them testable with made-up times.

Rules (MegaScale sec. 5.1: heartbeats with process status; ByteRobust: hang detection by stalled progress):
  peer_lost   the process left because another worker died, not by a fault of its own: it exited with
              EXIT_REQUESTED (75: the train command's status for "stopped because a peer failed or the job is
              being restarted"), or jax's distributed runtime aborted it because another task died
              (`WorkerState.peer_lost`, from its output). Never blamed while another failure explains it
              (`blame`).
  stopped     the process exited with 128 + SIGTERM or SIGINT: it was stopped by a signal from outside (a
              scheduler's preemption, an eviction), saved and left: resumable, not a failure of its host.
  exit        the process ended with any other non-zero code or a signal.
  heartbeat   no heartbeat for `heartbeat_timeout` seconds (a hang, SIGSTOP, a dead host), or none at all within
              `startup_timeout` seconds of the start (or of the loop's end, for a worker that is exiting).
  nonfinite   the worker reported a non-finite loss (and may have exited because of it: train.nonfinite=stop).
  stalled     its step has not advanced for `stall_timeout` seconds while another worker's step did; or no
              worker's step has advanced for `stall_timeout` seconds although their heartbeats go on (a job-wide
              hang: a deadlocked collective or a stuck checkpoint write). In a job-wide hang the workers whose
              step is behind the others' are failed: every worker runs the same program, so the others got past
              the step's collectives with them and now wait for a step these never dispatched (a training thread
              stuck on its host). When every step is the same, nothing tells who holds the others up: every
              worker is failed.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Sequence

from msjax.control.store import EXIT_REQUESTED

# Exit statuses of a worker stopped by a signal after saving (msjax.train.main): resumable.
STOPPED_EXITS = (128 + signal.SIGINT, 128 + signal.SIGTERM)


@dataclass(frozen=True)
class WorkerState:
    """What the supervisor knows about one worker. Times are the supervisor's clock, seconds.

    Attributes:
      rank: process index in the job (0 .. N-1).
      host: the host name it runs on.
      started_at: when it was launched.
      exit_code: None while running; Popen's returncode after (negative: killed by that signal).
      last_beat: when the newest heartbeat was seen, or None before the first.
      step: the newest step it reported (host-side counter), or None.
      step_changed_at: when `step` last changed (or the first beat's time).
      nonfinite: (step, loss) of a reported non-finite loss, or None.
      loop_done: its newest heartbeat said the training loop is over (it is saving, sampling, shutting down).
      peer_lost: its output shows jax's distributed runtime ended it because another task died.
    """

    rank: int
    host: str
    started_at: float
    exit_code: int | None = None
    last_beat: float | None = None
    step: int | None = None
    step_changed_at: float | None = None
    nonfinite: tuple[int, float] | None = None
    loop_done: bool = False
    peer_lost: bool = False


@dataclass(frozen=True)
class Failure:
    """One detected failure: which worker, which rule (`kind`: peer_lost / stopped / exit / heartbeat / nonfinite /
    stalled), why."""

    rank: int
    host: str
    kind: str
    detail: str

    def to_dict(self) -> dict:
        return {"rank": self.rank, "host": self.host, "kind": self.kind, "detail": self.detail}


def blame(failures: Sequence[Failure]) -> list[Failure]:
    """The failures that explain the others: every one but the `peer_lost` ones (workers that left because another
    died). Empty when all of them are `peer_lost`: the worker that died has not shown yet (its node's processes
    are gone without an exit status; its heartbeat expires within the timeout), and the caller waits for it."""
    return [f for f in failures if f.kind != "peer_lost"]


def describe_exit(code: int) -> str:
    """'exit code 3', 'killed by SIGKILL' or 'stopped by SIGTERM (exit code 143)' for a Popen returncode."""
    if code in STOPPED_EXITS:
        return f"stopped by {signal.Signals(code - 128).name} (exit code {code})"
    if code == EXIT_REQUESTED:
        return f"left because a peer failed (exit code {code})"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def detect_failures(workers: Sequence[WorkerState], now: float, *, heartbeat_timeout: float,
                    startup_timeout: float, stall_timeout: float = 0.0) -> list[Failure]:
    """The failures among `workers` at time `now` (see the module docstring for the rules).

    A worker that exited 0 is not failed (it finished, or saved and left on SIGTERM); its heartbeats stop and that
    is expected. At most one failure is reported per worker, the first rule that applies in the order above.

    Args:
      workers: one state per worker.
      now: the supervisor's clock, seconds.
      heartbeat_timeout: seconds without a heartbeat before a running worker is failed.
      startup_timeout: seconds from launch to the first heartbeat before a worker is failed.
      stall_timeout: seconds without step progress (while another worker progressed) before a worker is failed;
        0 disables the rule.
    Returns:
      Failures, in rank order.
    """
    out = []
    newest_progress = max((w.step_changed_at for w in workers
                           if w.step_changed_at is not None and w.exit_code is None), default=None)
    for w in sorted(workers, key=lambda w: w.rank):
        failure = None
        if w.exit_code is not None:
            if w.exit_code == EXIT_REQUESTED or (w.exit_code != 0 and w.peer_lost):
                failure = ("peer_lost", describe_exit(w.exit_code) if w.exit_code == EXIT_REQUESTED else
                           f"{describe_exit(w.exit_code)}: jax's distributed runtime ended it (another task died)")
            elif w.exit_code in STOPPED_EXITS:
                failure = ("stopped", describe_exit(w.exit_code))
            elif w.exit_code != 0 and w.nonfinite is not None:  # train.nonfinite=stop: it reported, then exited
                failure = ("nonfinite", f"non-finite loss {w.nonfinite[1]} reported at step {w.nonfinite[0]} "
                                        f"({describe_exit(w.exit_code)})")
            elif w.exit_code != 0:
                failure = ("exit", describe_exit(w.exit_code))
        elif w.nonfinite is not None:
            failure = ("nonfinite", f"non-finite loss {w.nonfinite[1]} reported at step {w.nonfinite[0]}")
        elif w.last_beat is None:
            if now - w.started_at > startup_timeout:
                failure = ("heartbeat", f"no heartbeat {now - w.started_at:.1f} s after launch "
                                        f"(startup timeout {startup_timeout:g} s)")
        elif now - w.last_beat > (limit := startup_timeout if w.loop_done else heartbeat_timeout):
            # After the loop, the process may sit in jax.distributed's shutdown barrier without beating: it gets
            # as long to exit as a new worker gets to start.
            failure = ("heartbeat", f"last heartbeat {now - w.last_beat:.1f} s ago (timeout {limit:g} s) at step "
                                    f"{w.step}" + (" after the loop ended" if w.loop_done else ""))
        elif (stall_timeout > 0 and w.step_changed_at is not None and newest_progress is not None
              and now - w.step_changed_at > stall_timeout and newest_progress - w.step_changed_at > stall_timeout):
            failure = ("stalled", f"step {w.step} unchanged for {now - w.step_changed_at:.1f} s while other workers "
                                  f"advanced (stall timeout {stall_timeout:g} s)")
        if failure:
            out.append(Failure(w.rank, w.host, *failure))
    running = [w for w in workers if w.exit_code is None and not w.loop_done]
    if (not out and stall_timeout > 0 and running and newest_progress is not None
            and all(w.step_changed_at is not None for w in running) and now - newest_progress > stall_timeout):
        steps = [w.step for w in running if w.step is not None]
        behind = min(steps) if steps and min(steps) < max(steps) else None
        out = [Failure(w.rank, w.host, "stalled", f"no worker's step advanced for {now - newest_progress:.1f} s "
                                                  f"(stall timeout {stall_timeout:g} s; at step {w.step}"
                                                  + (f", the others at {max(steps)}): it holds the job up"
                                                     if behind is not None else "): a job-wide hang"))
               for w in sorted(running, key=lambda w: w.rank) if behind is None or w.step == behind]
    return out


# Signals an operator, a scheduler's preemption or a launcher tearing the job down send to stop a worker: a worker
# that died of one says nothing about its host. SIGKILL is not one of them: it is also how the kernel's OOM killer
# and a dying node end a process, so a worker killed by it gets the self-checks and counts as a death on its host
# (`died`), as an error exit or an abort (XLA/CUDA checks) does.
OUTSIDE_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def died(failure: Failure, exit_code: int | None) -> bool:
    """Whether `failure` is a worker's death its host may be to blame for: an exit nobody asked for (an error exit,
    an abort, SIGKILL), not a stop by one of OUTSIDE_SIGNALS, a save-and-stop (`stopped`), a hang or a stall.
    `exit_code`: the worker's Popen returncode (-SIG for a signal; None: unknown, not counted)."""
    if failure.kind != "exit" or exit_code is None or exit_code == 0:
        return False
    return exit_code > 0 or -exit_code not in OUTSIDE_SIGNALS  # ints: a realtime signal has no Signals member


def needs_diagnosis(failures: Sequence[Failure], exit_codes: dict[int, int | None]) -> bool:
    """Whether the failures could be a host's fault, so the self-checks should run before the restart: False only
    when every failure is a worker stopped from outside: one that exited by one of OUTSIDE_SIGNALS (Popen
    returncode -SIG in `exit_codes`, by rank) or that saved and left on one (`stopped`), which the self-checks would
    only cost time on (a whole self-check round: a process start, jax's import and a cross-host all-reduce, per
    restart)."""
    return any(f.kind not in ("exit", "stopped")
               or (f.kind == "exit" and ((exit_codes.get(f.rank) or 0) >= 0
                                         or -exit_codes[f.rank] not in OUTSIDE_SIGNALS))
               for f in failures)


def finished(workers: Sequence[WorkerState]) -> bool:
    """True when every worker exited with code 0."""
    return bool(workers) and all(w.exit_code == 0 for w in workers)
