"""msjax.flops: `executed_matmul_flops` on programs whose matmul FLOPs are known by hand (loops counted by their
trip counts, conditions by the branch taken, shard_map bodies once per member with their own axis index, and a
loop-free program against XLA's own cost analysis); then the model's FLOP formula against that count of the traced
forward and forward + backward programs, for GPT-2 and Llama-style blocks (SwiGLU's third matrix, RoPE, RMSNorm,
untied head)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from msjax.config import AttentionConfig, ModelConfig
from msjax.flops import executed_matmul_flops, flops_per_token, matmul_params, mean_attended_keys
from msjax.model import abstract_model, apply, init_params

B, D = 4, 8
MATMUL = 2 * B * D * D  # (B, D) @ (D, D): 2 FLOPs per multiply-add


def _w(seed: int) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (D, D))


def test_loop_free_program_matches_xla_cost_analysis():
    x, w1, w2 = jnp.ones((B, D)), _w(0), jax.random.normal(jax.random.key(1), (D, 3 * D))

    def f(x, w1, w2):
        return jnp.tanh(x @ w1) @ w2

    want = MATMUL + 2 * B * D * 3 * D
    assert executed_matmul_flops(f, x, w1, w2) == want
    assert jax.jit(f).lower(x, w1, w2).compile().cost_analysis()["flops"] >= want  # XLA adds the tanh's


def test_scan_counts_every_iteration_and_cond_the_branch_taken():
    x, w = jnp.ones((B, D)), _w(0)

    def f(x, w):
        def body(c, i):
            c = jax.lax.cond(i % 3 == 0, lambda c: (c @ w) @ w, lambda c: c, c)  # i = 0, 3, 6: 2 matmuls
            return c @ w, None

        c, _ = jax.lax.scan(body, x, jnp.arange(7))
        return jax.lax.fori_loop(0, 5, lambda i, c: c @ w, c)  # static bounds: a scan of 5

    assert executed_matmul_flops(f, x, w) == (7 + 3 * 2 + 5) * MATMUL
    # XLA counts a loop body once: what this count exists to fix
    assert jax.jit(f).lower(x, w).compile().cost_analysis()["flops"] < (7 + 3 * 2 + 5) * MATMUL


def test_while_loop_counts_its_trips_and_refuses_data_dependent_ones():
    x, w = jnp.ones((B, D)), _w(0)

    def counted(x, w):
        return jax.lax.while_loop(lambda c: c[0] < 4, lambda c: (c[0] + 1, c[1] @ w), (0, x))[1]

    assert executed_matmul_flops(counted, x, w) == 4 * MATMUL

    def data_dependent(x, w):
        return jax.lax.while_loop(lambda c: c.sum() < 1e6, lambda c: c @ w, x)

    with pytest.raises(ValueError, match="while loop whose trip count depends on data"):
        executed_matmul_flops(data_dependent, x, w)
    with pytest.raises(ValueError, match="cond whose branch index depends on data"):
        executed_matmul_flops(lambda x, w: jax.lax.cond(x.sum() > 0, lambda: x @ w, lambda: x), x, w)


def test_shard_map_counts_each_member_with_its_own_axis_index():
    mesh = jax.make_mesh((2, 2), ("pipe", "other"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:4])
    x, w = jnp.ones((B, D)), _w(0)

    def stage(x, w):
        me = jax.lax.axis_index("pipe")

        def body(c, i):  # member 0 multiplies twice at ticks 0 and 2, member 1 at ticks 1 and 3
            c = jax.lax.cond((i + me) % 2 == 0, lambda c: c @ w @ w, lambda c: c, c)
            return c, None

        return jax.lax.scan(body, x, jnp.arange(4))[0]

    def f(x, w):
        return jax.shard_map(stage, mesh=mesh, in_specs=(P(), P()), out_specs=P("pipe"), axis_names={"pipe"},
                             check_vma=False)(x, w)

    # only the manual axis multiplies the count: `other` is left to the compiler (shapes global over it)
    assert executed_matmul_flops(f, x, w) == 2 * (2 * 2) * MATMUL


def test_gradients_and_checkpoint_recompute_are_counted():
    x, w = jnp.ones((B, D)), _w(0)

    def loss(remat):
        layer = (lambda w, x: jnp.tanh(x @ w))
        if remat:
            layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)
        return jax.grad(lambda w, x: layer(w, layer(w, x)).sum())

    # forward 2 matmuls; backward: both weight gradients and the second layer's input gradient (the first
    # layer's input is not differentiated); full remat reruns each layer's forward in its backward
    assert executed_matmul_flops(loss(False), w, x) == (2 + 3) * MATMUL
    assert executed_matmul_flops(loss(True), w, x) == (2 + 3 + 2) * MATMUL


def test_model_count_matches_the_formula_for_a_dense_model():
    # the single-device gradient of a tiny GPT against msjax.flops' 6 N + attention formula (no window, xla
    # attention: the count sees every masked score, so compare with k_bar = T, Megatron's convention), plus the
    # one matmul the formula leaves out: msjax.ops.softmax's backward takes its row sum sum_s(g y) as a
    # contraction, 2 B H T T per layer (B = 2 sequences, H = 4 heads, T = 16)
    from msjax.config import Config, apply_overrides
    from msjax.model import abstract_model, apply

    cfg = apply_overrides(Config(), {"model.num_layers": 2, "model.d_model": 32, "model.num_heads": 4,
                                     "model.d_ff": 64, "model.max_seq_len": 16, "model.vocab_size": 128,
                                     "model.attention.impl": "xla", "train.seq_len": 16}).validate()
    graphdef, params, _ = abstract_model(cfg.model)
    tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)

    def loss(p, t):
        return apply(graphdef, p, t).mean()

    counted = executed_matmul_flops(jax.grad(loss), params, tokens)
    softmax_rows = 2 * 2 * (2 * 4 * 16 * 16)
    assert counted == pytest.approx(2 * 16 * flops_per_token(cfg.model, 16, megatron_convention=True)
                                    + softmax_rows, rel=1e-12)
    assert np.isfinite(counted)


GPT = dict()
LLAMA = dict(position="rope", norm="rmsnorm", mlp="swiglu", use_bias=False, tie_embeddings=False, num_kv_heads=2)


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=50, vocab_multiple=64, num_layers=3, d_model=32, num_heads=4, d_ff=48, max_seq_len=16)
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("kw", [GPT, LLAMA, dict(LLAMA, block="parallel", tie_embeddings=True, scan_layers=False),
                                dict(GPT, num_kv_heads=1, head_dim=6)], ids=["gpt", "llama", "llama-parallel-tied",
                                                                             "gpt-mqa-k6"])
def test_formula_counts_the_traced_matmuls(kw):
    cfg = _cfg(**kw)
    b, t = 2, 16
    graphdef, _, _ = abstract_model(cfg)
    params = init_params(cfg, jax.random.key(0))
    tokens = jnp.zeros((b, t), jnp.int32)
    # The traced attention computes the whole T x T score matrix (masked): Megatron's k_bar = T convention.
    per_token = flops_per_token(cfg, t, megatron_convention=True)
    forward = executed_matmul_flops(lambda p: apply(graphdef, p, tokens), params)
    assert forward == per_token / 3 * b * t
    n_swiglu = cfg.num_layers * cfg.d_model * cfg.ff_size if cfg.mlp == "swiglu" else 0
    assert matmul_params(cfg) == (sum(x.size for x in jax.tree.leaves(params)) - _not_in_matmuls(cfg, params))
    assert n_swiglu == 0 or matmul_params(cfg) - matmul_params(dataclasses.replace(cfg, mlp="gelu")) == n_swiglu

    def loss(p):
        return apply(graphdef, p, tokens).astype(jnp.float32).sum()

    both = executed_matmul_flops(jax.grad(loss), params)
    # Backward = 2 x forward for every matmul, plus one contraction the model's softmax backward adds per score
    # row (msjax/ops/softmax.py: sum_s g * y written as a dot; 2 x B x H x T x T per layer), which the MFU
    # formula does not count (element-wise work).
    softmax_rows = 2 * b * cfg.num_heads * t * t * cfg.num_layers
    assert both == per_token * b * t + softmax_rows


def _not_in_matmuls(cfg, params) -> int:
    """Parameters outside N: norms, biases, position table, and the input embedding when it is untied."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    out = 0
    for path, x in leaves:
        name = path[-1].key
        if name in ("scale", "bias") or name.startswith("b") or name == "wpe":
            out += x.size
        if name == "wte" and not cfg.tie_embeddings:
            out += x.size
    return out


@pytest.mark.parametrize("t, w", [(1, None), (7, None), (16, 1), (16, 5), (16, 16), (16, 40), (9, 4)])
def test_mean_attended_keys_counts_the_causal_window_mask(t, w):
    i, j = np.arange(t)[:, None], np.arange(t)[None]
    mask = (j <= i) & ((j > i - w) if w else True)
    assert mean_attended_keys(t, w) == pytest.approx(mask.sum() / t, rel=1e-12)
    assert mean_attended_keys(t, w, megatron_convention=True) == (t if w is None else min(w, t))


def test_window_lowers_only_the_attention_term():
    cfg = _cfg(**LLAMA)
    windowed = dataclasses.replace(cfg, attention=AttentionConfig(window=4))
    full, local = flops_per_token(cfg, 16), flops_per_token(windowed, 16)

    def attn(c):
        return 12 * c.num_layers * c.num_heads * c.head_size * mean_attended_keys(16, c.attention.window)

    assert full - attn(cfg) == local - attn(windowed) == 6 * matmul_params(cfg)
