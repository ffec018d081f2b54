"""The model against an independent NumPy forward pass (GPT-2 and Llama-style blocks), plus causality, window,
remat/scan invariance, and decoding with a KV cache against the full forward pass."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from msjax.config import AttentionConfig, ModelConfig
from msjax.model import abstract_model, apply, init_params
from msjax.ops.attention import attention

TOL = 2e-5  # float32, relative to logits of order 1


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=50, vocab_multiple=64, num_layers=2, d_model=32, num_heads=4, max_seq_len=16)
    base.update(kw)
    return ModelConfig(**base)


def _ln(x, p, eps, kind="layernorm"):
    if kind == "rmsnorm":
        assert "bias" not in p  # RMSNorm has no offset
        return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * p["scale"]
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    y = (x - mu) / np.sqrt(var + eps) * p["scale"]
    return y + p["bias"] if p.get("bias") is not None else y


def _rope(x, base):
    """Rotary embedding as complex multiplication: pair i = x[i] + 1j x[i + K/2] times exp(1j p base^(-2i/K))."""
    t, k = x.shape[1], x.shape[-1]
    z = x[..., : k // 2] + 1j * x[..., k // 2:]
    theta = np.arange(t)[:, None] * base ** (-np.arange(0, k, 2) / k)  # (T, K/2)
    z = z * np.exp(1j * theta)[None, :, None, :]
    return np.concatenate([z.real, z.imag], axis=-1)


def _gelu(x):  # tanh approximation, as jax.nn.gelu(approximate=True)
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def numpy_gpt(cfg: ModelConfig, params: dict, tokens: np.ndarray) -> np.ndarray:
    """Straight-line float64 GPT forward from the parameter dict: the reference."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    b, t = tokens.shape
    x = p["wte"][tokens] + (p["wpe"][:t] if cfg.position == "learned" else 0.0)
    ln = lambda u, q: _ln(u, q, cfg.norm_eps, cfg.norm)  # noqa: E731
    bias = (lambda q, name: q[name]) if cfg.use_bias else (lambda q, name: 0.0)  # noqa: E731
    h, g, k = cfg.num_heads, cfg.kv_heads, cfg.head_size
    w = cfg.attention.window or t
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    allowed = (j <= i) & (j > i - w)
    for layer in range(cfg.num_layers):
        lp = jax.tree.map(lambda a: a[layer], p["blocks"]) if "blocks" in p else p["layers"][layer]

        def attn(u):
            a = lp["attn"]
            q = np.einsum("btd,dhk->bthk", u, a["wq"]) + bias(a, "bq")
            kk = np.einsum("btd,dgk->btgk", u, a["wk"]) + bias(a, "bk")
            v = np.einsum("btd,dgk->btgk", u, a["wv"]) + bias(a, "bv")
            if cfg.position == "rope":
                q, kk = _rope(q, cfg.rope_base), _rope(kk, cfg.rope_base)
            kk, v = np.repeat(kk, h // g, axis=2), np.repeat(v, h // g, axis=2)
            s = np.einsum("bthk,bshk->bhts", q, kk) / np.sqrt(k)
            s = np.where(allowed, s, -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            o = np.einsum("bhts,bshk->bthk", w, v)
            return np.einsum("bthk,hkd->btd", o, a["wo"]) + bias(a, "bo")

        def mlp(u):
            m = lp["mlp"]
            if cfg.mlp == "swiglu":
                gate = u @ m["w_gate"] + bias(m, "b_gate")
                hid = gate / (1 + np.exp(-gate)) * (u @ m["w_in"] + bias(m, "b_in"))
            else:
                hid = _gelu(u @ m["w_in"] + bias(m, "b_in"))
            return hid @ m["w_out"] + bias(m, "b_out")

        if cfg.block == "parallel":
            u = ln(x, lp["ln1"])
            x = x + attn(u) + mlp(u)
        else:
            x = x + attn(ln(x, lp["ln1"]))
            x = x + mlp(ln(x, lp["ln2"]))
    x = ln(x, p["ln_f"])
    logits = x @ (p["wte"].T if cfg.tie_embeddings else p["lm_head"])
    logits[..., cfg.vocab_size:] = -1e9
    return logits


LLAMA = dict(position="rope", norm="rmsnorm", mlp="swiglu", use_bias=False, tie_embeddings=False, num_kv_heads=2,
             d_ff=40, rope_base=500.0)


def _random_params(cfg, seed=0):
    # Biases and norms are zeros/ones at init; randomise every leaf so the reference checks them too.
    params = init_params(cfg, jax.random.key(seed))
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    leaves = [l + 0.05 * jax.random.normal(k, l.shape) for l, k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, leaves)


def unstack(params: dict) -> dict:
    """Stacked (scanned) parameters -> the per-layer layout of scan_layers=False."""
    out = {k: v for k, v in params.items() if k != "blocks"}
    n = jax.tree.leaves(params["blocks"])[0].shape[0]
    out["layers"] = {i: jax.tree.map(lambda a: a[i], params["blocks"]) for i in range(n)}
    return out


@pytest.mark.parametrize("kw", [
    dict(),
    dict(scan_layers=False, remat="full"),
    dict(block="parallel"),
    dict(attention=AttentionConfig(window=3)),
    dict(num_kv_heads=2, tie_embeddings=False),
    dict(num_kv_heads=1, block="parallel", attention=AttentionConfig(window=1)),
    LLAMA,
    dict(LLAMA, scan_layers=False, use_bias=True, attention=AttentionConfig(window=5)),
    dict(LLAMA, block="parallel", tie_embeddings=True, num_kv_heads=1, head_dim=6),
    dict(position="rope", norm="layernorm", mlp="gelu"),
    dict(position="learned", norm="rmsnorm", mlp="swiglu", use_bias=True),
], ids=["gpt", "unscanned-remat", "parallel", "window", "gqa-untied", "mqa-parallel-w1", "llama",
        "llama-unscanned-bias-window", "llama-parallel-tied-mqa-k6", "rope-layernorm-gelu",
        "learned-rmsnorm-swiglu-bias"])
def test_forward_matches_numpy_reference(kw):
    cfg = tiny(**kw)
    graphdef, _, _ = abstract_model(cfg)
    params = _random_params(cfg)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12)).astype(np.int32)
    got = np.asarray(jax.jit(apply, static_argnums=0)(graphdef, params, tokens))
    want = numpy_gpt(cfg, params, tokens)
    np.testing.assert_allclose(got[..., :cfg.vocab_size], want[..., :cfg.vocab_size], atol=TOL, rtol=TOL)
    assert (got[..., cfg.vocab_size:] == -1e9).all()


