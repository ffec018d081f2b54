"""Shared set-up for loop-level tests: a small real-text corpus and a tiny run config on a 2x2x2 mesh.

Session-scoped so that every test module reuses one corpus (and its token cache) instead of building its own.
"""

import shutil
import sysconfig
from pathlib import Path

import pytest

from msjax.config import Config, apply_overrides


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """A few real standard-library sources copied as .txt files (real text, present on every machine)."""
    d = tmp_path_factory.mktemp("small_corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("textwrap.py", "fnmatch.py", "glob.py", "shlex.py", "bisect.py", "colorsys.py"):
        shutil.copy(stdlib / name, d / f"{name}.txt")
    return d


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


@pytest.fixture
def make_tiny_config():
    """The `tiny_run_config` factory, as a fixture (conftest functions are not importable by test modules)."""
    return tiny_run_config
