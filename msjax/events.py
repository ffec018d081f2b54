"""The run's event log: `<run_dir>/events.jsonl`, one writer API and one reader for the loop, observability and
the supervisor.

Schema: one JSON object per line, `{"time": float, "kind": str, **fields}`.
  time    wall-clock time of the event, unix seconds (`time.time()` of the process that wrote it; the run's hosts
          are assumed NTP-synchronised, as every figure that subtracts two events' times assumes).
  kind    what happened (below). Every other field is the kind's own, JSON values only (anything else is written
          with `str`). Durations are seconds, steps are optimizer steps (1-based; the step a run resumed from is
          the step of its checkpoint), ranks are `jax.process_index()`s, attempts count from 0.

Kinds, by writer:
  the supervisor (msjax.supervise.supervisor; figures read off them in msjax.supervise.figures)
    run_start        the supervisor started: run_id, hosts, spares, devices_per_host.
    launch           attempt `attempt` started on `hosts` (pids, standbys_used, overrides).
    worker_start     a worker's first heartbeat: attempt, rank, host, start_step (the step it resumed from), pid.
    first_step       every worker of the attempt has dispatched a step past its restore step: attempt, step.
    worker_phases    a worker's start-up marks: attempt, rank, host, phases ({name: unix s}, msjax.control.phases).
    fault_injected   a fault went in (a benchmark's or a test's watcher): fault, rank, host, step, attempt.
    detected         failures found and blamed: attempt, failures, collateral (each rank, host, kind, detail).
    stopped          the attempt's workers were stopped: attempt, grace_s, how many took SIGTERM / SIGKILL.
    diagnosis_skipped, diagnosed, excluded, spare_used, straggler_kept, replanned, restart, nonfinite_reported,
    supervisor_error, sink_error
                     the supervisor's decisions (see msjax.supervise.supervisor).
    attempt_end      an attempt ended: attempt, start_step, last_step, step_s, finished.
    run_end          the run ended: status, report.
  observability (msjax.observe)
    straggler        a rank flagged slow at a window end: step, process, host, coords, scores, figures, threshold.
    straggler_recovered, straggler_excluded
                     the flag was lifted; the host was recorded for exclusion: step, process (host).
    profile          a profiler trace was captured: first_step, num_steps, dir, ...
  the loop (msjax.goodput)
    goodput          rank 0's goodput ledger so far (msjax.goodput.LoopLedger.to_dict): written at every logging
                     step and once at the loop's end, so a killed worker leaves its last one behind.

Writes: each event is one `write` of a whole line to a file opened in append mode, flushed at once, so writers
in several processes (the supervisor and its workers' rank 0) do not interleave within a line on a local or
POSIX filesystem (O_APPEND), and a writer that dies leaves every earlier line readable. A crash in the middle of
a write can leave a torn last line: `read_events` skips any line that is not a JSON object.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

FILE_NAME = "events.jsonl"

log = logging.getLogger(__name__)


def events_path(run_dir_or_file: str | Path) -> Path:
    """`<run_dir>/events.jsonl` for a run directory; a path ending in .jsonl is taken as the file itself."""
    p = Path(run_dir_or_file)
    return p if p.suffix == ".jsonl" else p / FILE_NAME


class EventLog:
    """Appends events to a run's events.jsonl and hands each to `sink` too. Thread-safe.

    Args:
      run_dir_or_file: the run directory (or the events file itself); its directory is created.
      sink: optional callable taking each event dict (the supervisor's Redis `events` stream); its first error
        is recorded in the log as a `sink_error` event and the sink is not called again, so a lost control plane
        never stops the run: the file stays the record.
    """

    def __init__(self, run_dir_or_file: str | Path, sink: Callable[[dict], None] | None = None):
        self.path = events_path(run_dir_or_file)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._sink = sink
        self._sink_failed = False
        self._lock = threading.Lock()

    def emit(self, kind: str, **fields: Any) -> dict:
        """Writes `{"time": now, "kind": kind, **fields}` as one line and returns it.

        Raises ValueError when `fields` holds "time" or "kind" (the schema's own fields)."""
        event = _event(kind, fields)
        line = json.dumps(event, default=str) + "\n"
        with self._lock:
            self._file.write(line)
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


def append_event(run_dir_or_file: str | Path, kind: str, **fields: Any) -> dict:
    """Appends one event to `<run_dir>/events.jsonl` (the directory is created) and returns it: `EventLog.emit`
    for writers that emit rarely and keep no file open. Raises ValueError as `EventLog.emit`."""
    event = _event(kind, fields)
    path = events_path(run_dir_or_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(event, default=str) + "\n")
    return event


def read_events(run_dir_or_file: str | Path, kind: str | None = None) -> list[dict]:
    """The events of a run in file order (all, or those of one `kind`); [] when there is no file.

    A line that is not a JSON object (a torn last line, from a writer killed mid-write) is skipped: one message at
    debug level, never an error, so a crashed run's log is still read."""
    path = events_path(run_dir_or_file)
    if not path.exists():
        return []
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            log.debug("%s line %d is not JSON (a torn write); skipped", path, n)
            continue
        if isinstance(event, dict) and (kind is None or event.get("kind") == kind):
            out.append(event)
    return out


def _event(kind: str, fields: dict[str, Any]) -> dict:
    clash = {"time", "kind"} & fields.keys()
    if clash:
        raise ValueError(f"event {kind!r}: field(s) {sorted(clash)} are the schema's own; allowed are any others")
    return {"time": time.time(), "kind": kind, **fields}
