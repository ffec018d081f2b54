"""Recovery figures read off a supervised run's event log (msjax.events: the schema and every kind).

Definitions (wall-clock seconds; every event's `time`):
  detection latency  fault_injected -> detected.
  recovery time      fault_injected -> first_step of the next attempt (the first kept step after restart).
  recomputed steps   the furthest step seen in the faulted attempt (its workers' heartbeats, rank 0's goodput
                     ledger) minus the step the next attempt restored (a lower bound: a heartbeat lags its
                     worker by up to a period, and a killed worker reports nothing after its last beat).
Where the run's whole wall time went (productive steps, start-up, restarts, recomputed steps, ...) and the
effective training time ratio are the goodput ledger's (msjax.goodput).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Iterator

if TYPE_CHECKING:  # the planner is imported where a projection is made, not with these figures
    from msjax.planner.goodput import Inputs, Projection


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
    `first_step`; recomputed_steps is the furthest step seen in the attempt (module docstring) minus the next
    attempt's restore step. A figure is None when the run ended before it happened (e.g. no restart after the last
    fault)."""
    events = list(events)
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
        # when the fault went in. Rank 0's goodput ledger, written at logging steps and when its loop ends (a lost
        # peer ends it), records the step it had dispatched then, which may be past its last beat.
        end = next((x for x in rest if x["kind"] == "attempt_end" and x["attempt"] == e["attempt"]), None)
        launched = next((x["time"] for x in events if x["kind"] == "launch" and x["attempt"] == e["attempt"]), 0.0)
        until = nxt["time"] if nxt is not None else float("inf")
        ledgered = [x["step"] for x in events if x["kind"] == "goodput" and x.get("step") is not None
                    and launched <= x["time"] <= until]
        reached = max(e["step"], (end or {}).get("last_step") or 0, *ledgered)
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
    events = list(events)
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


def training_starts(events: Iterable[dict]) -> dict[int, float]:
    """attempt -> when the attempt started training: its slowest worker's `first_step` mark (unix s), the end of
    the first step's compilation and dispatch on every worker. Attempts whose workers never marked a first step
    are missing."""
    starts: dict[int, float] = {}
    for e in events:
        mark = (e.get("phases") or {}).get("first_step") if e["kind"] == "worker_phases" else None
        if mark is not None:
            starts[e["attempt"]] = max(starts.get(e["attempt"], mark), mark)
    return starts


def run_projection(events: Iterable[dict], ledger: dict, checkpoint_every: int, step_s: float,
                   devices: int) -> tuple[Projection, Inputs]:
    """The goodput projection (msjax.planner.goodput.project) fed with a fault-injected run's own failure rate and
    costs, to hold against the ETTR its ledger measured. Faults are taken to strike training only (each attempt's
    fault is injected after its first step: `restart_failures=False`).

    What the run gives the model (wall seconds):
      once       run_start -> the first attempt's training start (`training_starts`), and the ledger's teardown.
      restarts   per fault, fault_injected -> the next attempt's training start, split into RESTART_PARTS by its
                 recovery phases (`recovery_phases`, less the supervisor's heartbeat lag); mean per kind, the
                 kinds' shares as injected.
      rate       faults / exposed seconds, exposed = wall - once - the restarts' sum (the time faults could strike).
      segment    `checkpoint_every` x `step_s` seconds of training between checkpoints, split in the ledger's
                 proportions into productive (τ), checkpoint stall (δ) and data wait, evaluation and straggler time
                 (the overhead ω, per productive second). The save is taken as complete when the stall ends (no
                 background-write lag): an asynchronous save's write is not in the event log.
    Args:
      events: the run's event log, `fault_injected` events among them.
      ledger: its `msjax.goodput.run_ledger`.
      checkpoint_every: checkpoint.every, steps.
      step_s: seconds per training step (the attempts' `step_s`).
      devices: devices of the job.
    Returns:
      (the Projection, its Inputs: stall, step time and one line per figure and where it came from).
    Raises:
      ValueError: no fault, or a fault with no attempt that trained after it.
    """
    from msjax.planner import goodput as gp

    events = sorted(events, key=lambda e: e["time"])
    starts = training_starts(events)
    run_start = next(e["time"] for e in events if e["kind"] == "run_start")
    faults = [e for e in events if e["kind"] == "fault_injected"]
    if not faults:
        raise ValueError("the run had no injected fault: nothing to project")
    phases_of = {(p["attempt"], p["rank"], p["kind"]): p["phases"] for p in recovery_phases(events)}
    costs_of: dict[str, list[dict[str, float]]] = {}
    restarts = 0.0
    for f in faults:
        later = [a for a in starts if a > f["attempt"]]
        if not later:
            raise ValueError(f"fault {f['fault']} at {f['time']:.1f}: no attempt trained after it")
        restart = starts[min(later)] - f["time"]
        restarts += restart
        costs = dict.fromkeys(gp.RESTART_PARTS, 0.0)
        for phase, seconds in phases_of[(f["attempt"], f["rank"], f["fault"])].items():
            if phase != "heartbeat_lag":
                costs[gp.PHASE_PARTS[phase]] += seconds
        # The phases end at the slowest worker's marks; whatever they miss (a mark that came early) is start-up.
        costs["startup"] += restart - sum(costs.values())
        costs_of.setdefault(f["fault"], []).append(costs)
    b = ledger["buckets"]
    once = starts[min(starts)] - run_start + b["teardown"]
    exposed = ledger["wall_s"] - once - restarts
    overheads = b["data_wait"] + b["evaluation"] + b["straggler"]
    training = b["productive"] + b["checkpoint"] + overheads
    segment = checkpoint_every * step_s
    kinds = {kind: gp.FailureKind(len(c) / len(faults), {p: sum(x[p] for x in c) / len(c) for p in gp.RESTART_PARTS},
                                  source=f"this run's {len(c)} {kind} fault(s)") for kind, c in costs_of.items()}
    stall = segment * b["checkpoint"] / training
    notes = [f"{len(faults)} faults in {exposed:.1f} s of training: one per {exposed / len(faults):.1f} s",
             f"once: {once:.1f} s (start-up and compilation before the first step, teardown at the end)",
             f"segment: {checkpoint_every} steps x {step_s:.3f} s = {segment:.2f} s, of which checkpoint stall "
             f"{stall:.3f} s and data wait, evaluation and straggler time {overheads / training:.1%} (the ledger's "
             "shares)"] + [f"{k} faults: {v.share:.0%}, restart {v.restart_s:.1f} s ("
                           + ", ".join(f"{p} {v.costs[p]:.1f}" for p in gp.RESTART_PARTS) + ")" for k, v in kinds.items()]
    projection = gp.project(ledger["wall_s"], devices, len(faults) / exposed * 3600.0 / devices, kinds,
                            stall_s=stall, interval_s=segment * b["productive"] / training,
                            overhead=overheads / b["productive"], fixed_s=once, restart_failures=False)
    return projection, gp.Inputs(kinds=kinds, stall_s=stall, lag_s=0.0, step_s=step_s, assumptions=notes)
