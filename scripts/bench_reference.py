"""A reference train step for `scripts/bench.py --plain_jax`: nanoGPT's GPT-2 block written in plain JAX + optax.

No logical axis names, no sharding constraints, no NNX: one fused (D, 3D) QKV matmul, (B, H, T, T) attention, tied
embeddings, AdamW; biases in the linear layers and LayerNorm or none, as nanoGPT's `bias` flag (msjax's
`model.use_bias`). It computes the same model as msjax's serial block at a config's shapes (same parameter count
and model FLOPs; its own initialisation), so the two steps' times say how much of the step time is msjax's
graph and how much is what XLA makes of the model itself on this backend (docs/cpu_speed.md).
It is a yardstick only: nothing in the training stack uses it.

Legend: B batch, T sequence, D model width, H heads, K head dim, F MLP width, V vocabulary, L layers.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from msjax.config import Config
from msjax.ops import matmul


def _init(key: jax.Array, L: int, D: int, F: int, T: int, V: int, std: float, with_bias: bool) -> dict[str, Any]:
    keys = iter(jax.random.split(key, 4 * L + 2))

    def normal(*shape):
        return std * jax.random.normal(next(keys), shape, jnp.float32)

    def bias(*shape):  # a zero bias, or none (nanoGPT's bias=False)
        return {"b": jnp.zeros(shape)} if with_bias else {}

    def norm():
        return {"scale": jnp.ones((D,)), **bias(D)}

    layers = [{"ln1": norm(), "ln2": norm(),
               "qkv": {"w": normal(D, 3 * D), **bias(3 * D)}, "o": {"w": normal(D, D), **bias(D)},
               "in": {"w": normal(D, F), **bias(F)}, "out": {"w": normal(F, D), **bias(D)}} for _ in range(L)]
    return {"wte": normal(V, D), "wpe": normal(T, D), "ln_f": norm(), "layers": layers}


def _layer_norm(x_btd: jax.Array, p: dict[str, jax.Array], eps: float) -> jax.Array:
    mean = x_btd.mean(-1, keepdims=True)
    var = jnp.square(x_btd - mean).mean(-1, keepdims=True)
    y_btd = (x_btd - mean) * jax.lax.rsqrt(var + eps) * p["scale"]
    return y_btd + p["b"] if "b" in p else y_btd


def plain_train_step(cfg: Config, vocab_size: int) -> tuple[Callable, Any, dict[str, jax.Array]]:
    """The jitted reference step at `cfg`'s shapes (model.*, train.global_batch, train.seq_len, optimizer.lr).

    Args:
      cfg: a validated config; only the serial block without a sliding window is modelled.
      vocab_size: the embedding rows V (the config's padded vocabulary, so the FLOPs match).
    Returns:
      (step, state, batch): `step(state, batch) -> (state, loss)` (jitted, state donated), a fresh state
      (params, AdamW state) and a batch of random int32 tokens {"inputs", "targets"}: (B, T).
    Raises:
      ValueError: a model this reference does not reproduce (a parallel block, a sliding window, grouped-query
        heads, head_dim other than d_model / num_heads, untied embeddings, RoPE, RMSNorm, SwiGLU): its times would
        not be those of the same model.
    """
    m, t = cfg.model, cfg.train
    unlike = {"model.block": m.block != "serial", "model.attention.window": m.attention.window is not None,
              "model.num_kv_heads": m.kv_heads != m.num_heads, "model.head_dim": m.head_size * m.num_heads != m.d_model,
              "model.tie_embeddings": not m.tie_embeddings,
              "model.position": m.position != "learned", "model.norm": m.norm != "layernorm",
              "model.mlp": m.mlp != "gelu"}
    if any(unlike.values()):
        raise ValueError(f"plain_train_step models nanoGPT's block (serial, no window, multi-head, head_dim = d_model "
                         f"/ num_heads, tied embeddings, learned positions, LayerNorm, GeLU); this config "
                         f"differs in "
                         f"{', '.join(k for k, v in unlike.items() if v)}")
    B, T, D, H, L, F, V = t.global_batch, t.seq_len, m.d_model, m.num_heads, m.num_layers, m.ff_size, vocab_size
    K = D // H
    causal_tt = jnp.tril(jnp.ones((T, T), bool))
    mt = matmul.resolve(m.matmul_dtype, m.dtype)  # msjax's weight-matmul operands, here the plain way (cast, dot)

    def linear(x, p):
        y = jnp.matmul(x.astype(mt), p["w"].astype(mt), preferred_element_type=jnp.float32).astype(x.dtype)
        return y + p["b"] if "b" in p else y

    def block(x_btd, p):
        qkv_btd = linear(_layer_norm(x_btd, p["ln1"], m.norm_eps), p["qkv"])  # (B, T, 3D)
        q_bhtk, k_bhtk, v_bhtk = (a.reshape(B, T, H, K).transpose(0, 2, 1, 3) for a in jnp.split(qkv_btd, 3, -1))
        s_bhts = (q_bhtk @ k_bhtk.swapaxes(-1, -2)) * K**-0.5
        w_bhts = jax.nn.softmax(jnp.where(causal_tt, s_bhts, -jnp.inf), axis=-1)
        o_btd = (w_bhts @ v_bhtk).transpose(0, 2, 1, 3).reshape(B, T, D)
        x_btd = x_btd + linear(o_btd, p["o"])
        h_btf = jax.nn.gelu(linear(_layer_norm(x_btd, p["ln2"], m.norm_eps), p["in"]))
        return x_btd + linear(h_btf, p["out"])

    def loss_fn(params, batch):
        x_btd = params["wte"][batch["inputs"]] + params["wpe"][None]
        for p in params["layers"]:
            x_btd = block(x_btd, p)
        logits_btv = linear(_layer_norm(x_btd, params["ln_f"], m.norm_eps), {"w": params["wte"].T})
        return optax.softmax_cross_entropy_with_integer_labels(logits_btv, batch["targets"]).mean()

    o = cfg.optimizer  # constant lr, no clipping, no finite check: a floor, not a twin of msjax's optimizer
    tx = optax.adamw(o.lr, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay)

    def step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    params = _init(jax.random.key(0), L, D, F, T, V, m.init_std, m.use_bias)
    k_in, k_out = jax.random.split(jax.random.key(1))
    batch = {"inputs": jax.random.randint(k_in, (B, T), 0, V, jnp.int32),
             "targets": jax.random.randint(k_out, (B, T), 0, V, jnp.int32)}
    return jax.jit(step, donate_argnums=0), (params, tx.init(params)), batch
