"""The run's event log and the figures read off it.

Every event is one JSON object per line in `<run_dir>/events.jsonl`: `{"t": unix seconds, "kind": ..., ...}`,
flushed as it is written (a supervisor that dies leaves a readable log), and also passed to an optional sink
(the control plane's Redis stream). Kinds written by `msjax.supervise.supervisor`:

  run_start        the supervisor started (hosts, layout).
  launch           attempt k started (hosts, restore step known later, overrides).
  worker_start     a worker's first heartbeat (rank, start_step: the step it resumed from).
  first_step       every worker of an attempt has dispatched its first step (attempt, step: the lowest).
  worker_phases    a worker's start-up timestamps (attempt, rank, phases: msjax.control.phases).
  fault_injected   a fault was injected (fault kind, rank, step), written by a watcher that injects them (a
                   benchmark's or a test's: msjax.supervise.supervisor.Progress.emit).
  detected         failures found and blamed (each: rank, host, kind, detail), and `collateral`: the workers that
                   left because of them (msjax.supervise.detect.blame).
  stopped          the job was stopped (how many workers took SIGTERM, SIGKILL).
  diagnosed        the self-checks' result per host.
  excluded         a host left the job (reason).
  replanned        the old and new layout, with predicted MFU.
  restart          a restart was decided (attempt, backoff delay).
  attempt_end      an attempt ended: restore step, last step seen, the step rate seen (for the effective time).
  run_end          the run ended (status: finished / budget_exhausted / no_layout / error, and the figures).

Definitions (all wall-clock seconds on the supervisor's clock):
  detection latency  fault_injected -> detected.
  recovery time      fault_injected -> first_step of the next attempt (the first kept step after restart).
  recomputed steps   the furthest step seen in the faulted attempt minus the step the next attempt restored
                     (heartbeats lag by up to a period, so this is a lower bound).
  effective training time ratio  (wall time of the steps that were kept) / (run_start -> run_end), where an
    attempt's kept steps are those from its restore step up to the step the next attempt restored (all of them
    for the last attempt), each costing the attempt's steady-state step time (steps after the first, which
    carries the compilation).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable


class EventLog:
    """Appends events to `path` (JSON lines) and hands each to `sink` too. Thread-safe.

    Args:
      path: the events.jsonl file (its directory is created).
      sink: optional callable taking each event dict (e.g. a Redis stream writer); its errors are recorded in
        the log once as `sink_error` and otherwise ignored, so a lost control plane does not stop the run.
    """

    def __init__(self, path: Path | str, sink: Callable[[dict], None] | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._sink = sink
        self._sink_failed = False
        self._lock = threading.Lock()

    def emit(self, kind: str, **fields: Any) -> dict:
        """Writes `{"t": now, "kind": kind, **fields}` and returns it."""
        event = {"t": time.time(), "kind": kind, **fields}
        line = json.dumps(event, default=str)
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()
        if self._sink is not None and not self._sink_failed:
            try:
                self._sink(event)
            except Exception as e:  # noqa: BLE001 - the local log stays the record
                self._sink_failed = True
                self.emit("sink_error", error=repr(e))
        return event

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_events(path: Path | str) -> list[dict]:
    """The events of an events.jsonl file, in order (a torn last line, from a crash mid-write, is skipped)."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def fault_figures(events: Iterable[dict]) -> list[dict]:
    """Per injected fault: {kind, rank, step, attempt, detection_s, recovery_s, recomputed_steps}.

    detection_s is fault_injected -> the next `detected`; recovery_s is fault_injected -> the next attempt's
    `first_step`; recomputed_steps is the step seen at the fault minus the next attempt's restore step. A figure
    is None when the run ended before it happened (e.g. no restart after the last fault).
    """
    events = list(events)
    out = []
    for i, e in enumerate(events):
        if e["kind"] != "fault_injected":
            continue
        rest = events[i + 1:]
        detected = next((x for x in rest if x["kind"] == "detected"), None)
        nxt = next((x for x in rest if x["kind"] == "launch" and x["attempt"] > e["attempt"]), None)
        first = None
        worker_start = None
        if nxt is not None:
            first = next((x for x in rest if x["kind"] == "first_step" and x["attempt"] == nxt["attempt"]), None)
            worker_start = next((x for x in rest if x["kind"] == "worker_start"
                                 and x["attempt"] == nxt["attempt"]), None)
        restored = worker_start["start_step"] if worker_start else None
        # Heartbeats lag the host-side step by up to a period, and a stopped worker reports no more: the furthest
        # step any worker of the attempt reported (its attempt_end) bounds the work lost better than the step seen
        # when the fault went in.
        end = next((x for x in rest if x["kind"] == "attempt_end" and x["attempt"] == e["attempt"]), None)
        reached = max(e["step"], (end or {}).get("last_step") or 0)
        out.append({
            "kind": e["fault"], "rank": e["rank"], "step": e["step"], "attempt": e["attempt"],
            "detection_s": detected["t"] - e["t"] if detected else None,
            "recovery_s": first["t"] - e["t"] if first else None,
            "restored_step": restored, "reached_step": reached,
            "recomputed_steps": max(0, reached - restored) if restored is not None else None,
        })
    return out


