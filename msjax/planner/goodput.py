"""Projected goodput of a long run: how often it fails, what each failure costs, the checkpoint interval that keeps
the most of its wall time productive, and the effective training time ratio (ETTR) it then reaches.

The model (Daly 2006, "A higher order estimate of the optimum checkpoint interval for restart dumps", Future
Generation Computer Systems 22(3)):
  - failures strike the job as a Poisson process: a job of N devices, each failing at rate λ, has a mean time
    between failures M = 1 / (N λ);
  - training runs in segments of τ seconds of productive steps, each ended by a checkpoint that stalls the steps
    for δ seconds (the blocked part of an asynchronous save);
  - a failure costs a restart of R seconds (detection, teardown, restart start-up, compilation, restore; a failure
    may strike during a restart too) and the work since the newest complete checkpoint, which is recomputed;
  - an asynchronous checkpoint is complete w seconds after it was taken (its background write): a failure in
    that window goes back one checkpoint further. To first order that adds w to the work lost per failure, so the
    model takes R + w as the restart cost.
Then one segment takes, in expectation, T(τ) = M e^{R/M} (e^{(τ+δ)/M} - 1) seconds of wall time, and
ETTR(τ) = τ / T(τ). R scales T by a constant, so the best τ does not depend on it: τ* solves
1 - e^{-(τ+δ)/M} = τ / M (found by bisection, `best_interval`). Young's first-order optimum (1974) is
sqrt(2 δ M); Daly's higher-order one is checked against τ* in the tests.

Where failures strike only while the job trains (`restart_failures=False`: the clock of the failure process stops
during a restart, as in a benchmark that injects faults into a training job), the same argument gives
T(τ) = (M + R)(e^{(τ+δ)/M} - 1): each of the e^{(τ+δ)/M} - 1 expected failures per segment costs exactly R. The
two agree to first order in R/M (at R/M = 0.04 they differ by 0.08% of the wall time) and share the optimum τ*.
Per-step overheads that are neither productive nor a checkpoint (data wait, evaluation) stretch the segment: a
fraction ω of the productive time makes it τ(1 + ω) + δ long, and the optimum productive interval is
τ*(ω) = τ*(0) / (1 + ω).

Units: seconds throughout, rates per device-hour where named so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

# The parts of one restart, in the order they happen (msjax.supervise.figures.RECOVERY_PHASES groups into these).
RESTART_PARTS = ("detection", "teardown", "startup", "compilation", "restore")


def segment_time(interval_s: float, stall_s: float, restart_s: float, mtbf_s: float,
                 restart_failures: bool = True) -> float:
    """Expected wall seconds to complete one segment of `interval_s` seconds of steps and its checkpoint stall
    `stall_s`, with failures of mean time between them `mtbf_s`, each costing `restart_s` plus the segment so far
    (module docstring: Daly 2006). `restart_failures`: failures strike restarts too (True), or only the steps and
    the stall (False). Raises ValueError for a non-positive interval or MTBF, or a negative cost."""
    _check(interval_s=interval_s, mtbf_s=mtbf_s)
    if stall_s < 0 or restart_s < 0:
        raise ValueError(f"stall_s={stall_s}, restart_s={restart_s}: allowed are seconds >= 0")
    failed = math.expm1((interval_s + stall_s) / mtbf_s)  # expected failures per segment, times M / M
    if restart_failures:
        return mtbf_s * math.exp(restart_s / mtbf_s) * failed
    return (mtbf_s + restart_s) * failed


def ettr(interval_s: float, stall_s: float, restart_s: float, mtbf_s: float, restart_failures: bool = True,
         overhead: float = 0.0) -> float:
    """The effective training time ratio, productive seconds / wall seconds, of checkpointing every `interval_s`
    productive seconds (`segment_time`'s arguments; `overhead`: per-step seconds that are not productive, as a
    fraction of the productive ones, module docstring)."""
    if not (math.isfinite(overhead) and overhead >= 0):
        raise ValueError(f"overhead={overhead!r}: allowed is a finite fraction >= 0")
    return interval_s / segment_time(interval_s * (1.0 + overhead), stall_s, restart_s, mtbf_s, restart_failures)


def young_interval(stall_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum interval sqrt(2 δ M) (Young 1974, "A first order approximation to the optimum
    checkpoint interval", CACM 17(9)), seconds."""
    _check(mtbf_s=mtbf_s)
    return math.sqrt(2.0 * stall_s * mtbf_s)


