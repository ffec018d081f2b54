"""End to end: the loop trains on real text, writes metrics/checkpoints/sample, resumes bit-identically, and
refuses bad input before any step runs."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from msjax.checkpoint import Checkpointer
from msjax.config import ConfigError, apply_overrides
from msjax.data import DataError
from msjax.train import run
from tests.msjax.tiny_runs import tiny_run_config as tiny

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def corpus(small_corpus) -> Path:
    return small_corpus  # tests/msjax/conftest.py: real standard-library text, built once per session


def test_trains_and_writes_metrics_checkpoints_and_sample(tmp_path, corpus):
    cfg = tiny(tmp_path, corpus, **{"train.steps": 30, "optimizer.decay_steps": 30, "optimizer.lr": 3e-3,
                                    "train.eval_every": 10, "checkpoint.every": 10})
    summary = run(cfg)
    val = [v for _, v in summary.val_loss]
    assert len(val) == 3 and val[-1] < val[0] - 0.3, val  # validation loss visibly falls
    assert summary.checkpoints == [10, 20, 30]
    assert isinstance(summary.sample, str) and summary.sample
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {"loss", "tokens_per_s", "mfu", "grad_norm"} <= set(rows[0]) and any("val_loss" in r for r in rows)
    assert list((tmp_path / "run" / "tb").glob("events.out.tfevents.*"))
    assert (tmp_path / "run" / "tokenizer.json").exists() and (tmp_path / "run" / "config.json").exists()


def test_the_config_a_preflight_returns_is_the_one_that_runs(tmp_path, corpus):
    """A pre-flight check may change the config (the planner's raises a preset's remat that does not fit): the run,
    its checkpoints and its config.json are the returned config's."""
    cfg = tiny(tmp_path, corpus, **{"train.steps": 2, "train.eval_every": 0, "checkpoint.every": 2,
                                    "train.sample_tokens": 0})
    seen = []

    def preflight(c):
        seen.append(c)
        return apply_overrides(c, {"model.remat": "full"})

    run(cfg, preflight=preflight)
    assert seen == [cfg] and cfg.model.remat == "none"
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model"]["remat"] == "full"


def _params(summary):
    return jax.tree.leaves(jax.device_get(summary.state))


@pytest.mark.slow
def test_resume_is_bit_identical_and_skips_unfinished_checkpoints(tmp_path, corpus):
    straight = run(tiny(tmp_path / "a", corpus))
    run(tiny(tmp_path / "b", corpus, **{"train.steps": 4}))
    ckpt_dir = tmp_path / "b" / "run" / "checkpoints"
    # A write of step 6 that never finished: Orbax writes under a temporary name and renames when complete.
    shutil.copytree(ckpt_dir / "4", ckpt_dir / "6.orbax-checkpoint-tmp-1700000000")
    resumed = run(tiny(tmp_path / "b", corpus, **{"checkpoint.resume": True}))
    assert resumed.start_step == 4
    for x, y in zip(_params(straight), _params(resumed)):
        np.testing.assert_array_equal(x, y)  # params, optimizer state, step and RNG, bit for bit
    assert straight.val_loss[-1] == resumed.val_loss[-1]
    assert straight.sample == resumed.sample


