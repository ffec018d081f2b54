"""FSDP prefetch: layer i+1's parameter all-gather issued before layer i's compute (`mesh.fsdp_prefetch`).

Under FSDP (ZeRO-3) every layer's weights are sharded over `fsdp` and all-gathered just before use. Left to
GSPMD inside the layer scan, the gather of layer i sits at the top of iteration i, in front of the matmuls that
need it: nothing to hide it behind unless the scheduler hoists it across the loop boundary. Here the scan carries
the gathered weights: iteration i starts layer i+1's all-gather, then runs layer i on the weights gathered one
iteration earlier (PyTorch FSDP's forward prefetch; MegaScale sec. 3.2, "the all-gather of the next layer's
parameters overlapped with the current layer's forward"). The transpose of the gather is the gradient's
reduction over `fsdp`, so the backward scan reduce-scatters layer i+1's gradients in iteration i, as the
backward produces them, instead of after the loop. Memory: one extra layer of gathered weights.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from msjax.sharding import active_rules
from sharding_rules import axes as ax
from sharding_rules import logical_to_mesh_spec


def _without_fsdp(spec: P) -> P:
    out = []
    for entry in spec:
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        kept = tuple(a for a in axes if a != ax.FSDP)
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return P(*out)


def scan_layers(layer: Callable[[jax.Array, Any], tuple[jax.Array, Any]], x_btd: jax.Array, stacked: Any
                ) -> jax.Array:
    """`jax.lax.scan(layer, x, stacked)[0]` with each layer's FSDP all-gather one iteration ahead.

    Args:
      layer: `(x, one layer's params) -> (x, None)`, the scanned layer (remat applied by the caller).
      x_btd: the residual stream (B, T, D).
      stacked: the layers' parameters (an nnx.State with a leading `layers` axis, L >= 1).
    Returns:
      (B, T, D) after all L layers. Outside `msjax.sharding.use_rules` this is a plain scan.
    """
    active = active_rules()
    if active is None:
        return jax.lax.scan(layer, x_btd, stacked)[0]
    mesh, rules = active
    logical = nnx.get_partition_spec(stacked)
    # One layer's layout with `fsdp` dropped: what the layer's matmuls read (still split over `tensor`).
    gathered = jax.tree.map(lambda s: NamedSharding(mesh, _without_fsdp(logical_to_mesh_spec(tuple(s)[1:], rules))),
                            logical, is_leaf=lambda s: isinstance(s, P))

    def gather(params):
        return jax.tree.map(jax.lax.with_sharding_constraint, params, gathered)

    first = gather(jax.tree.map(lambda p: p[0], stacked))
    rest = jax.tree.map(lambda p: p[1:], stacked)

    def body(carry, next_params):
        x, current = carry
        upcoming = gather(next_params)  # issued before this layer's matmuls: the prefetch
        x, _ = layer(x, current)
        return (x, upcoming), None

    (x_btd, last), _ = jax.lax.scan(body, (x_btd, first), rest)
    return layer(x_btd, last)[0]
