"""msjax.ops.rms_norm's hand-written backward against autodiff of the textbook formula (random data, float32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from msjax.ops.rms_norm import rms_norm

TOL = 1e-5  # float32: both sides round differently; relative to the largest magnitude of each compared array


def reference(x, scale, eps):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + eps) * scale


def close(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=0, atol=TOL * max(1.0, np.abs(b).max()))


@pytest.mark.parametrize("shape", [(2, 3, 8), (4, 16, 128), (5, 96), (2, 2, 4, 32)])
def test_forward_and_gradients_match_autodiff(shape):
    k = jax.random.split(jax.random.key(0), 3)
    x = 3.0 * jax.random.normal(k[0], shape) + 0.5
    scale = 1.0 + 0.3 * jax.random.normal(k[1], shape[-1:])
    dy = jax.random.normal(k[2], shape)  # a random cotangent, not ones
    close(rms_norm(x, scale, 1e-6), reference(x, scale, 1e-6))

    def loss(f):
        return lambda x, s: jnp.sum(f(x, s, 1e-6) * dy)

    got = jax.jit(jax.grad(loss(rms_norm), argnums=(0, 1)))(x, scale)
    want = jax.grad(loss(reference), argnums=(0, 1))(x, scale)
    for g, w in zip(got, want):
        close(g, w)


def test_bfloat16_input_keeps_its_gradient_dtype():
    x = jax.random.normal(jax.random.key(1), (3, 5, 16)).astype(jnp.bfloat16)
    dx = jax.grad(lambda x: jnp.sum(rms_norm(x, jnp.ones(16), 1e-5)))(x)
    assert dx.dtype == jnp.bfloat16