@pytest.mark.slow
def test_steps_per_execution_trains_like_single_steps_and_resumes_bit_identically(tmp_path, corpus):
    """K = 2 steps per call (a scan over the step) against one step per call, on data 2 x fsdp 2 x tensor 2: the
    same batches in the same order, so the same parameters within float32 rounding (the scan's body is compiled
    as a loop body, the single step as a program of its own, and XLA may fuse them differently); the loop's
    logging, evaluation, checkpoints and goodput count every step. Resumed with K = 2 from K = 2's checkpoint,
    bit for bit; resumed from a K = 1 checkpoint off the K grid (step 3), single steps up to step 4, then calls."""
    single = run(tiny(tmp_path / "single", corpus))
    two = run(tiny(tmp_path / "two", corpus, **{"train.steps_per_execution": 2}))
    for x, y in zip(_params(single), _params(two)):
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-6)
    assert two.checkpoints == single.checkpoints == [4, 8]
    assert [s for s, _ in two.val_loss] == [4, 8]
    np.testing.assert_allclose([v for _, v in two.val_loss], [v for _, v in single.val_loss], rtol=1e-5)
    rows = [json.loads(line) for line in (tmp_path / "two" / "run" / "metrics.jsonl").read_text().splitlines()]
    # logged every 2 steps, except the first call's end (step 2), which includes compiling, as step 1 with K = 1
    assert [r["step"] for r in rows if "loss" in r] == [4, 6, 8]
    assert two.goodput["steps"] == 8  # steps counted by number, not by calls
    timed = [json.loads(line) for line in (tmp_path / "two" / "run" / "ranks" / "rank0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in timed] == [2, 4, 6, 8]

    run(tiny(tmp_path / "resumed", corpus, **{"train.steps_per_execution": 2, "train.steps": 4}))
    resumed = run(tiny(tmp_path / "resumed", corpus, **{"train.steps_per_execution": 2, "checkpoint.resume": True}))
    assert resumed.start_step == 4
    for x, y in zip(_params(two), _params(resumed)):
        np.testing.assert_array_equal(y, x)

    run(tiny(tmp_path / "off_grid", corpus, **{"train.steps": 3}))
    off_grid = run(tiny(tmp_path / "off_grid", corpus, **{"train.steps_per_execution": 2, "checkpoint.resume": True}))
    assert off_grid.start_step == 3 and off_grid.checkpoints == [3, 4, 8]
    for x, y in zip(_params(single), _params(off_grid)):
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_checkpoint_restores_onto_another_mesh(tmp_path, corpus):
    cfg = tiny(tmp_path, corpus, **{"train.steps": 4})
    summary = run(cfg)
    from msjax.mesh import make_mesh
    from msjax.train_step import build_train_program

    other = apply_overrides(cfg, {"mesh.data": 1, "mesh.fsdp": 8, "mesh.tensor": 1})
    program = build_train_program(other, make_mesh(other.mesh), vocab_size=summary.state["params"]["wte"].shape[0])
    step, state, loader = Checkpointer(cfg.checkpoint, tmp_path / "run" / "checkpoints").restore(
        program.abstract_state)
    assert step == 4 and loader["step"] == 4
    wte = state["params"]["wte"]
    assert wte.addressable_shards[0].data.shape == (wte.shape[0], wte.shape[1] // 8)  # embed split 8 ways (FSDP)
    for x, y in zip(_params(summary), jax.tree.leaves(jax.device_get(state))):
        np.testing.assert_array_equal(x, y)


def test_existing_checkpoints_need_resume(tmp_path, corpus):
    run(tiny(tmp_path, corpus, **{"train.steps": 4}))
    with pytest.raises(ConfigError, match="already holds checkpoints .latest step 4.; pass --resume"):
        run(tiny(tmp_path, corpus, **{"train.steps": 4}))


def test_unwritable_checkpoint_dir_fails_before_training(tmp_path, corpus):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    cfg = tiny(tmp_path, corpus, **{"checkpoint.dir": str(blocker / "ckpt")})
    with pytest.raises(ConfigError, match="checkpoint.dir=.*a_file/ckpt' is not writable"):
        run(cfg)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_missing_data_path_is_an_error(tmp_path, corpus):
    with pytest.raises(DataError, match="does_not_exist"):
        run(tiny(tmp_path, corpus, **{"data.paths": (str(tmp_path / "does_not_exist"),)}))


def test_train_script_reports_bad_flags():
    proc = subprocess.run([sys.executable, "scripts/train.py", "--config=gpt_tiny", "--mesh.tensor=4"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "error: model.num_heads=6 is not divisible by the tensor-parallel size mesh.tensor=4" in proc.stderr
