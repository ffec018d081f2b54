"""Parallel equivalence, shared by test_parallel, test_overlap and test_pipeline: one tiny config, one short
deterministic run per layout, one comparison.

Compared: the loss of each of STEPS optimizer steps (each depends on every earlier update), the global gradient
norm of each step (computed outside any shard_map, as clipping and LAMB see it), and the full gradient pytree at
initialisation, float32, within TOL. Parameters after Adam steps are not compared element-wise: Adam divides by
sqrt(v), so a parameter whose gradient is ~0 turns float32 rounding into lr-sized differences without any layout
being wrong. Single-device references are computed once per session (`layout_reference` in conftest.py), keyed
by their config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from msjax.config import Config, apply_overrides
from msjax.mesh import make_mesh
from msjax.train_step import TrainProgram, build_train_program

TOL = 1e-5
STEPS = 3
VOCAB = 100

BASE = {
    "model.num_layers": 2, "model.d_model": 64, "model.num_heads": 8, "model.d_ff": 128,
    "model.max_seq_len": 32, "model.attention.window": 12, "train.seq_len": 32, "train.global_batch": 8,
    "train.steps": 10, "optimizer.warmup_steps": 2, "mesh.data": 1,
}

# A Llama-style model on BASE: RoPE, RMSNorm, SwiGLU (d_ff 96, three matrices), no biases, untied output projection,
# 16 query heads of 4 sharing 8 key/value heads (8: the tensor=8 layout splits them). With BASE's window of 12 of 32
# RoPE meets the sliding window, and under context parallelism each sequence shard's own positions.
LLAMA = {"model.position": "rope", "model.rope_base": 500.0, "model.norm": "rmsnorm", "model.mlp": "swiglu",
         "model.use_bias": False, "model.tie_embeddings": False, "model.num_heads": 16, "model.num_kv_heads": 8,
         "model.d_ff": 96}


def tiny_config(**overrides) -> Config:
    """BASE with dotted `overrides`, validated."""
    return apply_overrides(Config(), {**BASE, **overrides}).validate()


def random_tokens() -> np.ndarray:
    """(8, 33) int32 tokens in [0, VOCAB): inputs are [:, :-1], targets [:, 1:]."""
    return np.random.default_rng(0).integers(0, VOCAB, (8, 33)).astype(np.int32)


@dataclass
class LayoutRun:
    losses: np.ndarray  # (STEPS,)
    norms: np.ndarray  # (STEPS,) global gradient norms
    grads: Any  # gradient pytree at initialisation, on the host
    program: TrainProgram
    state: Any  # train state after STEPS steps
    first_metrics: dict  # the first step's metrics, on the host


def run_layout(cfg: Config, tokens: np.ndarray, n_devices: int | None = None) -> LayoutRun:
    """STEPS steps of `cfg` on the first `n_devices` devices (default: the mesh's size) on one fixed batch."""
    n_devices = n_devices or int(np.prod(list(cfg.mesh.axis_sizes().values())))
    program = build_train_program(cfg, make_mesh(cfg.mesh, jax.devices()[:n_devices]), vocab_size=VOCAB)
    state = program.init_fn(jax.random.key(0))
    batch = {"inputs": jax.device_put(tokens[:, :-1], program.batch_sharding),
             "targets": jax.device_put(tokens[:, 1:], program.batch_sharding)}
    _, grads = program.grad_fn(state["params"], batch)
    losses, norms, first = [], [], None
    for _ in range(STEPS):
        state, metrics = program.step_fn(state, batch)
        first = first or jax.device_get(metrics)
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    return LayoutRun(np.array(losses), np.array(norms), jax.device_get(grads), program, state, first)


def assert_same(want: LayoutRun, got: LayoutRun) -> None:
    """Losses, gradient norms and initial gradients within TOL, and the reference really trains."""
    np.testing.assert_allclose(got.losses, want.losses, atol=TOL, rtol=0)
    np.testing.assert_allclose(got.norms, want.norms, atol=TOL, rtol=0)
    assert jax.tree.structure(got.grads) == jax.tree.structure(want.grads)
    for x, y in zip(jax.tree.leaves(want.grads), jax.tree.leaves(got.grads)):
        np.testing.assert_allclose(y, x, atol=TOL, rtol=0)
    assert want.losses[-1] < want.losses[0]
