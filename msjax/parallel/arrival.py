"""Each device's own share of the step, timed inside the step: when the step starts on it and when its backward pass
has carried the gradient back to the model's input.

A synchronous SPMD step ends at the same moment on every rank, so the step time cannot tell which rank the others
waited for. What can is each rank's own compute: MegaScale (Jiang et al., NSDI'24) records CUDA events around
every rank's compute and communication and compares the ranks' compute times. Here two marks per device and step,
taken by host callbacks (`jax.experimental.io_callback`) inside the compiled step, without any host sync of the
training thread:

  start   the step's input tokens pass through a mark before the forward pass reads them (`step_start`, in the
          train step): when the step begins on the device;
  arrive  the gradient of the embedding output, the last activation gradient of the backward pass, passes through
          a mark (`backward_end`, in the model): when the device has run the forward pass and the backward's chain
          of activation gradients, the critical path of its backward.

`msjax.observe.timing` takes a rank's own compute time per step as its devices' last arrival minus their first
start. A rank whose devices or host are slow, or that is paused, takes longer there than the others; what the
others then wait for happens after the marks, in the step's collectives. The span leaves out the weight gradients
computed after the chain (XLA orders them freely), so it measures the rank's speed, not its whole compute.

Each mark is tied into the data flow: the callback reads the device's block of the marked array and the array
flows on only after it (`jax.lax.optimization_barrier`). The block is read under `jax.shard_map` in the layout the
array already has, so no collective is added. Both marks are the identity unless the train step traces inside
`use_arrival_marks(step)`, which it does with `observe.own_compute` (the pipelined step marks nothing: its stages
run the embedding inside their own schedule). They are not free: on XLA:CPU a program that holds host callbacks
ran slower than the same program without them (about 12%, docs/stragglers.md), whether or not the callbacks ran
(a callback under a `lax.cond` that never fired cost as much); what they cost on GPUs was not measured. With gradient accumulation the arrival fires once per microbatch. Timestamps are
`time.perf_counter()` seconds of this process, collected in `ARRIVALS`.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections import defaultdict
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from msjax.sharding import active_rules, nested_shard_map, use_parallelism
from msjax.sharding_rules import logical_to_mesh_spec
from msjax.sharding_rules import axes as ax

_STEP: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("msjax_arrival_step", default=None)


class ArrivalLog:
    """Timestamps of the marks, per step and kind ("start", "arrive"), from the device threads that run the
    callbacks (thread-safe). At most `max_keys` (step, kind) entries are kept, the oldest dropped first, so a
    program run with marks and nobody taking them holds a bounded amount."""

    def __init__(self, max_keys: int = 4096) -> None:
        self._lock = threading.Lock()
        self._marks: dict[tuple[int, str], list[float]] = defaultdict(list)
        self.max_keys = max_keys

    def record(self, step: int, kind: str, t: float) -> None:
        with self._lock:
            self._marks[(step, kind)].append(t)
            if len(self._marks) > self.max_keys:
                del self._marks[min(self._marks)]

    def take(self, step: int) -> dict[str, list[float]]:
        """kind -> the timestamps recorded for `step` (seconds, perf_counter); removes them and those of earlier
        steps."""
        with self._lock:
            out = {kind: self._marks.pop((s, kind)) for (s, kind) in list(self._marks) if s == step}
            for old in [key for key in self._marks if key[0] < step]:
                del self._marks[old]
            return out

    def clear(self) -> None:
        with self._lock:
            self._marks.clear()


ARRIVALS = ArrivalLog()


def _recorder(kind: str):
    def record(step: np.ndarray, _first: np.ndarray) -> np.ndarray:
        ARRIVALS.record(int(step), kind, time.perf_counter())
        return np.zeros((), np.int32)

    return record


def _marked(x: jax.Array, names: tuple[str, ...], step: jax.Array, kind: str) -> jax.Array:
    """`x` (one logical name per dimension) after a timestamp of `kind` on every device that holds a block of it:
    the callback reads the block and `x` flows on only after it. Under `jax.shard_map` in the layout the active
    rules give `x`, so no collective is added."""
    record = _recorder(kind)

    def per_device(block, s):
        # The block's first element is an operand so that the callback runs once the block is computed; the
        # barrier holds the block back until the callback has run.
        done = io_callback(record, jax.ShapeDtypeStruct((), jnp.int32), s, block.reshape(-1)[0], ordered=False)
        block, _ = jax.lax.optimization_barrier((block, done))
        return block

    active = active_rules()
    if active is None:  # single-device code: no layout to keep
        return per_device(x, step)
    spec = logical_to_mesh_spec(names, active[1])
    return nested_shard_map(per_device, active[0], in_specs=(spec, jax.sharding.PartitionSpec()), out_specs=spec,
                            check_vma=False)(x, step)


@contextlib.contextmanager
def use_arrival_marks(step: jax.Array) -> Iterator[None]:
    """Makes `step_start` and `backward_end` record, under step number `step` (an int32 scalar of the traced step),
    for code traced inside this context; the model marks its embedding output with `backward_end` there
    (`msjax.sharding.use_parallelism`)."""
    token = _STEP.set(step)
    try:
        with use_parallelism(backward_end=backward_end):
            yield
    finally:
        _STEP.reset(token)


@jax.custom_vjp
def _mark(x_btd: jax.Array, step: jax.Array) -> jax.Array:
    return x_btd


def _mark_fwd(x_btd, step):
    return x_btd, step


def _mark_bwd(step, g_btd):
    return _marked(g_btd, (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_EMBED), step, "arrive"), None


_mark.defvjp(_mark_fwd, _mark_bwd)


def step_start(tokens_bt: jax.Array) -> jax.Array:
    """Identity on the step's input tokens (B, T), laid out as (act_batch, act_seq); inside `use_arrival_marks` it
    records, on every device, when the step begins there: the forward pass waits for the timestamp."""
    step = _STEP.get()
    if step is None:
        return tokens_bt
    return _marked(tokens_bt, (ax.ACT_BATCH, ax.ACT_SEQ), step, "start")


def backward_end(x_btd: jax.Array) -> jax.Array:
    """Identity on the model's embedding output (B, T, D), laid out as (act_batch, act_seq, act_embed); inside
    `use_arrival_marks` its gradient records, on every device, when the backward pass reaches it."""
    step = _STEP.get()
    if step is None:
        return x_btd
    return _mark(x_btd, step)
