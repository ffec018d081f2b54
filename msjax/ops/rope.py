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
    yarn (Peng et al. 2023, "YaRN", sec. 3.2 "NTK-by-parts"; `transformers`' `_compute_yarn_parameters`): the
    dimension that turns r times over C is d(r) = K ln(C / (2 pi r)) / (2 ln base); below d(beta_fast) frequencies
    are kept, above d(beta_slow) divided by `factor`, with a linear ramp over pair index i between (the bounds
    floored and ceiled when `truncate`).
    """
    pos_freqs = base ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    inv_freq = 1.0 / pos_freqs  # (K/2,)
    if scaling is None or scaling.type == "none":
        return inv_freq
    if scaling.type == "linear":
        return inv_freq / scaling.factor
    if scaling.type == "yarn":
        def dim_of(rotations: float) -> float:
            return head_dim * math.log(scaling.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
        if scaling.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # the reference's guard against a zero-width ramp
        ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
        kept = 1 - ramp  # the share of each frequency left as it was (extrapolated)
        return 1.0 / (scaling.factor * pos_freqs) * (1 - kept) + inv_freq * kept
    context, low, high = scaling.original_max_seq_len, scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (context / wavelen - low) / (high - low)
    mixed = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    return jnp.where(wavelen > context / low, inv_freq / scaling.factor,
                     jnp.where(wavelen < context / high, inv_freq, mixed))


def attention_factor(scaling: RopeScalingConfig | None) -> float:
    """The factor yarn scales cos and sin by (YaRN sec. 3.4: sqrt(1/t) = 0.1 ln(s) + 1 for scale s), 1.0 for the
    other scalings: `scaling.attention_factor` when set, else mscale(factor, mscale) / mscale(factor,
    mscale_all_dim) when both are set (DeepSeek-V2/V3), else 0.1 ln(factor) + 1 (`transformers`' rule)."""
    if scaling is None or scaling.type != "yarn":
        return 1.0
    if scaling.attention_factor:
        return scaling.attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.factor, scaling.mscale) / mscale(scaling.factor, scaling.mscale_all_dim)
    return mscale(scaling.factor)


def rope_angles(positions: jax.Array, head_dim: int, base: float,
                scaling: RopeScalingConfig | None = None) -> tuple[jax.Array, jax.Array]:
    """cos and sin of the rotation angles, each (..., K/2) float32, for integer `positions` (...), both times yarn's
    attention factor (`attention_factor`; 1 otherwise)."""
    angles = positions.astype(jnp.float32)[..., None] * inverse_frequencies(head_dim, base, scaling)
    scale = attention_factor(scaling)
    if scale == 1.0:
        return jnp.cos(angles), jnp.sin(angles)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


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
