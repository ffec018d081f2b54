"""Metrics out: a JSONL file (one object per logged step, easy to load anywhere) and TensorBoard event files
through tensorboardX (a well-kept writer with no TensorFlow dependency). Only process 0 writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax


class MetricsWriter:
    """Writes `{step, **scalars}` to `<run_dir>/metrics.jsonl` and TensorBoard events under `<run_dir>/tb`."""

    def __init__(self, run_dir: Path):
        self.enabled = jax.process_index() == 0
        if not self.enabled:
            return
        from tensorboardX import SummaryWriter

        run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        self._tb = SummaryWriter(str(run_dir / "tb"))

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
