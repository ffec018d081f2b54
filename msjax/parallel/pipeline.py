"""Pipeline parallelism inside the one jitted train step: interleaved 1F1B over the `pipeline` mesh axis.

SPMD, not MPMD: one program, `jax.shard_map` manual over the `pipeline` axis only (`axis_names={"pipeline"}`),
so inside a stage the data, fsdp, sequence and tensor axes stay under the compiler's sharding propagation (the
model's `constrain` calls keep working). Stages exchange activations and their gradients with `ppermute` on a
ring (stage P - 1 wraps round to stage 0 for the next model chunk).

The schedule (`msjax.parallel.schedule`) is a loop over ticks (`lax.scan`, never differentiated). At every tick
each stage:
  1. forward: if its forward slot is busy, runs chunk v on the activation received at the end of the previous
     tick (stage 0, chunk 0: the embedding of microbatch i) and stores that chunk input in a ring-buffer stash of
     2 P V slots (independent of M);
  2. sends the forward output to the next stage (`ppermute`), issued before the backward below and independent
     of it, so the transfer of microbatch i overlaps the backward compute of the same tick and the next tick's
     forward only waits for the data it needs;
  3. backward: if its backward slot is busy, recomputes chunk v from the stashed input under `jax.vjp` (the last
     virtual stage includes the final norm, output projection and loss, seeded with 1 / M; stage 0's chunk 0
     follows with the embedding's vjp), and adds the parameter gradients to float32 accumulators in the carry;
  4. sends the input gradient to the previous stage (`ppermute`), which overlaps the next tick's forward.
Ticks in which every stage's forward (or backward) slot is idle skip that work (`lax.cond` on a predicate that
is the same on every device), so the warm-up and cool-down cost what the bubble says. Activation
memory per stage is the stash (the microbatches in flight, bounded by P and V, not M) plus one chunk's
activations while it is recomputed: at M = 4P the compiled step's temp memory stays within 1.25x of M = P
(tests/msjax/test_pipeline.py). The price is one extra forward of every chunk (as full rematerialisation).

Parameters: the layer parameters are regrouped inside the step into (P, V, Lc, ...) (stage, chunk, layer in
chunk), sharded over `pipeline` on the first axis; the embedding, final norm and (untied) output projection are
replicated over `pipeline` and their gradients summed over it (the tied embedding's two uses meet there). The
checkpointed train state keeps the model's own layout (stacked `blocks` or per-layer `layers.i`), so checkpoints
restore onto any layout. With stacked layers the rule set is extended with `layers -> pipeline`, so each stage
stores only its own L / P layers and, for V = 1, regrouping is local; for V > 1 the interleaved assignment moves
(V - 1) / V of each stage's layers between stages once per step (an all-to-all) and the gradients back.
Per-layer parameters (`scan_layers=False`, the CPU presets) are replicated over `pipeline` and stacked inside
the step.

The optimizer update happens outside the `shard_map` on the whole gradient pytree, so clipping and LAMB's
trust ratios see whole-model norms.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from msjax.config import Config, ModelConfig
from msjax.model import REMAT_POLICIES, Block, abstract_model
from msjax.parallel.schedule import Schedule
from msjax.sharding import constrain, use_rules
from msjax.sharding_rules import Rules, logical_to_mesh_spec
from msjax.sharding_rules import axes as ax

AXIS = ax.PIPELINE


def pipeline_rules(rules: Rules, stages: int) -> Rules:
    """The rule set with stacked layers split over `pipeline` (each stage stores its own layers); unchanged for
    one stage."""
    return {**rules, ax.LAYERS: AXIS} if stages > 1 else rules


def microbatches(cfg: Config) -> int:
    """M: `pipeline.microbatches`, or mesh.pipeline when it is 0."""
    return cfg.pipeline.microbatches or cfg.mesh.pipeline


def schedule_of(cfg: Config) -> Schedule:
    """The interleaved 1F1B schedule this config's step runs."""
    return Schedule(cfg.mesh.pipeline, cfg.pipeline.virtual_stages, microbatches(cfg))


def _block_graphdef(model_cfg: ModelConfig) -> nnx.GraphDef:
    with nnx.use_eager_sharding(False):
        block = nnx.eval_shape(lambda: Block(model_cfg, nnx.Rngs(0)))
    return nnx.split(block)[0]


