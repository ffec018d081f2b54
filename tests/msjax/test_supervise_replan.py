"""Re-planning onto fewer devices keeps the loss curve: the planner's layout of the same global batch on the
devices left (more gradient accumulation where the data axis shrinks), restored from a checkpoint onto the new
mesh, gives the same losses (float32, within 1e-5) as the uninterrupted run on the original layout."""

import json

import jax
import numpy as np
import pytest

from msjax.checkpoint import Checkpointer
from msjax.config import apply_overrides
from msjax.data import BatchLoader, prepare_data
from msjax.mesh import make_mesh
from msjax.planner import PlanError
from msjax.supervise.replan import planner_hardware, replan
from msjax.train import run
from msjax.train_step import build_train_program

TOL = 1e-5


def test_replan_layout_and_reports(make_tiny_config, small_corpus, tmp_path):
    cfg = make_tiny_config(tmp_path, small_corpus, **{"mesh.data": 4, "mesh.fsdp": 2, "mesh.tensor": 1,
                                                      "model.vocab_size": 100})
    plan = replan(cfg, 8, 4)
    assert plan.old["data"] * plan.old["fsdp"] == 8 and plan.old["microbatches"] == 1
    new = plan.new
    assert new["devices"] == 4 and new["pipeline"] == 1
    assert new["data"] * new["fsdp"] * new["sequence"] * new["tensor"] == 4
    # the same global batch, microbatches no larger per replica, so accumulation makes up the lost width
    assert new["microbatches"] * new["microbatch_size"] * new["data"] * new["fsdp"] == 8
    assert new["microbatch_size"] <= plan.old["microbatch_size"] and new["microbatches"] == 2
    text = plan.text()
    assert "old: 8 devices" in text and "new: 4 devices" in text and "predicted MFU" in text
    # 3 devices: nothing divides (heads 2, width 32, seq 32, batch 8): a clear error with the reasons
    with pytest.raises(PlanError, match="no layout of train.global_batch=8 fits on 3 devices"):
        replan(cfg, 8, 3)
    assert planner_hardware("", "cpu")[0] == "a100-80g" and "stand-in" in planner_hardware("", "cpu")[1]
    assert planner_hardware("", "NVIDIA H100 80GB HBM3") == ("h100", "")


@pytest.mark.slow
def test_replanned_restart_continues_the_loss_curve(make_tiny_config, small_corpus, tmp_path):
    over = {"mesh.data": 4, "mesh.fsdp": 2, "mesh.tensor": 1, "train.steps": 6, "checkpoint.every": 3,
            "train.log_every": 1, "train.eval_every": 0, "train.sample_tokens": 0, "optimizer.decay_steps": 6}
    cfg = make_tiny_config(tmp_path, small_corpus, **over)
    straight = run(cfg)  # uninterrupted, original layout, 8 devices
    losses = {r["step"]: r["loss"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text()
                                                  .splitlines()) if "loss" in r}
    # the interrupted run: the same schedule (decay_steps fixed), stopped at its checkpoint of step 3
    first = run(make_tiny_config(tmp_path / "cut", small_corpus, **{**over, "train.steps": 3}))
    assert first.checkpoints[-1] == 3

    vocab = straight.state["params"]["wte"].shape[0]
    data = prepare_data(cfg.data)
    plan = replan(apply_overrides(cfg, {"model.vocab_size": data.tokenizer.vocab_size}), 8, 4)
    new_cfg = apply_overrides(cfg, plan.overrides).validate()
    assert new_cfg.train.microbatches == 2
    mesh = make_mesh(new_cfg.mesh, jax.devices()[:4])
    program = build_train_program(new_cfg, mesh, vocab_size=data.tokenizer.vocab_size)
    step, state, loader_state = Checkpointer(cfg.checkpoint, tmp_path / "cut" / "run" / "checkpoints").restore(
        program.abstract_state)
    assert step == 3 and state["params"]["wte"].shape[0] == vocab
    loader = BatchLoader(data.train, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch,
                         seed=cfg.data.seed, sharding=program.batch_sharding, prefetch=0)
    loader.restore(loader_state)
    try:
        for s in range(4, 7):
            state, metrics = program.step_fn(state, next(loader))
            assert abs(float(metrics["loss"]) - losses[s]) < TOL, (s, float(metrics["loss"]), losses[s])
    finally:
        loader.close()
    for x, y in zip(jax.tree.leaves(jax.device_get(straight.state["params"])),
                    jax.tree.leaves(jax.device_get(state["params"]))):
        np.testing.assert_allclose(x, y, atol=TOL, rtol=0)
