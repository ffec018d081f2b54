"""Parallel equivalence: the same short deterministic run on 1 device and on data x fsdp x sequence x tensor
meshes of 8 fake CPU devices gives the same losses and gradients within 1e-5 (float32).

Compared: the loss of each of STEPS optimizer steps (each depends on every earlier update), the global gradient
norm of each step, and the full gradient pytree at initialisation. Parameters after Adam steps are not compared
element-wise: Adam divides by sqrt(v), so a parameter whose gradient is ~0 turns float32 rounding into
lr-sized differences without any layout being wrong."""

import jax
import numpy as np
import optax
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
        "train.steps": 10, "optimizer.warmup_steps": 2,
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
    return np.array(losses), np.array(norms), jax.device_get(grads), program, state


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, VOCAB, (8, 33)).astype(np.int32)


@pytest.fixture(scope="module")
def single(tokens):
    cfg = tiny_config(**{"mesh.data": 1})
    return run_layout(cfg, 1, tokens)


def _assert_same(a, b):
    (la, na, ga), (lb, nb, gb) = a[:3], b[:3]
    np.testing.assert_allclose(lb, la, atol=TOL, rtol=0)
    np.testing.assert_allclose(nb, na, atol=TOL, rtol=0)
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        np.testing.assert_allclose(y, x, atol=TOL, rtol=0)


@pytest.mark.parametrize("mesh", [
    dict(data=2, fsdp=2, tensor=2), dict(data=8), dict(tensor=8), dict(fsdp=8), dict(data=2, sequence=2, tensor=2),
])
def test_layouts_match_single_device(single, tokens, mesh):
    cfg = tiny_config(**{f"mesh.{k}": v for k, v in {"data": 1, **mesh}.items()})
    _assert_same(single, run_layout(cfg, 8, tokens))
    assert single[0][-1] < single[0][0]  # the run really trains


@pytest.mark.parametrize("rules", ["dp", "fsdp", "tp", "fsdp_tp"])
def test_rule_sets_match_single_device(single, tokens, rules):
    cfg = tiny_config(**{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "mesh.rules": rules})
    _assert_same(single, run_layout(cfg, 8, tokens))


def test_gradient_accumulation_matches_one_big_batch(single, tokens):
    cfg = tiny_config(**{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "train.microbatches": 2})
    losses, norms, *_ = run_layout(cfg, 8, tokens)
    np.testing.assert_allclose(losses, single[0], atol=TOL, rtol=0)
    np.testing.assert_allclose(norms, single[1], atol=TOL, rtol=0)


def test_fsdp_shards_parameters_and_optimizer_state(tokens):
    cfg = tiny_config(**{"mesh.data": 1, "mesh.fsdp": 4, "mesh.tensor": 2})
    *_, program, state = run_layout(cfg, 8, tokens)
    w_in = state["params"]["blocks"]["mlp"]["w_in"]  # (layers, embed, mlp)
    assert w_in.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    assert w_in.addressable_shards[0].data.shape == (2, 64 // 4, 128 // 2)
    # Adam's moments by name: the chain is wrapped in apply_if_finite, so their position in the state moves
    mu, nu = (optax.tree_utils.tree_get(state["opt_state"], name) for name in ("mu", "nu"))
    assert mu["blocks"]["mlp"]["w_in"].sharding.spec == w_in.sharding.spec
    assert nu["blocks"]["attn"]["wq"].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)


def test_batch_split_errors():
    cfg = tiny_config(**{"mesh.data": 8, "train.global_batch": 12})
    with pytest.raises(ConfigError, match="microbatch of 12 sequences .* does not split over data x fsdp = 8"):
        build_train_program(cfg, make_mesh(cfg.mesh), VOCAB)
