"""The Pallas kernel wired into training: a tiny run with impl=pallas (interpret mode on CPU) matches impl=xla,
on one device and sharded over data x tensor (the kernel then runs per shard under shard_map)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from msjax.config import Config, apply_overrides
from msjax.mesh import make_mesh
from msjax.ops.attention import resolve_impl
from msjax.train_step import build_train_program

TOL = 1e-5  # float32 losses; the kernel matches the reference to ~5e-7 (tests/pallas_kernels)
VOCAB, STEPS = 64, 3


def _losses(impl: str, mesh: dict, n_devices: int, tokens: np.ndarray) -> np.ndarray:
    cfg = apply_overrides(Config(), {
        "model.num_layers": 2, "model.d_model": 32, "model.num_heads": 2, "model.max_seq_len": 24,
        "model.attention.window": 8, "model.attention.impl": impl, "model.vocab_multiple": 64,
        "train.seq_len": 24, "train.global_batch": 4, "train.steps": 10, "optimizer.warmup_steps": 1,
        **{f"mesh.{k}": v for k, v in mesh.items()},
    }).validate()
    program = build_train_program(cfg, make_mesh(cfg.mesh, jax.devices()[:n_devices]), vocab_size=VOCAB)
    state = program.init_fn(jax.random.key(0))
    batch = {"inputs": jax.device_put(tokens[:, :-1], program.batch_sharding),
             "targets": jax.device_put(tokens[:, 1:], program.batch_sharding)}
    losses = []
    for _ in range(STEPS):
        state, metrics = program.step_fn(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses)


@pytest.mark.parametrize("mesh, n", [(dict(data=1), 1), (dict(data=2, tensor=2), 4)])
def test_pallas_training_matches_xla(mesh, n):
    tokens = np.random.default_rng(0).integers(0, VOCAB, (4, 25)).astype(np.int32)
    xla = _losses("xla", {"data": 1}, 1, tokens)
    pallas = _losses("pallas", mesh, n, tokens)
    np.testing.assert_allclose(pallas, xla, atol=TOL, rtol=0)
    assert xla[-1] < xla[0]


def test_auto_picks_per_backend():
    assert resolve_impl("auto", backend="cpu") == "xla"
    assert resolve_impl("auto", np.float32, backend="gpu") == "xla"
    assert resolve_impl("auto", jnp.bfloat16, backend="gpu") == "cudnn"
    assert resolve_impl("auto", backend="tpu") == "pallas"
    with pytest.raises(ValueError, match="model.attention.impl='flash'; allowed: auto, xla, pallas, cudnn"):
        resolve_impl("flash")
