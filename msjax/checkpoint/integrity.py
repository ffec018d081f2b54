"""Per-array checksums of a train state, independent of its sharding, and the integrity record that makes a
checkpoint complete.

The checksum of an array x with n elements, read as 32-bit words b_i (16-bit dtypes widened, booleans and 8-bit
types widened likewise) at flat position i (row-major, of the global array), is two sums modulo 2^32:
  c1 = sum_i b_i * (2 i + 1)               c2 = sum_i rotl(b_i, 13) * h(i) | 1
with h a multiplicative hash (Knuth's 2654435761). Both weights are odd, so a single flipped bit at any position
changes c1 (2^k times an odd number is never 0 mod 2^32); garbage over a region collides in both lanes with
probability about 2^-64. It is not a cryptographic hash: it detects corruption, not tampering.

Why a weighted sum rather than CRC32 over the file bytes: a sum composes over shards. It is computed by one
jitted reduction on the arrays where they live; in a multi-process run every process reduces the shards it holds
(replicas are counted once, by XLA's SPMD partitioner) and an all-reduce combines them, so each process
checksums what it writes and no process gathers the whole state. And the value does not depend on the layout:
a checkpoint written on one mesh verifies after a restore onto another.

The record (`msjax_integrity.json` in the step directory) is written only after Orbax has committed the step
(its temporary directory renamed), from the checksums of the very arrays that were saved; a step directory
without a record is an interrupted write and is never restored.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

RECORD_NAME = "msjax_integrity.json"
RECORD_FORMAT = 1


def _words(x: jax.Array) -> jax.Array:
    """x as a flat uint32 array, one word per element (64-bit types are not used in the train state)."""
    x = x.reshape(-1)
    size = jnp.dtype(x.dtype).itemsize
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if size == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if size == 2:
        return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    if size == 1:
        return jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
    raise TypeError(f"checksum: unsupported dtype {x.dtype} (itemsize {size})")


def _array_checksum(x: jax.Array) -> jax.Array:
    """uint32 (3,): c1, c2, all-finite flag of one array; see the module docstring for the formula."""
    b = _words(x)
    i = jax.lax.iota(jnp.uint32, b.shape[0])
    c1 = jnp.sum(b * (2 * i + 1), dtype=jnp.uint32)
    rot = (b << 13) | (b >> 19)
    c2 = jnp.sum(rot * ((i * jnp.uint32(2654435761)) | 1), dtype=jnp.uint32)
    finite = jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)
    return jnp.stack([c1, c2, finite.astype(jnp.uint32)])


# One jitted reduction per array (not one over the whole tree): leaves may live on different device sets (a
# scalar on one device, a parameter over the mesh), and compiled reductions are shared by arrays of one shape.
_jitted_checksum = jax.jit(_array_checksum)


def checksum_state(state: Any) -> Callable[[], tuple[dict[str, str], bool]]:
    """Dispatches the checksums of every array of `state` and returns a function that fetches them.

    The reduction is dispatched asynchronously, so the caller is not blocked; the state's buffers are read
    before any later computation that donates them (PjRt orders a donation after pending reads).

    Args:
      state: pytree of jax.Arrays (any sharding, any number of processes; every process must call this).
    Returns:
      fetch(): ({key path: "c1c2" as 16 hex digits}, whether every floating-point array is finite); it blocks
      until the reduction is done.
    """
    sums = jax.tree.map(_jitted_checksum, state)

    def fetch() -> tuple[dict[str, str], bool]:
        out, finite = {}, True
        for path, sum3 in jax.tree_util.tree_flatten_with_path(jax.device_get(sums))[0]:
            c1, c2, ok = (int(v) for v in np.asarray(sum3))
            out[jax.tree_util.keystr(path)] = f"{c1:08x}{c2:08x}"
            finite = finite and bool(ok)
        return out, finite

    return fetch


def mismatches(expected: dict[str, str], actual: dict[str, str]) -> list[str]:
    """Key paths whose checksum differs, or that are present on one side only (sorted)."""
    keys = set(expected) | set(actual)
    return sorted(k for k in keys if expected.get(k) != actual.get(k))


def write_record(step_dir: Path, record: dict[str, Any]) -> None:
    """Writes `record` as the step's integrity record atomically (temporary file, fsync, rename, fsync of the
    directory), so a crash leaves either no record or a whole one.

    Raises:
      OSError: the step directory is not writable.
    """
    path = step_dir / RECORD_NAME
    tmp = step_dir / f".{RECORD_NAME}.tmp"
    with open(tmp, "w") as f:
        json.dump({"format": RECORD_FORMAT, **record}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(step_dir, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_record(step_dir: Path) -> dict[str, Any] | None:
    """The step's integrity record, or None if it has none (an interrupted write).

    Raises:
      ValueError: the record exists but is not a readable record of this format.
    """
    path = step_dir / RECORD_NAME
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"integrity record {path} is unreadable: {e}") from None
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT or "checksums" not in record:
        raise ValueError(f"integrity record {path} is not a format-{RECORD_FORMAT} record")
    return record
