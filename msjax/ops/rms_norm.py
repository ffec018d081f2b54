"""RMSNorm (Zhang and Sennrich 2019, "Root Mean Square Layer Normalization", eq. 4) with a hand-written backward.

Why a `jax.custom_vjp`, as for LayerNorm (msjax/ops/layer_norm.py): autodiff through `mean(x * x)` hands XLA:CPU
the same row reductions in transposed order that made LayerNorm's derived backward slow; the closed form is one
row-wise pass.

Forward, over the last axis of width D:
    xhat = x * r,   r = 1 / sqrt(mean(x^2) + eps),   y = xhat * scale
Backward of the normalisation, with g = dL/dxhat:
    dx = r * (g - xhat * mean(g * xhat))
(the LayerNorm closed form without the mean-centring term). Llama's RMSNorm (`LlamaRMSNorm` in Hugging Face
`transformers`) normalises in float32 and multiplies by the gain after casting back; in float32 both are this.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in float32; no offset (Llama's norms have none).

    Args:
      x: (..., D) activations, any float dtype.
      scale: (D,) gain.
      eps: added to the mean square (e.g. 1e-5; Llama 3 uses 1e-5, Llama 2 1e-6).
    Returns:
      (..., D) float32 (the caller casts back to its activation dtype).
    """
    return rms_normalize(x.astype(jnp.float32), eps) * scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """xhat = x / sqrt(mean(x^2) + eps) over the last axis; x (..., D) float32 -> (..., D) float32."""
    return _forward(x, eps)[0]


def _forward(x, eps):
    r = jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + eps)
    xhat = x * r
    return xhat, (xhat, r)


def _backward(eps, residuals, g):
    del eps
    xhat, r = residuals
    return (r * (g - xhat * (g * xhat).mean(-1, keepdims=True)),)


rms_normalize.defvjp(_forward, _backward)
