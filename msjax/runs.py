"""A run directory as others read it: its config and its newest verified checkpoint.

Training writes a run directory (`msjax.train.run`: config.json, tokenizer.json, checkpoints/), and so does
`scripts/convert.py --from_hf` (msjax.hf). Generation (`msjax.generate.load_run`) and export to Hugging Face
(`msjax.hf.export_hf`) read one back through these two functions, onto whatever mesh the devices allow.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp

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


def restore_params(run_dir: str | Path, cfg: Config, devices: Sequence[jax.Device] | None = None,
                   dtype: str | None = None) -> tuple[Any, int, dict]:
    """(train program, step, parameters) of a run's newest verified checkpoint, restored onto the mesh of `cfg`
    (any mesh: Orbax reshards). Only the parameters are read (`Checkpointer.restore(partial=True)`: the optimizer
    state, twice the parameters' bytes under Adam, never reaches memory) and verified against the checkpoint's
    record.

    Args:
      run_dir, cfg: the run directory and its config (`run_config`).
      devices: the devices of the mesh (default: all).
      dtype: "float32" or "bfloat16" to cast the parameters to, one array at a time (each stored array is freed
        once its cast exists, so the peak is the stored parameters plus one array); None keeps the stored dtype.
    Raises:
      ConfigError: a mesh that does not fit the devices, a dtype not allowed, or a newest checkpoint that holds no
        parameters.
      msjax.checkpoint.CheckpointError: no checkpoint, or none passes verification (a checkpoint without
        parameters among them).
    """
    if dtype not in (None, "float32", "bfloat16"):
        raise ConfigError(f"--dtype={dtype!r}: allowed: 'float32', 'bfloat16' (or none: as stored)")
    program = build_train_program(resolve_layout(cfg, devices, strict=False))
    # Read-only: the run may still be training, and its newest step may be between Orbax's commit and its record.
    ckpt = Checkpointer(cfg.checkpoint, checkpoint_dir(cfg.checkpoint, str(run_dir)), read_only=True)
    try:
        if ckpt.latest_step() is None:
            raise CheckpointError(f"no complete checkpoint in {ckpt.directory}")
        record = ckpt.newest_record()
        if record is not None and not any(k.startswith("['params']") for k in record.get("checksums", {})):
            held = sorted({k.split("]")[0] + "]" for k in record.get("checksums", {})})
            raise ConfigError(f"{ckpt.directory}: the newest checkpoint (step {ckpt.latest_step()}) holds no "
                              f"parameters (its arrays are under {', '.join(held) or 'nothing'}); generation and "
                              "export read a checkpoint that training or convert.py --from_hf wrote")
        step, state, _ = ckpt.restore({"params": program.abstract_state["params"]}, partial=True)
    finally:
        ckpt.close()
    params = state["params"]
    if dtype is not None:
        params = cast_params(params, dtype)
    return program, step, params


def cast_params(params: Any, dtype: str) -> Any:
    """`params` with every floating-point array cast to `dtype` on its own sharding, one array at a time: each
    original is deleted once its cast exists (the caller must hold no other reference to them), so the peak is
    the original parameters plus the largest cast array, never both trees."""
    target = jnp.dtype(dtype)

    def cast(x: jax.Array) -> jax.Array:
        if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == target:
            return x
        y = _cast(x, target)  # elementwise: the result keeps the input's sharding
        y.block_until_ready()
        x.delete()
        return y

    return jax.tree.map(cast, params)


# One compiled cast per shape and sharding (a model's layers share a few), not one per array.
_cast = jax.jit(lambda x, dtype: x.astype(dtype), static_argnums=1)
