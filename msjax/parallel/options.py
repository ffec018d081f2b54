"""The overlap switches that traced code reads: which tensor-parallel overlap and whether FSDP prefetches.

The train step enters `use_overlap(cfg.mesh)` next to `msjax.sharding.use_rules` while it traces. It applies the
transforms the switches ask for to the model (`msjax.sharding.use_parallelism`: the collective matmul runs each
block, FSDP prefetch runs the layer scan), and the parallel code asks `active()`. Outside such a scope everything
is off, so the model still runs as plain single-device code.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterator

TP_OVERLAP_MODES = ("none", "xla", "collective_matmul")


@dataclass(frozen=True)
class Overlap:
    """tp: `none` (GSPMD's own all-gather / reduce-scatter), `xla` (the same program, with XLA's windowed
    einsum and async-collective flags from `msjax.parallel.xla_flags`), `collective_matmul` (our decomposed
    shard_map code, `msjax.parallel.collective_matmul`). fsdp_prefetch: gather layer i+1 during layer i."""

    tp: str = "none"
    fsdp_prefetch: bool = False


_ACTIVE: contextvars.ContextVar[Overlap] = contextvars.ContextVar("msjax_overlap", default=Overlap())


@contextlib.contextmanager
def use_overlap(mesh_cfg) -> Iterator[None]:
    """Makes code traced inside this context use the overlap switches of `mesh_cfg` (a `MeshConfig`), and applies
    the model transforms they select."""
    # Imported here: both transforms read these switches (`active`) themselves.
    from msjax.parallel import collective_matmul, fsdp_prefetch
    from msjax.sharding import use_parallelism

    token = _ACTIVE.set(Overlap(tp=mesh_cfg.tp_overlap, fsdp_prefetch=mesh_cfg.fsdp_prefetch))
    transforms = {"block": collective_matmul.block if mesh_cfg.tp_overlap == "collective_matmul" else None,
                  "scan_layers": fsdp_prefetch.scan_layers if mesh_cfg.fsdp_prefetch else None}
    try:
        with use_parallelism(**transforms):
            yield
    finally:
        _ACTIVE.reset(token)


def active() -> Overlap:
    """The switches of the enclosing `use_overlap` (all off outside one)."""
    return _ACTIVE.get()