def _ends_graphdef(model_cfg: ModelConfig) -> tuple[nnx.GraphDef, list[str]]:
    """GraphDef of the model without layers (embedding, final norm, output projection) and its top-level keys."""
    ends_cfg = dataclasses.replace(model_cfg, num_layers=0, scan_layers=False)
    graphdef, abs_params, _ = abstract_model(ends_cfg)
    return graphdef, sorted(abs_params)


class PipelinedGrads:
    """`(params, inputs (B, T), targets (B, T)) -> (mean loss, grads)` by interleaved 1F1B (module docstring).

    Args:
      cfg: validated config with mesh.pipeline > 1 and model.vocab_size set.
      mesh: the device mesh (axes as `msjax.mesh`).
      rules: the rule set in force (already extended by `pipeline_rules`).
      param_shardings: NamedSharding pytree of the parameters (the step's layout).
      layer_specs: logical PartitionSpec of one layer's parameters (nested dict, no `layers` axis).
      loss_fn: `(logits (b, T, V) float32, targets (b, T) int32) -> mean loss` (float32 scalar).
      rounds: gradient-accumulation rounds (`train.microbatches`), each one pipeline flush of M microbatches.
    Calling it (inside the jitted step) returns the loss averaged over all B x T tokens and float32 gradients
    laid out like `params`.
    """

    def __init__(self, cfg: Config, mesh: Mesh, rules: Rules, param_shardings: Any, layer_specs: Any,
                 loss_fn: Callable[[jax.Array, jax.Array], jax.Array], rounds: int = 1):
        self.cfg, self.mesh, self.rules, self.loss_fn, self.rounds = cfg, mesh, rules, loss_fn, rounds
        self.model_cfg = m = cfg.model
        self.sched = schedule_of(cfg)
        self.stages, self.v = cfg.mesh.pipeline, cfg.pipeline.virtual_stages
        self.chunk_layers = m.num_layers // (self.stages * self.v)
        self.param_shardings = param_shardings
        self.block_gd = _block_graphdef(m)
        self.ends_gd, self.end_keys = _ends_graphdef(m)  # its empty layer list holds no state
        # (P, V, Lc, ...) regrouped layer parameters: stage on `pipeline`, then the layer's own layout.
        self.staged_shardings = jax.tree.map(
            lambda spec: NamedSharding(mesh, P(AXIS, None, None, *logical_to_mesh_spec(tuple(spec), rules))),
            layer_specs, is_leaf=lambda x: isinstance(x, P))
        # per-layer parameters (replicated over `pipeline`) stacked (L, ...) in the layer's own layout, whole on
        # every stage: see `_stacked`
        self.stacked_shardings = jax.tree.map(
            lambda spec: NamedSharding(mesh, P(None, *logical_to_mesh_spec(tuple(spec), rules))),
            layer_specs, is_leaf=lambda x: isinstance(x, P))

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

    def stage(self, params: dict) -> Any:
        """Layer parameters (L, ...) -> (P, V, Lc, ...): virtual stage s = v P + p holds layers [s Lc, (s+1) Lc)."""
        p, v, lc = self.stages, self.v, self.chunk_layers

        def regroup(x):
            return x.reshape(v, p, lc, *x.shape[1:]).swapaxes(0, 1)

        staged = jax.tree.map(regroup, self._stacked(params))
        return jax.lax.with_sharding_constraint(staged, self.staged_shardings)

    def unstage(self, staged: Any) -> dict:
        """The inverse of `stage`: (P, V, Lc, ...) gradients back to the model's layer layout."""
        m = self.model_cfg
        stacked = jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(m.num_layers, *x.shape[3:]), staged)
        if m.scan_layers:
            return {"blocks": stacked}
        return {"layers": {i: jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(m.num_layers)}}

    # -- the model's pieces, as pure functions ----------------------------------------------------------------

    def _embed(self, ends: dict, tokens_bt: jax.Array) -> jax.Array:
        return nnx.merge(self.ends_gd, ends).embed(tokens_bt)

    def _head_loss(self, ends: dict, x_btd: jax.Array, targets_bt: jax.Array) -> jax.Array:
        logits = nnx.merge(self.ends_gd, ends).head(x_btd)
        return self.loss_fn(logits, targets_bt)

    def _chunk(self, chunk: Any, x_btd: jax.Array) -> jax.Array:
        """Lc layers of one chunk (params stacked (Lc, ...)), looped or scanned like the model."""
        m, gd = self.model_cfg, self.block_gd

        def layer(state, x):
            return nnx.merge(gd, state)(x)

        if m.remat != "none":
            layer = jax.checkpoint(layer, policy=REMAT_POLICIES[m.remat], prevent_cse=not m.scan_layers)
        if m.scan_layers:
            x_btd, _ = jax.lax.scan(lambda x, s: (layer(s, x), None), x_btd, chunk)
            return x_btd
        for j in range(self.chunk_layers):
            x_btd = layer(jax.tree.map(lambda a, j=j: a[j], chunk), x_btd)
        return x_btd

    # -- the schedule ------------------------------------------------------------------------------------------

    def _flush(self, staged: Any, ends: dict, inputs_mbt: jax.Array, targets_mbt: jax.Array):
        """Body of the shard_map (one stage's view): one interleaved-1F1B flush over M microbatches.

        Args (per stage): staged (1, V, Lc, ...); ends: embedding/head params; inputs_mbt, targets_mbt (M, b, T).
        Returns: (loss summed over microbatches / M, summed over stages), staged grads (1, V, Lc, ...),
          ends grads (summed over stages).
        """
        sched, p_count, m = self.sched, self.stages, self.sched.microbatches
        staged = jax.tree.map(lambda x: x[0], staged)
        stage = jax.lax.axis_index(AXIS)
        dt = jnp.dtype(self.model_cfg.dtype)
        b, t = inputs_mbt.shape[1:]
        act_names = (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_EMBED)
        zeros_act = constrain(jnp.zeros((b, t, self.model_cfg.d_model), dt), act_names)
        stash = jnp.zeros((sched.slots, b, t, self.model_cfg.d_model), dt)
        stash = constrain(stash, (None, *act_names))
        g_staged = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), staged)
        g_ends = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), ends)
        fwd_ring = [(j, (j + 1) % p_count) for j in range(p_count)]
        bwd_ring = [(j, (j - 1) % p_count) for j in range(p_count)]
        seed = jnp.float32(1.0 / m)

        def chunk_params(v):
            return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, v, 0, keepdims=False), staged)

        def f32_add(acc, g):
            return jax.tree.map(lambda a, d: a + d.astype(jnp.float32), acc, g)

        def tick(carry, tk):
            fwd_in, bwd_in, stash, g_staged, g_ends, loss = carry

            # 1. forward slot. Skipped (lax.cond) only in ticks where every stage's slot is idle: the predicate
            # is the same on all devices, because a branch that some devices of a collective take and others do
            # not deadlocks (XLA:CPU's rendezvous expects every device). Within a busy tick an idle stage
            # computes on stale data and its result is masked; the tick lasts as long as its busiest stage.
            f_on, f_mb, f_v, f_slot = sched.forward(tk, stage)

            def forward(stash):
                tokens = jax.lax.dynamic_index_in_dim(inputs_mbt, f_mb, 0, keepdims=False)
                x = jnp.where((stage == 0) & (f_v == 0), self._embed(ends, tokens).astype(dt), fwd_in)
                y = self._chunk(chunk_params(f_v), x)
                old = jax.lax.dynamic_index_in_dim(stash, f_slot, 0, keepdims=False)
                stash = jax.lax.dynamic_update_index_in_dim(stash, jnp.where(f_on, x, old), f_slot, 0)
                return constrain(y.astype(dt), act_names), stash

            y, stash = jax.lax.cond(tk < sched.forward_ticks, forward, lambda s: (zeros_act, s), stash)
            # 2. send it on now: nothing below depends on it, so the transfer overlaps the backward.
            fwd_out = jax.lax.ppermute(y, AXIS, fwd_ring)

            # 3. backward slot (same rule for skipping). Every stage runs chunk + head + loss under one vjp and
            # the cotangents select what counts: the last virtual stage seeds the loss with 1 / M, the others
            # take the gradient received from the next stage (a per-stage branch would deadlock, see above;
            # the head costs the other stages nothing, since the last stage's tick is the longest anyway).
            b_on, b_mb, b_v, b_slot = sched.backward(tk, stage)

            def backward(g_staged, g_ends, loss):
                last = b_on & (stage == p_count - 1) & (b_v == self.v - 1)
                x = jax.lax.dynamic_index_in_dim(stash, b_slot, 0, keepdims=False)
                inputs = jax.lax.dynamic_index_in_dim(inputs_mbt, b_mb, 0, keepdims=False)
                targets = jax.lax.dynamic_index_in_dim(targets_mbt, b_mb, 0, keepdims=False)

                def f(cp, ends, x):
                    y = self._chunk(cp, x)
                    return y, self._head_loss(ends, y, targets)

                (_, mb_loss), vjp = jax.vjp(f, chunk_params(b_v), ends, x)
                dy = jnp.where(b_on & ~last, bwd_in, jnp.zeros_like(bwd_in))
                d_cp, d_ends, dx = vjp((dy, jnp.where(last, seed, 0.0).astype(mb_loss.dtype)))
                dx = constrain(dx.astype(dt), act_names)
                # stage 0, chunk 0: the embedding's vjp with the input gradient (zero cotangent elsewhere)
                _, embed_vjp = jax.vjp(lambda e: self._embed(e, inputs).astype(dt), ends)
                (d_embed,) = embed_vjp(jnp.where(b_on & (stage == 0) & (b_v == 0), dx, jnp.zeros_like(dx)))
                g_ends = jax.tree.map(lambda a, d1, d2: a + jnp.where(b_on, d1.astype(jnp.float32)
                                                                      + d2.astype(jnp.float32), 0.0),
                                      g_ends, d_ends, d_embed)
                g_chunk = jax.tree.map(
                    lambda a, d: jax.lax.dynamic_index_in_dim(a, b_v, 0, keepdims=False)
                    + jnp.where(b_on, d.astype(jnp.float32), 0.0), g_staged, d_cp)
                g_staged = jax.tree.map(lambda a, g: jax.lax.dynamic_update_index_in_dim(a, g, b_v, 0), g_staged,
                                        g_chunk)
                loss = loss + jnp.where(last, mb_loss.astype(jnp.float32), 0.0) * seed
                return dx, g_staged, g_ends, loss

            dx, g_staged, g_ends, loss = jax.lax.cond(
                tk >= sched.backward_start, backward, lambda *c: (zeros_act, *c), g_staged, g_ends, loss)
            # 4. send the input gradient back; it overlaps the next tick's forward.
            bwd_out = jax.lax.ppermute(dx, AXIS, bwd_ring)
            return (fwd_out, bwd_out, stash, g_staged, g_ends, loss), None

        carry = (zeros_act, zeros_act, stash, g_staged, g_ends, jnp.float32(0.0))
        (_, _, _, g_staged, g_ends, loss), _ = jax.lax.scan(tick, carry, jnp.arange(sched.ticks))
        loss = jax.lax.psum(loss, AXIS)
        g_ends = jax.lax.psum(g_ends, AXIS)
        return loss, jax.tree.map(lambda g: g[None], g_staged), g_ends

    def __call__(self, params: dict, inputs_bt: jax.Array, targets_bt: jax.Array) -> tuple[jax.Array, dict]:
        m, a = self.sched.microbatches, self.rounds
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
            flush = jax.shard_map(self._flush, mesh=mesh, in_specs=(P(AXIS), P(), P(), P()),
                                  out_specs=(P(), P(AXIS), P()), axis_names={AXIS}, check_vma=False)

            def round_(carry, mb):
                loss_sum, gs_sum, ge_sum = carry
                loss, gs, ge = flush(staged, ends, mb[0], mb[1])
                return (loss_sum + loss, f32_tree_add(gs_sum, gs), f32_tree_add(ge_sum, ge)), None

            zeros = (jnp.float32(0.0), jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), staged),
                     jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), ends))
            if a == 1:
                xs = (split(inputs_bt)[0], split(targets_bt)[0])
                loss, g_staged, g_ends = flush(staged, ends, *xs)
            else:
                (loss, g_staged, g_ends), _ = jax.lax.scan(round_, zeros, (split(inputs_bt), split(targets_bt)))
                loss = loss / a
                g_staged = jax.tree.map(lambda g: g / a, g_staged)
                g_ends = jax.tree.map(lambda g: g / a, g_ends)
            grads = {**g_ends, **self.unstage(g_staged)}
        return loss, jax.lax.with_sharding_constraint(grads, self.param_shardings)


def f32_tree_add(a: Any, b: Any) -> Any:
    """Leafwise a + b in float32."""
    return jax.tree.map(lambda x, y: x + y.astype(jnp.float32), a, b)
