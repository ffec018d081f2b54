"""Table-driven pipelining in the one jitted step: 1F1B, ZB-H1 and ZB-V (`msjax.parallel.schedules`) with the
backward split into B and W (`msjax.parallel.split_backward`).

The step is `PipelinedGrads`'s (`msjax.parallel.pipeline`: one `shard_map` manual over `pipeline`, the parameters
regrouped into (P, V, Lc) chunks, the output layer spread over the stages along the sequence, the optimizer outside)
with another flush. `pipeline.schedule`'s action table is compiled on the host into per-(stage, tick) integer
arrays (`TickPlan`), and every tick each stage runs the one pass its row names: F (its chunk forward under
`jax.vjp` with the weight matmuls tapped, the residuals into a stash slot), B (the vjp on the cotangent: input
gradient, small-parameter gradients, and each weight matmul's (x, dy) into a W slot), W (the weight gradients from
a W slot) or nothing. Each pass is a `lax.cond` on the stage's own row that takes the buffers it writes as operands
and updates them in place, as the interleaved step's passes do; an F or idle tick touches no accumulator. (One
`lax.switch` returning every buffer made XLA copy them each tick; returning the passes' outputs and writing them
after the switch wrote a zero-filled stash slot and every accumulator each tick: 1.1-1.2x the interleaved step's
CPU seconds on fake CPU devices, 0.95x now: docs/pipeline.md.) An idle stage computes nothing: unlike the
interleaved step's lock-step ticks, no stage runs a masked pass. Collectives inside a pass run over axes within the
stage (tensor, data, fsdp, sequence), whose devices all take the same branch.

After the pass, every tick: the output layer and loss if some stage finished the last virtual stage's forward this
tick (a condition on the tick alone, as it holds collectives over `pipeline`); then the stage's output is sent on
one of two `ppermute` rings (to stage p + 1, to stage p - 1) or kept (ZB-V's turn from chunk 0 to chunk 1 on stage
P - 1), and what arrives is written into the stage's inbox: a buffer of slots of (b, T, D) activations or
gradients waiting for the pass that reads them, at slots the host assigned (interval colouring over write and read
ticks, as the stash's). A pass reads its input from the inbox, never from the tick before, since a table may put
other passes between a microbatch's two chunks.

Placement: virtual stage s lives on stage `schedules.placement`; the regrouping of the layers into chunks follows it
(for ZB-V chunk 1 of stage p is virtual stage 2P - 1 - p).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from msjax.parallel import split_backward as sb
from msjax.parallel.pipeline import ACT, AXIS, PipelinedGrads, add_rows
from msjax.parallel.schedules import Action, ActionTable, placement
from msjax.sharding import constrain

IDLE, FWD, BWD, WGT = range(4)
NEXT, PREV, KEEP, NOWHERE = range(4)  # where a pass's output goes


@dataclasses.dataclass(frozen=True)
class TickPlan:
    """An action table compiled for the traced step: int32 arrays (P, ticks) unless named otherwise.

    kind: IDLE, FWD, BWD, WGT. chunk: the stage's chunk index of the pass's virtual stage. micro: its microbatch.
    first: the pass is of virtual stage 0 (F reads the embedding, B feeds the embedding's gradient). inbox: slot its
    input is read from (F of virtual stage 0: unused; B of the last virtual stage: the loss gradient's). res: stash
    slot written (F) or read (B). wslot: W slot written (B) or read (W). route: where the output goes (NEXT, PREV,
    KEEP, NOWHERE). from_prev / from_next / keep / loss: inbox slot written at the end of the tick by what arrives
    on the ring from stage p - 1, on the ring from stage p + 1, by the stage's own kept output, by the loss gradient
    (spare slot: nothing). loss_on, loss_mb: (ticks,) the output layer runs for that microbatch this tick.
    embed_grad_on: (ticks,) some stage runs virtual stage 0's B (the embedding's gradient follows). send_next,
    send_prev: (ticks,) some stage sends on that ring (else its `ppermute` is skipped). host: the stage of the last
    virtual stage. inbox_slots, res_slots, w_slots: buffer sizes (a spare slot each beyond).
    """

    kind: np.ndarray
    chunk: np.ndarray
    micro: np.ndarray
    first: np.ndarray
    inbox: np.ndarray
    res: np.ndarray
    wslot: np.ndarray
    route: np.ndarray
    from_prev: np.ndarray
    from_next: np.ndarray
    keep: np.ndarray
    loss: np.ndarray
    loss_on: np.ndarray
    loss_mb: np.ndarray
    embed_grad_on: np.ndarray
    send_next: np.ndarray
    send_prev: np.ndarray
    host: int
    inbox_slots: int
    res_slots: int
    w_slots: int

    @property
    def ticks(self) -> int:
        return self.kind.shape[1]


def _colour(intervals: list[tuple[int, int, Any]]) -> tuple[dict[Any, int], int]:
    """Slots for (write tick, read tick, key) entries: a slot read at tick r may be written again at the end of tick
    r. Interval colouring in order of writes (optimal). Returns ({key: slot}, slots used)."""
    out, free, busy, used = {}, [], [], 0
    for w, r, key in sorted(intervals, key=lambda e: (e[0], e[1])):
        while busy and busy[0][0] <= w:
            heapq.heappush(free, heapq.heappop(busy)[1])
        slot = heapq.heappop(free) if free else used
        used = max(used, slot + 1)
        out[key] = slot
        heapq.heappush(busy, (r, slot))
    return out, used


def compile_table(table: ActionTable) -> TickPlan:
    """The `TickPlan` of `table` (module docstring)."""
    p_count, s_count, ticks = table.stages, table.virtual, table.ticks
    at = {a: (p, t) for p, row in enumerate(table.grid) for t, a in enumerate(row) if a is not None}
    chunks = [[s for s in range(s_count) if table.stage_of(s) == p] for p in range(p_count)]
    host = table.stage_of(s_count - 1)

    def direction(src: int, dst: int) -> int:
        if src == dst:
            return KEEP
        return NEXT if dst == (src + 1) % p_count else PREV

    inbox: list[list[tuple[int, int, Any]]] = [[] for _ in range(p_count)]  # per stage: (write, read, pass)
    arrivals = []  # (stage, write tick, how it arrives, the pass that reads it)
    for a, (p, t) in at.items():
        i, s = a.microbatch, a.virtual_stage
        if a.kind == "F" and s > 0:
            q, w = at[Action("F", i, s - 1)]
            how = direction(q, p)
        elif a.kind == "B" and s < s_count - 1:
            q, w = at[Action("B", i, s + 1)]
            how = direction(q, p)
        elif a.kind == "B":
            w, how = at[Action("F", i, s)][1], "loss"
        else:
            continue
        inbox[p].append((w, t, a))
        arrivals.append((p, w, how, a))
    shape = (p_count, ticks)
    arr = {k: np.zeros(shape, np.int32) for k in ("kind", "chunk", "micro", "first", "inbox", "res", "wslot",
                                                    "route")}
    slots = [_colour(inbox[p]) for p in range(p_count)]
    n_inbox = max([n for _, n in slots] + [1])
    res = [_colour([(at[a][1], at[Action("B", a.microbatch, a.virtual_stage)][1], a) for a in at
                    if a.kind == "F" and at[a][0] == p]) for p in range(p_count)]
    n_res = max([n for _, n in res] + [1])
    wsl = [_colour([(at[a][1], at[Action("W", a.microbatch, a.virtual_stage)][1], a) for a in at
                    if a.kind == "B" and at[a][0] == p]) for p in range(p_count)]
    n_w = max([n for _, n in wsl] + [1])
    for k in ("from_prev", "from_next", "keep", "loss"):
        arr[k] = np.full(shape, n_inbox, np.int32)  # the spare slot: nothing arrives
    arr["res"][:] = n_res
    arr["wslot"][:] = n_w
    arr["route"][:] = NOWHERE
    for a, (p, t) in at.items():
        i, s = a.microbatch, a.virtual_stage
        arr["kind"][p, t] = {"F": FWD, "B": BWD, "W": WGT}[a.kind]
        arr["chunk"][p, t] = chunks[p].index(s)
        arr["micro"][p, t] = i
        arr["first"][p, t] = s == 0
        arr["inbox"][p, t] = slots[p][0].get(a, n_inbox)
        if a.kind in "FB":
            key = a if a.kind == "F" else Action("F", i, s)
            arr["res"][p, t] = res[p][0][key]
        if a.kind in "BW":
            key = a if a.kind == "B" else Action("B", i, s)
            arr["wslot"][p, t] = wsl[p][0][key]
        if a.kind == "F":
            arr["route"][p, t] = direction(p, table.stage_of(s + 1)) if s < s_count - 1 else NOWHERE
        elif a.kind == "B":
            arr["route"][p, t] = direction(p, table.stage_of(s - 1)) if s > 0 else NOWHERE
        else:
            arr["route"][p, t] = NOWHERE
    for p, w, how, a in arrivals:
        slot = slots[p][0][a]
        name = {NEXT: "from_prev", PREV: "from_next", KEEP: "keep", "loss": "loss"}[how]
        if arr[name][p, w] != n_inbox:
            raise AssertionError(f"two arrivals into stage {p} by {name} at tick {w}")
        arr[name][p, w] = slot
    loss_on, loss_mb, embed_grad_on = (np.zeros(ticks, np.int32) for _ in range(3))
    send_next, send_prev = ((arr["route"] == way).any(axis=0).astype(np.int32) for way in (NEXT, PREV))
    for a, (p, t) in at.items():
        if a.kind == "F" and a.virtual_stage == s_count - 1:
            loss_on[t], loss_mb[t] = 1, a.microbatch
        if a.kind == "B" and a.virtual_stage == 0:
            embed_grad_on[t] = 1
    return TickPlan(**arr, loss_on=loss_on, loss_mb=loss_mb, embed_grad_on=embed_grad_on, send_next=send_next,
                    send_prev=send_prev, host=host, inbox_slots=n_inbox, res_slots=n_res, w_slots=n_w)


@functools.lru_cache(maxsize=512)
def action_table(name: str, stages: int, virtual_stages: int, microbatches: int) -> ActionTable:
    """`ActionTable(...)`, its grid built once and cached: the planner prices many."""
    table = ActionTable(name, stages, virtual_stages, microbatches)
    _ = table.grid
    return table


@functools.lru_cache(maxsize=512)
def tick_plan(name: str, stages: int, virtual_stages: int, microbatches: int) -> TickPlan:
    """The compiled table of a schedule (`compile_table` of `action_table`), cached."""
    return compile_table(action_table(name, stages, virtual_stages, microbatches))


def flush_seconds(plan: TickPlan, pass_seconds: tuple[float, float, float], loss_seconds: float = 0.0) -> float:
    """Seconds one flush of `plan` takes on hardware where every stage's F, B and W last `pass_seconds` (per
    chunk and microbatch) and the output layer of a microbatch `loss_seconds`, as this module runs a table.

    Every tick ends with the `ppermute` rings in use that tick: a ring's send/receive pairs (every stage sends to
    the next and receives from the previous, XLA's collective-permute) complete once both neighbours have reached
    them, so a stage's tick ends no earlier than its neighbours' passes of that tick. A tick that runs the output
    layer (an all-to-all and an all-gather over `pipeline`) ends on every stage together, `loss_seconds` after the
    last stage's pass. So a long pass delays its neighbours, and a tick of short passes on some stages does not
    make up for a long one elsewhere: with equal passes the result is the table's ticks (`ActionTable.bubble`),
    with B longer than F and W more.

    Args:
      plan: `tick_plan` / `compile_table`.
      pass_seconds: (F, B, W) seconds of one chunk's pass for one microbatch.
      loss_seconds: seconds of one microbatch's output layer and loss (spread over the stages).
    Returns:
      seconds (float).
    """
    seconds = np.array([0.0, *pass_seconds])[plan.kind]  # (P, ticks)
    end = np.zeros(plan.kind.shape[0])
    for t in range(plan.ticks):
        end = end + seconds[:, t]  # each stage's pass, from where its previous tick ended
        if plan.send_next[t] or plan.send_prev[t]:  # the ring waits for both neighbours of every stage
            end = np.maximum(end, np.maximum(np.roll(end, 1), np.roll(end, -1)))
        if plan.loss_on[t]:
            end = np.full_like(end, end.max() + loss_seconds)
    return float(end.max())


class TablePipelinedGrads(PipelinedGrads):
    """`PipelinedGrads` run by an action table (module docstring); `cfg.pipeline.schedule` names it."""

    def __init__(self, cfg, mesh, rules, param_shardings, layer_specs, rounds: int = 1, tracing=None):
        super().__init__(cfg, mesh, rules, param_shardings, layer_specs, rounds, tracing)
        self.table = ActionTable(cfg.pipeline.schedule, self.stages, self.v, self.microbatches)
        self.plan = compile_table(self.table)

    def chunk_of(self, s: int) -> tuple[int, int]:
        """(stage, chunk) of virtual stage `s` under the schedule's placement (`schedules.placement`)."""
        name, p_count, v = self.cfg.pipeline.schedule, self.stages, self.v
        p = placement(name, p_count, v, s)
        return p, [x for x in range(p_count * v) if placement(name, p_count, v, x) == p].index(s)

    def w_entry(self, microbatch: int) -> tuple[jax.ShapeDtypeStruct, ...]:
        """What one W slot holds for one chunk and a microbatch of `microbatch` sequences: each weight matmul's
        (x, dy) for each of the chunk's layers (`split_backward.Site.tap`; a matmul reading an earlier one's x
        keeps an empty x), shapes global over the axes inside a stage. The W buffer is `TickPlan.w_slots` + 1
        of these per stage, beside the stash (`stash_entry`)."""
        chunk, x = self.abstract_chunk(microbatch)
        layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), chunk)
        with self.tracing():
            sites = sb.record_sites(lambda s, x_: nnx.merge(self.block_gd, s)(x_), layer, x)
        return tuple(jax.ShapeDtypeStruct((self.chunk_layers, *a.shape), a.dtype) for site in sites
                     for a in site.tap)

    def describe(self) -> str:
        t = self.table
        return (f"pipeline: {t.name}, P={t.stages} stages x V={t.virtual_stages} chunks, M={t.microbatches} "
                f"microbatches | {t.ticks} ticks, bubble {t.bubble:.1%} (one pass a tick) | activations in flight on "
                f"stage 0: {t.in_flight(0)}, waiting for W: {t.awaiting_w(0)}")

    def _flush(self, staged, ends, inputs_mbt, targets_mbt):
        plan, p_count, m = self.plan, self.stages, self.microbatches
        staged = jax.tree.map(lambda x: x[0], staged)
        stage = jax.lax.axis_index(AXIS)
        dt = jnp.dtype(self.model_cfg.dtype)
        b, t = inputs_mbt.shape[1:]
        zeros_act = constrain(jnp.zeros((b, t, self.model_cfg.d_model), dt), ACT)
        chunk0 = jax.tree.map(lambda a: a[0], staged)
        layer0 = jax.tree.map(lambda a: a[0], chunk0)
        gd = self.block_gd
        sites = sb.record_sites(lambda s, x: nnx.merge(gd, s)(x), layer0, zeros_act)
        weights = {s.param for s in sites}
        stacked = self.model_cfg.scan_layers

        def taps():
            return sb.zero_taps(sites, (self.chunk_layers,)) if stacked else [sb.zero_taps(sites)] * self.chunk_layers

        def chunk_vjp(layers, x):
            return self._chunk_vjp(layers, x, taps(), sites)

        probe = {}

        def probe_fn(chunk, x):
            _, rows, stash, where, treedef = chunk_vjp(self._layers(chunk), x)
            probe.update(where=where, treedef=treedef)
            return stash, rows

        stash_shapes, row_shapes = jax.eval_shape(probe_fn, chunk0, zeros_act)
        count = iter(range(1, 1 << 30))

        def zeros(shape, dtype):  # zeros XLA cannot merge (see PipelinedGrads._flush)
            return jnp.broadcast_to(jnp.where(stage < 0, next(count), 0).astype(dtype), shape)

        inbox = zeros((plan.inbox_slots + 1, *zeros_act.shape), dt)
        stash = [zeros((plan.res_slots + 1, *a.shape), a.dtype) for a in stash_shapes]
        pair_shapes = jax.eval_shape(lambda: taps())
        wstash = jax.tree.map(lambda a: zeros((plan.w_slots + 1, *a.shape), a.dtype), pair_shapes)
        g_staged = jax.tree.map(lambda x: zeros(x.shape, jnp.float32), staged)
        g_ends = jax.tree.map(lambda x: zeros(x.shape, jnp.float32), ends)
        rows = jax.tree.map(lambda a: zeros((self.v, *a.shape), a.dtype), row_shapes)
        tables = {k: jnp.asarray(getattr(plan, k).reshape(-1)) for k in
                  ("kind", "chunk", "micro", "first", "inbox", "res", "wslot", "route", "from_prev",
                   "from_next", "keep", "loss")}
        fwd_ring = [(j, (j + 1) % p_count) for j in range(p_count)]
        bwd_ring = [(j, (j - 1) % p_count) for j in range(p_count)]
        seed = jnp.float32(1.0 / m)
        t_slice = targets_mbt.shape[2]
        weights_bt = jnp.where(stage * t_slice + jnp.arange(t_slice) < t, 1.0 / (b * t), 0.0).astype(jnp.float32)
        weights_bt = jnp.broadcast_to(weights_bt, (b, t_slice))

        def pick(buffer, i):
            return jax.lax.dynamic_index_in_dim(buffer, i, 0, keepdims=False)

        def put(buffer, i, value):
            return jax.lax.dynamic_update_index_in_dim(buffer, value, i, 0)

        def chunk_params(v):
            return jax.tree.map(lambda x: pick(x, v), staged)

        def tick(carry, tk):
            inbox, stash, wstash, g_staged, g_ends, loss, rows = carry
            at = stage * plan.ticks + tk

            def row(name):
                return pick(tables[name], at)

            kind, v, mb, first, slot_in = row("kind"), row("chunk"), row("micro"), row("first"), row("inbox")
            res_slot, w_slot = row("res"), row("wslot")
            x_in = pick(inbox, slot_in)
            layers = self._layers(chunk_params(v))
            leaves = jax.tree.leaves(layers)

            def accumulate(g_staged, d_by_leaf):
                # adds only the leaves a pass computed: the others' accumulators are not read or written
                flat, tree = jax.tree.flatten(g_staged)
                flat = [put(acc, v, pick(acc, v) + d_by_leaf[j].astype(jnp.float32)) if j in d_by_leaf else acc
                        for j, acc in enumerate(flat)]
                return jax.tree.unflatten(tree, flat)

            # One condition per pass, each writing the buffers it makes in place (as the interleaved step's): only F
            # writes the stash, only B the W slots, and an idle or F tick touches no gradient accumulator.
            def forward(stash, rows):
                emb = constrain(self._embed(ends, pick(inputs_mbt, mb)).astype(dt), ACT)
                x = jnp.where(first == 1, emb, x_in)
                y, found, acts, where, _ = chunk_vjp(layers, x)
                if where != probe["where"]:
                    raise RuntimeError("pipeline: a chunk's residual layout differs from the probe's")
                return (constrain(y.astype(dt), ACT), [put(s, res_slot, a) for s, a in zip(stash, acts)],
                        add_rows(rows, v, found))

            def backward(stash, wstash, g_staged):
                acts = iter([pick(s, res_slot) for s in stash])
                vjp_fn = jax.tree.unflatten(probe["treedef"], [leaves[w] if w >= 0 else next(acts)
                                                                for w in probe["where"]])
                d_layers, dx, pairs = vjp_fn((x_in, seed))  # the router objective's seed is the loss's
                d = jax.tree.leaves(self._stack(d_layers))
                wstash = jax.tree.map(lambda s, a: put(s, w_slot, a), wstash, pairs)
                g_staged = accumulate(g_staged, {j: g for j, g in enumerate(d) if j not in weights})
                return constrain(dx.astype(dt), ACT), wstash, g_staged

            def weight(wstash, g_staged):
                pairs_in = jax.tree.map(lambda s: pick(s, w_slot), wstash)
                if stacked:
                    by_leaf = sb.weight_grads(sites, layers, pairs_in, stacked=True)
                else:
                    per_layer = [sb.weight_grads(sites, s, p, stacked=False) for s, p in zip(layers, pairs_in)]
                    by_leaf = {j: jnp.stack([g[j] for g in per_layer]) for j in weights}
                return accumulate(g_staged, by_leaf)

            with jax.named_scope("tick_pass"):
                y, stash, rows = jax.lax.cond(kind == FWD, forward, lambda *c: (zeros_act, *c), stash, rows)
                dx, wstash, g_staged = jax.lax.cond(kind == BWD, backward, lambda s, w, g: (zeros_act, w, g),
                                                    stash, wstash, g_staged)
                g_staged = jax.lax.cond(kind == WGT, weight, lambda w, g: g, wstash, g_staged)
                out = jnp.where(kind == FWD, y, dx)

            # virtual stage 0's input gradient is the embedding's (a condition on the tick: it holds collectives
            # over the vocabulary's axes; a stage without that pass contributes zero)
            def embed_grad(g_ends):
                _, embed_vjp = jax.vjp(lambda e: self._embed(e, pick(inputs_mbt, mb)).astype(dt), ends)
                (d_embed,) = embed_vjp(jnp.where((kind == BWD) & (first == 1), out, jnp.zeros_like(out)))
                return jax.tree.map(lambda a, d: a + d.astype(jnp.float32), g_ends, d_embed)

            with jax.named_scope("tick_embedding_grad"):
                g_ends = jax.lax.cond(pick(jnp.asarray(plan.embed_grad_on), tk) == 1, embed_grad, lambda g: g,
                                      g_ends)

            # the output layer and loss of the microbatch whose last virtual stage ran forward this tick, spread
            # over the stages along the sequence (PipelinedGrads._flush, step 5); its input gradient goes to the
            # host stage's inbox
            def output_layer(inbox, g_ends, loss):
                y_pad = jnp.pad(out, ((0, 0), (0, p_count * t_slice - t), (0, 0)))
                chunks = jax.lax.all_to_all(y_pad.reshape(b, p_count, t_slice, -1), AXIS, 1, 1)
                y_slice = constrain(chunks[:, plan.host], ACT)
                tg = pick(targets_mbt, pick(jnp.asarray(plan.loss_mb), tk))
                mb_loss, head_vjp = jax.vjp(lambda e, h: self._head_loss(e, h, tg, weights_bt), ends, y_slice)
                d_ends, d_slice = head_vjp(seed.astype(mb_loss.dtype))
                loss_dy = jax.lax.all_gather(d_slice.astype(dt), AXIS, axis=1, tiled=True)[:, :t]
                inbox = put(inbox, row("loss"), constrain(loss_dy, ACT))
                g_ends = jax.tree.map(lambda a, d: a + d.astype(jnp.float32), g_ends, d_ends)
                return inbox, g_ends, loss + mb_loss.astype(jnp.float32) * seed

            with jax.named_scope("tick_output_layer"):
                inbox, g_ends, loss = jax.lax.cond(pick(jnp.asarray(plan.loss_on), tk) == 1, output_layer,
                                                   lambda *c: c, inbox, g_ends, loss)
            route = row("route")
            with jax.named_scope("tick_send"):
                # a ring no stage sends on this tick is skipped (a condition on the tick: every device skips it);
                # on fake CPU devices each `ppermute` is a rendezvous of every device thread
                def send(on, way, ring):
                    return jax.lax.cond(pick(jnp.asarray(on), tk) == 1,
                                        lambda: jax.lax.ppermute(jnp.where(route == way, out, 0).astype(dt), AXIS,
                                                                 ring),
                                        lambda: jnp.zeros_like(out))

                to_next = send(plan.send_next, NEXT, fwd_ring)
                to_prev = send(plan.send_prev, PREV, bwd_ring)
            inbox = put(inbox, row("keep"), out)
            inbox = put(inbox, row("from_prev"), to_next)
            inbox = put(inbox, row("from_next"), to_prev)
            return (inbox, stash, wstash, g_staged, g_ends, loss, rows), None

        carry = (inbox, stash, wstash, g_staged, g_ends, jnp.float32(0.0), rows)
        (_, _, _, g_staged, g_ends, loss, rows), _ = jax.lax.scan(tick, carry, jnp.arange(plan.ticks))
        loss = jax.lax.psum(loss, AXIS)
        g_ends = jax.lax.psum(g_ends, AXIS)
        return loss, jax.tree.map(lambda g: g[None], g_staged), g_ends, jax.tree.map(lambda r: r[None], rows)
