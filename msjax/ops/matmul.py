"""Weight matmuls with their own backward: bfloat16 operands under float32 activations (`model.matmul_dtype`), and
XLA:CPU's float32 ones.

Mixed precision as GPU autocast and TPU's default matmul precision do it: the activations, norms, softmax,
residual stream and parameters stay float32; each weight matmul rounds its two operands to bfloat16 and
accumulates the products in float32 (a bf16 x bf16 product is exact in float32, so only the operand rounding
differs from a float32 matmul). The backward does the same: the output gradient is rounded to bfloat16 and both
input gradients are float32 products of bfloat16 operands. Autodiff of a cast-then-einsum would not: it contracts
the float32 output gradient with a bfloat16 operand, which XLA computes as a float32 matmul, and rounds the weight
gradient to bfloat16. Hence the custom VJP.

Why it exists: on a CPU with AMX-BF16 (Intel Sapphire Rapids and later) XLA:CPU runs bf16 dots with float32
accumulation 3-4x faster than float32 ones (jax 0.10.2, 2 cores, (768, 128) x (128, 512): 159 against 507 us;
2048^3: 953 against 240 GFLOP/s; docs/cpu_speed.md), while bfloat16 activations made the shakespeare_char step
slower (65.6 against 52.0 ms: elementwise work in bf16 is converted back and forth on CPU).

Residuals are the float32 operands themselves, cast again in the backward: the weight a matmul saves is the
parameter leaf (no bf16 copy of the parameters in a pipeline's stash of residuals), the activation is one that
its producer keeps anyway.

On XLA:CPU weight matmuls take this path with float32 operands too (`own_backward` says when), for the layout
of the weight gradient. dW contracts the tokens, the leading axis of both the activation and the output gradient,
so one of them must be transposed first: YNNPACK, which runs XLA:CPU's dots, takes only row-major (M, K) x
(K, N) operands, and XLA's loop emitter transposes at 1-2 GB/s. Left to autodiff, XLA transposes the wider
operand, and for the MLP fuses that transpose into the elementwise work around the GELU (recomputed in column
order): 3.3-4 ms per layer in the float32 shakespeare_char step, against ~0.5 ms for a dot. Here the backward
transposes the narrower of the two (the (B*T, D) gradient instead of the (B*T, 4D) activation) and then the
small weight-shaped product, behind an optimization barrier that keeps that transpose out of the dot (a dot with
a transposed output leaves YNNPACK for XLA's own, slower emitter). The float32 step, 10 steps a call: 47.4-48.4
-> 29.5-30.9 ms (docs/cpu_speed.md). GPU and TPU libraries take transposed operands themselves; there unrounded
matmuls keep XLA's own autodiff.

`resolve` turns the setting into a dtype: "activations" (the matmuls run in `model.dtype`, today's float32 or
bf16 path), "bfloat16", or "auto": bfloat16 where the backend's bf16 matmuls are known to be faster than its
float32 ones (GPU, TPU, a CPU with AMX-BF16 that this process may use, `msjax.hardware.cpu_amx_bf16_usable`; an
H100 ran an 8192^3 matmul at 778 against 407 TFLOP/s), the activations' dtype elsewhere. Without AMX, XLA:CPU's
bf16 dots are slower than its float32 ones even where the CPU has AVX-512-BF16 (AMD Zen 4, Intel Cooper Lake):
on an AMX Xeon with AMX refused (`scripts/refuse_amx.py`), a 1024^3 product 196-207 against 271-282 GFLOP/s and
the shakespeare_char step 37-40 against 32-33 ms (docs/cpu_speed.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from msjax.hardware import cpu_amx_bf16_usable

MATMUL_DTYPES = ("activations", "bfloat16", "auto")


def resolve(setting: str, activations, platform: str | None = None) -> jnp.dtype:
    """The dtype weight matmuls round their operands to under `model.matmul_dtype=setting`.

    Args:
      setting: "activations", "bfloat16" or "auto" (module docstring).
      activations: the activations' dtype (`model.dtype`); never widened: "bfloat16" or "auto" under bfloat16
        activations is bfloat16.
      platform: the backend deciding "auto" ("cpu", "gpu", "tpu"); None: `jax.default_backend()`.
    Returns:
      a jnp.dtype; equal to `activations` means unrounded matmuls in that dtype (`own_backward` says which
      path computes them).
    Raises:
      ValueError: an unknown setting.
    """
    activations = jnp.dtype(activations)
    if setting == "activations":
        return activations
    if setting == "bfloat16":
        return jnp.dtype(jnp.bfloat16)
    if setting == "auto":
        platform = platform or jax.default_backend()
        fast = platform in ("gpu", "cuda", "rocm", "tpu") or (platform == "cpu" and cpu_amx_bf16_usable())
        return jnp.dtype(jnp.bfloat16) if fast else activations
    raise ValueError(f"model.matmul_dtype={setting!r}: allowed are {', '.join(MATMUL_DTYPES)}")


def own_backward(operand_dtype, activations, platform: str | None = None) -> bool:
    """Whether weight matmuls go through `einsum` (its custom VJP) rather than a plain `jnp.einsum` left to
    autodiff: always when the operands are rounded (`operand_dtype` narrower than `activations`); unrounded, on
    XLA:CPU under float32 activations, the dtype CPU training runs in (the weight gradient's layout, module
    docstring). bfloat16 activations on a CPU are GPU and TPU configurations compiled for a dry run, which
    should lower as they do there.

    Args:
      operand_dtype: `resolve`'s dtype; activations: `model.dtype`; platform: as in `resolve`.
    Returns:
      True for `einsum`, False for plain autodiff (`msjax.model.dense` takes it).
    """
    platform = platform or jax.default_backend()
    if jnp.dtype(operand_dtype) != jnp.dtype(activations):
        return True
    return platform == "cpu" and jnp.dtype(activations) == jnp.float32


def einsum(spec: str, x: jax.Array, w: jax.Array, operand_dtype) -> jax.Array:
    """`jnp.einsum(spec, x, w)` with both operands rounded to `operand_dtype`, products accumulated in float32.

    Args:
      spec: a two-operand einsum "A,B->C" in which every index appears in exactly two of A, B, C (a weight
        matmul: "btd,df->btf", "bthk,hkd->btd", ...), so each input's gradient is again such an einsum.
      x, w: float arrays of any float dtype (typically float32 activations and a float32 weight).
      operand_dtype: the dtype the operands are rounded to (bfloat16, or float32 for no rounding).
    Returns:
      the product, float32, shaped by C. Gradients come back in the dtypes of x and w; on XLA:CPU (the default
      backend when traced) the weight gradient transposes the narrower of x and the output gradient.
    Raises:
      ValueError: a spec outside the form above.
    """
    _check_spec(spec)
    return _einsum(spec, jnp.dtype(operand_dtype), jax.default_backend() == "cpu", x, w)


@functools.cache
def _check_spec(spec: str) -> None:
    a, b, c = _parts(spec)
    for index in set(a + b + c):
        if (index in a) + (index in b) + (index in c) != 2:
            raise ValueError(f"matmul.einsum({spec!r}): every index must appear in exactly two of the operands "
                             f"and the output (index {index!r} does not)")


def _parts(spec: str) -> tuple[str, str, str]:
    ins, out = spec.replace(" ", "").split("->")
    a, b = ins.split(",")
    return a, b, out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _einsum(spec, dt, narrow_transpose, x, w):
    return jnp.einsum(spec, x.astype(dt), w.astype(dt), preferred_element_type=jnp.float32)


def _einsum_fwd(spec, dt, narrow_transpose, x, w):
    return _einsum(spec, dt, narrow_transpose, x, w), (x, w)


def _einsum_bwd(spec, dt, narrow_transpose, residuals, g):
    x, w = residuals
    return (input_grad(spec, w, g, dt).astype(x.dtype),
            _weight_grad(spec, x, g, dt, narrow_transpose).astype(w.dtype))


def input_grad(spec: str, w: jax.Array, g: jax.Array, operand_dtype) -> jax.Array:
    """The gradient of `einsum(spec, x, w, operand_dtype)` with respect to x, for output gradient `g`: float32,
    shaped like x (the backward's first half, also run alone by a split backward)."""
    a, b, c = _parts(spec)
    dt = jnp.dtype(operand_dtype)
    return jnp.einsum(f"{c},{b}->{a}", g.astype(dt), w.astype(dt), preferred_element_type=jnp.float32)


def weight_grad(spec: str, x: jax.Array, g: jax.Array, operand_dtype) -> jax.Array:
    """The gradient of `einsum(spec, x, w, operand_dtype)` with respect to w, for output gradient `g`: float32,
    shaped like w (the backward's second half; a split backward runs it later)."""
    return _weight_grad(spec, x, g, jnp.dtype(operand_dtype), jax.default_backend() == "cpu")


def _weight_grad(spec, x, g, dt, narrow_transpose):
    a, b, c = _parts(spec)
    g = g.astype(dt)
    if narrow_transpose and x.size > g.size:
        # dW as the product with the gradient first: the narrower operand is the one transposed for the dot
        # (module docstring); the result has the gradient's indices first and is transposed to B after.
        b_swapped = "".join(i for i in c if i in b) + "".join(i for i in a if i in b)
        dw = jnp.einsum(f"{c},{a}->{b_swapped}", g, x.astype(dt), preferred_element_type=jnp.float32)
        if b_swapped != b:  # the barrier keeps this transpose a copy of its own, not the dot's output layout
            dw = jnp.transpose(jax.lax.optimization_barrier(dw), [b_swapped.index(i) for i in b])
        return dw
    return jnp.einsum(f"{a},{c}->{b}", x.astype(dt), g, preferred_element_type=jnp.float32)


_einsum.defvjp(_einsum_fwd, _einsum_bwd)
