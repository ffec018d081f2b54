"""msjax.ops.softmax's hand-written backward against jax.nn.softmax and its autodiff (random data)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from msjax.ops.softmax import softmax

TOL = 1e-6  # float32, relative to the largest magnitude of each compared array


def close(a, b, tol=TOL):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=0, atol=tol * max(1.0, np.abs(b).max()))


def logits_and_cotangent(shape, seed, causal):
    k = jax.random.split(jax.random.key(seed), 2)
    x = 4.0 * jax.random.normal(k[0], shape)  # wide logits: probabilities far from uniform
    if causal:  # the attention's use: -inf above the diagonal, every row keeps its diagonal entry
        t, s = shape[-2], shape[-1]
        x = jnp.where(jnp.arange(s)[None, :] <= jnp.arange(t)[:, None] + (s - t), x, -jnp.inf)
    return x, jax.random.normal(k[1], shape)


@pytest.mark.parametrize("shape,causal", [((7,), False), ((3, 64), False), ((3, 64), True),
                                          ((2, 4, 1, 16, 16), False), ((2, 4, 1, 16, 16), True),
                                          ((2, 3, 5, 40), True)])
def test_forward_and_vjp_match_jax_nn_softmax(shape, causal):
    x, g = logits_and_cotangent(shape, seed=len(shape), causal=causal)
    want, want_vjp = jax.vjp(lambda x: jax.nn.softmax(x, axis=-1), x)
    got, got_vjp = jax.vjp(softmax, x)
    close(got, want)
    close(got_vjp(g)[0], want_vjp(g)[0])
    if causal:  # masked logits get exactly zero probability and zero gradient
        masked = np.isneginf(np.asarray(x))
        assert masked.any() and not np.asarray(got)[masked].any() and not np.asarray(got_vjp(g)[0])[masked].any()


def test_gradient_through_jit_and_vmap():
    x, g = logits_and_cotangent((3, 5, 12), seed=1, causal=False)
    loss = lambda f: (lambda x: jnp.sum(jnp.sin(f(x)) * g))
    ours = jax.jit(jax.vmap(jax.grad(loss(softmax))))(x)
    ref = jax.vmap(jax.grad(loss(lambda x: jax.nn.softmax(x, axis=-1))))(x)
    close(ours, ref)


def test_bfloat16_follows_jax_nn_softmax():
    x, g = logits_and_cotangent((4, 32), seed=2, causal=True)
    x, g = x.astype(jnp.bfloat16), g.astype(jnp.bfloat16)
    got, vjp = jax.vjp(softmax, x)
    want, want_vjp = jax.vjp(lambda x: jax.nn.softmax(x, axis=-1), x)
    assert got.dtype == want.dtype == jnp.bfloat16
    close(got, want, tol=1e-2)  # bfloat16: 8 bits of mantissa
    close(vjp(g)[0], want_vjp(g)[0], tol=2e-2)
