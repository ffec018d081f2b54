"""ZeRO-2's gradient reduction written out: one reduce-scatter over `fsdp` per gradient (`mesh.rules=zero2`).

ZeRO stage 2 (Rajbhandari et al. 2020, sec. 5.2) keeps the parameters whole on every data-parallel device and
shards the gradients and optimizer state: each device needs only the reduced gradient of the slice of optimizer
state it owns, so the gradient reduction is a reduce-scatter, (n-1)/n of the gradient's bytes per device on a
ring, where an all-reduce moves 2 (n-1)/n (Patarasuk & Yuan 2009). Left to GSPMD (a sharding constraint from the
replicated parameters' partial gradients to the sharded layout), XLA:CPU compiles the reduction to an all-reduce
of the whole gradient followed by a slice, inside the backward layer loop; only XLA:GPU's reduce-scatter creator
pass would fuse that pair, so the bytes a step moves would depend on the backend.

Here the gradient computation runs under `jax.shard_map`, manual over the batch axes `data` and `fsdp` (the
others, `tensor` and `sequence`, stay with the compiler, so the model's own layout constraints and nested
shard_maps keep working). Each device computes the mean loss and gradients of its own rows, then:
  - a gradient that the optimizer-state rules split over `fsdp` (on its `embed` dimension) is reduce-scattered
    over `fsdp` with `jax.lax.psum_scatter`, and the 1/fsdp slice all-reduced over `data` (hierarchical: the
    slow cross-`data` links carry 1/fsdp of the gradient);
  - any other gradient (norm scales, biases: no `embed` dimension) is all-reduced over `data` and `fsdp`.
The sums are divided by the number of batch shards, so the result is the gradient of the global mean loss, as
the plain data-parallel step computes it (tests/msjax/test_overlap.py: equal to one device within 1e-5, and the
reduce-scatters and their bytes read off the compiled step).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from msjax.sharding_rules import axes as ax

BATCH_AXES = (ax.DATA, ax.FSDP)  # mesh.expert is 1 under ZeRO-2 (the config refuses more)

LocalGrads = Callable[[Any, dict], tuple[jax.Array, Any]]


def fsdp_dim(spec: P) -> int:
    """The dimension that PartitionSpec `spec` splits over `fsdp`, or -1 when none does."""
    for dim, entry in enumerate(spec):
        if ax.FSDP in ((entry,) if isinstance(entry, str) else tuple(entry or ())):
            return dim
    return -1


def reduce_scattered_grads(local_grads: LocalGrads, mesh: Mesh, grad_shardings: Any) -> LocalGrads:
    """Wraps a per-device gradient function so that its gradients are reduce-scattered over `fsdp`.

    Args:
      local_grads: `(params, batch) -> ((loss, report), grads)`: the mean loss (float32 scalar), a dict of
        float32 scalars reported beside it (`train_step`'s: empty for a dense model; with MoE layers their router
        losses, computed over this device's tokens, so the step's are the devices' mean) and its gradients
        (float32, like `params`) over the rows of `batch` it is given (a dict of (B, T) arrays). Called on one
        device's rows, inside a region manual over `data` and `fsdp`.
      mesh: the train step's mesh (no axis manual around the call).
      grad_shardings: NamedSharding pytree like `params`: the layout the optimizer keeps the gradients in.
        A dimension split over `fsdp` must be split over `fsdp` alone, and never over `data`.
    Returns:
      `(params, batch) -> ((loss, report), grads)` for the global batch: the loss is the mean over every row, the
      gradients are its gradients, laid out over `fsdp` as `grad_shardings` says (other mesh axes as the
      compiler propagates them; the caller constrains them to `grad_shardings`). The batch's arrays are (B, T)
      with B split over `data` x `fsdp`; `params` must be replicated over both. A weighted loss (a batch with
      "weights") is not a mean of the devices' means: the config refuses it with ZeRO-2.
    Raises:
      ValueError: a gradient layout that splits a dimension over `data`, or over `fsdp` together with another
        axis.
    """
    specs = jax.tree.map(lambda s: s.spec, grad_shardings, is_leaf=lambda s: isinstance(s, NamedSharding))
    for spec in jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P)):
        for entry in spec:
            names = (entry,) if isinstance(entry, str) else tuple(entry or ())
            if ax.DATA in names or (ax.FSDP in names and len(names) > 1):
                raise ValueError(f"gradient PartitionSpec {spec}: the ZeRO-2 reduction shards a dimension over "
                                 f"{ax.FSDP!r} alone and none over {ax.DATA!r}")
    shards = mesh.shape[ax.DATA] * mesh.shape[ax.FSDP]

    def reduce(grad: jax.Array, spec: P) -> jax.Array:
        dim = fsdp_dim(spec)
        if dim < 0:
            return jax.lax.psum(grad, BATCH_AXES) / shards
        grad = jax.lax.psum_scatter(grad, ax.FSDP, scatter_dimension=dim, tiled=True)
        return jax.lax.psum(grad, ax.DATA) / shards

    def per_device(params, batch):
        (loss, report), grads = local_grads(params, batch)
        grads = jax.tree.map(reduce, grads, specs, is_leaf=lambda s: isinstance(s, P))
        report = jax.tree.map(lambda r: jax.lax.psum(r, BATCH_AXES) / shards, report)
        return (jax.lax.psum(loss, BATCH_AXES) / shards, report), grads

    out_grads = jax.tree.map(lambda s: P(*[ax.FSDP if d == fsdp_dim(s) else None for d in range(len(s))]), specs,
                             is_leaf=lambda s: isinstance(s, P))
    def run(params, batch):
        replicated = jax.tree.map(lambda _: P(), params)
        # check_vma=False: the per-device gradients are varying over the batch axes by construction, and the
        # loops inside (gradient accumulation) start from zeros that check_vma would ask to be cast varying.
        rows = jax.tree.map(lambda _: P(BATCH_AXES), batch)
        return jax.shard_map(per_device, mesh=mesh, in_specs=(replicated, rows), out_specs=(P(), out_grads),
                             axis_names=set(BATCH_AXES), check_vma=False)(params, batch)

    return run
