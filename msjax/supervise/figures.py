"""Recovery figures read off a supervised run's event log (msjax.events: the schema and every kind).

Definitions (wall-clock seconds; every event's `time`):
  detection latency  fault_injected -> detected.
  recovery time      fault_injected -> first_step of the next attempt (the first kept step after restart).
  recomputed steps   the furthest step seen in the faulted attempt minus the step the next attempt restored
                     (heartbeats lag by up to a period, so this is a lower bound).
Where the run's whole wall time went (productive steps, start-up, restarts, recomputed steps, ...) and the
effective training time ratio are the goodput ledger's (msjax.goodput).
"""

from __future__ import annotations

from typing import Iterable, Iterator


def _faults(events: Iterable[dict]) -> Iterator[tuple[dict, list[dict], dict | None]]:
    """Per injected fault: (its `fault_injected` event, the events after it, the next attempt's `launch` or None
    when the run ended before a restart)."""
    events = list(events)
    for i, e in enumerate(events):
        if e["kind"] == "fault_injected":
            rest = events[i + 1:]
            yield e, rest, next((x for x in rest if x["kind"] == "launch" and x["attempt"] > e["attempt"]), None)


def fault_figures(events: Iterable[dict]) -> list[dict]:
    """Per injected fault: {kind, rank, step, attempt, detection_s, recovery_s, recomputed_steps}.

    detection_s is fault_injected -> the next `detected`; recovery_s is fault_injected -> the next attempt's
    `first_step`; recomputed_steps is the step seen at the fault minus the next attempt's restore step. A figure
    is None when the run ended before it happened (e.g. no restart after the last fault).
    """
    out = []
    for e, rest, nxt in _faults(events):
        detected = next((x for x in rest if x["kind"] == "detected"), None)
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
            "detection_s": detected["time"] - e["time"] if detected else None,
            "recovery_s": first["time"] - e["time"] if first else None,
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
    out = []
    for e, rest, nxt in _faults(events):
        ends: dict[str, float] = {}
        upto = rest if nxt is None else rest[:rest.index(nxt) + 1]
        for kind in ("detected", "stopped", "diagnosed", "launch"):
            hit = next((x for x in upto if x["kind"] == kind), None)
            if hit is not None:
                ends[kind] = hit["time"]
        if nxt is not None:
            marks = [x["phases"] for x in rest if x["kind"] == "worker_phases" and x["attempt"] == nxt["attempt"]]
            for name in ("process_start", "imports", "rendezvous", "distributed", "prepared", "restored",
                         "first_step"):
                values = [m[name] for m in marks if name in m]
                if values:
                    ends[name] = max(values)
            first = next((x for x in rest if x["kind"] == "first_step" and x["attempt"] == nxt["attempt"]), None)
            if first is not None:
                ends["first_step_seen"] = first["time"]
        phases, t = {}, e["time"]
        for name, end in RECOVERY_PHASES:
            if end in ends:  # a mark before the previous end (a standby's process_start) is a phase of 0 s
                phases[name], t = max(0.0, ends[end] - t), max(t, ends[end])
        out.append({"kind": e["fault"], "rank": e["rank"], "attempt": e["attempt"], "phases": phases})
    return out
