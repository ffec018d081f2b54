"""Where logical axis names meet the mesh: the one activation-layout helper and parameter shardings.

The model names axes; `use_rules(mesh, rules)` says, for the code traced inside it, which mesh axes those names
land on. Outside such a context `constrain` is the identity, so the model also runs as plain single-device code.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding_rules import Rules, logical_to_mesh_spec

_ACTIVE: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar("msjax_rules", default=None)


@contextlib.contextmanager
def use_rules(mesh: Mesh, rules: Rules) -> Iterator[None]:
    """Makes `constrain` lay activations out on `mesh` under `rules` for code traced inside this context."""
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_rules() -> tuple[Mesh, Rules] | None:
    """The (mesh, rules) of the enclosing `use_rules`, or None outside one."""
    return _ACTIVE.get()


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Pins activation `x` (one logical name per dimension, e.g. ("act_batch", "act_seq", "act_embed")) to the
    layout the active rule set gives those names; identity when no rules are active."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    if len(names) != x.ndim:
        raise ValueError(f"constrain: {len(names)} names {tuple(names)} for an array of rank {x.ndim}")
    # Inside a partial-manual shard_map (the pipeline's stages) the context mesh marks the manual axes; a
    # sharding must be built on that mesh, or jax rejects it as belonging to another mesh.
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context.manual_axes:
        mesh = context
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_mesh_spec(names, rules)))


def tree_shardings(logical_specs: Any, mesh: Mesh, rules: Rules) -> Any:
    """NamedShardings for a pytree of logical PartitionSpecs (as `nnx.get_partition_spec` returns)."""
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, logical_to_mesh_spec(tuple(spec), rules)),
        logical_specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )
