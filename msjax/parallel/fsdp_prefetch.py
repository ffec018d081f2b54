"""FSDP prefetch: layer i+1's parameter all-gather issued before layer i's compute (`mesh.fsdp_prefetch`).

Under FSDP (ZeRO-3) every layer's weights are sharded over `fsdp` and all-gathered just before use. Left to
GSPMD inside the layer scan, the gather of layer i sits at the top of iteration i, in front of the matmuls that
need it: nothing to hide it behind unless the scheduler hoists it across the loop boundary. Here the scan carries
the gathered weights: iteration i starts layer i+1's all-gather, then runs layer i on the weights gathered one
iteration earlier (PyTorch FSDP's forward prefetch; MegaScale sec. 3.2, "the all-gather of the next layer's
parameters overlapped with the current layer's forward"). Memory: one extra layer of gathered weights.

The layer loop runs manual over `fsdp` (a `shard_map`; the other mesh axes stay with the compiler) and the gather
is our own `jax.lax.all_gather`, not a sharding constraint, because of what its transpose is: `psum_scatter`. So
the backward scan reduce-scatters each layer's weight gradients over `fsdp` in the iteration after the one that
produced them, independent of and beside the next layer's backward matmuls, instead of leaving the reduction to
GSPMD (which on XLA:CPU emits an all-reduce of the whole gradient and a slice). tests/msjax/test_overlap.py reads
both orders off the compiled program.

Where the layer runs a shard_map of its own (context parallelism, `mesh.sequence > 1`; collective matmul, which
gathers FSDP weights by hand inside its region), the gather ahead is a sharding constraint under GSPMD instead:
with jax 0.10 a partial-manual shard_map nested in the manual `fsdp` region gets residuals sharded over the
outer manual axis, which Shardy rejects ("manual axes must come before free axes").
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from msjax.parallel import options
from msjax.sharding import active_rules, drop_axes, nested_shard_map, region_mesh, region_spec
from msjax.sharding_rules import axes as ax
from msjax.sharding_rules import logical_to_mesh_spec


def _fsdp_dim(spec: P) -> int:
    """The dimension of a parameter that `spec` splits over `fsdp` (the rule sets put it on `embed` alone), or -1."""
    for dim, entry in enumerate(spec):
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        if ax.FSDP in axes:
            if len(axes) > 1:
                raise ValueError(f"PartitionSpec {spec}: dimension {dim} splits over {axes}; FSDP prefetch gathers "
                                 f"a dimension split over {ax.FSDP!r} alone")
            return dim
    return -1


def _prefetched_scan(run: Callable, x_btd: jax.Array, stacked: Any, gather: Callable, unroll: int) -> jax.Array:
    """The layer loop with the gather one iteration ahead: iteration i gathers layer i+1 (before its matmuls, on
    which they do not depend) and runs layer i on the weights gathered in iteration i - 1; `unroll` iterations
    per loop trip (jax.lax.scan's)."""
    def body(carry, next_params):
        x, current = carry
        upcoming = gather(next_params)  # issued before this layer's matmuls: the prefetch
        return (run(x, current), upcoming), None

    first = gather(jax.tree.map(lambda p: p[0], stacked))
    (x_btd, last), _ = jax.lax.scan(body, (x_btd, first), jax.tree.map(lambda p: p[1:], stacked), unroll=unroll)
    return run(x_btd, last)


def scan_layers(layer: Callable[[jax.Array, Any], tuple[jax.Array, Any]], x_btd: jax.Array, stacked: Any,
                unroll: int = 1) -> jax.Array:
    """`jax.lax.scan(layer, x, stacked, unroll=unroll)[0]` with each layer's FSDP all-gather one iteration ahead.

    Args:
      layer: `(x, one layer's params) -> (x, None)`, the scanned layer (remat applied by the caller).
      x_btd: the residual stream (B, T, D), batch split over (data, fsdp) as every rule set splits it.
      stacked: the layers' parameters (an nnx.State with a leading `layers` axis, L >= 1).
      unroll: layers per loop trip (`model.scan_unroll`).
    Returns:
      (B, T, D) after all L layers. Outside `msjax.sharding.use_rules`, or with `fsdp` of size 1, a plain scan.
    Raises:
      ValueError: a parameter dimension split over `fsdp` together with another mesh axis.
    """
    active = active_rules()
    if active is None or active[0].shape[ax.FSDP] == 1:  # nothing split over fsdp: nothing to gather ahead
        return jax.lax.scan(layer, x_btd, stacked, unroll=unroll)[0]
    mesh, rules = active
    specs = jax.tree.map(lambda s: logical_to_mesh_spec(tuple(s), rules), nnx.get_partition_spec(stacked),
                         is_leaf=lambda s: isinstance(s, P))

    def run(x, params):
        return layer(x, params)[0]

    if mesh.shape[ax.SEQUENCE] > 1 or options.active().tp == "collective_matmul":
        # GSPMD's gather: each layer's weights constrained to their layout without `fsdp` (module docstring).
        region = region_mesh(mesh)
        gathered = jax.tree.map(lambda s: NamedSharding(region, region_spec(drop_axes(P(*s[1:]), {ax.FSDP}), region)),
                                specs, is_leaf=lambda s: isinstance(s, P))
        return _prefetched_scan(run, x_btd, stacked,
                                lambda params: jax.tree.map(jax.lax.with_sharding_constraint, params, gathered), unroll)

    # Our own gather, manual over `fsdp`. Dimension 0 of a stacked parameter is `layers`, so the dimension split
    # over fsdp is d - 1 in one layer's slice (-1: not split, nothing to gather).
    leaves, treedef = jax.tree.flatten(stacked)
    dims = [_fsdp_dim(s) for s in treedef.flatten_up_to(specs)]
    in_specs = [P(*[ax.FSDP if i == d else None for i in range(x.ndim)]) for x, d in zip(leaves, dims)]

    def gather(params):  # all-gather forward; its transpose reduce-scatters the gradient
        return [p if d < 0 else jax.lax.all_gather(p, ax.FSDP, axis=d - 1, tiled=True) for p, d in zip(params, dims)]

    def per_fsdp_shard(x, *local):  # this device's batch rows and parameter shards
        return _prefetched_scan(lambda x, params: run(x, jax.tree.unflatten(treedef, params)), x, list(local), gather,
                                unroll)

    return nested_shard_map(per_fsdp_shard, mesh, in_specs=(P(ax.FSDP), *in_specs), out_specs=P(ax.FSDP),
                            axis_names={ax.FSDP}, check_vma=True)(x_btd, *leaves)
