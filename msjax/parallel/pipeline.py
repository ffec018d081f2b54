"""Pipeline parallelism inside the one jitted train step: interleaved 1F1B over the `pipeline` mesh axis.

SPMD, not MPMD: one program, `jax.shard_map` manual over the `pipeline` axis only (`axis_names={"pipeline"}`),
so inside a stage the data, fsdp, sequence and tensor axes stay under the compiler's sharding propagation (the
model's `constrain` calls keep working). Stages exchange activations and their gradients with `ppermute` on a
ring (stage P - 1 wraps round to stage 0 for the next model chunk).

The schedule (`msjax.parallel.schedule`) is a loop over ticks (`lax.scan`, never differentiated). At every tick
each stage:
  1. forward: runs chunk v on the activation received at the end of the previous tick (stage 0, chunk 0: the
     embedding of microbatch i) under `jax.vjp`, and stores what that vjp saved for the backward (the chunk's
     residual activations, never its parameters: see "Residuals" below) in a stash slot;
  2. sends the forward output to the next stage (`ppermute`), issued before the backward below and independent
     of it, so the transfer overlaps the backward compute and the next tick's forward only waits for its data;
  3. backward: rebuilds the chunk's vjp from the stashed residuals and the chunk's parameters and applies it to
     the gradient received from the next stage (the last virtual stage: the loss gradient of step 5 of the tick
     before), adding the parameter gradients to float32 accumulators in the carry;
  4. sends the input gradient to the previous stage (`ppermute`), which overlaps the next tick's forward;
  5. output layer, in the M ticks in which the last virtual stage ran a forward: that output is spread over the
     stages along the sequence (`psum_scatter` over `pipeline`, the other stages contributing zeros), every
     stage runs the final norm, vocabulary projection and loss on its T / P tokens (rounded up, the sequence
     padded to P slices) under `jax.vjp`, the loss summed over them / (b T) and seeded with 1 / M, and the input
     gradients are gathered back (`all_gather`) for the last stage's next backward;
  6. embedding gradient, in the M ticks in which stage 0 ran chunk 0 backward: the embedding's vjp on that
     input gradient (zero on the other stages).
So every microbatch's arithmetic is done once: each chunk's forward and backward once (plus what `model.remat`
recomputes, as on one device), the output layer once across the pipeline (1/P on each stage), the embedding
once per stage (a gather, no matmul). Ticks in which every stage's forward (or backward) slot is idle skip that
work (`lax.cond` on a predicate that is the same on every device, as are the predicates of steps 5 and 6, which
hold collectives over `pipeline`: a branch that some devices of a collective take and others do not deadlocks);
inside a busy tick an idle stage computes on stale data, its cotangent zero and its stash write sent to a spare
slot. (A per-stage branch around a chunk, whose collectives are over the axes inside a stage, runs fine on
XLA:CPU: the table schedules of `msjax.parallel.zero_bubble` are built on it and skip idle passes that way.)
Activation memory per stage is the stash: the microbatches in flight (bounded by P and V, not M) times one
chunk's residuals.

Residuals. `jax.vjp`'s result is a pytree whose leaves are the reused inputs and the residuals; a leaf that is
one of the chunk's parameter arrays is recognised by identity (the same traced value), stays out of the stash,
and the backward rebuilds the vjp with `tree_unflatten`, putting the chunk's parameters back. Anything computed
from the parameters inside the vjp'd function (a bf16 cast of float32 weights, the slice of a stacked layer)
would be a new leaf and a copy of the parameters in every stash slot, so each layer runs under `jax.checkpoint`:
its inputs are then residuals as they are, and its policy says what else is saved. `model.remat` picks the
policy as on one device (`full`, `dots`, `dots_no_batch`); `none` saves every intermediate except those computed
from the parameters alone (`_save_activations`), so nothing runs twice but parameter casts. Layers of a
per-layer model are sliced outside the vjp'd function; stacked layers go through `lax.scan`, whose
residuals forward the stacked parameters themselves.

Parameters: the layer parameters are regrouped inside the step into (P, V, Lc, ...) (stage, chunk, layer in
chunk), sharded over `pipeline` on the first axis; the embedding, final norm and (untied) output projection are
replicated over `pipeline` and their gradients summed over it (the tied embedding's two uses meet there). The
checkpointed train state keeps the model's own layout (stacked `blocks` or per-layer `layers.i`), so checkpoints
restore onto any layout. With stacked layers the rule set is extended with `layers -> pipeline`, so each stage
stores only its own L / P layers and, for V = 1, regrouping is local; for V > 1 the interleaved assignment moves
(V - 1) / V of each stage's layers between stages once per step (an all-to-all) and the gradients back.
Per-layer parameters (`scan_layers=False`: gpt_tiny, llama_tiny) are replicated over `pipeline` and stacked inside
the step.

Mixtures of experts. A chunk's vjp'd function returns (its output, its layers' share of the router losses' term
of the objective), and the backward seeds the second with the loss's 1 / M (zero on an idle stage, as its dy is), so
the router losses' gradients reach the router and every layer below through the same vjps as the tokens'; the
chunk's router statistics come out of the forward beside the vjp (`has_aux`) and each stage sums them per chunk
over its microbatches; the step puts them back in layer order. They are over one microbatch's tokens, as under
gradient accumulation on one device. The expert dispatch nests inside a stage (`msjax.parallel.expert`).

The optimizer update happens outside the `shard_map` on the whole gradient pytree, so clipping and LAMB's
trust ratios see whole-model norms.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, ContextManager

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from msjax.config import Config
from msjax.model import REMAT_POLICIES, abstract_model, block_graphdef, block_with_stats, cse_barrier, ends_graphdef
from msjax.ops import moe as moe_ops
from msjax.parallel import options as overlap
from msjax.parallel import split_backward
from msjax.parallel.schedule import Schedule, pipeline_summary
from msjax.sharding import constrain, use_rules
from msjax.sharding_rules import Rules, logical_to_mesh_spec
from msjax.sharding_rules import axes as ax

AXIS = ax.PIPELINE
ACT = (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_EMBED)


def schedule_of(cfg: Config) -> Schedule:
    """The interleaved 1F1B schedule this config's step runs (M: `Config.pipeline_microbatches`)."""
    return Schedule(cfg.mesh.pipeline, cfg.pipeline.virtual_stages, cfg.pipeline_microbatches())


