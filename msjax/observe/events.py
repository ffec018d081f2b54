"""`<run_dir>/events.jsonl`: one JSON object per line, `{"time": unix seconds, "kind": str, **details}`.

The supervisor (its own issue) reads and writes the same file; until it lands this is the one writer. Lines are
appended with a single `write` of a whole line, so concurrent appenders on one filesystem do not interleave
within a line (POSIX O_APPEND).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def append_event(run_dir: str | Path, kind: str, **details: Any) -> dict[str, Any]:
    """Appends one event to `<run_dir>/events.jsonl` and returns it.

    Args:
      run_dir: the run directory (created if missing).
      kind: what happened, e.g. "straggler", "straggler_recovered", "profile".
      details: JSON-serialisable fields.
    """
    event = {"time": time.time(), "kind": kind, **details}
    path = Path(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "events.jsonl", "a") as f:
        f.write(json.dumps(event) + "\n")
    return event


def read_events(run_dir: str | Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The events of a run (all, or those of one kind); [] when there is no file."""
    path = Path(run_dir) / "events.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if kind is None or r.get("kind") == kind]
