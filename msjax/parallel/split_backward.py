"""A layer's backward split in two (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", sec. 2): B, the gradient
with respect to the layer's input (and its small parameters: norm gains, biases), which the previous pipeline stage
waits for; and W, the gradients of its weight matrices, which only the optimizer waits for and a zero-bubble
schedule runs later to fill the pipeline's idle ticks. Together they do the arithmetic of one backward: W's
matmuls are exactly the ones B leaves out, and nothing is recomputed for the split.

How. The model computes every weight matmul through `msjax.model.dense`, which asks the declared point
`msjax.sharding.Parallelism.weight_matmul`. Under `tapping(...)` that point runs the matmul y = x @ w as a
`jax.custom_vjp` with one more input, a tap: zeros shaped like (x, y). Its backward returns the input gradient dy @
w^T (the matmul's own `input_grad`), no gradient for w, and, as the tap's "gradient", the pair (x, dy): the matmul's
input and output gradient, which is all its weight gradient needs. So `jax.vjp` of a layer with its taps gives, for
one output gradient, the input gradient, the small parameters' gradients and every weight matmul's (x, dy) (`B`),
and `weight_grads` turns those pairs into the weight gradients later (`W`) by the matmul's own `weight_grad`: the
products autodiff would have computed, none twice, and no primal product recomputed for either half. A matmul that
reads the same x as an earlier one (queries, keys and values; SwiGLU's gate and up) hands back an empty x and W
reuses the earlier one's, so W keeps each distinct input once.

Which weight a matmul multiplies by is found by identity: the w `dense` receives is one of the layer's parameter
leaves (`nnx.merge` hands them out as they are), checked when the sites are recorded (`record_sites`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from functools import partial
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp

from msjax.sharding import use_parallelism

_EMPTY = jax.ShapeDtypeStruct((0,), jnp.float32)  # the x of a matmul that reuses an earlier matmul's


@dataclasses.dataclass(frozen=True)
class Site:
    """One weight matmul of a layer, in the order the layer runs them.

    Attributes:
      plain: the matmul (`msjax.model.WeightMatmul`: (x, w) -> y, and the two halves of its backward).
      param: index of its weight among the layer's parameter leaves (`jax.tree.leaves(state)`).
      x_from: None when its tap keeps its own x; else the earlier site that reads the same x.
      x, y: its input and output (shapes for one layer and microbatch).
    """

    plain: Any
    param: int
    x_from: int | None
    x: jax.ShapeDtypeStruct
    y: jax.ShapeDtypeStruct

    @property
    def tap(self) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
        """What its tap holds (and its backward hands back): (x or an empty array, dy)."""
        return (self.x if self.x_from is None else _EMPTY), self.y


@dataclasses.dataclass
class _Recording:
    leaf_index: dict[int, int]
    sites: list[Site]
    xs: list[Any]


@dataclasses.dataclass
class _Tapping:
    leaf_index: dict[int, int]
    sites: tuple[Site, ...]
    taps: Iterator[Any]
    count: int = 0


_STATE: contextvars.ContextVar[_Recording | _Tapping | None] = contextvars.ContextVar("msjax_split_backward",
                                                                                    default=None)


def _leaf_of(state: _Recording | _Tapping, w: jax.Array) -> int:
    index = state.leaf_index
    if id(w) not in index:
        raise RuntimeError("split backward: a weight matmul's weight is not one of the layer's parameters as they "
                           "are (computed from them first?), so its gradient cannot be deferred")
    return index[id(w)]


def _hook(plain: Callable, x: jax.Array, w: jax.Array) -> jax.Array:
    """`Parallelism.weight_matmul` under `recording` / `tapping`."""
    state = _STATE.get()
    if isinstance(state, _Recording):
        y = plain(x, w)
        earlier = next((j for j, seen in enumerate(state.xs) if seen is x), None)
        state.sites.append(Site(plain, _leaf_of(state, w), earlier,
                                jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(y.shape, y.dtype)))
        state.xs.append(x)
        return y
    site = state.sites[state.count]
    state.count += 1
    if _leaf_of(state, w) != site.param:
        raise RuntimeError("split backward: the layer's weight matmuls differ from the recorded ones")
    return _tapped(plain, site.x_from is None, x, w, next(state.taps))


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _tapped(plain: Callable, keep_x: bool, x: jax.Array, w: jax.Array, tap: Any) -> jax.Array:
    return plain(x, w)


def _tapped_fwd(plain, keep_x, x, w, tap):
    return plain(x, w), (x, w)


def _tapped_bwd(plain, keep_x, res, dy):
    x, w = res
    dx = plain.input_grad(w, dy, x.dtype)  # the weight's gradient is W's
    return dx, None, (x if keep_x else jnp.zeros((0,), jnp.float32), dy)


_tapped.defvjp(_tapped_fwd, _tapped_bwd)


def record_sites(layer: Callable[[Any, jax.Array], jax.Array], state: Any, x: Any) -> tuple[Site, ...]:
    """The weight matmuls of `layer(state, x)` (abstract `state` and `x` suffice), in order. Raises RuntimeError
    when a weight is not a parameter leaf as it is."""

    def run(state, x):
        token = _STATE.set(_Recording({id(a): j for j, a in enumerate(jax.tree.leaves(state))}, found, []))
        try:
            with use_parallelism(weight_matmul=_hook):
                return layer(state, x)
        finally:
            _STATE.reset(token)

    found: list[Site] = []
    jax.eval_shape(run, state, x)
    return tuple(found)


def zero_taps(sites: tuple[Site, ...], leading: tuple[int, ...] = ()) -> tuple:
    """Zero taps for `sites`, with `leading` axes in front (the stacked layers' axis for a scan)."""
    return tuple(tuple(jnp.zeros((*leading, *s.shape), s.dtype) for s in site.tap) for site in sites)


@contextlib.contextmanager
def tapping(sites: tuple[Site, ...], state: Any, taps: tuple) -> Iterator[None]:
    """Runs the layer traced inside with its weight matmuls tapped (module docstring): `state` the layer's
    parameters as the layer receives them, `taps` from `zero_taps(sites)` (one layer's slice under a scan)."""
    token = _STATE.set(_Tapping({id(a): j for j, a in enumerate(jax.tree.leaves(state))}, sites, iter(taps)))
    try:
        with use_parallelism(weight_matmul=_hook):
            yield
    finally:
        _STATE.reset(token)


def weight_grads(sites: tuple[Site, ...], state: Any, pairs: tuple, stacked: bool) -> dict[int, jax.Array]:
    """W: the weight gradients from the (x, dy) pairs B handed back, by each matmul's own `weight_grad`.

    Args:
      sites: the layer's weight matmuls (`record_sites`).
      state: the layer's parameters (stacked over a leading layers axis when `stacked`).
      pairs: B's tap gradients, one (x, dy) per site (stacked when `stacked`).
    Returns:
      {parameter leaf index: its gradient, stacked when `stacked`}: a weight that two matmuls multiply by gets
      their sum.
    """
    leaves = jax.tree.leaves(state)
    out: dict[int, jax.Array] = {}
    for j, site in enumerate(sites):
        x = pairs[j if site.x_from is None else site.x_from][0]
        dy = pairs[j][1]

        def one(w, x, dy, plain=site.plain):
            return plain.weight_grad(x, dy, w.dtype)

        g = jax.vmap(one)(leaves[site.param], x, dy) if stacked else one(leaves[site.param], x, dy)
        out[site.param] = out[site.param] + g if site.param in out else g
    return out
