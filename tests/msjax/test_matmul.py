"""msjax.ops.matmul: bf16-operand weight matmuls against float64 references of the same rounded operands
(random data), the backward's dots all bf16, no bf16 copy of a weight among the residuals, and "auto"; float32
operands against float64 references, with the weight gradient transposing the narrower operand on XLA:CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from msjax.hardware import cpu_amx_bf16_usable
from msjax.ops import matmul
from tests.msjax import hlo_utils

TOL = 1e-5  # relative to the largest magnitude: float32 accumulation of exact bf16 x bf16 products
SPECS = {  # the model's weight matmuls, with small shapes for each letter
    "btd,df->btf": ((2, 5, 16), (16, 24)),
    "btf,fd->btd": ((2, 5, 24), (24, 16)),
    "btd,dhk->bthk": ((2, 5, 16), (16, 4, 8)),
    "bthk,hkd->btd": ((2, 5, 4, 8), (4, 8, 16)),
    "btd,vd->btv": ((2, 5, 16), (40, 16)),
    "bte,ve->btv": ((2, 5, 24), (8, 24)),  # a tied head narrower than the model: dW's operands swap, no transpose
}
TOL_F32 = 1e-6  # float32 operands against float64: float32 accumulation over at most 24 terms


def rounded(a) -> np.ndarray:
    """`a` rounded to bfloat16, as float64."""
    return np.asarray(jnp.asarray(a).astype(jnp.bfloat16).astype(jnp.float32), np.float64)


def close(got, want, tol=TOL):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max())


def operands(spec, seed):
    xs, ws = SPECS[spec]
    k = jax.random.split(jax.random.key(seed), 3)
    x, w = jax.random.normal(k[0], xs), jax.random.normal(k[1], ws)
    out_shape = jax.eval_shape(lambda x, w: jnp.einsum(spec, x, w), x, w).shape
    return x, w, jax.random.normal(k[2], out_shape)


@pytest.mark.parametrize("spec", SPECS)
def test_forward_and_gradients_are_float32_sums_of_rounded_operands(spec):
    x, w, g = operands(spec, seed=len(spec))
    a, b, c = spec.replace("->", ",").split(",")
    y, vjp = jax.vjp(lambda x, w: matmul.einsum(spec, x, w, jnp.bfloat16), x, w)
    dx, dw = vjp(g)
    assert y.dtype == dx.dtype == dw.dtype == jnp.float32
    close(y, np.einsum(spec, rounded(x), rounded(w)))
    close(dx, np.einsum(f"{c},{b}->{a}", rounded(g), rounded(w)))
    close(dw, np.einsum(f"{a},{c}->{b}", rounded(x), rounded(g)))
    # and not the float32 matmul: rounding the operands is visible at this tolerance, so the test can tell
    with pytest.raises(AssertionError):
        close(y, np.einsum(spec, np.asarray(x, np.float64), np.asarray(w, np.float64)))


def test_autodiff_of_a_cast_would_fail_the_same_check():
    """What the custom VJP replaces: differentiating cast-then-einsum rounds the weight gradient to bf16 (and
    contracts a float32 gradient with a bf16 operand); the reference check above rejects it."""
    spec = "btd,df->btf"
    x, w, g = operands(spec, seed=3)
    naive = lambda x, w: jnp.einsum(spec, x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),  # noqa: E731
                                    preferred_element_type=jnp.float32)
    _, vjp = jax.vjp(naive, x, w)
    with pytest.raises(AssertionError):
        close(vjp(g)[1], np.einsum("btd,btf->df", rounded(x), rounded(g)))


def test_every_dot_of_forward_and_backward_takes_bf16_operands():
    spec = "btd,df->btf"
    x, w, g = operands(spec, seed=4)
    loss = lambda x, w: jnp.sum(jnp.sin(matmul.einsum(spec, x, w, jnp.bfloat16)) * g)  # noqa: E731
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) == 3, dots  # forward, dX, dW
    for line in dots:
        operand_types = line.rsplit(":", 1)[1].split("->")[0]
        assert operand_types.count("xbf16>") == 2 and "xf32>" not in operand_types, line


def test_residuals_are_the_operands_not_bf16_copies():
    """The weight a matmul keeps for its backward is the float32 parameter itself (a pipeline's stash tells
    parameters apart from activations by identity), not a rounded copy."""
    spec = "btd,df->btf"
    x, w, _ = operands(spec, seed=5)
    _, vjp = jax.vjp(lambda x, w: matmul.einsum(spec, x, w, jnp.bfloat16), x, w)
    leaves = jax.tree.leaves(vjp)
    assert any(leaf is w for leaf in leaves) and any(leaf is x for leaf in leaves)
    assert not any(getattr(leaf, "dtype", None) == jnp.bfloat16 for leaf in leaves)


@pytest.mark.parametrize("spec", SPECS)
def test_float32_operands_give_float32_products_and_gradients(spec):
    """Unrounded operands through the custom VJP (XLA:CPU's path for float32 weight matmuls): the same function
    and gradients as float64 einsums, whichever operand the weight gradient transposes."""
    x, w, g = operands(spec, seed=7 + len(spec))
    a, b, c = spec.replace("->", ",").split(",")
    y, vjp = jax.vjp(lambda x, w: matmul.einsum(spec, x, w, jnp.float32), x, w)
    dx, dw = vjp(g)
    assert y.dtype == dx.dtype == dw.dtype == jnp.float32
    x64, w64, g64 = (np.asarray(v, np.float64) for v in (x, w, g))
    close(y, np.einsum(spec, x64, w64), TOL_F32)
    close(dx, np.einsum(f"{c},{b}->{a}", g64, w64), TOL_F32)
    close(dw, np.einsum(f"{a},{c}->{b}", x64, g64), TOL_F32)


def largest_transposed_array(text: str) -> int:
    """Elements of the largest array any transpose in a compiled HLO module produces (inside fusions too)."""
    comps = hlo_utils.parse(text)
    sizes = [int(np.prod(dims)) for comp in comps.values() for i in comp.instrs if i.op == "transpose"
             for _, dims in i.shapes]
    return max(sizes, default=0)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the layout rule is XLA:CPU's")
def test_the_weight_gradient_transposes_the_narrower_operand_on_cpu():
    """The model's MLP, float32: XLA:CPU's dots take row-major operands only, so dW_out = H^T dY transposes one of
    the hidden activation H (B*T x F) and the gradient dY (B*T x D). Autodiff (and a custom VJP writing dW as
    H^T dY) transposes H, fused into the GELU that produces it: recomputed in column order, ms per layer in the
    real step. `einsum` transposes nothing wider than dY. Fails when the backward transposes H."""
    bsz, t, d, f = 4, 64, 64, 256
    k = jax.random.split(jax.random.key(11), 4)
    x, g = jax.random.normal(k[0], (bsz, t, d)), jax.random.normal(k[1], (bsz, t, d))
    w_in, w_out = 0.1 * jax.random.normal(k[2], (d, f)), 0.1 * jax.random.normal(k[3], (f, d))

    def backward_hlo(product) -> str:
        def loss(x, w_in, w_out):
            h = jax.nn.gelu(product("btd,df->btf", x, w_in))
            return jnp.sum(product("btf,fd->btd", h, w_out) * g)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, w_in, w_out).compile().as_text()

    ours = backward_hlo(lambda s, a, b: matmul.einsum(s, a, b, jnp.float32))
    autodiff = backward_hlo(lambda s, a, b: jnp.einsum(s, a, b))
    assert largest_transposed_array(ours) <= bsz * t * d
    assert largest_transposed_array(autodiff) == bsz * t * f  # what it guards against


def test_own_backward_rule():
    f32, bf16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
    own = matmul.own_backward
    assert own(bf16, f32, platform="gpu") and own(bf16, f32, platform="cpu")  # rounded operands: always
    assert own(f32, f32, platform="cpu")  # CPU float32 training: the weight gradient's layout
    assert not own(f32, f32, platform="gpu") and not own(bf16, bf16, platform="tpu")  # autodiff elsewhere
    assert not own(bf16, bf16, platform="cpu")  # a GPU configuration compiled on CPU lowers as on the GPU


def test_resolve_settings():
    f32, bf16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
    assert matmul.resolve("activations", "float32") == f32
    assert matmul.resolve("activations", "bfloat16") == bf16
    assert matmul.resolve("bfloat16", "float32") == bf16
    assert matmul.resolve("auto", "float32", platform="gpu") == bf16
    assert matmul.resolve("auto", "float32", platform="tpu") == bf16
    assert matmul.resolve("auto", "float32", platform="cpu") == (bf16 if cpu_amx_bf16_usable() else f32)
    assert matmul.resolve("auto", "bfloat16", platform="cpu") == bf16  # never wider than the activations
    with pytest.raises(ValueError, match=r"model.matmul_dtype='fp8'.*activations, bfloat16, auto"):
        matmul.resolve("fp8", "float32")


def test_a_spec_whose_gradient_is_not_an_einsum_is_refused():
    with pytest.raises(ValueError, match=r"index 'c' does not"):  # c is summed out of w alone
        matmul.einsum("ab,cb->a", jnp.ones((2, 3)), jnp.ones((4, 3)), jnp.bfloat16)