def test_parameters_carry_logical_axis_names():
    _, abs_params, specs = abstract_model(tiny(tie_embeddings=False))
    assert tuple(specs["wte"]) == ("vocab", "embed")
    assert tuple(specs["lm_head"]) == ("embed", "vocab")
    assert tuple(specs["blocks"]["attn"]["wq"]) == ("layers", "embed", "heads", "head_dim")
    assert tuple(specs["blocks"]["mlp"]["w_in"]) == ("layers", "embed", "mlp")
    assert tuple(specs["blocks"]["ln1"]["scale"]) == ("layers", "norm")
    assert abs_params["blocks"]["attn"]["wq"].shape == (2, 32, 4, 8)
    assert jax.tree.structure(abs_params) == jax.tree.structure(
        jax.tree.map(lambda s: 0, specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)))


@pytest.mark.parametrize("window", [None, 4])
def test_attention_dispatch_matches_masked_softmax(window):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 10, 4, 8)).astype(np.float32)
    k = rng.standard_normal((2, 10, 2, 8)).astype(np.float32)
    v = rng.standard_normal((2, 10, 2, 8)).astype(np.float32)
    got = np.asarray(attention(q, k, v, window=window, impl="xla"))
    kk, vv = np.repeat(k, 2, axis=2), np.repeat(v, 2, axis=2)
    s = np.einsum("bthk,bshk->bhts", q, kk) / np.sqrt(8)
    i, j = np.arange(10)[:, None], np.arange(10)[None, :]
    s = np.where((j <= i) & (j > i - (window or 10)), s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bhts,bshk->bthk", a / a.sum(-1, keepdims=True), vv)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="window=0"):
        attention(q, k, v, window=0, impl="xla")


def test_causal_and_windowed_receptive_field():
    # One layer with window W: the token at position j influences exactly positions j .. j + W - 1.
    cfg, w, j = tiny(num_layers=1, attention=AttentionConfig(window=3)), 3, 5
    graphdef, _, _ = abstract_model(cfg)
    params = _random_params(cfg)
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (1, 12)).astype(np.int32)
    changed = tokens.copy()
    changed[0, j] = (tokens[0, j] + 1) % cfg.vocab_size
    diff = np.abs(np.asarray(apply(graphdef, params, tokens) - apply(graphdef, params, changed))).max(-1)[0]
    assert (diff[:j] == 0).all() and (diff[j + w:] == 0).all()
    assert (diff[j:j + w] > 1e-6).all()