def _shard_shapes(shapes: set[tuple[int, ...]], axis_sizes: list[int]) -> set[tuple[int, ...]]:
    """`shapes` and every shape a shard of one can have on a mesh with these axis sizes: each dimension divided by
    the product of any of the axes (that divides it)."""
    splits = {1}
    for size in axis_sizes:
        splits |= {x * size for x in splits}
    out = set()
    for shape in shapes:
        options = [[dim // n for n in sorted(splits) if dim % n == 0] for dim in shape]
        out.update(itertools.product(*options))
    return out


def _save_activations(param_shapes: set[tuple[int, ...]]) -> Callable[..., bool]:
    """The `jax.checkpoint` policy of `model.remat=none` inside a pipeline chunk: save every intermediate the
    backward needs except those computed from the layer's parameters alone (an operation all of whose array
    inputs have a parameter's shape: casts, transposes and reshapes of weights), which are recomputed from the
    parameters in the backward instead of stashed once per microbatch in flight. No arithmetic runs twice.

    A policy sees primitives and input shapes, not where values come from; an activation that happened to have a
    parameter's shape would be recomputed too (correct, only slower), which `test_pipeline`'s FLOP count would
    show. Inside a `shard_map` region of the layer (the expert dispatch) the policy sees each device's shard, so
    `param_shapes` holds the shards' shapes too (`_shard_shapes`): without them the expert weights' per-device
    values there (cast or marked varying) counted as activations, a copy of every expert weight in each stash
    slot."""

    def policy(prim, *avals, **params) -> bool:
        arrays = [a for a in avals if getattr(a, "shape", ())]
        return not arrays or not all(tuple(a.shape) in param_shapes for a in arrays)

    return policy


@dataclasses.dataclass(frozen=True)
class _Residuals:
    """Static layout of one chunk's vjp (the same for every chunk and microbatch, read off a probe trace).

    treedef: of the vjp function's pytree. where: per leaf, the index of the chunk parameter leaf it is (by
    identity), or -1 for a residual kept in the stash. stash: ShapeDtypeStructs of the stashed leaves. rows: of
    the chunk's router statistics (`PipelinedGrads._chunk`; {} for dense layers).
    """

    treedef: Any
    where: tuple[int, ...]
    stash: tuple[jax.ShapeDtypeStruct, ...]
    rows: dict


class PipelinedGrads:
    """`(params, inputs (B, T), targets (B, T)) -> (objective, grads, report)` by interleaved 1F1B (module
    docstring).

    Args:
      cfg: validated config with mesh.pipeline > 1 and model.vocab_size set.
      mesh: the device mesh (axes as `msjax.mesh`).
      rules: the rule set in force (already extended by `pipeline_rules`).
      param_shardings: NamedSharding pytree of the parameters (the step's layout).
      layer_specs: logical PartitionSpec of one layer's parameters (nested dict, no `layers` axis).
      rounds: gradient-accumulation rounds (`train.microbatches`), each one pipeline flush of M microbatches.
      tracing: the context the step is traced in (its rule set and model transforms: `msjax.train_step`), which
        the abstract traces of `stash_entry` and `w_entry` enter too, so they see the step's chunk; default: the
        rule set alone.
    Calling it (inside the jitted step) returns the objective (the loss averaged over all B x T tokens, plus with
    MoE layers the router losses' term, `msjax.ops.moe.router_report`), float32 gradients laid out like `params`
    and the report the one-device step makes with gradient accumulation over the same microbatches ({} for a dense
    model; with MoE layers "lm_loss", the router losses, dropped fraction, loads and "expert_load" (L, E)). A
    MoE layer's router statistics, and so its losses, are over one microbatch's tokens, as under gradient
    accumulation (and Megatron-Core's pipeline).
    """

    def __init__(self, cfg: Config, mesh: Mesh, rules: Rules, param_shardings: Any, layer_specs: Any,
                 rounds: int = 1, tracing: Callable[[], ContextManager] | None = None):
        self.cfg, self.mesh, self.rules, self.rounds = cfg, mesh, rules, rounds
        self.tracing = tracing or (lambda: use_rules(mesh, rules))
        self.model_cfg = m = cfg.model
        self.microbatches = cfg.pipeline_microbatches()
        # the interleaved tick table (a subclass runs another schedule and has none)
        self.sched = schedule_of(cfg) if cfg.pipeline.schedule == "interleaved" else None
        self.stages, self.v = cfg.mesh.pipeline, cfg.pipeline.virtual_stages
        self.chunk_layers = m.num_layers // (self.stages * self.v)
        self.moe_layers = sum(m.moe.is_moe_layer(i) for i in range(m.num_layers))  # every layer, or none
        self.param_shardings = param_shardings
        self.block_gd = block_graphdef(m)
        self.ends_gd, self.end_keys = ends_graphdef(m)  # its empty layer list holds no state
        # (P, V, Lc, ...) regrouped layer parameters: stage on `pipeline`, then the layer's own layout.
        self.staged_shardings = jax.tree.map(
            lambda spec: NamedSharding(mesh, P(AXIS, None, None, *logical_to_mesh_spec(tuple(spec), rules))),
            layer_specs, is_leaf=lambda x: isinstance(x, P))
        # per-layer parameters (replicated over `pipeline`) stacked (L, ...) in the layer's own layout, whole on
        # every stage: see `_stacked`
        self.stacked_shardings = jax.tree.map(
            lambda spec: NamedSharding(mesh, P(None, *logical_to_mesh_spec(tuple(spec), rules))),
            layer_specs, is_leaf=lambda x: isinstance(x, P))

    def describe(self) -> str:
        """The start-up line of the run: schedule, bubble fraction and microbatches in flight
        (`msjax.parallel.schedule.pipeline_summary`)."""
        return pipeline_summary(self.sched.stages, self.sched.virtual_stages, self.sched.microbatches)

    # -- parameter regrouping -------------------------------------------------------------------------------

    def _stacked(self, params: dict) -> Any:
        m = self.model_cfg
        if m.scan_layers:
            return params["blocks"]
        layers = [params["layers"][i] for i in range(m.num_layers)]
        # Pinned whole over `pipeline` (as the layers themselves are), so the stack is one local concatenate and
        # `stage` then a local slice. Left to GSPMD, the stack takes `stage`'s split over `pipeline` and XLA builds
        # it as a sum of L zero-padded (L, ...) copies, each live at once: L^2 layers of memory (measured in the
        # compiled refB pipeline4 step: 4 padded stacks of its 4 layers at the step's peak).
        return jax.lax.with_sharding_constraint(jax.tree.map(lambda *xs: jnp.stack(xs), *layers),
                                                self.stacked_shardings)

    def chunk_of(self, s: int) -> tuple[int, int]:
        """(stage, chunk) holding virtual stage `s`: the interleaved assignment, s = v P + p."""
        return s % self.stages, s // self.stages

    def stage(self, params: dict) -> Any:
        """Layer parameters (L, ...) -> (P, V, Lc, ...): chunk v of stage p holds the Lc layers of the virtual stage
        `chunk_of` puts there (interleaved: s = v P + p, layers [s Lc, (s + 1) Lc)).

        Stacked layers are stored split over `pipeline` in order, stage p holding blocks of Lc layers
        b = p V .. p V + V - 1; block b belongs to chunk `chunk_of(b)`. For V = 1 that is where the block already is.
        For V > 1 the blocks move by `ppermute` in P rounds (`_permute_blocks`): left to GSPMD, the reshape of a
        `pipeline`-split axis into (V, P, Lc) is an all-gather of every stage's layers onto every stage (measured
        in the compiled 175B step, pp8 x tp8 and V = 3: 81.5 GB of gathered layers per device).
        """
        p, v, lc = self.stages, self.v, self.chunk_layers
        if self.model_cfg.scan_layers and v > 1:
            move = jax.shard_map(lambda x, me: self._interleave(x, me[0], forward=True), mesh=self.mesh,
                                 in_specs=(P(AXIS), P(AXIS)), out_specs=P(AXIS), axis_names={AXIS}, check_vma=False)
            staged = jax.tree.map(lambda x: move(x, jnp.arange(p, dtype=jnp.int32)), self._stacked(params))
        else:  # per-layer parameters are whole on every stage, and V = 1 is local: a reshape
            order = self._block_order()
            staged = jax.tree.map(lambda x: x.reshape(p * v, lc, *x.shape[1:])[order].reshape(p, v, lc, *x.shape[1:]),
                                  self._stacked(params))
        return jax.lax.with_sharding_constraint(staged, self.staged_shardings)

    def _block_order(self) -> np.ndarray:
        """order[p V + v] = the virtual stage at (stage p, chunk v); the identity for V = 1."""
        order = np.zeros(self.stages * self.v, np.int64)
        for s in range(self.stages * self.v):
            p, c = self.chunk_of(s)
            order[p * self.v + c] = s
        return order

    def unstage(self, staged: Any) -> dict:
        """The inverse of `stage`: (P, V, Lc, ...) gradients back to the model's layer layout."""
        m = self.model_cfg
        if m.scan_layers and self.v > 1:
            back = jax.shard_map(lambda x, me: self._interleave(x, me[0], forward=False), mesh=self.mesh,
                                 in_specs=(P(AXIS), P(AXIS)), out_specs=P(AXIS), axis_names={AXIS}, check_vma=False)
            stages = jnp.arange(self.stages, dtype=jnp.int32)
            return {"blocks": jax.tree.map(lambda x: back(x, stages), staged)}
        inverse = np.argsort(self._block_order())
        stacked = jax.tree.map(lambda x: x.reshape(self.stages * self.v, *x.shape[2:])[inverse].reshape(
            m.num_layers, *x.shape[3:]), staged)
        if m.scan_layers:
            return {"blocks": stacked}
        return {"layers": {i: jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(m.num_layers)}}

    def _interleave(self, x: jax.Array, stage: jax.Array, forward: bool) -> jax.Array:
        """One stage's view (inside a shard_map over `pipeline`, `stage` its index, passed in as data because
        `axis_index` in this shard_map is a PartitionId that the SPMD partitioner refuses): its stored layers
        (V Lc, ...) -> its chunks (1, V, Lc, ...) (`forward`), or back."""
        p_count, v, lc = self.stages, self.v, self.chunk_layers
        # block b = p V + i stored on stage p at i is chunk `chunk_of(b)`
        stored_to_chunk = {(b // v, b % v): self.chunk_of(b) for b in range(p_count * v)}
        if forward:
            blocks = x.reshape(v, lc, *x.shape[1:])
            return _permute_blocks(blocks, stored_to_chunk, p_count, stage)[None]
        chunk_to_stored = {dst: src for src, dst in stored_to_chunk.items()}
        return _permute_blocks(x[0], chunk_to_stored, p_count, stage).reshape(v * lc, *x.shape[3:])

    # -- the model's pieces, as pure functions ----------------------------------------------------------------

    def _embed(self, ends: dict, tokens_bt: jax.Array) -> jax.Array:
        return nnx.merge(self.ends_gd, ends).embed(tokens_bt)

    def _head_loss(self, ends: dict, x_btd: jax.Array, targets_bt: jax.Array, weights_bt: jax.Array) -> jax.Array:
        """Sum over tokens of the cross-entropy times `weights_bt` (1 / (b T) for the microbatch's own tokens, 0
        for the padding that makes T split into P slices)."""
        logits = nnx.merge(self.ends_gd, ends).head(x_btd)
        return jnp.sum(token_cross_entropy(logits, targets_bt) * weights_bt)

    def _layers(self, chunk: Any) -> Any:
        """A chunk's parameters (Lc, ...) as the vjp'd function takes them: stacked for a scan, else a list of
        per-layer trees (sliced here, outside the vjp, so each slice is an input the residuals can name)."""
        if self.model_cfg.scan_layers:
            return chunk
        return [jax.tree.map(lambda a, j=j: a[j], chunk) for j in range(self.chunk_layers)]

    def _stack(self, d_layers: Any) -> Any:
        """The inverse of `_layers` for the chunk's parameter gradients: (Lc, ...)."""
        if self.model_cfg.scan_layers:
            return d_layers
        return jax.tree.map(lambda *xs: jnp.stack(xs), *d_layers)

    def _chunk(self, layers: Any, x_btd: jax.Array, taps: Any = None, sites: Any = None) -> tuple[jax.Array, dict]:
        """Lc layers of one chunk, each under `jax.checkpoint` with `model.remat`'s policy (module docstring:
        "Residuals"), looped or scanned like the model. With `taps` (one per layer, `split_backward.zero_taps` of
        `sites`) the weight matmuls are tapped, so the chunk's vjp can run as B and W
        (`msjax.parallel.split_backward`). Returns ((b, T, D) output, the layers' router statistics as
        `msjax.ops.moe.report_rows`, each (Lc, ...) float32; {} for dense layers)."""
        m, gd = self.model_cfg, self.block_gd
        if m.remat == "none":
            one = [a.shape[1:] for a in jax.tree.leaves(layers)] if m.scan_layers else \
                [a.shape for a in jax.tree.leaves(layers[0])]
            inner = [n for name, n in self.mesh.shape.items() if name != AXIS and n > 1]
            policy = _save_activations(_shard_shapes({tuple(s) for s in one}, inner))
        else:
            policy = REMAT_POLICIES[m.remat]
        def run(state, x, tap):
            if tap is None:
                return block_with_stats(nnx.merge(gd, state), x)
            with split_backward.tapping(sites, state, tap):
                return block_with_stats(nnx.merge(gd, state), x)

        layer = jax.checkpoint(run, policy=policy, prevent_cse=cse_barrier(m))
        if m.scan_layers:
            x_btd, stats = jax.lax.scan(lambda x, st: layer(st[0], x, st[1]), x_btd, (layers, taps),
                                        unroll=m.scan_unroll)
        else:
            per_layer = []
            for j, state in enumerate(layers):
                x_btd, found = layer(state, x_btd, None if taps is None else taps[j])
                per_layer.append(found)
            stats = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
        return x_btd, (moe_ops.report_rows(stats) if stats else {})

    def _router_objective(self, rows: dict) -> jax.Array:
        """The chunk's share of the router losses' term of the objective (`msjax.ops.moe.router_objective` over
        its layers, divided by the model's MoE layer count); 0 for dense layers."""
        if not rows:
            return jnp.float32(0.0)
        mo = self.model_cfg.moe
        return moe_ops.router_objective(rows["aux_loss"], rows["z_loss"], mo.aux_loss_coef, mo.z_loss_coef,
                                        self.moe_layers)

    def _chunk_vjp(self, layers: Any, x_btd: jax.Array, taps: Any = None, sites: Any = None
                   ) -> tuple[jax.Array, dict, list, tuple[int, ...], Any]:
        """(y, router statistics rows, stashed residual leaves, where, treedef): one chunk forward under `jax.vjp`,
        its residuals split from the parameters by identity (module docstring). The vjp'd function's output is
        (y, the chunk's router objective: `_router_objective`), so its cotangent is (dy, the objective's seed),
        and the router losses' gradients flow through the same backward as the tokens'. With `taps` (`_chunk`)
        the vjp also takes them, and its cotangent then has a third part, each weight matmul's (x, dy)."""
        chunk = self._chunk
        if overlap.active().tp == "collective_matmul":
            # The collective matmul's rings (a nested shard_map) hand their residuals out as new values, the
            # parameters among them, so they cannot be told apart: in that mode the chunk is stashed by its input
            # and runs again in the backward (full remat at chunk granularity: one more forward per chunk).
            chunk = jax.checkpoint(self._chunk, policy=jax.checkpoint_policies.nothing_saveable)

        def objective(layers, x, *taps):
            y, rows = chunk(layers, x, *taps, sites) if taps else chunk(layers, x)
            return (y, self._router_objective(rows)), rows

        (y, _), vjp_fn, rows = jax.vjp(objective, layers, x_btd, *([] if taps is None else [taps]), has_aux=True)
        leaves, treedef = jax.tree.flatten(vjp_fn)
        index = {id(a): j for j, a in enumerate(jax.tree.leaves(layers))}
        where = tuple(index.get(id(a), -1) for a in leaves)
        return y, rows, [a for a, w in zip(leaves, where) if w < 0], where, treedef

    def _residuals(self, chunk_abstract: Any, x_abstract: jax.ShapeDtypeStruct) -> _Residuals:
        """The static residual layout (`_Residuals`), from an abstract trace of one chunk forward."""
        found = {}

        def probe(chunk, x):
            _, rows, stash, where, treedef = self._chunk_vjp(self._layers(chunk), x)
            found.update(where=where, treedef=treedef)
            return stash, rows

        stash, rows = jax.eval_shape(probe, chunk_abstract, x_abstract)
        if all(w < 0 for w in found["where"]) and jax.tree.leaves(chunk_abstract):
            raise RuntimeError("pipeline: no chunk parameter was recognised among the vjp's residuals, so the "
                               "stash would copy them; the residual split needs jax.checkpoint's forwarding")
        return _Residuals(found["treedef"], found["where"], tuple(stash), rows)

    def stash_entry(self, microbatch: int) -> tuple[jax.ShapeDtypeStruct, ...]:
        """What one stash slot holds for one chunk and a microbatch of `microbatch` sequences: the residuals of
        the chunk's vjp that are not its parameters (shapes global over the axes inside a stage). The stash is
        `Schedule.slots` + 1 of these per stage."""
        chunk, x = self.abstract_chunk(microbatch)
        with self.tracing():
            return self._residuals(chunk, x).stash

    def abstract_chunk(self, microbatch: int) -> tuple[Any, jax.ShapeDtypeStruct]:
        """(one chunk's parameters, leaves (Lc, ...); a stage input of `microbatch` sequences (b, T, D)) as
        shapes, global over the axes inside a stage."""
        m = self.model_cfg
        _, abs_params, _ = abstract_model(m)
        with use_rules(self.mesh, self.rules):
            staged = jax.eval_shape(self.stage, abs_params)
        chunk = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[2:], a.dtype), staged)
        return chunk, jax.ShapeDtypeStruct((microbatch, self.cfg.train.seq_len, m.d_model), jnp.dtype(m.dtype))

    # -- the schedule ------------------------------------------------------------------------------------------

    def _flush(self, staged: Any, ends: dict, inputs_mbt: jax.Array, targets_mbt: jax.Array):
        """Body of the shard_map (one stage's view): one interleaved-1F1B flush over M microbatches.

        Args (per stage): staged (1, V, Lc, ...); ends: embedding/head params; inputs_mbt (M, b, T); targets_mbt
          (M, b, ceil(T / P)): this stage's slice of the targets, padded (tokens [p T / P, (p + 1) T / P) of the
          output layer's, rounded up).
        Returns: (loss summed over microbatches / M, summed over stages), staged grads (1, V, Lc, ...),
          ends grads (summed over stages), the router statistics rows of the stage's chunks summed over the
          microbatches (1, V, Lc, ...) ({} for dense layers).
        """
        sched, p_count, m = self.sched, self.stages, self.sched.microbatches
        staged = jax.tree.map(lambda x: x[0], staged)
        stage = jax.lax.axis_index(AXIS)
        dt = jnp.dtype(self.model_cfg.dtype)
        b, t = inputs_mbt.shape[1:]
        zeros_act = constrain(jnp.zeros((b, t, self.model_cfg.d_model), dt), ACT)
        res = self._residuals(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), staged),
                              jax.ShapeDtypeStruct(zeros_act.shape, dt))
        spare = sched.slots  # the slot an idle stage's forward writes to: never read
        count = iter(range(1, 1 << 30))

        def zeros(shape, dtype):
            # Zeros that XLA cannot merge with other zeros of the same shape (the stage index is never negative,
            # but the compiler cannot know): it merged identical zero buffers and then copied the one broadcast
            # into each loop carry, holding both (the stash and accumulators twice over at 175B, pp8 x tp8).
            return jnp.broadcast_to(jnp.where(stage < 0, next(count), 0).astype(dtype), shape)

        stash = [zeros((spare + 1, *a.shape), a.dtype) for a in res.stash]
        # (P V M,): stage p's forward of order index k -> slot, at p V M + k. A dynamic slice, not a gather:
        # GSPMD's gather partitioning fails on a table indexed by the manual axis' index (XLA check failure).
        slot_table = jnp.asarray(sched.slot_table.reshape(-1))
        vm = sched.virtual_stages * m

        def slot_of(k):
            return jax.lax.dynamic_index_in_dim(slot_table, stage * vm + k, 0, keepdims=False)
        g_staged = jax.tree.map(lambda x: zeros(x.shape, jnp.float32), staged)
        g_ends = jax.tree.map(lambda x: zeros(x.shape, jnp.float32), ends)
        rows = jax.tree.map(lambda a: zeros((self.v, *a.shape), a.dtype), res.rows)
        fwd_ring = [(j, (j + 1) % p_count) for j in range(p_count)]
        bwd_ring = [(j, (j - 1) % p_count) for j in range(p_count)]
        # loss of a microbatch = mean over its P token slices of each slice's mean; the flush averages M of them
        # each stage's output layer sums its tokens' losses / (b T); the flush averages M microbatches
        seed = jnp.float32(1.0 / m)
        t_slice = targets_mbt.shape[2]  # tokens per stage: T / P rounded up (the targets are padded to P of them)
        weights = jnp.where(stage * t_slice + jnp.arange(t_slice) < t, 1.0 / (b * t), 0.0).astype(jnp.float32)
        weights = jnp.broadcast_to(weights, (b, t_slice))

        def chunk_params(v):
            return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, v, 0, keepdims=False), staged)

        def tokens(which, i):
            return jax.lax.dynamic_index_in_dim(which, i, 0, keepdims=False)

        def f32_add(acc, g):
            return jax.tree.map(lambda a, d: a + d.astype(jnp.float32), acc, g)

        def tick(carry, tk):
            fwd_in, bwd_in, loss_dy, stash, g_staged, g_ends, loss, rows = carry

            # Every condition below is a function of the tick alone, the same on all devices: the output layer
            # holds collectives over pipeline, and a branch that some devices of a collective take and others do
            # not deadlocks (XLA:CPU's rendezvous expects every device of the collective).
            e_on, e_mb = sched.embed_tick(tk)
            with jax.named_scope("tick_embedding"):
                emb = jax.lax.cond(e_on, lambda: constrain(self._embed(ends, tokens(inputs_mbt, e_mb)).astype(dt),
                                                           ACT), lambda: zeros_act)

            # 1. forward slot, skipped in ticks where every stage's slot is idle; an idle stage in a busy tick
            # computes on stale data and stores into the spare slot.
            f_on, _, f_v, f_k = sched.forward(tk, stage)

            def forward(stash, rows):
                x = jnp.where((stage == 0) & (f_v == 0), emb, fwd_in)
                y, found, acts, where, _ = self._chunk_vjp(self._layers(chunk_params(f_v)), x)
                if where != res.where:
                    raise RuntimeError("pipeline: a chunk's residual layout differs from the probe's")
                slot = jnp.where(f_on, slot_of(f_k), spare)
                stash = [jax.lax.dynamic_update_index_in_dim(s, a, slot, 0) for s, a in zip(stash, acts)]
                return constrain(y.astype(dt), ACT), stash, add_rows(rows, f_v, found, f_on)

            with jax.named_scope("tick_forward"):
                y, stash, rows = jax.lax.cond(tk < sched.forward_ticks, forward, lambda *c: (zeros_act, *c),
                                              stash, rows)
            # 2. send it on now: nothing below depends on it, so the transfer can overlap the backward.
            with jax.named_scope("tick_send_forward"):
                fwd_out = jax.lax.ppermute(y, AXIS, fwd_ring)

            # 3. backward slot (same rule for skipping). The cotangent is zero on an idle stage, so its
            # parameter gradients are exactly zero (the vjp is linear in it) and need no mask.
            b_on, _, b_v, b_k = sched.backward(tk, stage)

            def backward(g_staged):
                last = (stage == p_count - 1) & (b_v == self.v - 1)
                dy = jnp.where(b_on, jnp.where(last, loss_dy, bwd_in), jnp.zeros_like(bwd_in))
                slot = slot_of(b_k)
                acts = iter([jax.lax.dynamic_index_in_dim(s, slot, 0, keepdims=False) for s in stash])
                params = jax.tree.leaves(self._layers(chunk_params(b_v)))
                vjp_fn = jax.tree.unflatten(res.treedef, [params[w] if w >= 0 else next(acts) for w in res.where])
                # the router objective's seed, like the loss's (1 / M), and zero on an idle stage as dy is
                d_layers, dx = vjp_fn((dy, jnp.where(b_on, seed, 0.0)))
                g_staged = jax.tree.map(
                    lambda acc, d: jax.lax.dynamic_update_index_in_dim(
                        acc, jax.lax.dynamic_index_in_dim(acc, b_v, 0, keepdims=False) + d.astype(jnp.float32),
                        b_v, 0),
                    g_staged, self._stack(d_layers))
                return constrain(dx.astype(dt), ACT), g_staged

            with jax.named_scope("tick_backward"):
                dx, g_staged = jax.lax.cond(tk >= sched.backward_start, backward, lambda g: (zeros_act, g),
                                            g_staged)
            # 4. send the input gradient back; nothing below depends on it either.
            with jax.named_scope("tick_send_backward"):
                bwd_out = jax.lax.ppermute(dx, AXIS, bwd_ring)

            # 5. output layer and loss of the microbatch that left the last virtual stage this tick, spread over
            # the stages along the sequence; its input gradient is the last stage's cotangent next tick.
            h_on, h_mb = sched.loss_tick(tk)

            def output_layer(loss_dy, g_ends, loss):
                # stage j gets tokens [j T / P, (j + 1) T / P) of the last stage's output: an all-to-all in which
                # only the last stage's chunks are kept. (A reduce-scatter of the output masked to zero elsewhere
                # would do the same, but XLA:CPU's promotion of 16-bit reductions aborts on the one jax emits.)
                y_pad = jnp.pad(y, ((0, 0), (0, p_count * t_slice - t), (0, 0)))
                chunks = jax.lax.all_to_all(y_pad.reshape(b, p_count, t_slice, -1), AXIS, 1, 1)
                y_slice = constrain(chunks[:, p_count - 1], ACT)  # (b, T / P, D) from stage P - 1
                tg = tokens(targets_mbt, h_mb)
                mb_loss, head_vjp = jax.vjp(lambda e, h: self._head_loss(e, h, tg, weights), ends, y_slice)
                d_ends, d_slice = head_vjp(seed.astype(mb_loss.dtype))
                loss_dy = jax.lax.all_gather(d_slice.astype(dt), AXIS, axis=1, tiled=True)[:, :t]
                return constrain(loss_dy, ACT), f32_add(g_ends, d_ends), loss + mb_loss.astype(jnp.float32) * seed

            with jax.named_scope("tick_output_layer"):
                loss_dy, g_ends, loss = jax.lax.cond(h_on, output_layer, lambda *c: c, loss_dy, g_ends, loss)

            # 6. the embedding's gradient from stage 0's chunk-0 input gradient (a zero cotangent elsewhere).
            eg_on, eg_mb = sched.embed_grad_tick(tk)

            def embed_grad(g_ends):
                _, embed_vjp = jax.vjp(lambda e: self._embed(e, tokens(inputs_mbt, eg_mb)).astype(dt), ends)
                (d_embed,) = embed_vjp(jnp.where(stage == 0, dx, jnp.zeros_like(dx)))
                return f32_add(g_ends, d_embed)

            with jax.named_scope("tick_embedding_grad"):
                g_ends = jax.lax.cond(eg_on, embed_grad, lambda g: g, g_ends)
            return (fwd_out, bwd_out, loss_dy, stash, g_staged, g_ends, loss, rows), None

        carry = (zeros_act, zeros_act, zeros_act, stash, g_staged, g_ends, jnp.float32(0.0), rows)
        (_, _, _, _, g_staged, g_ends, loss, rows), _ = jax.lax.scan(tick, carry, jnp.arange(sched.ticks))
        loss = jax.lax.psum(loss, AXIS)
        g_ends = jax.lax.psum(g_ends, AXIS)
        return loss, jax.tree.map(lambda g: g[None], g_staged), g_ends, jax.tree.map(lambda r: r[None], rows)

    def __call__(self, params: dict, inputs_bt: jax.Array, targets_bt: jax.Array) -> tuple[jax.Array, dict, dict]:
        m, a = self.microbatches, self.rounds
        mesh, rules = self.mesh, self.rules
        batch_spec = logical_to_mesh_spec((ax.ACT_BATCH, ax.ACT_SEQ), rules)
        micro = inputs_bt.shape[0] // (a * m)

        def split(x_bt):
            # Microbatch j takes rows j, j + A M, j + 2 A M, ... so each spans every data-parallel device.
            x = x_bt.reshape(micro, a * m, -1).swapaxes(0, 1).reshape(a, m, micro, -1)
            return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, None, *batch_spec)))

        with use_rules(mesh, rules):
            staged = self.stage(params)
            ends = {k: params[k] for k in self.end_keys}
            # the targets split along the sequence, padded to P equal slices: each stage's output layer runs on
            # T / P tokens (rounded up)
            pad = -targets_bt.shape[1] % self.stages
            targets_bt = jnp.pad(targets_bt, ((0, 0), (0, pad)))
            flush = jax.shard_map(self._flush, mesh=mesh, in_specs=(P(AXIS), P(), P(), P(None, None, AXIS)),
                                  out_specs=(P(), P(AXIS), P(), P(AXIS)), axis_names={AXIS}, check_vma=False)

            def round_(carry, mb):
                return f32_tree_add(carry, flush(staged, ends, mb[0], mb[1])), None

            if a == 1:
                xs = (split(inputs_bt)[0], split(targets_bt)[0])
                loss, g_staged, g_ends, rows = flush(staged, ends, *xs)
            else:
                zeros = jax.eval_shape(flush, staged, ends, split(inputs_bt)[0], split(targets_bt)[0])
                zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), zeros)
                sums, _ = jax.lax.scan(round_, zeros, (split(inputs_bt), split(targets_bt)))
                loss, g_staged, g_ends, rows = jax.tree.map(lambda g: g / a, sums)
            grads = {**g_ends, **self.unstage(g_staged)}
            if not rows:
                return loss, jax.lax.with_sharding_constraint(grads, self.param_shardings), {}
            # the rows summed over each round's M microbatches, per (stage, chunk, layer): back to layer order
            # and to means over the step's A M microbatches, the mean of the microbatches' reports
            inverse = np.argsort(self._block_order())
            rows = jax.tree.map(lambda r: r.reshape(self.stages * self.v, *r.shape[2:])[inverse].reshape(
                self.model_cfg.num_layers, *r.shape[3:]) / m, rows)
            mo = self.model_cfg.moe
            router, report = moe_ops.router_report(rows, mo.aux_loss_coef, mo.z_loss_coef)
        return (loss + router, jax.lax.with_sharding_constraint(grads, self.param_shardings),
                {"lm_loss": loss, **report})


