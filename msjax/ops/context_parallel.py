"""Context parallelism: attention with queries split over `sequence`, keys and values all-gathered by hand so
that the backward pass reduce-scatters dK/dV.

With `mesh.sequence > 1` queries stay split over `sequence` and every shard needs all keys and values. Left to
GSPMD (a sharding constraint that replicates K/V over `sequence`), the backward pass sums the per-shard dK/dV
with an all-reduce of the whole (B, S, G, K) gradient and then keeps a slice of it. Here attention runs under
`jax.shard_map` on each device's (batch, sequence, heads) block (attention is independent across batch and
heads, so the body is fully manual and GSPMD cannot re-layout it): an explicit
`jax.lax.all_gather` of K/V, whose transpose is `psum_scatter`, so each shard receives only the dK/dV rows it
owns: half the bytes of the all-reduce (a ring all-reduce moves 2 (n-1)/n of the buffer per device, a
reduce-scatter (n-1)/n; Patarasuk & Yuan 2009). docs/planner.md counts this saving; tests/msjax/test_overlap.py
reads it off the compiled program. Queries are masked at their offset in the sequence.
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from msjax.sharding import nested_shard_map
from msjax.sharding_rules import axes as ax


def sequence_sharded_attention(attend: Callable[..., jax.Array], mesh: Mesh, q_bthk: jax.Array,
                               k_bshk: jax.Array, v_bshk: jax.Array, *, q_spec: P, kv_spec: P,
                               segments_bt: jax.Array | None = None) -> jax.Array:
    """Causal attention with T split over mesh axis `sequence`; keys/values gathered, dK/dV reduce-scattered.

    Args:
      attend: `(q, k, v, q_offset[, q_segments, k_segments]) -> out`, attention on one shard's queries against
        all keys, q_offset the first query's position (int32 scalar), the segment ids (B, T/n) of this shard's
        queries and (B, S) of all keys when `segments_bt` is given; e.g. `msjax.ops.attention.xla_attention`.
      mesh: the active mesh; every axis is manual in the body.
      q_bthk: queries (B, T, H, K), T split over `sequence`.
      k_bshk, v_bshk: keys and values (B, S=T, G, K), S split over `sequence` like T.
      q_spec, kv_spec: their PartitionSpecs; dimension 1 must be exactly `sequence`.
      segments_bt: int32 (B, T) segment ids of packed examples, split like the queries' (B, T), or None.
    Returns:
      (B, T, H, K), laid out as `q_spec`.
    Raises:
      ValueError: a spec that does not split dimension 1 over `sequence` alone.
    """
    for name, spec in (("q_spec", q_spec), ("kv_spec", kv_spec)):
        if len(spec) < 2 or spec[1] != ax.SEQUENCE:
            raise ValueError(f"{name}={spec}: context parallelism needs dimension 1 split over {ax.SEQUENCE!r}")

    def body(q, k, v, *segments):
        k = jax.lax.all_gather(k, ax.SEQUENCE, axis=1, tiled=True)
        v = jax.lax.all_gather(v, ax.SEQUENCE, axis=1, tiled=True)
        offset = jax.lax.axis_index(ax.SEQUENCE) * q.shape[1]
        if not segments:
            return attend(q, k, v, offset)
        (q_seg,) = segments  # the keys' ids: every shard's, as the keys themselves
        return attend(q, k, v, offset, q_seg, jax.lax.all_gather(q_seg, ax.SEQUENCE, axis=1, tiled=True))

    args, specs = (q_bthk, k_bshk, v_bshk), (q_spec, kv_spec, kv_spec)
    if segments_bt is not None:
        args, specs = args + (segments_bt,), specs + (P(*tuple(q_spec)[:2]),)
    return nested_shard_map(body, mesh, in_specs=specs, out_specs=q_spec, check_vma=True)(*args)
