"""Checkpoints that never lose work: verified, two-stage, two-tier, through Orbax.

- `manager`: the Checkpointer (save through Orbax, complete with an integrity record, copy local -> persistent
  tier, rotate, restore the newest verified checkpoint with fallback), and `latest_verified`, the one answer to
  "which step would a restore resume from" for the restore and for any reader (a supervisor).
- `tiers`: a tier in a local directory or on object storage (gs://, s3://); the record is the last to arrive.
- `integrity`: layout-independent per-array checksums and the integrity record.
- `resume`: the saved-vs-current config check `--resume` runs before touching the run directory.
"""

from msjax.checkpoint.manager import (
    CheckpointError,
    Checkpointer,
    CheckpointWriteError,
    NonFiniteStateError,
    NoWholeCheckpointError,
    checkpoint_dir,
    ensure_writable,
    latest_verified,
    local_checkpoint_dir,
    staging_dir,
)
from msjax.checkpoint.resume import check_resume_config

__all__ = ["CheckpointError", "Checkpointer", "CheckpointWriteError", "NonFiniteStateError", "NoWholeCheckpointError",
           "checkpoint_dir", "ensure_writable", "latest_verified", "local_checkpoint_dir", "staging_dir",
           "check_resume_config"]
