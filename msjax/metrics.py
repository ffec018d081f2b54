"""Metrics out, to the sinks `train.loggers` names: a JSONL file (one object per logged step, easy to load anywhere),
TensorBoard event files through tensorboardX (a well-kept writer with no TensorFlow dependency) and Weights &
Biases through its own client (`msjax.observe.wandb_logger`). Only process 0 writes."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

import jax

from msjax.config import to_dict
from msjax.hooks import Hook, RunContext


def _step_of(row: str) -> float:
    """The step of a metrics.jsonl row; infinity for a torn or empty line (a crash mid-write), so it is dropped."""
    try:
        return float(json.loads(row)["step"])
    except (ValueError, KeyError, TypeError):
        return float("inf")


# Modules tensorboardX imports at import time if they are installed, none of which msjax's writer uses: torch only
# to accept torch tensors in its add_* calls (msjax passes floats), boto3 and google-cloud-storage only for event
# files at s3:// and gs:// URLs (msjax's TensorBoard directory is always the local run directory's `tb`).
_TENSORBOARDX_OPTIONAL = ("torch", "boto3", "google.cloud.storage")


def _summary_writer_class():
    """tensorboardX's SummaryWriter, imported without the optional modules it would load but msjax never uses.

    Those imports were most of the writer's start-up on a 2-core Xeon: torch 1.7 of 2.2 s (torch 2.13 installed
    beside msjax), boto3 and google-cloud-storage ~0.2 s more. While tensorboardX loads, importing any of them
    raises ImportError (a None entry in sys.modules), which tensorboardX handles; a module the process already
    imported is used as is, and each stays importable afterwards.
    """
    blocked = [name for name in _TENSORBOARDX_OPTIONAL if name not in sys.modules]
    for name in blocked:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        from tensorboardX import SummaryWriter
    finally:
        for name in blocked:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]
    return SummaryWriter


class MetricsWriter(Hook):
    """Writes `{step, **scalars}` to `<run_dir>/metrics.jsonl`, TensorBoard events under `<run_dir>/tb` and W&B,
    as `loggers` says: one of the run's hooks, so the loop hands its numbers to hooks alone (`on_log`: a logging
    step's scalars; `on_eval`: an evaluation's). `on_start` opens the sinks in the run directory, `on_end` closes
    them. Outside a run: `open(...)`, `write`, `close`.

    `loggers`: any of "jsonl", "tensorboard", "wandb" (`train.loggers`).

    Raises:
      ConfigError: wandb asked for but not installed (at `on_start` / `open`).
    """

    def __init__(self, loggers: Sequence[str] = ("jsonl", "tensorboard")):
        self.loggers = tuple(loggers)
        self.enabled = False
        self._jsonl = self._tb = self._wandb = None

    def on_start(self, ctx: RunContext) -> None:
        self.open(ctx.run_dir, start_step=ctx.start_step, name=ctx.config.name, config=to_dict(ctx.config))

    def on_log(self, ctx: RunContext, step: int, scalars: dict[str, float]) -> None:
        self.write(step, scalars)

    def on_eval(self, ctx: RunContext, step: int, scalars: dict[str, float]) -> None:
        self.write(step, scalars)

    def on_end(self, ctx: RunContext, error: BaseException | None) -> None:
        self.close()

    def open(self, run_dir: Path, start_step: int = 0, name: str = "", config: dict[str, Any] | None = None
             ) -> "MetricsWriter":
        """Opens the sinks under `run_dir` (process 0 only; elsewhere writing does nothing); returns self.

        `start_step`: the step the run (re)starts from. Rows of later steps, written by an earlier attempt that did
        not get to checkpoint them, are dropped from metrics.jsonl (rewritten atomically) and TensorBoard is told to
        purge them (tensorboardX `purge_step`), so a resumed run's metrics hold each step once. `name` and `config`
        (a dict) describe the run to W&B.
        """
        loggers = self.loggers
        self.enabled = jax.process_index() == 0
        if not self.enabled:
            return self
        run_dir.mkdir(parents=True, exist_ok=True)
        if "jsonl" in loggers:
            path = run_dir / "metrics.jsonl"
            if path.exists():
                rows = path.read_text().splitlines(keepends=True)
                kept = [r for r in rows if _step_of(r) <= start_step]
                if len(kept) != len(rows):
                    tmp = path.with_suffix(".jsonl.tmp")
                    tmp.write_text("".join(kept))
                    os.replace(tmp, path)
            self._jsonl = open(path, "a", buffering=1)
        if "tensorboard" in loggers:
            self._tb = _summary_writer_class()(str(run_dir / "tb"), purge_step=start_step + 1 if start_step else None)
        if "wandb" in loggers:
            from msjax.observe.wandb_logger import WandbLogger

            self._wandb = WandbLogger(run_dir, name, config or {})
        return self

    def write(self, step: int, scalars: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: float(v) for k, v in scalars.items()}}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if k != "step":
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.write(step, {k: v for k, v in row.items() if k != "step"})

    def close(self) -> None:
        for sink in (self._jsonl, self._tb, self._wandb):
            if sink is not None:
                sink.close()
        self._jsonl = self._tb = self._wandb = None
        self.enabled = False
