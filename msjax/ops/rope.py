"""Rotary position embeddings (RoPE; Su et al. 2021, "RoFormer", sec. 3.4.2), in the half-split layout.

Each head vector of size K is cut into halves (x1, x2) = (x[:K/2], x[K/2:]); pair i = (x1[i], x2[i]) is rotated by
the angle p * theta_i, p the token's position and theta_i = base^(-2i / K):
    y1 = x1 cos - x2 sin,   y2 = x2 cos + x1 sin.
This is the layout of Hugging Face `transformers`' Llama (`rotate_half`; Meta's reference code rotates interleaved
pairs (x[2i], x[2i+1]) instead, and HF's conversion script permutes q/k weights into this layout), so Llama
checkpoints in HF format convert with a plain copy. The angles are computed in float32 as HF does
(`inv_freq = 1 / base ** (arange(0, K, 2) / K)`; positions times inv_freq), the rotation in the input's dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from msjax.config import RopeScalingConfig


def inverse_frequencies(head_dim: int, base: float, scaling: RopeScalingConfig | None = None) -> jax.Array:
    """theta_i = base^(-2i / K) for i < K/2, float32 (K/2,), scaled as `scaling` says (msjax.config's
    RopeScalingConfig; None or type none: unscaled).

    linear: theta_i / factor. llama3 (Llama 3.1; Meta's reference code, `transformers`' `_compute_llama3_parameters`):
    with wavelength w_i = 2 pi / theta_i and the original context C, a frequency with w_i > C / low_freq_factor is
    divided by `factor`, one with w_i < C / high_freq_factor is kept, and between them
    s = (C / w_i - low) / (high - low) mixes the two: (1 - s) theta_i / factor + s theta_i.
    """
    inv_freq = 1.0 / (base ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))  # (K/2,)
    if scaling is None or scaling.type == "none":
        return inv_freq
    if scaling.type == "linear":
        return inv_freq / scaling.factor
    context, low, high = scaling.original_max_seq_len, scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (context / wavelen - low) / (high - low)
    mixed = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    return jnp.where(wavelen > context / low, inv_freq / scaling.factor,
                     jnp.where(wavelen < context / high, inv_freq, mixed))


def rope_angles(positions: jax.Array, head_dim: int, base: float,
                scaling: RopeScalingConfig | None = None) -> tuple[jax.Array, jax.Array]:
    """cos and sin of the rotation angles, each (..., K/2) float32, for integer `positions` (...)."""
    angles = positions.astype(jnp.float32)[..., None] * inverse_frequencies(head_dim, base, scaling)
    return jnp.cos(angles), jnp.sin(angles)


def rope(x_bthk: jax.Array, positions_bt: jax.Array, base: float,
         scaling: RopeScalingConfig | None = None) -> jax.Array:
    """Rotates every head of `x` by its token's position.

    Args:
      x_bthk: queries or keys (B, T, H, K), K even.
      positions_bt: int32 positions (B, T) or (1, T) (broadcast over the batch).
      base: the frequency base (`model.rope_base`; Llama 2: 10000, Llama 3: 500000).
      scaling: the frequency scaling (`model.rope_scaling`; `inverse_frequencies`), or None.
    Returns:
      (B, T, H, K) in x's dtype.
    Raises:
      ValueError: an odd head dimension.
    """
    k = x_bthk.shape[-1]
    if k % 2:
        raise ValueError(f"RoPE needs an even head dimension; got {k}")
    cos_btk, sin_btk = rope_angles(positions_bt, k, base, scaling)
    cos, sin = cos_btk[:, :, None, :].astype(x_bthk.dtype), sin_btk[:, :, None, :].astype(x_bthk.dtype)
    x1, x2 = x_bthk[..., : k // 2], x_bthk[..., k // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