def add_rows(acc: dict, v: jax.Array, rows: dict, on: jax.Array | bool = True) -> dict:
    """Router statistics accumulated per chunk: acc (V, Lc, ...) plus, at chunk `v`, a forward's `rows` (Lc, ...)
    where `on` (an idle stage's forward runs on stale data and adds nothing)."""
    return jax.tree.map(lambda a, r: jax.lax.dynamic_update_index_in_dim(
        a, jax.lax.dynamic_index_in_dim(a, v, 0, keepdims=False) + jnp.where(on, r, 0.0), v, 0), acc, rows)


def token_cross_entropy(logits_btv: jax.Array, targets_bt: jax.Array) -> jax.Array:
    """Next-token cross-entropy in float32 per position (nats), as `msjax.train_step.cross_entropy` computes it
    before its mean, with the label's logit taken as a masked sum over the vocabulary instead of a gather: XLA's SPMD
    partitioner aborts (a check failure in ExpandDeviceGroupsWithIota, jax 0.10.2) on the gather of
    `optax.softmax_cross_entropy_with_integer_labels` when its indices vary over the manual `pipeline` axis (each
    stage holds other tokens' targets) and the logits' vocabulary is split over `tensor`. The sum adds exact zeros
    to the one logit, so values and gradients are those of the gather.

    Args:
      logits_btv: (b, T, V) logits, any float dtype. targets_bt: (b, T) int32 in [0, V).
    Returns:
      (b, T) float32.
    """
    x = logits_btv.astype(jnp.float32)
    label = jnp.sum(jnp.where(jnp.arange(x.shape[-1]) == targets_bt[..., None], x, 0.0), axis=-1)
    return jax.nn.logsumexp(x, axis=-1) - label


