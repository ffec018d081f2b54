"""Metrics out: a JSONL file (one object per logged step, easy to load anywhere) and TensorBoard event files
through tensorboardX (a well-kept writer with no TensorFlow dependency). Only process 0 writes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax


def _step_of(row: str) -> float:
    """The step of a metrics.jsonl row; infinity for a torn or empty line (a crash mid-write), so it is dropped."""
    try:
        return float(json.loads(row)["step"])
    except (ValueError, KeyError, TypeError):
        return float("inf")


class MetricsWriter:
    """Writes `{step, **scalars}` to `<run_dir>/metrics.jsonl` and TensorBoard events under `<run_dir>/tb`.

    `start_step`: the step the run (re)starts from. Rows of later steps, written by an earlier attempt that did
    not get to checkpoint them, are dropped from metrics.jsonl (rewritten atomically) and TensorBoard is told to
    purge them (tensorboardX `purge_step`), so a resumed run's metrics hold each step once.
    """

    def __init__(self, run_dir: Path, start_step: int = 0):
        self.enabled = jax.process_index() == 0
        if not self.enabled:
            return
        from tensorboardX import SummaryWriter

        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / "metrics.jsonl"
        if path.exists():
            rows = path.read_text().splitlines(keepends=True)
            kept = [r for r in rows if _step_of(r) <= start_step]
            if len(kept) != len(rows):
                tmp = path.with_suffix(".jsonl.tmp")
                tmp.write_text("".join(kept))
                os.replace(tmp, path)
        self._jsonl = open(path, "a", buffering=1)
        self._tb = SummaryWriter(str(run_dir / "tb"), purge_step=start_step + 1 if start_step else None)

    def write(self, step: int, scalars: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: float(v) for k, v in scalars.items()}}
        self._jsonl.write(json.dumps(row) + "\n")
        for k, v in row.items():
            if k != "step":
                self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            self._tb.close()
