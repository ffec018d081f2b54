"""Checkpoints that never lose work: verified, two-stage, two-tier, through Orbax.

- `manager`: the Checkpointer (save through Orbax, complete with an integrity record, copy local -> persistent
  tier, rotate, restore the newest verified checkpoint with fallback).
- `integrity`: layout-independent per-array checksums and the integrity record.
- `resume`: the saved-vs-current config check `--resume` runs before touching the run directory.
"""

from msjax.checkpoint.manager import (
    CheckpointError,
    Checkpointer,
    CheckpointWriteError,
    NonFiniteStateError,
    checkpoint_dir,
    ensure_writable,
    local_checkpoint_dir,
)
from msjax.checkpoint.resume import check_resume_config

__all__ = ["CheckpointError", "Checkpointer", "CheckpointWriteError", "NonFiniteStateError", "checkpoint_dir",
           "ensure_writable", "local_checkpoint_dir", "check_resume_config"]
