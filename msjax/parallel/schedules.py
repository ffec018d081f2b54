"""Pipeline schedules as tables of actions: which forward (F), input-gradient (B) and weight-gradient (W) pass each
stage runs at every tick, for 1F1B, interleaved 1F1B, ZB-H1 and ZB-V; their bubble and activations in flight, and
a text grid. Pure Python (no jax), so the planner and `scripts/plan.py --schedule` read the same tables.

Terms. P stages, V model chunks per stage, M microbatches, S = P V virtual stages (chunks of L / S layers). A
microbatch i passes virtual stages 0 .. S - 1 forward and S - 1 .. 0 backward. The backward of a chunk is split
(Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ICLR, sec. 2) into B, the gradient with respect to the chunk's
input (which the previous virtual stage waits for), and W, the gradient with respect to its parameters (which only
the optimizer waits for). A schedule without the split runs each W right after its B: together they are the usual
backward pass.

Time model (the paper's, sec. 2): one tick per pass, T_F = T_B = T_W (one chunk's forward, input gradient and
weight gradient take equal time); a stage runs one pass at a time; a chunk's output reaches the next stage in time
for its next tick. Dependencies: F(i, s) after F(i, s - 1); B(i, s) after F(i, s) and B(i, s + 1) (the loss of the
last virtual stage in between); W(i, s) after B(i, s).

Placements: `interleaved` puts virtual stage s on stage s mod P (Narayanan et al. 2021, sec. 2.2): chunk v of stage
p is s = v P + p. `zb-v` (Qi et al. sec. 6) uses two chunks in a V: s on stage s for s < P and on 2P - 1 - s after,
so the last virtual stage is on stage 0 and the turn from chunk 0 to chunk 1 stays on stage P - 1.

The schedules:
  1f1b         Megatron-LM's 1F1B (V = 1): stage p runs P - p - 1 warm-up forwards, then one forward and one
               backward in turn, then the remaining backwards. Idle per stage: (P - 1)(T_F + T_B + T_W).
  interleaved  Megatron-LM's interleaved 1F1B (V chunks): warm-up 2(P - p - 1) + (V - 1) P forwards in the order
               of groups of P microbatches per chunk, then 1F1B. Idle: (P - 1)(T_F + T_B + T_W) in chunk passes,
               1 / V of 1F1B's.
  zb-h1        ZB-H1 (Qi et al. sec. 2.1): 1F1B's activations in flight (at most P - p microbatches between F and B
               on stage p), at most P Ws waiting, B first whenever ready, so the Ws fill the warm-up's and the
               cool-down's gaps. Idle: (P - 1)(T_F + T_B - T_W), a third of 1F1B's.
  zb-v         ZB-V (Qi et al. sec. 6): two chunks in a V, at most 2P chunk-microbatches between F and B on every
               stage (1F1B's peak, P whole microbatches, on every stage), 2P Ws waiting, B first. Idle: (P - 1) T_F,
               the time the last stage waits for the first microbatch to reach it: no other idle tick.
The zero-bubble tables are built by a greedy list scheduler under those limits (`_greedy`); for M >= P they reach
the closed forms exactly (tests/msjax/test_schedules.py checks several P and M).

Bubble fraction: idle device time over all device time, 1 - work / (P x ticks), as msjax has always reported it
(for 1F1B (P - 1) / (M + P - 1)); the paper's "bubble rate" divides by the work instead, (P - 1) / M for 1F1B.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zb-v")


@dataclass(frozen=True)
class Action:
    """One pass of one chunk for one microbatch: kind "F", "B" or "W", microbatch i, virtual stage s."""

    kind: str
    microbatch: int
    virtual_stage: int


def placement(name: str, stages: int, virtual_stages: int, s: int) -> int:
    """The stage holding virtual stage `s` under schedule `name` (module docstring, "Placements")."""
    if name == "zb-v":
        return s if s < stages else 2 * stages - 1 - s
    return s % stages


def check(name: str, stages: int, virtual_stages: int, microbatches: int) -> None:
    """Raises ValueError naming the schedule and what it allows when (P, V, M) does not fit it."""
    p, v, m = stages, virtual_stages, microbatches
    if name not in SCHEDULES:
        raise ValueError(f"pipeline schedule {name!r}: allowed are {', '.join(SCHEDULES)}")
    if p < 1 or v < 1 or m < 1:
        raise ValueError(f"pipeline schedule {name}: P, V, M >= 1, got P={p} V={v} M={m}")
    if name in ("1f1b", "zb-h1") and v != 1:
        raise ValueError(f"pipeline schedule {name} runs one chunk per stage: pipeline.virtual_stages=1, got {v}")
    if name == "zb-v" and v != 2:
        raise ValueError(f"pipeline schedule zb-v runs two chunks per stage: pipeline.virtual_stages=2, got {v}")
    if name == "interleaved" and v > 1 and m % p:
        raise ValueError(f"pipeline schedule interleaved: M={m} microbatches must be a multiple of P={p} stages")


@dataclass(frozen=True)
class ActionTable:
    """The tick table of one pipeline flush under a schedule (module docstring).

    Attributes:
      name: one of SCHEDULES.
      stages, virtual_stages, microbatches: P, V, M.
    Raises ValueError (`check`) on a (P, V, M) the schedule does not run.
    """

    name: str
    stages: int
    virtual_stages: int
    microbatches: int

    def __post_init__(self):
        check(self.name, self.stages, self.virtual_stages, self.microbatches)

    @property
    def virtual(self) -> int:
        return self.stages * self.virtual_stages

    def stage_of(self, s: int) -> int:
        return placement(self.name, self.stages, self.virtual_stages, s)

    @cached_property
    def grid(self) -> tuple[tuple[Action | None, ...], ...]:
        """grid[p][t]: the action stage p runs at tick t (None: idle), for t in [0, ticks)."""
        starts = _greedy(self) if self.name.startswith("zb") else _in_order(self, _megatron_orders(self))
        ticks = 1 + max(starts.values())
        grid = [[None] * ticks for _ in range(self.stages)]
        for a, t in starts.items():
            p = self.stage_of(a.virtual_stage)
            if grid[p][t] is not None:
                raise AssertionError(f"{self.name}: two actions on stage {p} at tick {t}")
            grid[p][t] = a
        return tuple(tuple(row) for row in grid)

    @property
    def ticks(self) -> int:
        return len(self.grid[0])

    @property
    def work(self) -> int:
        """Passes each stage runs: 3 V M."""
        return 3 * self.virtual_stages * self.microbatches

    @property
    def idle(self) -> int:
        """Idle ticks of a stage within the flush: ticks - work (the same on every stage)."""
        return self.ticks - self.work

    @property
    def bubble(self) -> float:
        """Idle fraction of all device time, 1 - work / ticks."""
        return self.idle / self.ticks

    def in_flight(self, stage: int) -> int:
        """Peak chunk-microbatches on `stage` between their F and their B: the activations a B still needs."""
        return self._peak(stage, "F", "B")

    def awaiting_w(self, stage: int) -> int:
        """Peak chunk-microbatches on `stage` between their B and their W: what a deferred W keeps (each weight
        matmul's input and output gradient), 1 for schedules that run W right after B."""
        return self._peak(stage, "B", "W")

    def _peak(self, stage: int, opens: str, closes: str) -> int:
        live = peak = 0
        for a in self.grid[stage]:
            if a is not None and a.kind == opens:
                live += 1
                peak = max(peak, live)
            elif a is not None and a.kind == closes:
                live -= 1
        return peak

    def text(self, width: int = 120) -> str:
        """The grid as text, one row per stage: `F3` forward of microbatch 3 (lower case `f3` for a stage's second
        chunk and later), `B3`, `W3`, `.` idle; the first `width` characters of each row (the rest elided)."""
        cell = 1 + len(str(self.microbatches - 1))
        rows = []
        for p, row in enumerate(self.grid):
            cells = []
            for a in row:
                if a is None:
                    cells.append(".".ljust(cell))
                else:
                    chunk = [s for s in range(self.virtual) if self.stage_of(s) == p].index(a.virtual_stage)
                    cells.append(f"{a.kind if chunk == 0 else a.kind.lower()}{a.microbatch}".ljust(cell))
            line = f"stage {p:<3d}| " + " ".join(cells)
            rows.append(line if len(line) <= width else line[:width - 4] + " ...")
        head = (f"{self.name}: P={self.stages} V={self.virtual_stages} M={self.microbatches}, {self.ticks} ticks of "
                f"one pass each, idle {self.idle} per stage, bubble {self.bubble:.1%}")
        return "\n".join([head, *rows])


def paper_idle(name: str, stages: int, virtual_stages: int, microbatches: int) -> int:
    """Idle ticks per stage by the closed forms (module docstring; T_F = T_B = T_W = one tick; interleaved in chunk
    passes): 1f1b and interleaved 3(P - 1), zb-h1 P - 1, zb-v P - 1."""
    check(name, stages, virtual_stages, microbatches)
    return 3 * (stages - 1) if name in ("1f1b", "interleaved") else stages - 1


def paper_bubble(name: str, stages: int, virtual_stages: int, microbatches: int) -> float:
    """The bubble fraction of the closed forms: idle / (3 V M + idle)."""
    idle = paper_idle(name, stages, virtual_stages, microbatches)
    return idle / (3 * virtual_stages * microbatches + idle)


def _deps(table: ActionTable, a: Action) -> list[Action]:
    """What `a` waits for. Without the split (1f1b, interleaved) a B waits for the whole backward of the virtual
    stage after it, its W included: the two are one pass there."""
    i, s, last = a.microbatch, a.virtual_stage, table.virtual - 1
    if a.kind == "F":
        return [Action("F", i, s - 1)] if s else []
    if a.kind == "B":
        after = "B" if table.name.startswith("zb") else "W"
        return [Action("F", i, s)] + ([Action(after, i, s + 1)] if s < last else [])
    return [Action("B", i, s)]


def _megatron_orders(table: ActionTable) -> list[list[Action]]:
    """Per stage, the order in which Megatron-LM's (interleaved) 1F1B runs its passes, each W right after its B."""
    p_count, v, m = table.stages, table.virtual_stages, table.microbatches
    vm, group = v * m, p_count * v if v > 1 else 1

    def decode(k: int, backward: bool) -> tuple[int, int]:  # k-th forward (backward) of a stage -> (i, chunk)
        if v == 1:
            return k, 0
        g, rem = k // group, k % group
        chunk = rem // p_count
        return g * p_count + rem % p_count, (v - 1 - chunk) if backward else chunk

    orders = []
    for p in range(p_count):
        warm = min(vm, (p_count - p - 1) * 2 + (v - 1) * p_count) if v > 1 else min(m, p_count - p - 1)
        f = [decode(k, False) for k in range(vm)]
        b = [decode(k, True) for k in range(vm)]
        order = [Action("F", i, c * p_count + p) for i, c in f[:warm]]
        for j in range(vm - warm):
            i, c = f[warm + j]
            order.append(Action("F", i, c * p_count + p))
            i, c = b[j]
            order += [Action("B", i, c * p_count + p), Action("W", i, c * p_count + p)]
        for i, c in b[vm - warm:]:
            order += [Action("B", i, c * p_count + p), Action("W", i, c * p_count + p)]
        orders.append(order)
    return orders


def _in_order(table: ActionTable, orders: list[list[Action]]) -> dict[Action, int]:
    """Start ticks of per-stage orders: each pass at the first tick its stage is free and its inputs are done."""
    end: dict[Action, int] = {}
    nxt = [0] * table.stages
    free = [0] * table.stages
    total = sum(len(o) for o in orders)
    while len(end) < total:
        moved = False
        for p, order in enumerate(orders):
            while nxt[p] < len(order):
                a = order[nxt[p]]
                deps = _deps(table, a)
                if any(d not in end for d in deps):
                    break
                start = max([free[p]] + [end[d] for d in deps])
                end[a] = start + 1
                free[p] = start + 1
                nxt[p] += 1
                moved = True
        if not moved:
            raise AssertionError(f"{table.name}: the per-stage orders deadlock")
    return {a: t - 1 for a, t in end.items()}


def _greedy(table: ActionTable) -> dict[Action, int]:
    """Start ticks of the zero-bubble schedules. At each tick each stage runs, of what is ready: a B (lowest
    microbatch, then latest virtual stage); else its oldest waiting W, when as many Ws wait as the schedule allows;
    else an F (lowest microbatch, then earliest virtual stage) while fewer chunk-microbatches than the schedule
    allows are between their F and B; else its oldest waiting W. Limits: zb-h1 P - p between F and B (1F1B's) and
    P waiting Ws; zb-v 2P and 2P."""
    p_count, last = table.stages, table.virtual - 1
    if table.name == "zb-h1":
        f_limit, w_limit = [p_count - p for p in range(p_count)], p_count
    else:
        f_limit, w_limit = [2 * p_count] * p_count, 2 * p_count
    end: dict[Action, int] = {}
    f_end: dict[tuple[int, int], int] = {}  # (microbatch, virtual stage) -> end tick, beside `end`: the scans
    b_end: dict[tuple[int, int], int] = {}  # below look passes up by tuple, not by a new Action each time
    mine = [[s for s in range(table.virtual) if table.stage_of(s) == p] for p in range(p_count)]
    todo_f = [sorted((i, s) for i in range(table.microbatches) for s in mine[p]) for p in range(p_count)]
    todo_b = [sorted(((i, s) for i in range(table.microbatches) for s in mine[p]), key=lambda x: (x[0], -x[1]))
              for p in range(p_count)]
    waiting_w: list[list[tuple[int, int]]] = [[] for _ in range(p_count)]
    live = [0] * p_count
    total, t, window = 3 * table.virtual * table.microbatches, 0, 2 * table.virtual + 4
    while len(end) < total:
        if t > 4 * total:
            raise AssertionError(f"{table.name}: the greedy schedule makes no progress")
        for p in range(p_count):
            # Microbatches move through a stage in order, so a ready pass is among the first few left of its kind
            # (the window holds the passes of about 2 P microbatches): the scan stays short for any M. A pass
            # is done when it finished before this tick.
            b = next(((i, s) for i, s in todo_b[p][:window] if f_end.get((i, s), t + 1) <= t and
                      (s == last or b_end.get((i, s + 1), t + 1) <= t)), None)
            f = next(((i, s) for i, s in todo_f[p][:window] if s == 0 or f_end.get((i, s - 1), t + 1) <= t), None)
            if b is not None:
                todo_b[p].remove(b)
                waiting_w[p].append(b)
                live[p] -= 1
                end[Action("B", *b)] = b_end[b] = t + 1
            elif waiting_w[p] and (len(waiting_w[p]) >= w_limit or f is None or live[p] >= f_limit[p]):
                end[Action("W", *waiting_w[p].pop(0))] = t + 1
            elif f is not None and live[p] < f_limit[p]:
                todo_f[p].remove(f)
                live[p] += 1
                end[Action("F", *f)] = f_end[f] = t + 1
        t += 1
    return {a: e - 1 for a, e in end.items()}
