"""msjax.flops against the matmuls of the traced programs: every dot_general of the model's forward pass (and of
the forward + backward pass) is counted from the jaxpr, scan bodies times their trip count, and compared exactly
with the formula, for GPT-2 and Llama-style blocks (SwiGLU's third matrix, RoPE, RMSNorm, untied head)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from msjax.config import AttentionConfig, ModelConfig
from msjax.flops import flops_per_token, matmul_params, mean_attended_keys
from msjax.model import abstract_model, apply, init_params


def dot_flops(jaxpr) -> int:
    """2 x (output elements) x (contracted size) summed over every dot_general in `jaxpr` and the jaxprs inside it
    (jit, remat, custom_vjp/jvp, cond branches: once; scan bodies: times `length`)."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)
        times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    total += times * dot_flops(inner)
    return total


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
    forward = dot_flops(jax.make_jaxpr(lambda p: apply(graphdef, p, tokens))(params).jaxpr)
    assert forward == per_token / 3 * b * t
    n_swiglu = cfg.num_layers * cfg.d_model * cfg.ff_size if cfg.mlp == "swiglu" else 0
    assert matmul_params(cfg) == (sum(x.size for x in jax.tree.leaves(params)) - _not_in_matmuls(cfg, params))
    assert n_swiglu == 0 or matmul_params(cfg) - matmul_params(dataclasses.replace(cfg, mlp="gelu")) == n_swiglu

    def loss(p):
        return apply(graphdef, p, tokens).astype(jnp.float32).sum()

    both = dot_flops(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)
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