def daly_interval(stall_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum interval (Daly 2006): sqrt(2 δ M) [1 + (δ / 2M)^(1/2) / 3 + (δ / 2M) / 9] - δ
    for δ < 2M, else M; seconds."""
    _check(mtbf_s=mtbf_s)
    if stall_s >= 2.0 * mtbf_s:
        return mtbf_s
    r = stall_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * stall_s * mtbf_s) * (1.0 + math.sqrt(r) / 3.0 + r / 9.0) - stall_s


def best_interval(stall_s: float, mtbf_s: float, rel_tol: float = 1e-12) -> float:
    """The interval that maximises `ettr` exactly: the root of 1 - e^{-(τ+δ)/M} - τ/M (module docstring), by
    bisection to `rel_tol`; seconds. With no stall every interval's checkpoint is free: returns 0 then (the limit
    of checkpointing continuously)."""
    _check(mtbf_s=mtbf_s)
    if stall_s <= 0:
        return 0.0

    def g(t: float) -> float:  # decreasing in t past its root; positive at 0
        return -math.expm1(-(t + stall_s) / mtbf_s) - t / mtbf_s

    lo, hi = 0.0, mtbf_s  # g(M) = -e^{-(M+δ)/M} < 0
    while hi - lo > rel_tol * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if g(mid) > 0 else (lo, mid)
    return 0.5 * (lo + hi)


@dataclass(frozen=True)
class FailureKind:
    """One kind of failure and what a restart after it costs.

    Attributes:
      share: the fraction of all failures of this kind (the shares of a projection sum to 1).
      costs: seconds of each of RESTART_PARTS (missing parts cost 0).
      source: where the costs come from (a benchmark record, a published figure), printed with the projection.
    """

    share: float
    costs: Mapping[str, float]
    source: str = ""

    @property
    def restart_s(self) -> float:
        return sum(self.costs.values())


@dataclass(frozen=True)
class Projection:
    """What `project` predicts for one run (seconds unless named otherwise).

    Attributes:
      run_s: the run's wall time.
      mtbf_s: the job's mean time between failures.
      failures: expected failures over the run, per kind name.
      interval_s: the checkpoint interval used (productive seconds between checkpoints): the one asked for, else
        the exact optimum, or the background write when that is longer.
      young_s, daly_s, best_s: the first-order, higher-order and exact optimum intervals.
      ettr: productive / wall.
      badput: expected wall seconds per part over the run: "checkpoint" (stalls), each of RESTART_PARTS (every
        failure's whole restart), and "lost work", the rest of the wall time: the work recomputed after failures
        (a checkpoint still being written included) and restarts cut short by another failure. With
        "productive" they sum to run_s.
      largest: the part of `badput` that costs the most.
    """

    run_s: float
    mtbf_s: float
    failures: dict[str, float]
    interval_s: float
    young_s: float
    daly_s: float
    best_s: float
    ettr: float
    badput: dict[str, float] = field(default_factory=dict)

    @property
    def largest(self) -> str:
        return max((k for k in self.badput if k != "productive"), key=self.badput.__getitem__)


def project(run_s: float, devices: int, failure_rate_per_device_hour: float, kinds: Mapping[str, FailureKind],
            stall_s: float, lag_s: float = 0.0, interval_s: float | None = None, *, overhead: float = 0.0,
            fixed_s: float = 0.0, restart_failures: bool = True) -> Projection:
    """The goodput of a run of `run_s` wall seconds on `devices` devices (module docstring).

    Args:
      run_s: wall seconds of the run.
      devices: accelerators in the job (each fails at `failure_rate_per_device_hour`).
      failure_rate_per_device_hour: failures per device per hour of the time failures strike (the wall time less
        `fixed_s`, and less the restarts where `restart_failures` is False), all kinds together.
      kinds: name -> FailureKind; the restart cost R is their share-weighted mean.
      stall_s: seconds each checkpoint stalls the steps.
      lag_s: seconds from a checkpoint being taken to its being complete (the background write).
      interval_s: productive seconds between checkpoints; None: the exact optimum (`best_interval`), or the
        background write `lag_s` when that is longer (a save does not start before the previous one is written).
      overhead: per-step seconds that are neither productive nor a checkpoint (data wait, evaluation), as a
        fraction of the productive seconds.
      fixed_s: wall seconds spent once, outside the failure process (the first start-up and compilation, the
        teardown at the end): badput "once".
      restart_failures: failures strike restarts too (True, the default: a host fails whenever it fails), or
        only the steps and checkpoints (False: faults injected into a training job).
    Raises:
      ValueError: non-positive run length, devices or rate; `fixed_s` outside [0, run_s); shares that do not sum
        to 1 (within 1e-6).
    """
    _check(run_s=run_s, devices=devices, failure_rate_per_device_hour=failure_rate_per_device_hour)
    if not 0.0 <= fixed_s < run_s:
        raise ValueError(f"fixed_s={fixed_s!r}: allowed is seconds in [0, run_s={run_s!r})")
    total = sum(k.share for k in kinds.values())
    if not kinds or abs(total - 1.0) > 1e-6:
        raise ValueError(f"failure shares {({n: k.share for n, k in kinds.items()})} sum to {total}; they must "
                         "sum to 1")
    mtbf = 3600.0 / (devices * failure_rate_per_device_hour)
    restart = sum(k.share * k.restart_s for k in kinds.values())
    best = best_interval(stall_s, mtbf) / (1.0 + overhead)
    # Orbax writes one checkpoint at a time: below the background write, each save would wait for the previous.
    tau = max(best, lag_s / (1.0 + overhead)) if interval_s is None else interval_s
    _check(interval_s=tau)
    exposed = run_s - fixed_s
    per_exposed = ettr(tau, stall_s, restart + lag_s, mtbf, restart_failures, overhead)
    productive = per_exposed * exposed
    segments = productive / tau
    # Failures arrive over the exposed time: with restart_failures, all of it; else only the segments' own time,
    # e^{(τ(1+ω)+δ)/M} - 1 of them per segment (segment_time), each followed by a whole restart.
    failures_total = (exposed / mtbf if restart_failures
                      else segments * math.expm1((tau * (1.0 + overhead) + stall_s) / mtbf))
    badput = {"productive": productive, "checkpoint": segments * stall_s}
    if overhead:
        badput["step overheads"] = segments * tau * overhead
    if fixed_s:
        badput["once"] = fixed_s
    for part in RESTART_PARTS:
        badput[part] = failures_total * sum(k.share * k.costs.get(part, 0.0) for k in kinds.values())
    badput["lost work"] = run_s - sum(badput.values())
    return Projection(run_s=run_s, mtbf_s=mtbf, failures={n: failures_total * k.share for n, k in kinds.items()},
                      interval_s=tau, young_s=young_interval(stall_s, mtbf), daly_s=daly_interval(stall_s, mtbf),
                      best_s=best, ettr=productive / run_s, badput=badput)


def _check(**values: float) -> None:
    for name, v in values.items():
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"{name}={v!r}: allowed is a finite number > 0")


# ---- inputs from measurements ------------------------------------------------------------------------------------

# Llama 3 (Dubey et al. 2024, "The Llama 3 Herd of Models", sec. 3.3.4): 419 unexpected interruptions in a 54-day
# snapshot of pre-training on 16,384 H100 GPUs. Per device-hour.
LLAMA3_FAILURES_PER_DEVICE_HOUR = 419 / (54 * 24 * 16_384)

# The share of each kind of failure: an assumption, not a measurement. GPU faults were 58.7% of Llama 3's
# unexpected interruptions (same source); they end the worker process while its host stays up ("process"). The
# rest is split here between a lost host (network, power, host maintenance: "host") and a job that hangs until a
# timeout ("hang").
DEFAULT_SHARES = {"process": 0.6, "host": 0.3, "hang": 0.1}

# The fault a `scripts/bench_recovery.py` record injected for each kind: a SIGKILLed worker, a node whose every
# process died (the real-SLURM cluster; without it, a host failing its self-checks), a SIGSTOPped worker.
RECORD_FAULTS = {"process": ("kill",), "host": ("node", "diag"), "hang": ("stop",)}

# How the recovery phases a record holds (msjax.supervise.figures.RECOVERY_PHASES) add up to RESTART_PARTS; the
# rendezvous and the restore are replaced by figures scaled to the planned job (`inputs_from_records`).
PHASE_PARTS = {"detect": "detection", "stop": "teardown", "diagnose": "teardown", "backoff": "teardown",
               "process_start": "startup", "imports": "startup", "rendezvous": "startup", "distributed": "startup",
               "prepare": "startup", "heartbeat_lag": "startup", "compile_first_step": "compilation",
               "restore": "restore"}


@dataclass(frozen=True)
class Inputs:
    """What a projection is computed from, each figure with where it came from.

    Attributes:
      kinds: name -> FailureKind.
      stall_s, lag_s: a checkpoint's stall of the steps and its background write, seconds.
      step_s: the planned step time, seconds (turns the interval into steps).
      assumptions: one line per input: its value, its source and the rule that scaled it.
    """

    kinds: dict[str, FailureKind]
    stall_s: float
    lag_s: float
    step_s: float
    assumptions: list[str]


def _shown(path: str) -> str:
    """`path` as printed: relative to the repository when it is one of its files (docs/results/...)."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    full = os.path.abspath(path)
    return os.path.relpath(full, root) if full.startswith(root + os.sep) else path


def _result(path: str, what: str) -> dict:
    import json

    try:
        with open(path) as f:
            return json.load(f)["result"]
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{what}={path!r}: not a readable benchmark record of docs/results ({type(e).__name__}: "
                         f"{e})") from None


def rendezvous_s(rows: list[dict], ranks: int) -> tuple[float, str]:
    """Seconds for `ranks` processes to join through the Redis control plane, from `scripts/bench_init.py` rows
    ({"store", "what", "ranks", "seconds"}): linear between the measured rank counts, and beyond them along the
    line through the two largest (the join is one round trip per worker to one server: linear in the ranks).
    Returns (seconds, the rule applied)."""
    points = sorted((r["ranks"], r["seconds"]) for r in rows if r.get("store") == "redis" and r.get("what") == "join")
    if len(points) < 2:
        raise ValueError("the start-up record holds fewer than two Redis join measurements")
    (r0, s0), (r1, s1) = next(((a, b) for a, b in zip(points, points[1:]) if b[0] >= ranks), points[-2:])
    seconds = max(s0 + (s1 - s0) * (ranks - r0) / (r1 - r0), 0.0)
    rule = "measured" if ranks in dict(points) else ("interpolated" if points[0][0] <= ranks <= points[-1][0]
                                                     else "extrapolated linearly")
    return seconds, f"{rule} from Redis joins of {r0:,} and {r1:,} ranks"


def inputs_from_records(*, state_bytes_per_device: float, devices_per_host: int, hosts: int, step_s: float,
                        shares: Mapping[str, float], recovery_record: str, checkpoint_record: str,
                        startup_record: str) -> Inputs:
    """The projection's inputs for a planned job, from measured records (docs/results JSON of
    `scripts/bench_recovery.py`, `scripts/bench_checkpoint.py` and `scripts/bench_init.py`).

    Scaling rules (each printed in `Inputs.assumptions`):
      - detection, teardown, start-up without the rendezvous, and compilation: as measured, per kind (the mean
        over the record's faults of that kind); the supervisor's heartbeat settings carry over, and compilation
        is a restart's, from jax's persistent cache;
      - the rendezvous: the Redis join of `hosts` processes (`rendezvous_s`);
      - checkpoint stall, background write and restore: the record's seconds per byte times the bytes each host
        holds (`state_bytes_per_device` x `devices_per_host`: every host writes and reads its own shards, in
        parallel with the others); a process or hang failure restores from the local tier, a lost host from
        the persistent tier.

    Raises:
      ValueError: an unreadable record, a kind of `shares` the recovery record has no fault for.
    """
    rec, ckpt, start = (_result(recovery_record, "--recovery_record"), _result(checkpoint_record,
                        "--checkpoint_record"), _result(startup_record, "--startup_record"))
    bytes_per_host = state_bytes_per_device * devices_per_host
    scale = bytes_per_host / ckpt["state_bytes"]
    join_s, join_rule = rendezvous_s(start["rows"], hosts)
    restore = {"local": ckpt["restore_local_s"] * scale, "persistent": ckpt["restore_persistent_s"] * scale}
    notes = [f"checkpoint: {bytes_per_host / 2**30:,.2f} GiB per host ({devices_per_host} devices x "
             f"{state_bytes_per_device / 2**30:,.2f} GiB of parameters and optimizer state); seconds per byte from "
             f"{_shown(checkpoint_record)} ({ckpt['state_bytes'] / 2**30:.2f} GiB on one host)",
             f"rendezvous of {hosts:,} hosts: {join_s:.2f} s, {join_rule} ({_shown(startup_record)})"]
    kinds = {}
    for kind, share in shares.items():
        faults = [r["phases"] for r in rec["recovery_phases"] if r["kind"] in RECORD_FAULTS.get(kind, ())]
        if not faults:
            raise ValueError(f"--failure_shares: kind {kind!r} has no fault in {recovery_record} (its faults: "
                             f"{sorted({r['kind'] for r in rec['recovery_phases']})}; kinds: "
                             f"{', '.join(RECORD_FAULTS)})")
        costs = dict.fromkeys(RESTART_PARTS, 0.0)
        for phases in faults:
            for phase, seconds in phases.items():
                if phase not in ("rendezvous", "restore"):
                    costs[PHASE_PARTS[phase]] += seconds / len(faults)
        costs["startup"] += join_s
        tier = "persistent" if kind == "host" else "local"
        costs["restore"] = restore[tier]
        source = (f"{_shown(recovery_record)} ({len(faults)} fault(s): {'/'.join(RECORD_FAULTS[kind])}); restore "
                  f"from the {tier} tier")
        kinds[kind] = FailureKind(share, costs, source=source)
        notes.append(f"{kind} failures: {share:.0%} of all; restart {sum(costs.values()):.1f} s ("
                     + ", ".join(f"{p} {costs[p]:.1f}" for p in RESTART_PARTS) + f") from {kinds[kind].source}")
    notes.append(f"step time {step_s:.3g} s (the plan's)")
    return Inputs(kinds=kinds, stall_s=ckpt["blocked_s"] * scale, lag_s=ckpt["background_s"] * scale,
                  step_s=step_s, assumptions=notes)


def projection_text(p: Projection, inputs: Inputs, title: str) -> str:
    """The projection as a table: failures, each badput part (hours, or seconds for a run under a day, and share of
    the wall time), the intervals, the ETTR, the largest part, and every assumption."""
    long = p.run_s >= 86_400.0
    unit, per = ("hours", 3600.0) if long else ("seconds", 1.0)
    length = f"{p.run_s / 86_400.0:,.1f} days" if long else f"{p.run_s:,.1f} s"
    mtbf = f"{p.mtbf_s / 3600.0:.2f} h" if long else f"{p.mtbf_s:.1f} s"
    lines = [title,
             f"  run {length}; job MTBF {mtbf}; expected failures "
             f"{sum(p.failures.values()):,.1f} (" + ", ".join(f"{k} {v:,.1f}" for k, v in p.failures.items()) + ")",
             f"  checkpoint every {p.interval_s / 60.0:,.1f} min = {p.interval_s / inputs.step_s:,.0f} steps "
             f"(stall {inputs.stall_s:.2f} s, background write {inputs.lag_s:.1f} s); optimum: exact "
             f"{p.best_s / 60.0:,.1f} min, Daly {p.daly_s / 60.0:,.1f} min, Young {p.young_s / 60.0:,.1f} min",
             f"  {'where the wall time goes':28s} {unit:>10s} {'share':>7s}"]
    for part, seconds in sorted(p.badput.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {part:28s} {seconds / per:10,.1f} {seconds / p.run_s:7.2%}")
    lines += [f"  ETTR {p.ettr:.2%}; the largest loss: {p.largest} ({p.badput[p.largest] / p.run_s:.2%} of the "
              "wall time)", "  assumptions:"] + [f"    - {a}" for a in inputs.assumptions]
    return "\n".join(lines)


def projection_dict(p: Projection, inputs: Inputs) -> dict:
    """The projection and its inputs, JSON-ready (seconds)."""
    return {"run_s": p.run_s, "mtbf_s": p.mtbf_s, "failures": p.failures, "interval_s": p.interval_s,
            "interval_steps": p.interval_s / inputs.step_s, "best_s": p.best_s, "daly_s": p.daly_s,
            "young_s": p.young_s, "ettr": p.ettr, "badput_s": p.badput, "largest": p.largest,
            "stall_s": inputs.stall_s, "lag_s": inputs.lag_s, "step_s": inputs.step_s,
            "kinds": {k: {"share": v.share, "costs_s": dict(v.costs), "source": v.source}
                      for k, v in inputs.kinds.items()},
            "assumptions": inputs.assumptions}
