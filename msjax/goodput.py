"""The goodput ledger: where a run's wall time went, as productive step time and named badput.

Every run writes `<run_dir>/goodput.json` at its end: the training loop for a run of its own (`LoopLedger`), the
supervisor over all attempts for a supervised one (`run_ledger`, from the event log). The ledger is the job's, not
one process's: every rank keeps its own, stores it in jax's coordination service at every logging step, and rank 0
combines them (`job_ledger`: a synchronous step waits for its slowest rank, so each badput bucket is the largest of
any rank's) and writes the result to the event log (`goodput` events, msjax.events) and to goodput.json, which also
lists each rank's ledger and names the slowest rank of each bucket. Every rank also hands its own ledger to the
control plane (`RedisMetricsSink.publish_goodput`: `msjax:{run_id}:goodput:{rank}` in the run's Redis).

Buckets (seconds of wall-clock time, `time.time()`; they partition the run's wall time, so they add up to it):

  One training process (LoopLedger), from the process's start (psutil's creation time) to the end of `run`:
    startup       process start -> the ledger's `on_start`, after every other hook's (imports, rendezvous,
                  jax.distributed, data, mesh, train program, checkpoint restore, the hooks' own start).
    compilation   `on_start` -> the end of the first step's dispatch (tracing, compiling, the first dispatch: jit
                  compiles synchronously at the first call), less the first batch's data wait.
    data_wait     the devices idle for want of the next batch: of each wait in `next(loader)`, the part after the
                  previous step's outputs were ready (msjax.hooks.DataWait, timed by the step observer's watcher);
                  the part before, hidden behind device work still queued, is productive. (The loop's whole wait
                  is kept as `data_wait_host_s`.)
    checkpoint    the loop blocked in the checkpoint save after each step (`checkpoint_s`), and in closing the
                  checkpointer at the end (waiting for an asynchronous save to commit).
    evaluation    validation-loss evaluation (`eval_s`).
                  The save and the evaluation start by waiting for the steps still queued on the device (at most the
                  dispatch queue's depth), so a step's device time can land in them: a bound, not a split, on a
                  device that runs ahead of the host.
    straggler     steps slowed down by a flagged straggler: for every straggler window (ranks/windows.jsonl, a
                  window whose `stragglers` is not empty), window steps x the slowest rank's excess over the
                  median in own compute (`own_compute_s`) or in time it could not run (`host_lag_s`), the larger,
                  at most a step (`straggler_seconds`): the time the job's synchronous step waited for its slowest
                  rank. Carved out of the step time.
    productive    the rest of the step loop: from one step's `on_step_end` to the next one's, less the data wait,
                  checkpoint and evaluation inside it (the device running steps, logging, the hooks); after the last
                  step, up to `on_end`, less the final evaluation and checkpoint; less straggler time.
    teardown      the ledger's `on_end` (before any other hook's) -> the end of `run`, less closing the checkpointer
                  (the other hooks' end, the closing sample, closing files).

  A supervised run (run_ledger), from the supervisor's `run_start` to its `run_end` event, attempt by attempt:
    startup       run_start -> the first launch, and each attempt's launch -> its rank 0's loop start.
    compilation, data_wait, checkpoint, evaluation, straggler, productive
                  the attempt's rank-0 ledger (its last `goodput` event written between the attempt's launch and its
                  `attempt_end`), covering loop start -> that event.
    recomputed    the productive time of the steps an attempt ran past the step the next attempt restored (work a
                  fault threw away): (ledger step - restored step) x the attempt's productive time per step, moved
                  out of productive.
    restart       the rest of a failed attempt after its last ledger (the steps since, lost, and the fault's
                  detection and stop), attempt_end -> the next launch (diagnostics, re-planning, backoff), and a
                  failed attempt that wrote no ledger at all.
    teardown      after a finished attempt's last ledger -> its attempt_end (the processes exiting), and the last
                  attempt_end -> run_end.

The effective training time ratio (ETTR, ByteRobust's term; MaxText's "goodput") is productive / wall.
`unaccounted_s` = wall - the buckets' sum: zero up to rounding when every interval was seen; a clock step or
overlapping attempts would show there.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

from msjax.events import append_event
from msjax.hooks import Hook, RunContext

log = logging.getLogger(__name__)

LOOP_BUCKETS = ("productive", "startup", "compilation", "data_wait", "checkpoint", "evaluation", "straggler",
                "teardown")
BUCKETS = ("productive", "startup", "compilation", "data_wait", "checkpoint", "evaluation", "straggler",
           "recomputed", "restart", "teardown")
FILE_NAME = "goodput.json"


def straggler_seconds(window_rows: Iterable[dict], window: int) -> float:
    """Seconds the job's steps waited for flagged stragglers (module docstring, `straggler`).

    Per straggler window, the slowest rank's excess over the ranks' median in the per-step figures that sit on a
    synchronous step's critical path: its own compute (`own_compute_s`) and the time it could not run (`host_lag_s`),
    the larger of the two, at most the median step time; with neither, the probe's ratio (`probe_s`, seconds per
    matmul) as a fraction of the median step: step x (1 - median / max). Times the window's steps.

    Args:
      window_rows: rows of ranks/windows.jsonl: {"stragglers": [rank, ...], "figures": {name: [per rank]}}, the
        figures per-step means over the window (seconds).
      window: steps per window (observe.window).
    """
    total = 0.0
    for row in window_rows:
        if not row.get("stragglers"):
            continue
        figs = row.get("figures", {})
        steps = sorted(figs.get("step_median_s") or figs.get("step_s") or [0.0])
        step = steps[len(steps) // 2]
        excess = [_max_over_median(figs[k]) for k in ("own_compute_s", "host_lag_s") if any(figs.get(k, []))]
        if excess:
            per_step = max(excess)
        elif any(figs.get("probe_s", [])):
            probe = sorted(figs["probe_s"])
            per_step = step * (1.0 - probe[len(probe) // 2] / probe[-1])
        else:
            continue
        total += window * min(per_step, step)
    return total


def _max_over_median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[-1] - ordered[len(ordered) // 2]


class LoopLedger(Hook):
    """The goodput ledger of one training process (module docstring), joined to the loop as a hook.

    `msjax.train.run` puts it last among its hooks (its `on_start` runs after every other hook's, its `on_end`
    before any other's) and calls `finish` at the very end.
    Rank 0 writes `goodput` events and goodput.json; every rank publishes its ledger to the control plane's
    ledger to the sinks it is given that have a `publish_goodput` method (the control plane's metrics sink).

    Args:
      sinks: live metric sinks (`msjax.train.build_hooks` passes the control plane's); those without
        `publish_goodput` are left out.
      process_start: unix seconds the process started (default: msjax.control.phases' `process_start`, else now).
      rank: this process's index (default: jax.process_index()).
    """

    def __init__(self, sinks: Sequence[Any] = (), process_start: float | None = None, rank: int | None = None):
        self.sinks = [s for s in sinks if hasattr(s, "publish_goodput")]
        if process_start is None:
            from msjax.control import phases

            process_start = phases.marks().get("process_start", time.time())
        self.process_start = process_start
        self.rank = rank
        self.buckets = dict.fromkeys(LOOP_BUCKETS, 0.0)
        self.loop_start: float | None = None
        self.last: float | None = None  # time.time() of the latest on_step_end (or on_end)
        self.ended: float | None = None
        self.start_step = 0
        self.step = 0
        self.steps = 0
        self._ctx: RunContext | None = None
        self._windows_read = 0  # bytes of windows.jsonl already read
        self._window_rows: list[dict] = []

    # -- the loop's side -------------------------------------------------------------------------------------------
    def on_start(self, ctx: RunContext) -> None:
        if self.rank is None:
            import jax

            self.rank = jax.process_index()
        self._ctx = ctx
        self.loop_start = self.last = time.time()
        self.buckets["startup"] = max(0.0, self.loop_start - self.process_start)
        self.start_step = self.step = ctx.start_step

    def on_step_end(self, ctx: RunContext, step: int, metrics: dict[str, Any]) -> None:
        now = time.time()
        tm = ctx.timings
        data = tm.get("data_s", 0.0)
        interval = now - self.last
        if self.steps == 0:  # the first step: its dispatch compiles
            self.buckets["compilation"] += interval - data
        else:  # the save and evaluation after the previous step, then this step's batch and dispatch
            ckpt, ev = tm.get("checkpoint_s", 0.0), tm.get("eval_s", 0.0)
            self.buckets["checkpoint"] += ckpt
            self.buckets["evaluation"] += ev
            self.buckets["productive"] += interval - data - ckpt - ev
        self.buckets["data_wait"] += data
        # a call may run several steps (train.steps_per_execution): count them by number
        self.last, self.step, self.steps = now, step, self.steps + step - self.step

    def on_log(self, ctx: RunContext, step: int, scalars: dict[str, float]) -> None:
        self._publish(final=False)

    def on_end(self, ctx: RunContext, error: BaseException | None) -> None:
        now = time.time()
        if self.steps:  # the last step's evaluation and save (timed after its on_step_end)
            ckpt, ev = ctx.timings.get("checkpoint_s", 0.0), ctx.timings.get("eval_s", 0.0)
            self.buckets["checkpoint"] += ckpt
            self.buckets["evaluation"] += ev
            self.buckets["productive"] += now - self.last - ckpt - ev
        else:
            self.buckets["compilation"] += now - self.last
        self.last = self.ended = now
        # goodput.json now too: a run that raises never reaches `finish`
        self._publish(final=False, write=True, error=None if error is None else type(error).__name__)

    def finish(self, checkpoint_close_s: float = 0.0) -> dict[str, Any]:
        """Closes the ledger at the end of `run` and returns it (`to_dict`); rank 0 writes goodput.json and a
        final `goodput` event. `checkpoint_close_s`: seconds spent closing the checkpointer after `on_end`."""
        now = time.time()
        self.buckets["checkpoint"] += checkpoint_close_s
        self.buckets["teardown"] += max(0.0, now - (self.ended or now) - checkpoint_close_s)
        self.last = now
        # Said apart too: the checkpoint bucket's share spent after every hook's on_end (an outside observer's
        # window ends before it).
        return self._publish(final=True, write=True, checkpoint_close_s=checkpoint_close_s)

    # -- the ledger --------------------------------------------------------------------------------------------------
    def _straggler(self) -> None:
        """Moves the straggler windows seen since the last call out of productive (rank 0 writes windows.jsonl)."""
        ctx = self._ctx
        if ctx is None or self.rank != 0:
            return
        path = Path(ctx.run_dir) / "ranks" / "windows.jsonl"
        if not path.exists():
            return
        with open(path, "rb") as f:
            f.seek(self._windows_read)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1  # whole lines only; a line being written is read next time
        self._windows_read += end
        new = []
        for line in chunk[:end].decode("utf-8", "replace").splitlines():
            try:
                new.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        window = getattr(getattr(ctx.config, "observe", None), "window", 0) or 0
        s = min(straggler_seconds(new, window), self.buckets["productive"])
        self.buckets["straggler"] += s
        self.buckets["productive"] -= s

    def to_dict(self, final: bool = False) -> dict[str, Any]:
        """This process's ledger so far: {"rank", "process_start", "loop_start", "until" (unix s: the end of the
        time covered), "start_step", "step", "steps", "final", "buckets" {name: s}, "wall_s", "ettr",
        "data_wait_host_s"}.

        `data_wait` holds the batch waits the devices sat idle for (`RunContext.data_wait`, from the step
        observer, for the steps whose device work is done); the rest of the loop's waits in `next(loader)`, hidden
        behind steps still running, counts as productive. `data_wait_host_s` is the loop's whole wait.
        """
        wall = (self.last or time.time()) - self.process_start
        buckets = dict(self.buckets)
        host_data = buckets["data_wait"]
        if self._ctx is not None:
            host_s, device_s = self._ctx.data_wait.totals()
            hidden = min(max(0.0, host_s - device_s), buckets["data_wait"])
            buckets["data_wait"] -= hidden
            buckets["productive"] += hidden
        return {"rank": self.rank, "process_start": self.process_start, "loop_start": self.loop_start,
                "until": self.last, "start_step": self.start_step, "step": self.step, "steps": self.steps,
                "final": final, "buckets": buckets, "wall_s": wall,
                "ettr": buckets["productive"] / wall if wall > 0 else None, "data_wait_host_s": host_data}

    def _publish(self, final: bool, write: bool = False, **extra: Any) -> dict[str, Any]:
        self._straggler()
        ledger = {**self.to_dict(final), **{k: v for k, v in extra.items() if v is not None}}
        ctx = self._ctx
        if ctx is None:
            return ledger
        for sink in self.sinks:
            sink.publish_goodput(self.rank, ledger)
        ranks = _exchange(self.rank, ledger, final and write)
        if self.rank == 0:
            job = job_ledger(ranks)
            append_event(ctx.run_dir, "goodput", **{k: v for k, v in job.items() if k != "ranks"})
            if write:
                write_ledger(ctx.run_dir, loop_summary(job))
            return job
        return ledger


# Every rank's ledger goes to jax's coordination service under these keys (the latest, overwritten at each
# publish; the final one, once): rank 0 reads them without a collective, so a rank that raised cannot hang it.
_KV_LATEST, _KV_FINAL = "msjax_goodput_latest/", "msjax_goodput_final/"
# How long rank 0 waits, at the end of a run, for another rank's final ledger. The ranks end their loops at the
# same step and close their checkpointers together, so the finals arrive within seconds; one that does not (its
# process raised) is replaced by its latest ledger, and a warning names it.
FINAL_WAIT_S = 60.0


def _exchange(rank: int, ledger: dict[str, Any], final: bool) -> list[dict[str, Any]]:
    """Every rank's latest ledger (rank 0; the others get [ledger]): this one stored in jax's coordination service,
    the others read from it, a final exchange waiting for every rank's final ledger (at most FINAL_WAIT_S in all).
    A rank that has published nothing yet is left out until it does."""
    import jax

    if jax.process_count() == 1:
        return [ledger]
    from msjax.compat import jax_distributed  # jax has no public key-value store

    client = jax_distributed.global_state.client
    text = json.dumps(ledger)
    try:
        client.key_value_set(f"{_KV_LATEST}{rank}", text, allow_overwrite=True)
        if final:
            client.key_value_set(f"{_KV_FINAL}{rank}", text, allow_overwrite=True)
    except Exception as e:  # noqa: BLE001 - the service is gone (rank 0 ended): the ledger is a report, not a step
        log.warning("goodput: rank %d could not publish its ledger to the coordination service: %s", rank, e)
    if rank != 0:
        return [ledger]
    latest = {int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in client.key_value_dir_get(_KV_LATEST)}
    latest[0] = ledger
    if final:
        deadline = time.monotonic() + FINAL_WAIT_S  # one wait for all: ranks that raised cost it once, not each
        for other in range(1, jax.process_count()):
            left_ms = max(1, int((deadline - time.monotonic()) * 1000))
            try:
                latest[other] = json.loads(client.blocking_key_value_get(f"{_KV_FINAL}{other}", left_ms))
            except Exception:  # noqa: BLE001 - the coordination service's deadline error
                log.warning("goodput: rank %d's final ledger did not arrive within %.0f s of the run's end "
                            "(FINAL_WAIT_S); the job's goodput.json takes its latest one", other, FINAL_WAIT_S)
    return [latest[r] for r in sorted(latest)]


def job_ledger(ranks: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The job's ledger from every rank's (LoopLedger.to_dict dicts, rank 0's first): a synchronous step waits for
    its slowest rank, so each badput bucket is the largest of any rank's (`slowest` names that rank), the wall the
    longest, and productive the wall's rest (never below 0; what the maxima overrun shows in `unaccounted_s` of
    goodput.json). Rank 0's own fields (steps, times) otherwise; `ranks` lists each rank's buckets, wall and ETTR.
    One rank: its ledger, with `ranks` and `slowest` added."""
    first = ranks[0]
    wall = max(r["wall_s"] for r in ranks)
    buckets, slowest = {}, {}
    for name in LOOP_BUCKETS:
        if name == "productive":
            continue
        worst = max(ranks, key=lambda r: r["buckets"].get(name, 0.0))
        buckets[name], slowest[name] = worst["buckets"].get(name, 0.0), worst["rank"]
    buckets["productive"] = max(0.0, wall - sum(buckets.values()))
    return {**first, "wall_s": wall, "buckets": {k: buckets[k] for k in LOOP_BUCKETS}, "slowest": slowest,
            "ettr": buckets["productive"] / wall if wall > 0 else None,
            "ranks": [{"rank": r["rank"], "step": r.get("step"), "final": r.get("final"), "wall_s": r["wall_s"],
                       "ettr": r["ettr"], "buckets": r["buckets"], "data_wait_host_s": r.get("data_wait_host_s")}
                      for r in ranks]}


def loop_summary(ledger: dict[str, Any]) -> dict[str, Any]:
    """goodput.json of a run of its own, from its job ledger (`job_ledger`): {"wall_s", "buckets", "ettr",
    "unaccounted_s", "steps", "slowest" {bucket: rank}, "ranks" [{"rank", "step", "final", "wall_s", "ettr",
    "buckets", "data_wait_host_s"}], "source": "loop"}."""
    buckets = {k: ledger["buckets"].get(k, 0.0) for k in BUCKETS}
    wall = ledger["wall_s"]
    return {"source": "loop", "wall_s": wall, "buckets": buckets, "ettr": ledger["ettr"],
            "unaccounted_s": wall - sum(buckets.values()),
            "steps": {"start": ledger["start_step"], "end": ledger["step"], "run": ledger["steps"]},
            "slowest": ledger.get("slowest", {}), "ranks": ledger.get("ranks", [])}


def run_ledger(events: Iterable[dict]) -> dict[str, Any]:
    """The goodput ledger of a supervised run, over all its attempts, from its event log (module docstring).

    Args:
      events: the run's events (msjax.events.read_events), with the supervisor's run_start, launch and
        attempt_end events and rank 0's `goodput` events.
    Returns:
      {"source": "supervisor", "wall_s", "buckets" {name: s}, "ettr", "unaccounted_s", "attempts": [{"attempt",
      "launch", "end", "finished", "ledger_step", "restored_step", "recomputed_steps", "buckets"}]}.
    Raises:
      ValueError: no run_start event (not a supervised run's log).
    """
    events = list(events)
    start = next((e["time"] for e in events if e["kind"] == "run_start"), None)
    if start is None:
        raise ValueError("the event log has no run_start event: not a supervised run's log")
    end = next((e["time"] for e in reversed(events) if e["kind"] == "run_end"), events[-1]["time"])
    launches = {e["attempt"]: e["time"] for e in events if e["kind"] == "launch"}
    ends = {e["attempt"]: e for e in events if e["kind"] == "attempt_end"}
    restored = {}
    for e in events:
        if e["kind"] == "worker_start" and e.get("start_step") is not None:
            restored[e["attempt"]] = min(restored.get(e["attempt"], e["start_step"]), e["start_step"])
    snaps = [e for e in events if e["kind"] == "goodput" and e.get("rank") == 0 and e.get("until")]
    total = dict.fromkeys(BUCKETS, 0.0)
    attempts = []
    order = sorted(launches)
    total["startup"] += (launches[order[0]] if order else end) - start
    for i, a in enumerate(order):
        lo = launches[a]
        ae = ends.get(a)
        hi = ae["time"] if ae else (launches[order[i + 1]] if i + 1 < len(order) else end)
        finished = bool(ae and ae.get("finished"))
        b = dict.fromkeys(BUCKETS, 0.0)
        mine = [s for s in snaps if lo <= s["loop_start"] and s["until"] <= hi]
        snap = max(mine, key=lambda s: s["until"]) if mine else None
        nxt = order[i + 1] if i + 1 < len(order) else None
        lost = 0
        if snap is None:
            b["startup" if finished else "restart"] += hi - lo
        else:
            b["startup"] += snap["loop_start"] - lo
            # The attempt's timeline is rank 0's: its loop ran from loop_start to until. The job's badput buckets
            # are each the largest rank's (a synchronous step waits for the slowest); productive is the rest of
            # rank 0's loop time, not the job's, whose wall is the longest rank's (a warm standby started long
            # before the launch has the longest) and would count time outside this window twice.
            badput = 0.0
            for k in ("compilation", "data_wait", "checkpoint", "evaluation", "straggler", "teardown"):
                b[k] += snap["buckets"].get(k, 0.0)
                badput += snap["buckets"].get(k, 0.0)
            b["productive"] += max(0.0, snap["until"] - snap["loop_start"] - badput)
            if nxt is not None and restored.get(nxt) is not None and snap["steps"]:
                lost = max(0, min(snap["step"] - restored[nxt], snap["steps"]))
                per_step = b["productive"] / snap["steps"]
                b["recomputed"] += lost * per_step
                b["productive"] -= lost * per_step
            b["teardown" if finished else "restart"] += hi - snap["until"]
        if nxt is not None:
            b["restart"] += launches[nxt] - hi
        for k in BUCKETS:
            total[k] += b[k]
        attempts.append({"attempt": a, "launch": lo, "end": hi, "finished": finished,
                         "ledger_step": snap["step"] if snap else None, "restored_step": restored.get(a),
                         "recomputed_steps": lost, "buckets": b})
    if order:
        last_hi = attempts[-1]["end"]
        total["teardown"] += end - last_hi
    wall = end - start
    return {"source": "supervisor", "wall_s": wall, "buckets": total,
            "ettr": total["productive"] / wall if wall > 0 else None,
            "unaccounted_s": wall - sum(total.values()), "attempts": attempts}


def write_ledger(run_dir: str | Path, ledger: dict[str, Any]) -> Path:
    """Writes `ledger` to `<run_dir>/goodput.json` (through a temporary file and a rename: a reader never sees a
    half-written one). Returns the path."""
    path = Path(run_dir) / FILE_NAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(ledger, indent=2))
    tmp.replace(path)
    return path


def read_ledger(run_dir: str | Path) -> dict[str, Any] | None:
    """`<run_dir>/goodput.json`, or None when the run wrote none."""
    path = Path(run_dir) / FILE_NAME
    return json.loads(path.read_text()) if path.exists() else None


def describe(ledger: dict[str, Any]) -> str:
    """One line per bucket with seconds and share of the wall time, largest first, then the ETTR."""
    wall = ledger["wall_s"]
    rows = sorted(ledger["buckets"].items(), key=lambda kv: -kv[1])
    lines = [f"goodput: wall {wall:.1f} s, effective training time ratio "
             f"{(ledger['ettr'] or 0):.1%}"]
    lines += [f"  {k:<12} {v:9.2f} s  {v / wall:6.1%}" for k, v in rows if v > 0 and wall > 0]
    return "\n".join(lines)
