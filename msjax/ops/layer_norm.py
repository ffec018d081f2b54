"""LayerNorm with a hand-written backward (`jax.custom_vjp`).

Why not autodiff: differentiating `(x - mean) * rsqrt(var + eps) * scale + bias` through `mean` and `var` gives
XLA a backward it fuses badly on CPU: on the shakespeare_char step (XLA:CPU, jax 0.10.2) the residual stream's
gradient came out of twelve large loop fusions written in transposed (D, B*T) order, 8.3 of the step's 64 ms of
op time. The closed form below is one row-wise pass; the same step ran 0.75x as long with it (docs/cpu_speed.md).

Forward (Ba, Kiros and Hinton 2016, "Layer Normalization", eq. 4), over the last axis of width D:
    xhat = (x - mean(x)) * r,   r = 1 / sqrt(var(x) + eps),   y = xhat * scale + bias
Backward of the normalisation, with g = dL/dxhat (= dy * scale; the standard closed form, as in Apex's and
Megatron's fused LayerNorm kernels):
    dx = r * (g - mean(g) - xhat * mean(g * xhat))
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array | None, eps: float) -> jax.Array:
    """LayerNorm over the last axis, computed in float32.

    Only the normalisation x -> xhat has the hand-written backward; the gain and offset stay with autodiff, so
    their gradients get jax's own reductions (inside `shard_map` an invariant `scale` gets the psum its
    cotangent needs).

    Args:
      x: (..., D) activations, any float dtype.
      scale: (D,) gain.
      bias: (D,) offset, or None (no bias).
      eps: added to the variance (e.g. 1e-5).
    Returns:
      (..., D) float32 (the caller casts back to its activation dtype).
    """
    y = normalize(x.astype(jnp.float32), eps) * scale
    return y if bias is None else y + bias


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def normalize(x: jax.Array, eps: float) -> jax.Array:
    """xhat = (x - mean(x)) / sqrt(var(x) + eps) over the last axis; x (..., D) float32 -> (..., D) float32."""
    return _forward(x, eps)[0]


def _forward(x, eps):
    mean = x.mean(-1, keepdims=True)
    r = jax.lax.rsqrt(jnp.square(x - mean).mean(-1, keepdims=True) + eps)
    xhat = (x - mean) * r
    return xhat, (xhat, r)


def _backward(eps, residuals, g):
    del eps
    xhat, r = residuals
    return (r * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True)),)


normalize.defvjp(_forward, _backward)