def _permute_blocks(blocks: jax.Array, mapping: dict, stages: int, stage: jax.Array) -> jax.Array:
    """Moves blocks between the stages of `pipeline` (inside a shard_map over it): `blocks` (n, ...) is this
    stage's, `mapping` sends (stage p, block i) to (stage q, block k) for every block of every stage (a
    permutation). Round r = 0 .. P - 1 sends, with one `ppermute` shifting by r, the blocks each stage has for
    stage p + r, padded to the round's largest count; the tables of which block goes where are constants
    indexed by the stage (one dynamic slice each: GSPMD's gather partitioning fails on a table indexed by the
    manual axis' index).

    Returns:
      (n, ...) this stage's blocks after the move.
    """
    out = jnp.zeros_like(blocks)
    n = blocks.shape[0]
    after = jnp.int32(0)  # 0, computed from the previous round's data: the rounds run one after another
    for r in range(stages):
        sends = [sorted((i, k) for (src, i), (dst, k) in mapping.items() if src == q and dst == (q + r) % stages)
                 for q in range(stages)]
        width = max(len(x) for x in sends)
        if not width:
            continue
        src = np.zeros((stages, width), np.int32)
        dst = np.full((stages, width), n, np.int32)  # n: nothing arrives in this place
        for q in range(stages):
            for j, (i, _) in enumerate(sends[q]):
                src[q, j] = i
            for j, (_, k) in enumerate(sends[(q - r) % stages]):
                dst[q, j] = k
        src_of, dst_of = jnp.asarray(src.reshape(-1)), jnp.asarray(dst.reshape(-1))

        def at(table, j):
            return jax.lax.dynamic_index_in_dim(table, stage * width + j, 0, keepdims=False)

        data = jnp.stack([jax.lax.dynamic_index_in_dim(blocks, at(src_of, j) + after, 0, keepdims=False)
                          for j in range(width)])
        if r:
            data = jax.lax.ppermute(data, AXIS, [(q, (q + r) % stages) for q in range(stages)])
        # Left free, XLA issues every round's ppermute at once and keeps all their buffers (the rounds' padded
        # widths add up to more than the stage's layers: 25 GB at 175B, pp8 x tp8, V = 3). A zero that the next
        # round's indices read from this round's data (the stage index is never negative, but the compiler
        # cannot know) orders the rounds, so one round's buffer is live at a time.
        first = data[(0,) * data.ndim]
        after = jnp.where((stage < 0) & (first != first), jnp.int32(1), jnp.int32(0))
        for j in range(width):
            k = at(dst_of, j)
            keep = jax.lax.dynamic_index_in_dim(out, jnp.minimum(k, n - 1), 0, keepdims=False)
            out = jax.lax.dynamic_update_index_in_dim(out, jnp.where(k < n, data[j], keep), jnp.minimum(k, n - 1),
                                                      0)
    return out


def f32_tree_add(a: Any, b: Any) -> Any:
    """Leafwise a + b in float32."""
    return jax.tree.map(lambda x, y: x + y.astype(jnp.float32), a, b)
