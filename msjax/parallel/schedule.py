"""The interleaved 1F1B schedule as a table of ticks: which microbatch and model chunk each pipeline stage runs
forward and backward at every tick, where each microbatch's activations wait in the stash, its bubble and its
microbatches in flight.

Pure integer arithmetic (numpy at most, no jax import), so the same functions drive the traced train step
(`msjax.parallel.pipeline`, with traced tick and stage numbers) and the planner's pricing (`msjax.planner`).

Terms (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", sec. 2.2): P pipeline stages, V model chunks per stage (virtual stages), M microbatches per
flush. Virtual stage s = v P + p is chunk v of stage p and holds layers [s Lc, (s + 1) Lc) with Lc = L / (P V):
the interleaved assignment, so an activation leaving stage P - 1 wraps round to stage 0 for the next chunk.

The table (one forward slot and one backward slot per stage per tick; a stage-to-stage transfer takes one tick):
  base(i)   = (i // P) V P + i % P                    microbatches go round in groups of P (Megatron's order)
  F(i, s)   = base(i) + s                             forward of microbatch i on virtual stage s
  B(i, s)   = S + base(i) + (S - 1 - s),  S = P V     backward, the tick after the forward left the last stage
On stage p the forward index k = t - p = (i // P) V P + v P + i % P is a mixed-radix number over (group, chunk,
member), so each stage runs at most one forward per tick; the backward likewise. F(i, s + 1) = F(i, s) + 1 and
B(i, s - 1) = B(i, s) + 1, so every input a stage needs arrived (by `ppermute`) at the end of the tick before;
the loss gradient of microbatch i is computed in the tick of F(i, S - 1), after the last virtual stage's
forward, and consumed by B(i, S - 1) the tick after.
Ticks: V M + S + P - 1. Forward slots are busy in V M + P - 1 ticks and backward slots in V M + P - 1 ticks;
ticks in which no stage uses a slot skip that work (`lax.cond`), so the step lasts about
(V M + P - 1)(t_f + t_b) for V M (t_f + t_b) of work per stage: the bubble fraction (P - 1) / (V M + P - 1)
of the paper's sec. 2.2.

Stage p keeps what each chunk's backward needs (the activations its forward saved) from the forward's tick to
the backward's, in a stash of slots. Those live entries are the microbatches in flight: at most
min(V M, V P + P - 2p) (counting the tick of the backward, when the next forward's entry is already stored;
checked against the simulated table in tests/msjax/test_pipeline.py). On stage 0 that is V P + P, Megatron's
interleaved warm-up count plus two (2(P - 1) + (V - 1) P + 2); for V = 1 it is 2P where Megatron's 1F1B holds P,
because here a tick carries a forward and a backward and a transfer costs a tick each way. An entry of virtual
stage s lives B - F = 2 S - 1 - 2 s ticks, so chunk 0's entries outlive the others': a ring buffer indexed by the
forward's order would need 2 S slots. `slot_table` instead gives every entry the lowest slot free at its forward
(interval colouring in order of start, which is optimal), so the stash needs only the V P + P slots of the
steady state's peak (`Schedule.slots`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np


def bubble_fraction(stages: int, virtual_stages: int, microbatches: int) -> float:
    """Idle fraction of a pipelined step, (P - 1) / (V M + P - 1) (Narayanan et al. 2021, sec. 2.2.1-2.2.2).

    Args:
      stages, virtual_stages, microbatches: P, V, M (all >= 1).
    Returns:
      a fraction in [0, 1); 0 for P = 1.
    """
    p, v, m = stages, virtual_stages, microbatches
    return (p - 1) / (v * m + p - 1)


def in_flight(stages: int, virtual_stages: int, microbatches: int, stage: int = 0) -> int:
    """Chunk-microbatches whose activations stage `stage` holds at once at the peak of this schedule:
    min(V M, V P + P - 2 p). Stage 0 holds the most. With P = 1 there is no schedule: the V chunks of the one
    stage are in flight."""
    p, v, m = stages, virtual_stages, microbatches
    if p == 1:
        return v
    return min(v * m, v * p + p - 2 * stage)


def pipeline_summary(stages: int, virtual_stages: int, microbatches: int) -> str:
    """The start-up line of a pipelined run: schedule, bubble fraction and microbatches in flight (the same
    functions the planner prices). `microbatches`: M as resolved (`msjax.layout.Layout.microbatches`)."""
    p, v, m = stages, virtual_stages, microbatches
    return (f"pipeline: interleaved 1F1B, P={p} stages x V={v} chunks, M={m} microbatches | "
            f"bubble (P-1)/(VM+P-1) = {bubble_fraction(p, v, m):.1%} | "
            f"{in_flight(p, v, m)} chunk-microbatches in flight on stage 0 (stash of {Schedule(p, v, m).slots} "
            "slots)")


@dataclass(frozen=True)
class Schedule:
    """The tick table of one interleaved 1F1B flush (module docstring).

    Attributes:
      stages, virtual_stages, microbatches: P, V, M.
    """

    stages: int
    virtual_stages: int
    microbatches: int

    def __post_init__(self):
        p, v, m = self.stages, self.virtual_stages, self.microbatches
        if p < 1 or v < 1 or m < 1:
            raise ValueError(f"pipeline schedule needs P, V, M >= 1, got P={p} V={v} M={m}")
        if v > 1 and m % p:
            raise ValueError(f"interleaved schedule: M={m} microbatches must be a multiple of P={p} stages")

    @property
    def virtual(self) -> int:
        """S = P V virtual stages."""
        return self.stages * self.virtual_stages

    @property
    def ticks(self) -> int:
        """Ticks of one flush: V M + S + P - 1."""
        return self.virtual_stages * self.microbatches + self.virtual + self.stages - 1

    @property
    def forward_ticks(self) -> int:
        """Ticks [0, V M + P - 1) in which some stage runs a forward."""
        return self.virtual_stages * self.microbatches + self.stages - 1

    @property
    def backward_start(self) -> int:
        """First tick in which some stage runs a backward (S); from there to the end one always does."""
        return self.virtual

    @property
    def chunk_runs(self) -> int:
        """Chunk forwards (and, as many, chunk backwards) each stage executes in a flush, masked ones included:
        every stage computes in every tick in which some stage's slot is busy (V M + P - 1 of them), so V M are
        its own and P - 1 are the bubble's. The schedule's own count of the arithmetic a flush does."""
        return self.forward_ticks

    @property
    def slots(self) -> int:
        """Stash slots per stage: V P + P, the peak of live entries on stage 0 in the steady state
        (`in_flight` for M >= 2P), allocated whatever M, so that the step's memory does not depend on the
        microbatch count. With fewer microbatches fewer slots are ever used."""
        return self.virtual + self.stages if self.stages > 1 else self.virtual_stages

    @property
    def bubble(self) -> float:
        return bubble_fraction(self.stages, self.virtual_stages, self.microbatches)

    @property
    def in_flight(self) -> int:
        return in_flight(self.stages, self.virtual_stages, self.microbatches)

    def _decode(self, k: Any) -> tuple[Any, Any]:
        """(microbatch, chunk) of a stage-local order index k = g V P + c P + r (c counting up)."""
        p, vp = self.stages, self.virtual
        g, rem = k // vp, k % vp
        return g * p + rem % p, rem // p

    def order(self, microbatch: Any, chunk: Any) -> Any:
        """The stage-local forward order index k of (microbatch, chunk): the column of `slot_table`."""
        p, vp = self.stages, self.virtual
        return (microbatch // p) * vp + chunk * p + microbatch % p

    def forward(self, tick: Any, stage: Any) -> tuple[Any, Any, Any, Any]:
        """What `stage` runs forward at `tick`: (active, microbatch, chunk, order index k).

        Works on Python ints and on traced jax integers alike (only arithmetic and comparisons). When not
        active, the other three are in range but meaningless.
        """
        k = tick - stage
        active = (k >= 0) & (k < self.virtual_stages * self.microbatches)
        k = _clip(k, self.virtual_stages * self.microbatches - 1)
        mb, chunk = self._decode(k)
        return active, mb, chunk, k

    def backward(self, tick: Any, stage: Any) -> tuple[Any, Any, Any, Any]:
        """What `stage` runs backward at `tick`: (active, microbatch, chunk, order index k of its forward)."""
        k = tick - self.virtual - (self.stages - 1 - stage)
        active = (k >= 0) & (k < self.virtual_stages * self.microbatches)
        k = _clip(k, self.virtual_stages * self.microbatches - 1)
        mb, down = self._decode(k)
        chunk = self.virtual_stages - 1 - down
        return active, mb, chunk, self.order(mb, chunk)

    def loss_tick(self, tick: Any) -> tuple[Any, Any]:
        """(active, microbatch): whether the last virtual stage (chunk V - 1 of stage P - 1) ran a forward at
        `tick`, so the output layer and loss of that microbatch run in this tick. The same on every stage: a
        condition on it may hold collectives. Active in M ticks of the flush."""
        on, mb, chunk, _ = self.forward(tick, self.stages - 1)
        return on & (chunk == self.virtual_stages - 1), mb

    def embed_tick(self, tick: Any) -> tuple[Any, Any]:
        """(active, microbatch): whether stage 0 runs chunk 0 forward at `tick` (it needs the embedding of that
        microbatch). The same on every stage; active in M ticks."""
        on, mb, chunk, _ = self.forward(tick, 0)
        return on & (chunk == 0), mb

    def embed_grad_tick(self, tick: Any) -> tuple[Any, Any]:
        """(active, microbatch): whether stage 0 runs chunk 0 backward at `tick` (the embedding's gradient of that
        microbatch follows). The same on every stage; active in M ticks."""
        on, mb, chunk, _ = self.backward(tick, 0)
        return on & (chunk == 0), mb

    @cached_property
    def slot_table(self) -> np.ndarray:
        """int32 (P, V M): the stash slot of the forward with order index k on stage p, in [0, `slots`).

        Entries of stage p are [F, B] tick intervals (closed: in a tick the forward stores before the backward
        reads, so an entry freed by the backward of tick t cannot take the forward of tick t); each takes the
        lowest slot free at its forward. Colouring intervals in order of start is optimal, so the largest slot
        used is the peak of live entries.
        """
        p_count, vm = self.stages, self.virtual_stages * self.microbatches
        table = np.zeros((p_count, vm), np.int32)
        for p in range(p_count):
            free = list(range(self.slots))
            heapq.heapify(free)
            live: list[tuple[int, int]] = []  # (backward tick, slot)
            for k in range(vm):
                t = k + p
                while live and live[0][0] < t:
                    heapq.heappush(free, heapq.heappop(live)[1])
                _, chunk = self._decode(k)
                slot = heapq.heappop(free)  # IndexError would mean `in_flight` is wrong: the test simulates it
                table[p, k] = slot
                heapq.heappush(live, (t + 2 * self.virtual - 1 - 2 * (chunk * p_count + p), slot))
        return table


def _clip(k: Any, hi: int) -> Any:
    if isinstance(k, int):
        return min(max(k, 0), hi)
    import jax.numpy as jnp  # traced: only reached from inside the jitted step

    return jnp.clip(k, 0, hi)
