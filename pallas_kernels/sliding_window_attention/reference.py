"""Plain-JAX causal sliding-window attention: the kernels' twin in the tests and the fallback (`backend="xla"`).

Legend: B batch, T sequence length, H query heads, Hkv key/value heads, G = H // Hkv, K head dim, W window.
Materialises the (B, Hkv, G, T, T) logits, so memory grows as T^2: fine for tests and short sequences only.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def sliding_window_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    window: int | None = None,
    segment_ids: jax.Array | None = None,
    sm_scale: float | None = None,
) -> jax.Array:
    """softmax(sm_scale * Q K^T + mask) V with the sliding-window causal mask, softmax math in float32.

    Query i attends key j iff i - W < j <= i (W tokens including itself) and, when segment ids are given,
    segment_ids[b, i] == segment_ids[b, j]. window=None is plain causal attention.

    Args:
      q: (B, T, H, K) float32 / bfloat16 / float16.
      k, v: (B, T, Hkv, K), H % Hkv == 0 (GQA; Hkv = 1 is MQA).
      window: W >= 1 or None.
      segment_ids: (B, T) integer or None.
      sm_scale: logit scale; default 1 / sqrt(K).

    Returns:
      (B, T, H, K) in q.dtype. Logits, softmax and the PV product are computed in float32 from the inputs
      upcast to float32.

    Raises:
      ValueError: window < 1; shapes that do not match the contract above (see `check_inputs`).
    """
    check_inputs(q, k, v, window, segment_ids)
    batch, seq_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    q_btngk = q.astype(jnp.float32).reshape(batch, seq_len, num_kv_heads, group, head_dim)  # (B, T, Hkv, G, K)
    k_f32 = k.astype(jnp.float32)  # (B, S, Hkv, K)
    v_f32 = v.astype(jnp.float32)
    logits = jnp.einsum("btngk,bsnk->bngts", q_btngk, k_f32, precision="highest") * sm_scale  # (B, Hkv, G, T, S)
    q_pos = jnp.arange(seq_len)[:, None]
    k_pos = jnp.arange(seq_len)[None, :]
    visible = k_pos <= q_pos  # (T, S)
    if window is not None:
        visible = visible & (k_pos > q_pos - window)
    visible = visible[None, None, None]  # (1, 1, 1, T, S)
    if segment_ids is not None:
        same = segment_ids[:, :, None] == segment_ids[:, None, :]  # (B, T, S)
        visible = visible & same[:, None, None]
    # Every row keeps its diagonal, so no row is fully masked and the softmax is well defined.
    logits = jnp.where(visible, logits, -jnp.inf)
    weights = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bngts,bsnk->btngk", weights, v_f32, precision="highest")  # (B, T, Hkv, G, K)
    return out.reshape(batch, seq_len, num_heads, head_dim).astype(q.dtype)


def check_inputs(q, k, v, window, segment_ids) -> None:
    """Validates the attention contract; raises ValueError naming the offending argument."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1):
        raise ValueError(f"window must be an int >= 1 or None, got {window!r}")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be 4-D (B, T, H, K); got q{q.shape}, k{k.shape}, v{v.shape}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape (B, T, Hkv, K); got k{k.shape}, v{v.shape}")
    batch, seq_len, num_heads, head_dim = q.shape
    if k.shape[0] != batch or k.shape[1] != seq_len:
        raise ValueError(
            f"k/v batch and sequence length must match q (self-attention); got q{q.shape}, k{k.shape}"
        )
    if k.shape[3] != head_dim:
        raise ValueError(f"head dims differ: q has K={head_dim}, k/v have K={k.shape[3]}")
    if num_heads % k.shape[2]:
        raise ValueError(
            f"query heads H={num_heads} must be a multiple of key/value heads Hkv={k.shape[2]} (GQA)"
        )
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if segment_ids is not None:
        if segment_ids.shape != (batch, seq_len):
            raise ValueError(f"segment_ids must have shape (B, T) = {(batch, seq_len)}, got {segment_ids.shape}")
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(f"segment_ids must be an integer array, got {segment_ids.dtype}")