def _loss_and_grads(cfg, params, tokens):
    graphdef, _, _ = abstract_model(cfg)

    def loss(p):
        logits = apply(graphdef, p, tokens[:, :-1])
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1).mean()

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("change", [dict(remat="full"), dict(remat="dots"), dict(remat="dots_no_batch"),
                                    dict(scan_layers=False), dict(scan_layers=False, remat="dots"),
                                    dict(scan_unroll=2), dict(scan_unroll=2, remat="dots")])
def test_remat_and_unscanned_layers_change_nothing(change):
    cfg = tiny()
    params = _random_params(cfg)
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 13)).astype(np.int32)
    l0, g0 = _loss_and_grads(cfg, params, tokens)
    if change.get("scan_layers") is False:
        params, g0 = unstack(params), unstack(g0)
    l1, g1 = _loss_and_grads(dataclasses.replace(cfg, **change), params, tokens)
    assert jax.tree.structure(g0) == jax.tree.structure(g1)
    np.testing.assert_allclose(l0, l1, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("unroll, loops", [(1, 1), (2, 0), (5, 0)])
def test_an_unrolled_scan_is_straight_line_code_over_stacked_parameters(unroll, loops):
    """scan_unroll >= num_layers leaves no loop in the compiled forward and backward, and the parameters (and
    their gradients) stay stacked: one array per kind of parameter. A rolled scan compiles to a while loop each
    way (the backward's loop is fused into the forward's by no pass, so one rolled scan shows at least one)."""
    cfg = tiny(scan_unroll=unroll)
    params = _random_params(cfg)
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 13)).astype(np.int32)
    graphdef, _, _ = abstract_model(cfg)

    def loss(p):
        logits = apply(graphdef, p, tokens[:, :-1])
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1).mean()

    hlo = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
    whiles = hlo.count(" while(")
    assert (whiles == 0) if loops == 0 else (whiles >= loops), whiles
    grads = jax.jit(jax.grad(loss))(params)
    assert all(g.shape[0] == cfg.num_layers for g in jax.tree.leaves(grads["blocks"]))


def test_bfloat16_compute_tracks_float32():
    cfg = tiny()
    params = _random_params(cfg)
    tokens = np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 13)).astype(np.int32)
    l32, _ = _loss_and_grads(cfg, params, tokens)
    l16, g16 = _loss_and_grads(dataclasses.replace(cfg, dtype="bfloat16"), params, tokens)
    assert abs(float(l16) - float(l32)) < 0.02 * float(l32)  # bf16 has ~3 significant digits
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(g16))  # parameters stay float32


def test_bfloat16_matmuls_under_float32_activations_track_float32():
    """model.matmul_dtype=bfloat16: the loss and the gradient within bf16's operand rounding of float32's (unit
    roundoff 2^-9, a few matmuls deep: measured 0.5% for the whole gradient), every gradient float32, and not
    the float32 computation itself."""
    cfg = tiny()
    params = _random_params(cfg)
    tokens = np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 13)).astype(np.int32)
    l32, g32 = _loss_and_grads(cfg, params, tokens)
    lmx, gmx = _loss_and_grads(dataclasses.replace(cfg, matmul_dtype="bfloat16"), params, tokens)
    assert 0 < abs(float(lmx) - float(l32)) < 0.01 * float(l32)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(gmx))
    flat = lambda g: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])  # noqa: E731
    assert np.linalg.norm(flat(gmx) - flat(g32)) < 0.02 * np.linalg.norm(flat(g32))
    # Leaf by leaf, except those whose exact gradient is zero (the key bias: softmax ignores a constant added to
    # every key's score), where both sides are rounding noise (1e-10 here, 1e-7 on an H100) of no scale.
    scale = float(np.abs(flat(g32)).max())
    for a, b in zip(jax.tree.leaves(gmx), jax.tree.leaves(g32)):
        if np.abs(b).max() > 1e-4 * scale:
            np.testing.assert_allclose(a, b, atol=0.05 * float(np.abs(b).max()))


def test_sequence_longer_than_positions_is_an_error():
    cfg = tiny()
    graphdef, _, _ = abstract_model(cfg)
    with pytest.raises(ValueError, match="longer than the model's positions"):
        apply(graphdef, init_params(cfg, jax.random.key(0)), np.zeros((1, 17), np.int32))


