"""The tiny run config that loop-level tests share (importable, unlike conftest.py)."""

from pathlib import Path

from msjax.config import Config, apply_overrides


def tiny_run_config(tmp: Path, corpus: Path, **overrides) -> Config:
    """An 8-step char-level run of a 2-layer, width-32 GPT on data 2 x fsdp 2 x tensor 2, checkpoint every 4."""
    base = {
        "model.num_layers": 2, "model.d_model": 32, "model.num_heads": 2, "model.max_seq_len": 32,
        "data.paths": (str(corpus),), "data.tokenizer": "char", "data.val_fraction": 0.2,
        "data.cache_dir": str(tmp / "cache"), "train.seq_len": 32, "train.global_batch": 8, "train.steps": 8,
        "train.eval_every": 4, "train.eval_batches": 2, "train.log_every": 2, "train.sample_tokens": 20,
        "train.run_dir": str(tmp / "run"), "train.progress": False, "optimizer.warmup_steps": 2,
        "optimizer.decay_steps": 8, "checkpoint.every": 4, "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2,
    }
    return apply_overrides(Config(name="test"), {**base, **overrides}).validate()
