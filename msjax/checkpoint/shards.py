"""Per-host checkpoints: which files of a step each process writes, uploads and needs, for hosts that share no disk.

With a local tier, every process runs its own Orbax writer on its own local directory (`<local_dir>/process-<i>/`,
which may be a path that exists separately on each host): the arrays in zarr, one file per chunk, every chunk this
process holds (replicas included, so the host restores from its own tier alone when the layout is unchanged), and
Orbax's metadata files. This is Orbax's emergency-checkpoint local tier (each host a primary of its own directory,
`MultiprocessingOptions(primary_host=None)`, `ArrayHandler(replica_id=None)`); where it differs: the files are
Orbax's ordinary zarr layout, so the union of every host's files is one ordinary checkpoint, readable on any mesh.

Why zarr and not OCDBT (Orbax's default): OCDBT keeps one database per process and merges their manifests into
one at the commit, on the primary host, which reads every process's files; zarr keeps each chunk a file named by
its position in the chunk grid (`state/<param>/<i>.<j>`), so a chunk's name says which part of which array it
holds, and a host can upload, or download, exactly its own part.

Naming used here (Orbax 0.12's): the train state is the composite item `state`; an array's directory is its
parameter name (`ocp.tree.get_param_names`: key path entries joined with "."); `.zarray` holds its shape and chunk
shape; chunk keys join chunk-grid indices with "." ("0" for a scalar).

- `owned_chunks` (at save): the chunks a process uploads, each chunk by exactly one process: a block held in R
  replicas (replica ids 0..R-1, one per device) has each of its chunks uploaded by the holder of replica
  `hash(chunk) mod R`, so a state replicated over data-parallel replicas is uploaded by all of them in parts (what
  Orbax's `use_replica_parallel` does for its own writes). Process 0 also uploads every file that is not a chunk
  (metadata, the loader position).
- `needed_chunks` (at restore): the chunks a process reads for the shardings it restores onto (none for a process
  outside a single-replica restore's source replica).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import jax
import orbax.checkpoint as ocp

STATE_ITEM = "state"  # the composite item the train state is saved under (Checkpointer.save)
ZARRAY = ".zarray"


def param_dirs(state: Any) -> list[str]:
    """The directory of each leaf of `state` inside a step, `state/<param name>`, in `jax.tree.leaves` order."""
    names = jax.tree.leaves(ocp.tree.get_param_names(state, include_empty_nodes=False))
    return [f"{STATE_ITEM}/{n}" for n in names]


def chunk_keys(index: tuple, shape: tuple[int, ...], chunks: Iterable[int]) -> list[str]:
    """The zarr chunk keys ("i.j", "0" for a scalar) of the chunks that overlap the block `index` (a tuple of
    slices, as `Shard.index`) of an array of `shape` stored in chunks of shape `chunks`."""
    if not shape:
        return ["0"]
    ranges = []
    for sl, n, c in zip(index, shape, chunks, strict=True):
        start, stop, _ = sl.indices(n)
        if stop <= start:
            return []
        ranges.append(range(start // c, (stop - 1) // c + 1))
    return [".".join(map(str, k)) for k in itertools.product(*ranges)]


@dataclass(frozen=True)
class ShardIndex:
    """One block of one array that this process holds, as a save or restore sees it: the array's directory and
    shape, the block it covers, the replica ids of this process's copies of it (one per device holding it here;
    empty for a host value another process uploads) and how many replicas of the block the whole job holds. Taken
    from shardings only (no device data is read)."""

    param_dir: str
    shape: tuple[int, ...]
    index: tuple
    replica_ids: tuple[int, ...] = (0,)
    replicas: int = 1


def _block(index: tuple, shape: tuple[int, ...]) -> tuple:
    return tuple(sl.indices(n)[:2] for sl, n in zip(index, shape))


def shard_indices(state: Any) -> list[ShardIndex]:
    """This process's blocks of every array of `state`, one entry per distinct block. Leaves are jax Arrays
    (replica ids from their shards' metadata, replica counts from their sharding; no device data is read), host
    values (NumPy arrays, scalars: uploaded by process 0 alone), or ShapeDtypeStructs with a sharding (replica id
    0 of 1: what a restore reads does not depend on it) or without one (the whole array)."""
    out: list[ShardIndex] = []
    for d, leaf in zip(param_dirs(state), jax.tree.leaves(state), strict=True):
        shape = tuple(getattr(leaf, "shape", ()))  # a Python scalar has none
        whole = tuple(slice(0, n) for n in shape)
        counts: dict[tuple, int] = {}
        if isinstance(leaf, jax.Array):
            pairs = [(s.index, s.replica_id) for s in leaf.addressable_shards]
            for index in leaf.sharding.devices_indices_map(shape).values():  # every device's block, job-wide
                counts[_block(index, shape)] = counts.get(_block(index, shape), 0) + 1
        elif not isinstance(leaf, jax.ShapeDtypeStruct):  # a host value (NumPy, a scalar): process 0's to upload
            pairs = [(whole, 0)] if jax.process_index() == 0 else [(whole, None)]
        elif leaf.sharding is None:  # restored whole, onto one device or as a NumPy array
            pairs = [(whole, 0)]
        else:
            pairs = [(i, 0) for i in leaf.sharding.addressable_devices_indices_map(shape).values()]
        blocks: dict[tuple, tuple[tuple, set]] = {}
        for index, rid in pairs:
            _, rids = blocks.setdefault(_block(index, shape), (index, set()))
            if rid is not None:
                rids.add(rid)
        out.extend(ShardIndex(d, shape, index, tuple(sorted(rids)), counts.get(key, 1))
                   for key, (index, rids) in blocks.items())
    return out


def chunk_shape(step_dir: Path, param_dir: str) -> tuple[int, ...]:
    """The chunk shape recorded in `<step_dir>/<param_dir>/.zarray`. Raises OSError, ValueError (not zarr)."""
    meta = json.loads((step_dir / param_dir / ZARRAY).read_text())
    return tuple(int(c) for c in meta["chunks"])


def owned_chunks(step_dir: Path, shards: list[ShardIndex]) -> set[str]:
    """The chunk files (paths relative to the step) this process uploads: of each block's chunks, those whose
    replica `owner(chunk, replicas)` it holds, so that every chunk is uploaded by exactly one process and the
    replicas of a block share its upload."""
    return {rel for s, rel in _chunks_of(step_dir, shards) if owner(rel, s.replicas) in s.replica_ids}


def owner(rel: str, replicas: int) -> int:
    """The replica id (0..replicas-1) whose holder uploads the chunk file `rel`: a hash of its name, the same on
    every process."""
    return int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big") % replicas


def needed_chunks(step_dir: Path, shards: list[ShardIndex]) -> set[str]:
    """The chunk files (relative to the step) that reading `shards` touches, with chunk shapes from the `.zarray`
    files under `step_dir`."""
    return {rel for _, rel in _chunks_of(step_dir, shards)}


def _chunks_of(step_dir: Path, shards: list[ShardIndex]) -> Iterable[tuple[ShardIndex, str]]:
    """(shard, chunk file relative to the step) for every chunk each of `shards` overlaps."""
    chunks: dict[str, tuple[int, ...]] = {}
    for s in shards:
        if s.param_dir not in chunks:
            chunks[s.param_dir] = chunk_shape(step_dir, s.param_dir)
        for k in chunk_keys(s.index, s.shape, chunks[s.param_dir]):
            yield s, f"{s.param_dir}/{k}"


def is_chunk(rel: str, array_dirs: set[str]) -> bool:
    """Whether the step-relative path `rel` is a chunk file: a file other than `.zarray` directly inside an array's
    directory (one that holds a `.zarray`)."""
    parent, _, name = rel.rpartition("/")
    return parent in array_dirs and name != ZARRAY


def array_dirs_of(rels: Iterable[str]) -> set[str]:
    """The array directories among step-relative file paths: the parents of `.zarray` files."""
    return {r.rpartition("/")[0] for r in rels if r.rpartition("/")[2] == ZARRAY}


def is_zarr_layout(rels: Iterable[str]) -> bool:
    """Whether a step's files are the per-chunk zarr layout (else Orbax's OCDBT: only read whole)."""
    return any(r.startswith(f"{STATE_ITEM}/") and r.endswith("/" + ZARRAY) for r in rels)


def relative_files(step_dir: Path) -> list[str]:
    """Every file under `step_dir`, as sorted POSIX paths relative to it."""
    return sorted(p.relative_to(step_dir).as_posix() for p in step_dir.rglob("*") if p.is_file())

