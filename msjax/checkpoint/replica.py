"""Single-replica restore: state replicated over the data-parallel replicas is read by one replica and broadcast
to the others (Orbax's single-replica restore, MaxText's `enable_single_replica_ckpt_restoring`).

Without it every data-parallel replica reads the whole checkpoint: `data` times the storage traffic at a restart.
With it the devices of replica 0 (index 0 of the mesh's `data` axis) read their shards and one collective sum
over the `data` axis (Orbax's `broadcast_one_replica_to_all`: replica 0 holds the values, every other replica
zeros) gives every replica its copy.

Why not Orbax's `SingleReplicaArrayHandler` as it stands: its broadcast sums the values themselves, which is not
bit-exact. -0.0 + 0.0 = +0.0 in IEEE 754 (measured on this stack: a -0.0 parameter came back as +0.0), and a
bool leaf (optax.apply_if_finite's state) comes back as int32, because jnp.sum of bools is an integer sum. So
here Orbax's reader (the ordinary array handler) reads onto replica 0's devices, every leaf is reinterpreted as
unsigned integers of its width (bitcast; bools as uint8) before Orbax's broadcast, where a sum with zeros is
exact, and reinterpreted back afterwards.

It applies when every leaf has a NamedSharding on one mesh whose `data` axis is > 1, no leaf is split over
`data` (the state is replicated over it), and every process holds devices of replica 0 only or of other
replicas only, or all devices (one process): Orbax's assumption (its `_validate_sharding...` check and
`process_spans_multiple_replicas`). Otherwise `plan` says why and the caller restores normally.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

# Orbax's broadcast and replica helpers are not exported (orbax-checkpoint 0.12.8 keeps them in _src).
from msjax.compat import orbax_multislice as multislice

DATA_AXIS = "data"
PRIMARY_REPLICA = 0


@dataclass(frozen=True)
class ReplicaPlan:
    """How a single-replica restore runs: the global mesh, the index of its `data` axis, and the mesh of
    replica 0 (the same axis names, `data` of size 1)."""

    mesh: Mesh
    axis: int
    replica_mesh: Mesh

    @property
    def is_source(self) -> bool:
        """Whether this process holds devices of replica 0 (and so reads)."""
        return jax.process_index() in {d.process_index for d in self.replica_mesh.devices.flat}


def _spec_axes(spec) -> set[str]:
    out = set()
    for entry in spec:
        if entry is None:
            continue
        out.update(entry if isinstance(entry, tuple) else (entry,))
    return out


def plan(abstract_state: Any) -> tuple[ReplicaPlan | None, str]:
    """Whether `abstract_state` (leaves with `.sharding`) can be restored by one replica and broadcast.

    Returns:
      (plan, "") when it can; (None, reason) when not (the reason is one phrase, for a log line).
    """
    leaves = jax.tree.leaves(abstract_state)
    if not leaves:
        return None, "the state is empty"
    shardings = [getattr(x, "sharding", None) for x in leaves]
    if not all(isinstance(s, NamedSharding) for s in shardings):
        return None, "not every array has a NamedSharding"
    mesh = shardings[0].mesh
    if any(s.mesh != mesh for s in shardings):
        return None, "the arrays lie on different meshes"
    if DATA_AXIS not in mesh.axis_names or mesh.shape[DATA_AXIS] < 2:
        return None, "the mesh has no data axis > 1 (one replica)"
    split = [i for i, s in enumerate(shardings) if DATA_AXIS in _spec_axes(s.spec)]
    if split:
        return None, f"{len(split)} array(s) are split over the data axis (not replicated over it)"
    axis = mesh.axis_names.index(DATA_AXIS)
    if jax.process_count() > 1 and multislice.process_spans_multiple_replicas(mesh, replica_axis_index=axis):
        return None, "a process holds devices of more than one data-parallel replica"
    replica_devices = multislice.replica_devices(mesh, replica_id=PRIMARY_REPLICA, replica_axis_index=axis)
    replica_mesh = Mesh(np.expand_dims(replica_devices, axis), mesh.axis_names,
                        axis_types=mesh.axis_types)
    return ReplicaPlan(mesh, axis, replica_mesh), ""


def replica_abstract(abstract_state: Any, p: ReplicaPlan) -> Any:
    """`abstract_state` with every leaf placed on replica 0's devices (same partition spec): what Orbax reads."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                       sharding=NamedSharding(p.replica_mesh, x.sharding.spec)),
                        abstract_state)


def _uint(dtype) -> Any:
    size = jnp.dtype(dtype).itemsize
    return {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[size]


def _to_bits(x: jax.Array) -> jax.Array:
    return x.astype(jnp.uint8) if x.dtype == jnp.bool_ else jax.lax.bitcast_convert_type(x, _uint(x.dtype))


def _from_bits(b: jax.Array, dtype) -> jax.Array:
    # Orbax's jnp.sum widens 8- and 16-bit unsigned integers to uint32 (exact: one term is non-zero); narrow first.
    if dtype == jnp.bool_:
        return b != 0
    return jax.lax.bitcast_convert_type(b.astype(_uint(dtype)), dtype)


def _per_shard(fn, x: jax.Array, dtype) -> jax.Array:
    """`fn` applied to each addressable shard on its own device (no collective, so it runs on replica 0's
    processes alone), reassembled with x's sharding."""
    shards = [fn(s.data) for s in x.addressable_shards]
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards, dtype=dtype)


def broadcast(restored: Any, abstract_state: Any, p: ReplicaPlan) -> Any:
    """Broadcasts the state read by replica 0 (`restored`, on `replica_abstract` shardings; on processes outside
    replica 0 it is not read and may be `replica_abstract` itself) to every replica, bit for bit, onto the
    shardings of `abstract_state`. Every process must call it (it runs one collective per memory chunk)."""
    leaves, treedef = jax.tree.flatten(abstract_state)
    src = jax.tree.leaves(restored)
    bits = []
    for x, a in zip(src, leaves):
        u = _uint(jnp.uint8 if a.dtype == jnp.bool_ else a.dtype)
        if p.is_source:
            bits.append(_per_shard(_to_bits, x, u))
        else:
            bits.append(jax.ShapeDtypeStruct(a.shape, u, sharding=NamedSharding(p.replica_mesh, a.sharding.spec)))
    # The memory bound Orbax would estimate from the device's capacity: here the whole state in one chunk, which
    # is what a normal restore holds too (plus replica 0's copy, freed as it goes).
    limit = max(1, sum(multislice.get_leaf_memory_per_device(b) for b in bits)) * 2
    out, _ = multislice.broadcast_one_replica_to_all(tuple(bits), p.mesh, p.axis, p.is_source,
                                                     memory_limit_bytes=limit)
    dtypes = tuple(a.dtype for a in leaves)
    back = jax.jit(lambda bs: tuple(_from_bits(b, dt) for b, dt in zip(bs, dtypes)),
                   out_shardings=tuple(a.sharding for a in leaves))(tuple(out))
    return jax.tree.unflatten(treedef, back)
