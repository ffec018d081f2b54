"""A mixture of experts' load, per layer and expert: what share of the token-expert assignments each expert got.

`ExpertLoadLog` writes `<run_dir>/expert_load.jsonl` at every logging step (process 0): a row `{"step": s,
"load": [[...E shares...] per MoE layer]}` from the step's `expert_load` report (`msjax.train_step`: each MoE
layer's `load`, the fraction of the step's assignments routed to each expert, averaged over accumulated
microbatches). The run report draws it as a heatmap of layers x experts (`msjax.observe.report`). A row is a few
hundred numbers for small models and L x E for large ones (Qwen3-30B-A3B: 48 x 128), once per logging step: a
file of its own, not scalars for every sink.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax

from msjax.hooks import Hook, RunContext

EXPERT_LOAD_FILE = "expert_load.jsonl"


class ExpertLoadLog(Hook):
    """Appends each logging step's expert load to `expert_load.jsonl` (module docstring); rows of steps after
    `start_step` left by an earlier attempt are dropped at the start, as metrics.jsonl's are."""

    def __init__(self):
        self._metrics: dict[str, Any] | None = None
        self._file = None

    def on_start(self, ctx: RunContext) -> None:
        if jax.process_index() != 0:
            return
        path = ctx.run_dir / EXPERT_LOAD_FILE
        if path.exists():  # rewritten whole (a temporary file, then a rename): never half a file
            kept = [row for row in path.read_text().splitlines(keepends=True)
                    if json.loads(row)["step"] <= ctx.start_step]
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(kept))
            os.replace(tmp, path)
        self._file = open(path, "a", buffering=1)

    def on_step_end(self, ctx: RunContext, step: int, metrics: dict[str, Any]) -> None:
        self._metrics = metrics  # device arrays: read at the logging step, when the loop has waited for them

    def on_log(self, ctx: RunContext, step: int, scalars: dict[str, float]) -> None:
        if self._file is None or self._metrics is None or "expert_load" not in self._metrics:
            return
        load = jax.device_get(self._metrics["expert_load"]).tolist()
        self._file.write(json.dumps({"step": step, "load": load}) + "\n")

    def on_end(self, ctx: RunContext, error: BaseException | None) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