# A restart's phases, in order: (name, the event or worker mark it ends at). Worker marks are the slowest worker's
# (the job steps when its last worker does).
RECOVERY_PHASES = (
    ("detect", "detected"), ("stop", "stopped"), ("diagnose", "diagnosed"), ("backoff", "launch"),
    ("process_start", "process_start"), ("imports", "imports"), ("rendezvous", "rendezvous"),
    ("distributed", "distributed"), ("prepare", "prepared"), ("restore", "restored"),
    ("compile_first_step", "first_step"), ("heartbeat_lag", "first_step_seen"),
)


def recovery_phases(events: Iterable[dict]) -> list[dict]:
    """Where each fault's recovery time went: per injected fault {kind, rank, attempt, phases: {name: seconds}},
    the phases of RECOVERY_PHASES that happened, each from the end of the one before (the first from the fault).

    Supervisor phases: detect (fault -> detected), stop (-> stopped), diagnose (-> diagnosed, when run), backoff
    (-> the next launch; includes re-planning). Worker phases of the next attempt, from its workers'
    `worker_phases` (the slowest worker's mark): process_start (launch -> the process exists), imports (jax and
    the stack), rendezvous, distributed (jax.distributed), prepare (data, mesh, program), restore, compile_first_step
    (the first step's compilation and dispatch), heartbeat_lag (-> the supervisor's first_step event). A mark
    that comes before the previous phase's end counts as 0 s (a warm standby's process started before the launch).
    The phases sum to the fault's recovery_s, or to more when the supervisor saw a fast worker's first step (a
    host-side dispatch) before the slowest worker had compiled its own: the job's first step runs only then.
    """
    events = list(events)
    out = []
    for i, e in enumerate(events):
        if e["kind"] != "fault_injected":
            continue
        rest = events[i + 1:]
        nxt = next((x for x in rest if x["kind"] == "launch" and x["attempt"] > e["attempt"]), None)
        ends: dict[str, float] = {}
        upto = rest if nxt is None else rest[:rest.index(nxt) + 1]
        for kind in ("detected", "stopped", "diagnosed", "launch"):
            hit = next((x for x in upto if x["kind"] == kind), None)
            if hit is not None:
                ends[kind] = hit["t"]
        if nxt is not None:
            marks = [x["phases"] for x in rest if x["kind"] == "worker_phases" and x["attempt"] == nxt["attempt"]]
            for name in ("process_start", "imports", "rendezvous", "distributed", "prepared", "restored",
                         "first_step"):
                values = [m[name] for m in marks if name in m]
                if values:
                    ends[name] = max(values)
            first = next((x for x in rest if x["kind"] == "first_step" and x["attempt"] == nxt["attempt"]), None)
            if first is not None:
                ends["first_step_seen"] = first["t"]
        phases, t = {}, e["t"]
        for name, end in RECOVERY_PHASES:
            if end in ends:  # a mark before the previous end (a standby's process_start) is a phase of 0 s
                phases[name], t = max(0.0, ends[end] - t), max(t, ends[end])
        out.append({"kind": e["fault"], "rank": e["rank"], "attempt": e["attempt"], "phases": phases})
    return out


def effective_time(events: Iterable[dict]) -> dict:
    """The effective training time ratio of a run (see the module docstring).

    Returns {"ratio", "kept_s", "total_s", "kept_steps", "lost_steps"}; ratio is None without run_start/run_end.
    """
    events = list(events)
    start = next((e["t"] for e in events if e["kind"] == "run_start"), None)
    end = next((e["t"] for e in reversed(events) if e["kind"] == "run_end"), None)
    attempts = [e for e in events if e["kind"] == "attempt_end"]
    kept_s, kept_steps, lost_steps = 0.0, 0, 0
    for i, a in enumerate(attempts):
        restored, last = a.get("start_step"), a.get("last_step")
        if restored is None or last is None or last <= restored:
            continue
        nxt = attempts[i + 1].get("start_step") if i + 1 < len(attempts) else None
        kept_until = last if nxt is None else min(last, nxt)
        kept = max(0, kept_until - restored)
        kept_steps += kept
        lost_steps += last - restored - kept
        if a.get("step_s"):
            kept_s += kept * a["step_s"]
    total = (end - start) if start is not None and end is not None else None
    return {"ratio": kept_s / total if total else None, "kept_s": kept_s, "total_s": total,
            "kept_steps": kept_steps, "lost_steps": lost_steps}
