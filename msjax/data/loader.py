"""Batches of random token windows or of packed rows, assembled as global jax.Arrays, prefetched off the critical
path.

Token windows (a 1-D token array, data.format=text): sampling is nanoGPT's `get_batch`: each of the B rows of a
step is a window of T+1 consecutive tokens starting at a uniformly random position; inputs are its first T tokens
and targets its last T (the next-token shift). The B start positions of step s are drawn from
`np.random.default_rng([seed, s])`, so a batch is a pure function of (seed, step): resuming at step s needs
nothing but s, and every process draws the same positions.

Packed rows (`msjax.data.sft.PackedRows`, data.format=chat): the N rows are read in epochs, epoch e in the order
`np.random.default_rng([seed, e]).permutation(N)`, one epoch after another without end; step s takes positions
s*B .. s*B+B-1 of that sequence (`row_indices`). Each row is seen once per epoch, and a batch is again a pure
function of (seed, step). A batch has the rows' five keys (inputs, targets, weights, segments, positions).

Multi-host: each process gathers only the rows (and, under sequence sharding, the columns) that its addressable
devices hold, in the order `jax.make_array_from_process_local_data` expects (per dimension, the sorted distinct
shard starts of the process's devices), and that call assembles the global (B, T) array without any
communication.

Why Grain: the sampler is random access by step, which is exactly Grain's `MapDataset` model:
`MapDataset.range(0, ∞).map(batch_of_step)` is the whole pipeline; `ThreadPrefetchIterDataset` runs it in one
background thread with a bounded queue (`prefetch` batches), stops and joins that thread on `close()`, re-raises
a producer's exception in the consumer, and `grain.experimental.set_next_index` repositions it for `restore`.
Grain's own checkpoint state is not needed: the next step alone is the loader's state.

Dims: B global batch, T sequence length, N packed rows.
"""

from __future__ import annotations

import atexit
import weakref
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np

from msjax.data.corpus import DataError
from msjax.data.sft import PackedRows

# Upper end of the step range Grain indexes (a MapDataset needs a length): far beyond any run.
_MAX_STEPS = 1 << 62
# Second seed word of the evaluation windows, so they are not the training windows of some step.
_EVAL_STREAM = 0x6576616C  # "eval"


# Loaders still open at interpreter exit. Their prefetch thread may be inside a JAX transfer when Python tears
# down (C++ then aborts: "FATAL: exception not rethrown"), and Grain's finalizer trips over unloaded modules;
# closing them from atexit, which runs before both, ends the thread cleanly.
_OPEN_LOADERS: "weakref.WeakSet[BatchLoader]" = weakref.WeakSet()


@atexit.register
def _close_open_loaders() -> None:
    for loader in list(_OPEN_LOADERS):
        loader.close()


def _split_name(tokens: np.ndarray) -> str:
    filename = getattr(tokens, "filename", None)
    return f"split {Path(filename).stem!r} ({filename})" if filename else "token array"


