"""A run directory as others read it: its config and its newest verified checkpoint.

Training writes a run directory (`msjax.train.run`: config.json, tokenizer.json, checkpoints/), and so does
`scripts/convert.py --from_hf` (msjax.hf). Generation (`msjax.generate.load_run`) and export to Hugging Face
(`msjax.hf.export_hf`) read one back through these two functions, onto whatever mesh the devices allow.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import jax

from msjax.checkpoint import CheckpointError, Checkpointer, checkpoint_dir
from msjax.config import Config, ConfigError, apply_overrides, load_preset
from msjax.layout import resolve as resolve_layout
from msjax.train_step import build_train_program


def run_config(run_dir: str | Path, overrides: dict[str, Any] | None = None) -> Config:
    """A run directory's config.json with dotted `overrides`, validated. Raises ConfigError when there is none,
    or when the run never set its vocabulary."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.json").is_file():
        raise ConfigError(f"--run_dir={str(run_dir)!r} has no config.json (not a run directory)")
    cfg = apply_overrides(load_preset(str(run_dir / "config.json")), overrides or {}).validate()
    if cfg.model.vocab_size < 1:
        raise ConfigError(f"{run_dir}/config.json: model.vocab_size is 0 (the run never started)")
    return cfg


def restore_params(run_dir: str | Path, cfg: Config, devices: Sequence[jax.Device] | None = None
                   ) -> tuple[Any, int, dict]:
    """(train program, step, parameters) of a run's newest verified checkpoint, restored onto the mesh of `cfg`
    (any mesh: Orbax reshards). The whole train state is read and verified (the checkpoint's checksums cover it);
    the optimizer state is dropped before returning.

    Raises:
      ConfigError: a mesh that does not fit the devices.
      msjax.checkpoint.CheckpointError: no checkpoint, or none passes verification.
    """
    program = build_train_program(resolve_layout(cfg, devices, strict=False))
    # Read-only: the run may still be training, and its newest step may be between Orbax's commit and its record.
    ckpt = Checkpointer(cfg.checkpoint, checkpoint_dir(cfg.checkpoint, str(run_dir)), read_only=True)
    try:
        if ckpt.latest_step() is None:
            raise CheckpointError(f"no complete checkpoint in {ckpt.directory}")
        step, state, _ = ckpt.restore(program.abstract_state)
    finally:
        ckpt.close()
    return program, step, state["params"]
