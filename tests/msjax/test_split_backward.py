"""The split backward (msjax.parallel.split_backward): B (input and small-parameter gradients, and each weight
matmul's (x, dy)) then W (the weight gradients) equal one `jax.vjp` backward, and do its arithmetic once."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from msjax.config import AttentionConfig, ModelConfig
from msjax.model import REMAT_POLICIES, Block
from msjax.parallel import split_backward as sb

LAYERS = 3
GPT = dict(vocab_size=64, num_layers=LAYERS, d_model=32, num_heads=4, max_seq_len=16)
LLAMA = dict(GPT, position="rope", norm="rmsnorm", mlp="swiglu", use_bias=False, num_kv_heads=2, qk_norm=True)


def _layers(cfg: ModelConfig):
    """LAYERS random blocks: (graphdef, per-layer states)."""
    with nnx.use_eager_sharding(False):
        blocks = [Block(cfg, nnx.Rngs(i)) for i in range(LAYERS)]
    states = [nnx.split(b)[1] for b in blocks]
    # non-zero biases and norm offsets, so their gradients are not the only thing compared
    states = [jax.tree.map(lambda a, k=k: a + 0.1 * jax.random.normal(jax.random.key(k), a.shape, a.dtype), s)
              for k, s in enumerate(states)]
    return nnx.split(blocks[0])[0], states


def _chunk(gd, cfg, sites=None):
    """(layers, x[, taps]) -> y: the layers in a Python loop or a scan over stacked states, each under
    jax.checkpoint with the remat policy, tapped when `sites` is given."""
    policy = REMAT_POLICIES.get(cfg.remat, jax.checkpoint_policies.everything_saveable)

    def layer(state, x, taps=None):
        if sites is None:
            return nnx.merge(gd, state)(x)
        with sb.tapping(sites, state, taps):
            return nnx.merge(gd, state)(x)

    layer = jax.checkpoint(layer, policy=policy)

    def run(layers, x, taps=None):
        if cfg.scan_layers:
            xs = layers if taps is None else (layers, taps)
            body = (lambda x, s: (layer(s, x), None)) if taps is None else (lambda x, st: (layer(*st[:1], x, st[1]),
                                                                                          None))
            return jax.lax.scan(body, x, xs)[0]
        for j, state in enumerate(layers):
            x = layer(state, x) if taps is None else layer(state, x, taps[j])
        return x

    return run


@pytest.mark.parametrize("family", ["gpt", "llama", "parallel"])
@pytest.mark.parametrize("remat", ["none", "dots", "full"])
@pytest.mark.parametrize("scan", [False, True])
def test_b_then_w_equals_one_backward(family, remat, scan):
    cfg = ModelConfig(**{"gpt": GPT, "llama": LLAMA, "parallel": dict(GPT, block="parallel")}[family],
                      remat=remat, scan_layers=scan, attention=AttentionConfig(window=6))
    gd, states = _layers(cfg)
    layers = jax.tree.map(lambda *a: jnp.stack(a), *states) if scan else states
    x = jax.random.normal(jax.random.key(10), (2, 16, 32), jnp.float32)
    dy = jax.random.normal(jax.random.key(11), x.shape, jnp.float32)

    want_y, full = jax.vjp(_chunk(gd, cfg), layers, x)
    want_dlayers, want_dx = full(dy)

    sites = sb.record_sites(lambda s, x: nnx.merge(gd, s)(x), states[0], x)
    # q, k, v read one x; gpt's MLP has one input matmul, llama's two (gate and up) reading one x
    assert len(sites) == (7 if family == "llama" else 6)
    assert [s.x_from for s in sites[:3]] == [None, 0, 0]
    taps = sb.zero_taps(sites, (LAYERS,)) if scan else [sb.zero_taps(sites)] * LAYERS
    y, split = jax.vjp(_chunk(gd, cfg, sites), layers, x, taps)
    d_small, dx, pairs = split(dy)  # B
    np.testing.assert_array_equal(y, want_y)
    np.testing.assert_allclose(dx, want_dx, atol=1e-6, rtol=1e-6)
    weights = {s.param for s in sites}

    def combine(state, d_state, pair):  # W, and B's gradients of everything that is no weight matrix
        w = sb.weight_grads(sites, state, pair, stacked=scan)
        leaves = jax.tree.leaves(d_state)
        assert all(not np.any(leaves[j]) for j in weights)  # B computed no weight gradient
        return jax.tree.unflatten(jax.tree.structure(d_state), [w.get(j, g) for j, g in enumerate(leaves)])

    got = combine(layers, d_small, pairs) if scan else [combine(*a) for a in zip(layers, d_small, pairs)]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want_dlayers)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


def test_b_and_w_do_the_arithmetic_of_one_backward():
    """FLOPs of the compiled B plus the compiled W equal the compiled one-pass backward's within 1% (unrolled
    layers: XLA counts a loop body once); B alone does no weight-gradient matmul."""
    cfg = ModelConfig(**GPT, scan_layers=False, remat="dots")
    gd, states = _layers(cfg)
    x = jax.random.normal(jax.random.key(10), (4, 16, 32), jnp.float32)
    dy = jnp.ones_like(x)
    sites = sb.record_sites(lambda s, x: nnx.merge(gd, s)(x), states[0], x)
    taps = [sb.zero_taps(sites)] * LAYERS

    def flops(f, *args):
        return jax.jit(f).lower(*args).compile().cost_analysis()["flops"]

    def one(layers, x, dy):
        return jax.vjp(_chunk(gd, cfg), layers, x)[1](dy)

    def b(layers, x, dy):
        return jax.vjp(_chunk(gd, cfg, sites), layers, x, taps)[1](dy)

    pairs = jax.jit(b)(states, x, dy)[2]

    def w(layers, pairs):
        return [sb.weight_grads(sites, s, p, stacked=False) for s, p in zip(layers, pairs)]

    def forward(layers, x):
        return _chunk(gd, cfg)(layers, x)

    fwd = flops(forward, states, x)
    full, split_b, split_w = flops(one, states, x, dy), flops(b, states, x, dy), flops(w, states, pairs)
    weight = sum(2 * np.prod(s.x.shape[:-1]) * np.prod(s.y.shape[2:]) * s.x.shape[-1] for s in sites) * LAYERS
    assert split_w == pytest.approx(weight, rel=0.01)  # W: one matmul per weight, nothing else
    assert split_b + split_w == pytest.approx(full, rel=0.01), (split_b, split_w, full, fwd)