def _check_tokens(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    if seq_len < 1:
        raise DataError(f"seq_len={seq_len}: allowed is an integer >= 1")
    if tokens.ndim != 1:
        raise DataError(f"{_split_name(tokens)}: expected 1-D token ids, got shape {tokens.shape}")
    if tokens.shape[0] < seq_len + 1:
        raise DataError(f"{_split_name(tokens)} holds {tokens.shape[0]} tokens; a window of seq_len={seq_len} "
                        f"needs at least {seq_len + 1} (add text, lower train.seq_len, or change "
                        "data.val_fraction)")
    return tokens


def _check_rows(rows: PackedRows, seq_len: int) -> PackedRows:
    if rows.num_rows < 1:
        raise DataError("the packed rows are empty: no example to batch")
    if seq_len != rows.seq_len:
        raise DataError(f"seq_len={seq_len}, but the rows were packed to {rows.seq_len} positions; pack them with "
                        "train.seq_len")
    return rows


def _local_indices(sharding: jax.sharding.Sharding | None, shape: tuple[int, int]) -> tuple[np.ndarray, ...]:
    """Per dimension, the global indices this process holds, in `make_array_from_process_local_data` order."""
    if sharding is None:
        return tuple(np.arange(n) for n in shape)
    shard = sharding.shard_shape(shape)
    index_map = sharding.addressable_devices_indices_map(shape)
    out = []
    for dim in range(len(shape)):
        starts = sorted({index[dim].start or 0 for index in index_map.values()})
        out.append(np.concatenate([np.arange(s, s + shard[dim]) for s in starts]))
    return tuple(out)


class _Assembler:
    """Builds the (process-local part of the) batch for given window starts and makes it a global array."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch: int, sharding: jax.sharding.Sharding | None):
        self.tokens = np.asarray(tokens)  # an ndarray view of a memmap: still file-backed, cheaper to index
        self.shape = (batch, seq_len)
        self.sharding = sharding
        self.rows, self.cols = _local_indices(sharding, self.shape)

    def __call__(self, starts_b: np.ndarray) -> dict[str, jax.Array]:
        idx = starts_b[self.rows][:, None] + self.cols[None, :]  # (B_local, T_local) token positions
        inputs = self.tokens[idx].astype(np.int32)
        targets = self.tokens[idx + 1].astype(np.int32)
        return _global({"inputs": inputs, "targets": targets}, self.sharding, self.shape)


class _RowAssembler:
    """Builds the (process-local part of the) batch of given packed rows and makes each key a global array."""

    def __init__(self, rows: PackedRows, batch: int, sharding: jax.sharding.Sharding | None):
        self.arrays = rows.arrays
        self.num_rows = rows.num_rows
        self.shape = (batch, rows.seq_len)
        self.sharding = sharding
        self.rows, self.cols = _local_indices(sharding, self.shape)

    def __call__(self, rows_b: np.ndarray) -> dict[str, jax.Array]:
        idx = np.ix_(rows_b[self.rows], self.cols)  # (B_local, T_local) of the (N, T) arrays
        return _global({k: v[idx] for k, v in self.arrays.items()}, self.sharding, self.shape)


def _global(local: dict[str, np.ndarray], sharding: jax.sharding.Sharding | None, shape: tuple[int, int]
            ) -> dict[str, jax.Array]:
    """Each process-local (B_local, T_local) array as the global (B, T) array; on one device without sharding."""
    if sharding is None:
        return {k: jax.device_put(v) for k, v in local.items()}
    return {k: jax.make_array_from_process_local_data(sharding, v, shape) for k, v in local.items()}


def window_starts(num_tokens: int, seq_len: int, batch: int, seed: int, step: int) -> np.ndarray:
    """Start positions (B,) int64 of the windows of `step`: uniform in [0, num_tokens - seq_len - 1], drawn from
    `np.random.default_rng([seed, step])` (nanoGPT's `torch.randint(len(data) - block_size, (B,))`)."""
    return np.random.default_rng([seed, step]).integers(0, num_tokens - seq_len, size=batch, dtype=np.int64)


def row_indices(num_rows: int, batch: int, seed: int, step: int) -> np.ndarray:
    """The packed rows (B,) int64 of `step`: positions step*B .. step*B+B-1 of the endless sequence of epochs,
    epoch e being `np.random.default_rng([seed, e]).permutation(num_rows)` (module docstring). B may exceed N:
    the batch then spans several epochs."""
    pos = step * batch + np.arange(batch, dtype=np.int64)
    epochs, at = np.divmod(pos, num_rows)
    out = np.empty(batch, dtype=np.int64)
    for e in np.unique(epochs).tolist():
        here = epochs == e
        out[here] = np.random.default_rng([seed, e]).permutation(num_rows)[at[here]]
    return out


class _RowsOfStep:
    def __init__(self, assemble: _RowAssembler, seed: int):
        self.assemble, self.seed = assemble, seed

    def __call__(self, step: int) -> dict[str, jax.Array]:
        return self.assemble(row_indices(self.assemble.num_rows, self.assemble.shape[0], self.seed, step))


class _BatchOfStep:
    def __init__(self, assemble: _Assembler, seed: int):
        self.assemble, self.seed = assemble, seed

    def __call__(self, step: int) -> dict[str, jax.Array]:
        batch, seq_len = self.assemble.shape
        return self.assemble(window_starts(self.assemble.tokens.shape[0], seq_len, batch, self.seed, step))


class BatchLoader:
    """Iterator of training batches: {"inputs": (B, T) int32, "targets": (B, T) int32} of random windows of a
    token array, or, from packed rows, those and {"weights": float32, "segments": int32, "positions": int32}, each
    (B, T), of the rows of the step (module docstring).

    Deterministic: batch s depends only on (tokens, seq_len, global_batch, seed, s), not on the number of
    processes or devices, nor on restarts. Prefetches `prefetch` batches in a background thread (0: none).

    Args:
      tokens: 1-D token ids (the train split's np.memmap), or the train split's `PackedRows` (N may be below
        global_batch: a batch then spans epochs).
      seq_len: T (the rows' T for packed rows).
      global_batch: B, across all processes.
      seed: non-negative int.
      sharding: sharding of the (B, T) batch (e.g. NamedSharding(mesh, P(('data', 'fsdp'), 'sequence'))); None
        gives single-device arrays.
      prefetch: batches assembled ahead.
      step: the first step to yield (to resume).
    Raises:
      DataError: fewer than seq_len + 1 tokens (names the split and its size); packed rows that are empty or of
        another T than seq_len; bad seq_len/global_batch/seed.
    """

    def __init__(self, tokens: np.ndarray | PackedRows, *, seq_len: int, global_batch: int, seed: int,
                 sharding: jax.sharding.Sharding | None = None, prefetch: int = 2, step: int = 0):
        if isinstance(tokens, PackedRows):
            _check_rows(tokens, seq_len)
        else:
            _check_tokens(tokens, seq_len)
        if global_batch < 1 or seed < 0 or prefetch < 0 or step < 0:
            raise DataError(f"BatchLoader: global_batch={global_batch} must be >= 1, seed={seed}, "
                            f"prefetch={prefetch} and step={step} >= 0")
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        if isinstance(tokens, PackedRows):
            self._batch_at = _RowsOfStep(_RowAssembler(tokens, global_batch, sharding), seed)
        else:
            self._batch_at = _BatchOfStep(_Assembler(tokens, seq_len, global_batch, sharding), seed)
        # The pipeline holds `_batch_at`, not `self`, so dropping the loader frees it (and closes the thread).
        dataset = (grain.MapDataset.range(0, _MAX_STEPS)
                   .map(self._batch_at)
                   .to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))
        dataset = grain.experimental.ThreadPrefetchIterDataset(dataset, prefetch_buffer_size=prefetch)
        self._it = iter(dataset)
        self._step = 0
        _OPEN_LOADERS.add(self)
        if step:
            self._seek(step)

    def batch_at(self, step: int) -> dict[str, jax.Array]:
        """The batch of `step`, built synchronously (what iteration yields at that step)."""
        return self._batch_at(step)

    def __iter__(self) -> "BatchLoader":
        return self

    def __next__(self) -> dict[str, jax.Array]:
        if self._it is None:
            raise RuntimeError("BatchLoader is closed")
        batch = next(self._it)
        self._step += 1
        return batch

    @property
    def step(self) -> int:
        """The step of the batch the next `next()` returns."""
        return self._step

    def state(self) -> dict[str, Any]:
        """JSON-serialisable position: {'step': next step, 'seed': seed}."""
        return {"step": self._step, "seed": self.seed}

    def restore(self, state: dict[str, Any]) -> None:
        """Continues from `state` (from `state()`): the next batch is the one that followed it.

        Raises DataError if the state was saved by a loader with another seed (its batches would differ)."""
        if int(state.get("seed", self.seed)) != self.seed:
            raise DataError(f"loader state has seed={state['seed']} but this loader has seed={self.seed}")
        self._seek(int(state["step"]))

    def _seek(self, step: int) -> None:
        if self._it is None:
            raise RuntimeError("BatchLoader is closed")
        if step < 0:
            raise DataError(f"loader step={step}: allowed is >= 0")
        # Stops the prefetch thread, drops what it had queued and restarts it at `step` on the next `next()`.
        grain.experimental.set_next_index(self._it, step)
        self._step = step

    def close(self) -> None:
        """Stops and joins the prefetch thread. Idempotent."""
        it, self._it = self._it, None
        if it is not None:
            it.close()

    def __enter__(self) -> "BatchLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def eval_batches(tokens: np.ndarray | PackedRows, *, seq_len: int, batch: int, num_batches: int, seed: int = 0,
                 sharding: jax.sharding.Sharding | None = None) -> list[dict[str, jax.Array]]:
    """A fixed set of `num_batches` validation batches of shape (batch, seq_len): {"inputs", "targets"} int32 of
    a token array, or the five keys of packed rows (`BatchLoader`).

    Token array: the batch * num_batches windows start at evenly spaced positions across the split, so they
    cover it as well as that many windows can (their mean loss estimates the whole split's with less error than
    random windows), in an order shuffled by `seed` so each batch mixes the whole split. Packed rows: the first
    batch * num_batches rows of one permutation of them drawn from `seed`, cycled when there are fewer, so every
    row is evaluated before any repeats; shuffled, because best-fit decreasing packing (msjax.data.sft) fills its
    first rows with the split's longest examples, which alone would not estimate the split's loss. Same result on
    every call.

    Raises DataError if the split holds fewer than seq_len + 1 tokens (naming it and its size), or its packed
    rows are empty or of another T than seq_len.
    """
    if isinstance(tokens, PackedRows):
        _check_rows(tokens, seq_len)
    else:
        _check_tokens(tokens, seq_len)
    if batch < 1 or num_batches < 0:
        raise DataError(f"eval_batches: batch={batch} must be >= 1 and num_batches={num_batches} >= 0")
    if isinstance(tokens, PackedRows):
        order = np.random.default_rng([seed, _EVAL_STREAM]).permutation(tokens.num_rows)
        rows = order[np.arange(batch * num_batches) % tokens.num_rows].reshape(num_batches, batch)
        assemble_rows = _RowAssembler(tokens, batch, sharding)
        return [assemble_rows(r) for r in rows]
    n = batch * num_batches
    starts = np.linspace(0, tokens.shape[0] - seq_len - 1, n).round().astype(np.int64)
    starts = starts[np.random.default_rng([seed, _EVAL_STREAM]).permutation(n)].reshape(num_batches, batch)
    assemble = _Assembler(tokens, seq_len, batch, sharding)
    return [assemble(s) for s in starts]
