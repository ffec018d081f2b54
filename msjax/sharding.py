"""Where logical axis names meet the mesh: the one activation-layout helper, parameter shardings, and the points
where parallelism is applied to a model from outside it.

The model names axes; `use_rules(mesh, rules)` says, for the code traced inside it, which mesh axes those names
land on. Outside such a context `constrain` is the identity, so the model also runs as plain single-device code.

Parallelism that changes how a model computes, not only where its arrays live, reaches it the same way: the model
asks `applied()` at five declared points (run one block, scan the stacked layers, mark the input whose gradient ends
the backward, run one weight matmul, run a mixture of experts' experts) and does its own plain math where nothing is
applied. `msjax.parallel` installs its transforms with `use_parallelism` (the collective matmul and FSDP prefetch
from `use_overlap`, the arrival marks from `use_arrival_marks`, expert parallelism from `use_expert_parallelism`);
the model never imports it (torchtitan's `parallelize_llama` applies tensor, FSDP and pipeline parallelism to a
model that knows none of them, the same split).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from msjax.sharding_rules import Rules, logical_to_mesh_spec

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
    region = region_mesh(mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(region, region_spec(logical_to_mesh_spec(names, rules),
                                                                                  region)))


@dataclass(frozen=True)
class Parallelism:
    """The transforms `msjax.parallel` applies to a model, each None where the model's own code runs.

    Attributes:
      block: `(block, x_btd) -> y_btd`, one transformer layer computed another way (the collective matmul). It
        reads the block through the interface the block declares (`msjax.model.Block`: its attention's
        projections and `finish_qkv`, its MLP's `column_weights` and `activate`).
      scan_layers: `(layer, x_btd, stacked, unroll) -> x_btd`, the stacked layers' scan
        (`jax.lax.scan(layer, x, stacked, unroll=unroll)[0]` by default; FSDP prefetch gathers ahead).
      backward_end: `x_btd -> x_btd`, an identity on the embedding output whose gradient marks where the backward
        pass ends (the straggler detector's arrival marks).
      weight_matmul: `(matmul, x, w) -> matmul(x, w)`, one weight matmul computed with a different backward (the
        split backward's record of its input and output gradient, `msjax.parallel.split_backward`); `matmul` is the
        model's own (`msjax.model.WeightMatmul`: the product and the two halves of its backward).
      experts: `(moe, x_btd, weights_btk, experts_btk) -> y_btd`, a dropless mixture of experts' output (B, T, D)
        after the routing: each token's k experts weighted by the router, plus the shared expert, computed on a
        mesh (expert parallelism's all-to-all, `msjax.parallel.expert`). It reads the layer through
        `msjax.model.MoE`'s declared names; the routing (weights_btk float32, experts_btk int32, (B, T, k)) is
        the model's.
    """

    block: Callable[[Any, jax.Array], jax.Array] | None = None
    scan_layers: Callable[..., jax.Array] | None = None
    backward_end: Callable[[jax.Array], jax.Array] | None = None
    weight_matmul: Callable[[Callable, jax.Array, jax.Array], jax.Array] | None = None
    experts: Callable[[Any, jax.Array, jax.Array, jax.Array], jax.Array] | None = None


_PARALLELISM: contextvars.ContextVar[Parallelism] = contextvars.ContextVar("msjax_parallelism",
                                                                          default=Parallelism())


@contextlib.contextmanager
def use_parallelism(**transforms: Callable | None) -> Iterator[None]:
    """Applies `transforms` (fields of `Parallelism`; the others stay as the enclosing context has them) to models
    traced inside this context."""
    token = _PARALLELISM.set(dataclasses.replace(_PARALLELISM.get(), **transforms))
    try:
        yield
    finally:
        _PARALLELISM.reset(token)


def applied() -> Parallelism:
    """The transforms of the enclosing `use_parallelism` contexts (none outside them)."""
    return _PARALLELISM.get()


def region_mesh(mesh: Mesh) -> Any:
    """The mesh that shardings and nested `shard_map`s must name at this point of a trace.

    Inside a partial-manual shard_map (the pipeline's stages) the context's abstract mesh marks the axes already
    manual; a sharding or a nested shard_map built on the concrete `mesh` is rejected there as belonging to
    another mesh. Outside one, `mesh` itself.
    """
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context.manual_axes:
        return context
    return mesh


def region_spec(spec: PartitionSpec, region: Any) -> PartitionSpec:
    """`spec` as seen inside a manual region: the mesh axes `region` (from `region_mesh`) has already made manual
    are dropped (inside FSDP prefetch's region over `fsdp`, a batch split over ("data", "fsdp") is, per device,
    split over "data" alone)."""
    manual = set(getattr(region, "manual_axes", ()))
    return drop_axes(spec, manual) if manual else spec


def drop_axes(spec: PartitionSpec, axes: Iterable[str]) -> PartitionSpec:
    """`spec` with the mesh `axes` removed from every dimension (a dimension left with none is replicated)."""
    dropped = set(axes)
    out = []
    for entry in spec:
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        kept = tuple(a for a in names if a not in dropped)
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return PartitionSpec(*out)


def nested_shard_map(f: Callable, mesh: Mesh, in_specs: Any, out_specs: Any,
                     axis_names: Iterable[str] | None = None, **kwargs: Any) -> Callable:
    """`jax.shard_map` over `axis_names` (default: every axis of `mesh`) that also works inside another
    partial-manual shard_map: there it uses the context mesh (`region_mesh`) and leaves out the axes the
    enclosing region already made manual (e.g. `pipeline` inside a pipeline stage), in `axis_names` and in the
    specs (`region_spec`). Extra keyword arguments go to `jax.shard_map` (check_vma, ...)."""
    region = region_mesh(mesh)
    names = set(mesh.axis_names if axis_names is None else axis_names)
    names -= set(getattr(region, "manual_axes", ()))
    in_specs, out_specs = jax.tree.map(lambda s: region_spec(s, region), (in_specs, out_specs),
                                       is_leaf=lambda s: isinstance(s, PartitionSpec))
    return jax.shard_map(f, mesh=region, in_specs=in_specs, out_specs=out_specs, axis_names=names, **kwargs)


def tree_shardings(logical_specs: Any, mesh: Mesh, rules: Rules) -> Any:
    """NamedShardings for a pytree of logical PartitionSpecs (as `nnx.get_partition_spec` returns)."""
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, logical_to_mesh_spec(tuple(spec), rules)),
        logical_specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )
