"""The interleaved 1F1B schedule as a table of ticks: which microbatch and model chunk each pipeline stage runs
forward and backward at every tick, its bubble and its microbatches in flight.

Pure integer arithmetic (no jax import), so the same functions drive the traced train step
(`msjax.parallel.pipeline`, with traced tick and stage numbers) and the planner's pricing (`msjax.planner`).

Terms (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", sec. 2.2): P pipeline stages, V model chunks per stage (virtual stages), M microbatches per
flush. Virtual stage s = v P + p is chunk v of stage p and holds layers [s Lc, (s + 1) Lc) with Lc = L / (P V):
the interleaved assignment, so an activation leaving stage P - 1 wraps round to stage 0 for the next chunk.

The table (one forward slot and one backward slot per stage per tick; a stage-to-stage transfer takes one tick):
  base(i)   = (i // P) V P + i % P                    microbatches go round in groups of P (Megatron's order)
  F(i, s)   = base(i) + s                             forward of microbatch i on virtual stage s
  B(i, s)   = S + base(i) + (S - 1 - s),  S = P V     backward, after the forward has left the last stage
On stage p the forward index k = t - p = (i // P) V P + v P + i % P is a mixed-radix number over (group, chunk,
member), so each stage runs at most one forward per tick; the backward likewise. F(i, s + 1) = F(i, s) + 1 and
B(i, s - 1) = B(i, s) + 1, so every input a stage needs arrived (by `ppermute`) at the end of the tick before.
Ticks: V M + S + P - 1. Forward slots are busy in V M + P - 1 ticks and backward slots in V M + P - 1 ticks;
ticks in which no stage uses a slot skip that work (`lax.cond`), so the step lasts about
(V M + P - 1)(t_f + t_b) for V M (t_f + t_b) of work per stage: the bubble fraction (P - 1) / (V M + P - 1)
of the paper's sec. 2.2.

Stage p keeps each chunk input from its forward to its backward (the backward recomputes the chunk from it).
Those live entries are the microbatches in flight: at most min(V M, V P + P - 2p) chunk inputs (counting the
tick of the backward, when the next forward's input is already stored; checked against the simulated table in
tests/msjax/test_pipeline.py). On stage 0 that is V P + P, Megatron's interleaved warm-up count plus two
(2(P - 1) + (V - 1) P + 2); for V = 1 it is 2P where Megatron's 1F1B holds P, because here a tick carries a
forward and a backward and a transfer costs a tick each way. Slots are reused modulo 2 S: an entry lives
B - F = 2 S - 1 - 2 s < 2 S ticks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
    """Chunk inputs stage `stage` holds at once at the peak of this schedule: min(V M, V P + P - 2 p).

    Each is one (b, T, D) activation (the chunk is recomputed from it in the backward). Stage 0 holds the most.
    With P = 1 there is no schedule: the V chunks of the one stage are in flight.
    """
    p, v, m = stages, virtual_stages, microbatches
    if p == 1:
        return v
    return min(v * m, v * p + p - 2 * stage)


def pipeline_summary(stages: int, virtual_stages: int, microbatches: int) -> str:
    """The start-up line of a pipelined run: schedule, bubble fraction and microbatches in flight (the same
    functions the planner prices). `microbatches` 0 means `stages` (pipeline.microbatches' default)."""
    m = microbatches or stages
    return (f"pipeline: interleaved 1F1B, P={stages} stages x V={virtual_stages} chunks, M={m} microbatches | "
            f"bubble (P-1)/(VM+P-1) = {bubble_fraction(stages, virtual_stages, m):.1%} | "
            f"{in_flight(stages, virtual_stages, m)} chunk inputs in flight on stage 0")


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
    def slots(self) -> int:
        """Chunk-input stash slots per stage (2 S: longer than any entry lives)."""
        return 2 * self.virtual

    @property
    def bubble(self) -> float:
        return bubble_fraction(self.stages, self.virtual_stages, self.microbatches)

    @property
    def in_flight(self) -> int:
        return in_flight(self.stages, self.virtual_stages, self.microbatches)

    def _decode(self, k: Any) -> tuple[Any, Any, Any]:
        """(microbatch, chunk, remainder) of a stage-local order index k = g V P + c P + r (c counting up)."""
        p, vp = self.stages, self.virtual
        g, rem = k // vp, k % vp
        return g * p + rem % p, rem // p, g * vp + rem % p

    def forward(self, tick: Any, stage: Any) -> tuple[Any, Any, Any, Any]:
        """What `stage` runs forward at `tick`: (active, microbatch, chunk, stash slot).

        Works on Python ints and on traced jax integers alike (only arithmetic and comparisons). When not
        active, the other three are in range but meaningless.
        """
        k = tick - stage
        active = (k >= 0) & (k < self.virtual_stages * self.microbatches)
        k = _clip(k, self.virtual_stages * self.microbatches - 1)
        mb, chunk, base = self._decode(k)
        return active, mb, chunk, (base + chunk * self.stages) % self.slots

    def backward(self, tick: Any, stage: Any) -> tuple[Any, Any, Any, Any]:
        """What `stage` runs backward at `tick`: (active, microbatch, chunk, stash slot of its forward)."""
        k = tick - self.virtual - (self.stages - 1 - stage)
        active = (k >= 0) & (k < self.virtual_stages * self.microbatches)
        k = _clip(k, self.virtual_stages * self.microbatches - 1)
        mb, down, base = self._decode(k)
        chunk = self.virtual_stages - 1 - down
        return active, mb, chunk, (base + chunk * self.stages) % self.slots


def _clip(k: Any, hi: int) -> Any:
    if isinstance(k, int):
        return min(max(k, 0), hi)
    import jax.numpy as jnp  # traced: only reached from inside the jitted step

    return jnp.clip(k, 0, hi)