def test_llama_parameters_and_zero_vocabulary_padding():
    cfg = tiny(**LLAMA)
    _, abs_params, specs = abstract_model(cfg)
    assert "wpe" not in abs_params  # RoPE: no position table
    assert set(abs_params["blocks"]["mlp"]) == {"w_gate", "w_in", "w_out"}
    assert tuple(specs["blocks"]["mlp"]["w_gate"]) == ("layers", "embed", "mlp")
    assert set(abs_params["blocks"]["ln1"]) == {"scale"} and set(abs_params["ln_f"]) == {"scale"}
    assert abs_params["blocks"]["attn"]["wk"].shape == (2, 32, 2, 8)  # grouped-query: 2 key/value heads
    assert tuple(specs["lm_head"]) == ("embed", "vocab")
    # LayerNorm with biases off has no offset either; RMSNorm never has one, even with biases on
    assert set(abstract_model(tiny(use_bias=False))[1]["ln_f"]) == {"scale"}
    assert set(abstract_model(tiny(norm="rmsnorm"))[1]["ln_f"]) == {"scale"}
    params = init_params(cfg, jax.random.key(0))
    v = cfg.vocab_size
    assert (np.asarray(params["wte"][v:]) == 0).all() and (np.asarray(params["lm_head"][:, v:]) == 0).all()
    assert np.abs(np.asarray(params["wte"][:v])).min(axis=1).max() > 0  # the real rows are random


@pytest.mark.parametrize("kw", [dict(), dict(attention=AttentionConfig(window=4)), LLAMA,
                                dict(LLAMA, scan_layers=False, block="parallel", attention=AttentionConfig(window=3)),
                                dict(scan_unroll=2)],
                         ids=["gpt", "gpt-window4", "llama", "llama-unscanned-parallel-window3", "gpt-unrolled"])
def test_decode_with_kv_cache_matches_full_forward(kw):
    """A batch of prompts of different lengths, prefilled together (right-padded), then decoded one token at a
    time: every real position's logits equal the full forward pass over the row's whole sequence. With a window
    the cache is a ring of W slots (smaller than the sequence)."""
    from msjax.model import apply_decode, cache_slots, init_cache

    cfg = tiny(**kw)
    graphdef, _, _ = abstract_model(cfg)
    params = _random_params(cfg)
    rng = np.random.default_rng(5)
    total, lengths = 14, np.array([5, 2, 7], np.int32)
    seqs = rng.integers(0, cfg.vocab_size, (3, total)).astype(np.int32)
    want = np.asarray(apply(graphdef, params, seqs))  # (B, total, V)
    cache = init_cache(cfg, 3, total)
    assert cache.slots == cache_slots(cfg, total) == min(cfg.attention.window or total, total)
    decode = jax.jit(apply_decode, static_argnums=0)
    prompt = np.where(np.arange(7)[None] < lengths[:, None], seqs[:, :7], 0).astype(np.int32)  # right-padded
    logits, cache = decode(graphdef, params, prompt, np.zeros(3, np.int32), lengths, cache)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(np.asarray(logits)[b, :n], want[b, :n], atol=TOL, rtol=TOL)
    pos = lengths.copy()
    while (pos < total).any():
        step = np.minimum(pos, total - 1)
        tokens = seqs[np.arange(3), step][:, None]
        logits, cache = decode(graphdef, params, tokens, step, np.ones(3, np.int32), cache)
        for b in range(3):
            if pos[b] < total:
                np.testing.assert_allclose(np.asarray(logits)[b, 0], want[b, pos[b]], atol=TOL, rtol=TOL)
        pos += 1


def test_llama_block_through_the_sliding_window_kernel():
    """RoPE'd queries and keys go through the Pallas sliding-window kernel (interpret mode on CPU) as through the
    XLA reference: loss and every gradient within 1e-5."""
    cfg = tiny(**LLAMA, attention=AttentionConfig(window=5, impl="xla"))
    params = _random_params(cfg)
    tokens = np.random.default_rng(6).integers(0, cfg.vocab_size, (2, 13)).astype(np.int32)
    l_xla, g_xla = _loss_and_grads(cfg, params, tokens)
    l_pl, g_pl = _loss_and_grads(dataclasses.replace(cfg, attention=AttentionConfig(window=5, impl="pallas")),
                                 params, tokens)
    np.testing.assert_allclose(l_pl, l_xla, atol=1e-5, rtol=0)
    for a, b in zip(jax.tree.leaves(g_xla), jax.tree.leaves(g_pl)):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
