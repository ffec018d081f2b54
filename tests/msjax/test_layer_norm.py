"""msjax.ops.layer_norm's hand-written backward against autodiff of the textbook formula (random data, float32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from msjax.ops.layer_norm import layer_norm

TOL = 1e-5  # float32: both sides round differently; relative to the largest magnitude of each compared array


def reference(x, scale, bias, eps):
    x = x.astype(jnp.float32)
    mean = x.mean(-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(jnp.square(x - mean).mean(-1, keepdims=True) + eps) * scale
    return y if bias is None else y + bias


def close(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=0, atol=TOL * max(1.0, np.abs(b).max()))


def inputs(shape, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    d = shape[-1]
    x = 3.0 * jax.random.normal(k[0], shape) + 0.5  # off-centre, not unit scale: the backward's mean terms matter
    return x, 1.0 + 0.3 * jax.random.normal(k[1], (d,)), 0.2 * jax.random.normal(k[2], (d,)), \
        jax.random.normal(k[3], shape)


@pytest.mark.parametrize("shape", [(2, 3, 8), (4, 16, 128), (5, 96), (2, 2, 4, 32)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_forward_and_gradients_match_autodiff(shape, with_bias):
    x, scale, bias, dy = inputs(shape)
    bias = bias if with_bias else None
    close(layer_norm(x, scale, bias, 1e-5), reference(x, scale, bias, 1e-5))

    def loss(f):
        return lambda x, s, b: jnp.sum(f(x, s, b, 1e-5) * dy)  # a random cotangent, not ones

    argnums = (0, 1, 2) if with_bias else (0, 1)
    got = jax.jit(jax.grad(loss(layer_norm), argnums=argnums))(x, scale, bias)
    want = jax.grad(loss(reference), argnums=argnums)(x, scale, bias)
    for g, w in zip(got, want):
        close(g, w)


def test_bfloat16_input_and_vmap():
    """A bfloat16 input gets a bfloat16 gradient; under vmap (the pipeline's stages) the gradients match."""
    x, scale, bias, dy = inputs((3, 4, 6, 32), seed=1)
    dx = jax.grad(lambda x: jnp.sum(layer_norm(x, scale, bias, 1e-5) * dy))(x.astype(jnp.bfloat16))
    assert dx.dtype == jnp.bfloat16
    scales = jnp.stack([scale, 2.0 * scale, scale - 0.5])

    def per_stage(f):
        return lambda x, s: jnp.sum(jax.vmap(lambda xi, si: f(xi, si, bias, 1e-5))(x, s) * dy)

    got = jax.grad(per_stage(layer_norm), argnums=(0, 1))(x, scales)
    want = jax.grad(per_stage(reference), argnums=(0, 1))(x, scales)
    for g, w in zip(got, want):
        close(g, w)
