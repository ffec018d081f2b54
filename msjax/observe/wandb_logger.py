"""Weights & Biases as a metrics sink beside JSONL and TensorBoard (`train.loggers=...,wandb`).

The real `wandb` client (an optional dependency: `pip install msjax[wandb]`), configured as W&B documents it, by
environment: $WANDB_PROJECT (default "msjax"), $WANDB_ENTITY, $WANDB_MODE (`offline` writes the run under
`<run_dir>/wandb/` without an account or network; `wandb sync` uploads it later). The run's config is the W&B
run's config. The W&B run id is kept in `<run_dir>/wandb_run_id`, so a resumed msjax run continues the same W&B
run (`resume="allow"`); W&B keeps a step only once, so steps a crashed attempt logged after its last checkpoint
are not logged again.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from msjax.config import ConfigError

RUN_ID_FILE = "wandb_run_id"


class WandbLogger:
    """Logs `{step, **scalars}` rows to a W&B run. Process 0 only (the caller decides).

    Args:
      run_dir: the msjax run directory (W&B's files go to `<run_dir>/wandb/`).
      name: the run's name (`config.name`).
      config: the run's config as a dict (`msjax.config.to_dict`).
    Raises:
      ConfigError: `wandb` is not installed (naming the extra that installs it).
    """

    def __init__(self, run_dir: Path, name: str, config: dict[str, Any]):
        try:
            import wandb
        except ImportError:
            raise ConfigError("train.loggers names wandb, which is not installed: pip install 'msjax[wandb]' (or "
                              "leave wandb out of train.loggers)") from None
        run_dir.mkdir(parents=True, exist_ok=True)
        id_file = run_dir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else None  # None: W&B makes a new one
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "msjax"), name=name, id=run_id,
                               resume="allow", dir=str(run_dir), config=config, reinit="finish_previous")
        id_file.write_text(self._run.id)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log(dict(scalars), step=step)

    def close(self) -> None:
        self._run.finish()
