"""The sharded training program: state layout, initialisation, and the jitted train and eval steps.

Data flow: config -> mesh + rules -> abstract model -> shardings -> jitted init (state created sharded, never
materialised whole on one device) -> jitted step with explicit in/out shardings and the state donated.
With mesh.pipeline > 1 the gradients come from the interleaved-1F1B schedule of `msjax.parallel.pipeline`
(evaluation and sampling run the plain model under GSPMD); the optimizer update is the same either way.

Train state (a plain pytree, what Orbax saves):
  step     int32 scalar, optimizer steps taken.
  params   nested dict of float arrays (see `msjax.model`), sharded by the rule set.
  opt_state optax state; moments sharded like the parameters they follow.
  rng      uint32 key data (2,): the run's random stream, advanced each step (sampling uses it).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from msjax.config import Config
from msjax.layout import Layout, resolve as resolve_layout
from msjax.model import Packing, abstract_model, apply_with_stats, init_params
from msjax.ops import moe as moe_ops
from msjax.optim import learning_rates, make_optimizer, skipped_steps
from msjax.parallel.arrival import step_start, use_arrival_marks
from msjax.parallel.expert import use_expert_parallelism
from msjax.parallel.options import use_overlap
from msjax.parallel.pipeline import PipelinedGrads
from msjax.parallel.zero_bubble import TablePipelinedGrads
from msjax.parallel.zero2 import reduce_scattered_grads
from msjax.sharding import constrain, tree_shardings, use_rules
from msjax.sharding_rules import OPTIMIZER_STATE_RULES
from msjax.sharding_rules import axes as ax


@dataclass
class TrainProgram:
    """Everything needed to run or compile one layout of one config.

    Attributes:
      config: the config, with model.vocab_size filled in.
      mesh: the device mesh.
      graphdef: the model's static structure (nnx.GraphDef).
      optimizer: the optax transformation.
      abstract_state: train state as jax.ShapeDtypeStruct leaves with `.sharding` set.
      state_shardings: NamedSharding pytree matching the state.
      abstract_batch: {key: ShapeDtypeStruct (B, T) with the batch sharding} for `batch_keys(config.data.format)`.
      batch_sharding: NamedSharding of a (B, T) batch array.
      init_fn: jitted `key -> state`, creating the state already sharded.
      step_fn: jitted `(state, batch) -> (state, metrics)`; `state` is donated.
      steps_fn: with `train.steps_per_execution` K > 1, jitted `(state, batches) -> (state, metrics)` running K
        steps in one call (a `jax.lax.scan` of the step over the tuple of K batches, stacked inside the program);
        `metrics` are the last step's; `state` is donated. None when K = 1.
      eval_fn: jitted `(params, batch) -> mean loss` (float32 scalar).
      grad_fn: jitted `(params, batch) -> (objective, grads)`: the step's gradients of one whole batch (accumulated over
        train.microbatches, or pipelined, as the step does), grads sharded like params.
      param_count: number of parameters (elements).
      param_bytes, opt_state_bytes: global sizes of parameters and optimizer state, bytes.
      pipeline: the `msjax.parallel.pipeline.PipelinedGrads` the step runs with mesh.pipeline > 1, else None.
      matmul_dtype: the dtype name the weight matmuls' operands take on this backend ("float32", "bfloat16":
        `model.matmul_dtype` resolved, `msjax.ops.matmul.resolve`): what a CPU's MFU is measured against.
      layout: the resolved layout the program was built for (`msjax.layout.Layout`).
    """

    config: Config
    mesh: Mesh
    graphdef: Any
    optimizer: optax.GradientTransformation
    abstract_state: dict
    state_shardings: dict
    abstract_batch: dict
    batch_sharding: NamedSharding
    init_fn: Callable
    step_fn: Callable
    eval_fn: Callable
    grad_fn: Callable
    param_count: int
    param_bytes: int
    opt_state_bytes: int
    pipeline: PipelinedGrads | None = None
    matmul_dtype: str = "float32"
    steps_fn: Callable | None = None
    layout: Layout | None = None

    def evaluate(self, params: Any, batches: Sequence[dict]) -> float:
        """Mean loss (nats per token) of `params` over `batches` (each like `abstract_batch`): the validation loss.
        Batches of windows weigh the same (each holds B*T tokens); batches with weights (chat) weigh by the tokens
        they train on, so the loss is the mean over every such token. NaN when there are no batches."""
        if not batches:
            return float("nan")
        losses = [float(self.eval_fn(params, b)) for b in batches]
        if "weights" not in batches[0]:
            return sum(losses) / len(losses)
        counts = [float(np.asarray(jax.device_get(b["weights"])).sum()) if b["weights"].is_fully_addressable
                  else float(jax.jit(jnp.sum)(b["weights"])) for b in batches]
        return sum(x * n for x, n in zip(losses, counts)) / max(sum(counts), 1.0)

    @functools.cached_property
    def learning_rates(self) -> np.ndarray:
        """(train.steps,) float32: the learning rate of step s at index s - 1 (`msjax.optim.learning_rates`),
        computed once per program: what the loop logs and the step observer records."""
        return learning_rates(self.config.optimizer, self.config.train.steps)


def _nbytes(tree: Any) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def cross_entropy(logits_btv: jax.Array, targets_bt: jax.Array, weights_bt: jax.Array | None = None,
                  total: jax.Array | None = None) -> jax.Array:
    """Next-token cross-entropy in float32 (nats): the mean over all B*T positions, or, with `weights_bt`
    (float32 (B, T): 1 on the tokens trained on, e.g. an assistant's, 0 elsewhere), the weighted sum over `total`
    (a float32 scalar; default the weights' sum, at least 1). A step split into microbatches passes the whole
    step's total, so each token weighs the same whichever microbatch holds it (a mean of microbatch means would
    weigh the tokens of a microbatch with few of them more)."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits_btv.astype(jnp.float32), targets_bt)
    if weights_bt is None:
        return losses.mean()
    if total is None:
        total = jnp.maximum(weights_bt.sum(), 1.0)
    return (losses * weights_bt).sum() / total


def packing(batch: dict) -> Packing | None:
    """The `Packing` of a batch of packed examples (keys "segments", "positions"), or None (plain windows)."""
    return Packing(batch["segments"], batch["positions"]) if "segments" in batch else None


def batch_keys(data_format: str) -> tuple[str, ...]:
    """The keys of a batch (each (B, T)): inputs and targets int32; chat adds weights float32, segments and
    positions int32 (msjax.data.sft)."""
    return ("inputs", "targets") + (("weights", "segments", "positions") if data_format == "chat" else ())


def build_train_program(cfg: Config | Layout, mesh: Mesh | None = None, vocab_size: int | None = None
                        ) -> TrainProgram:
    """Builds the sharded train program of one layout.

    Args:
      cfg: the resolved `msjax.layout.Layout` to build; or a Config, resolved here on `mesh` (`msjax.layout.resolve`).
      mesh: with a Config, the mesh from `msjax.mesh.make_mesh(cfg.mesh)`; ignored with a Layout.
      vocab_size: with a Config, the tokenizer's vocabulary (fills model.vocab_size when it is 0).
    Raises:
      ConfigError: what `msjax.layout.resolve` raises: a vocabulary that is missing or larger than
        model.vocab_size, a model or (pipeline) microbatch that does not split over the mesh.
    """
    # A Config given here is resolved as the low-level API always built it: any rule set on any mesh.
    layout = cfg if isinstance(cfg, Layout) else resolve_layout(cfg, mesh=mesh, vocab_size=vocab_size,
                                                                 strict=False)
    if layout.padded_vocab is None:
        layout = layout.with_vocab(None)  # raises: no vocabulary at all
    cfg, mesh, rules = layout.config, layout.mesh, layout.rules
    model_cfg, t, stages = cfg.model, cfg.train, layout.stages

    graphdef, abs_params, logical_specs = abstract_model(model_cfg)
    param_shardings = tree_shardings(logical_specs, mesh, rules)

    def init(key: jax.Array) -> dict:  # traced below, once `tx` exists
        params_key, run_key = jax.random.split(key)
        params = init_params(model_cfg, params_key)
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params),
                "rng": jax.random.key_data(run_key)}

    tx = make_optimizer(cfg.optimizer, t.steps)
    abs_opt = jax.eval_shape(tx.init, abs_params)
    replicated = NamedSharding(mesh, P())
    # Optimizer moments follow their parameter's sharding (so FSDP shards them too); counters are replicated.
    # Gradients follow the optimizer state's rules (`Layout.state_rules`): the parameters' own, except ZeRO-2.
    grad_shardings = tree_shardings(logical_specs, mesh, layout.state_rules)
    opt_shardings = optax.tree_map_params(tx, lambda _, s: s, abs_opt, grad_shardings,
                                          transform_non_params=lambda _: replicated)
    state_shardings = {"step": replicated, "params": param_shardings, "opt_state": opt_shardings,
                       "rng": replicated}
    batch_sharding = NamedSharding(mesh, layout.batch_spec)

    @contextlib.contextmanager
    def tracing() -> Iterator[None]:
        """Where every function of this program is traced: the layout's rule set, the model transforms of the
        overlap switches (collective matmul, FSDP prefetch: `msjax.parallel.options.use_overlap`) and, for a
        mixture of experts, expert parallelism (`msjax.parallel.expert`)."""
        experts = use_expert_parallelism() if model_cfg.moe.num_experts else contextlib.nullcontext()
        with use_rules(mesh, rules), use_overlap(cfg.mesh), experts:
            yield

    moe = model_cfg.moe

    def loss_fn(params: dict, batch: dict, total: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """(the objective, what the step reports beside it). Dense: the cross-entropy and {}. With MoE layers the
        objective adds each router loss, averaged over the MoE layers, times its coefficient (model.moe.
        aux_loss_coef, z_loss_coef), and the report has the cross-entropy alone ("lm_loss"), both router losses
        unweighted, the fraction of assignments dropped and the most loaded expert's share over the mean's
        (1: even), averaged over the MoE layers, and "expert_load" (L_moe, E): each expert's share of its layer's
        assignments (`msjax.observe.experts`)."""
        logits_btv, stats = apply_with_stats(graphdef, params, batch["inputs"], packing(batch))
        ce = cross_entropy(logits_btv, batch["targets"], batch.get("weights"), total)
        if not stats:
            return ce, {}
        router, report = moe_ops.router_report(moe_ops.report_rows(stats), moe.aux_loss_coef, moe.z_loss_coef)
        return ce + router, {"lm_loss": ce, **report}

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    pipelined = None
    if stages > 1:  # interleaved 1F1B over the pipeline axis (msjax/parallel/pipeline.py)
        layer_specs = logical_specs["blocks"] if model_cfg.scan_layers else logical_specs["layers"][0]
        if model_cfg.scan_layers:  # drop the leading `layers` axis
            layer_specs = jax.tree.map(lambda s: P(*tuple(s)[1:]), layer_specs, is_leaf=lambda x: isinstance(x, P))
        runner = PipelinedGrads if cfg.pipeline.schedule == "interleaved" else TablePipelinedGrads
        pipelined = runner(cfg, mesh, rules, param_shardings, layer_specs, t.microbatches, tracing)

    def local_grads(params: dict, batch: dict) -> tuple[tuple[jax.Array, dict], dict]:
        """((objective, report), gradients) over the rows given (the global batch, or one device's rows under
        ZeRO-2): the mean loss, or with weights the weighted sum over the weights' total (`cross_entropy`); the
        report (`loss_fn`) averaged over the microbatches, its cross-entropy summed like the loss."""
        if t.microbatches == 1:
            return grad_fn(params, batch)
        weights = batch.get("weights")
        total = None if weights is None else jnp.maximum(weights.sum(), 1.0)  # the whole step's, see cross_entropy

        # Gradient accumulation: microbatch m takes rows m, m + M, m + 2M, ... so every microbatch still spans
        # all data-parallel devices (each holds contiguous rows).
        def split(x_bt):
            x_mbt = x_bt.reshape(-1, t.microbatches, x_bt.shape[-1]).swapaxes(0, 1)
            return constrain(x_mbt, (None, ax.ACT_BATCH, ax.ACT_SEQ))

        def accumulate(carry, mb):
            loss_sum, grad_sum = carry
            (loss, report), grads = grad_fn(params, mb, total)
            return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), report

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        (loss, grads), reports = jax.lax.scan(accumulate, (jnp.zeros((), jnp.float32), zeros),
                                              jax.tree.map(split, batch))
        m = t.microbatches
        # over the microbatches (axis 0) only: "expert_load" stays (L, E)
        report = {k: jnp.sum(v, axis=0) if (k == "lm_loss" and weights is not None) else jnp.mean(v, axis=0)
                  for k, v in reports.items()}
        if weights is not None:
            return (loss, report), grads  # the microbatches' sums over the step's total are the step's
        return (loss / m, report), jax.tree.map(lambda g: g / m, grads)

    if cfg.mesh.rules in OPTIMIZER_STATE_RULES:  # ZeRO-2: reduce-scatter the gradients over fsdp by hand
        local_grads = reduce_scattered_grads(local_grads, mesh, grad_shardings)

    def train_step(state: dict, batch: dict) -> tuple[dict, dict]:
        params = state["params"]
        # Each device's arrival at the gradient reduction, for the straggler detector (msjax.parallel.arrival);
        # the pipeline's stages run the embedding inside their own schedule, where nothing is marked.
        observed = cfg.observe.window and cfg.observe.own_compute and stages == 1
        marks = use_arrival_marks(state["step"] + 1) if observed else contextlib.nullcontext()
        with tracing(), marks:
            if stages > 1:
                loss, grads, report = pipelined(params, batch["inputs"], batch["targets"])
            else:
                (loss, report), grads = local_grads(params, {**batch, "inputs": step_start(batch["inputs"])})
        grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        rng = jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state["rng"]))[0])
        # "loss" is the language model's cross-entropy, with or without router losses in the objective
        report = dict(report)
        metrics = {"loss": report.pop("lm_loss", loss), "grad_norm": optax.tree.norm(grads),
                   "skipped": skipped_steps(opt_state), **report}
        new_state = {"step": state["step"] + 1, "params": new_params, "opt_state": opt_state, "rng": rng}
        return new_state, metrics

    def eval_step(params: dict, batch: dict) -> jax.Array:
        with tracing():
            loss, report = loss_fn(params, batch)
            return report.get("lm_loss", loss)

    def batch_grads(params: dict, batch: dict) -> tuple[jax.Array, dict]:
        with tracing():
            if stages > 1:
                return pipelined(params, batch["inputs"], batch["targets"])[:2]
            (loss, _), grads = local_grads(params, batch)  # the step's: accumulated over train.microbatches
            return loss, grads

    init_fn = jax.jit(init, out_shardings=state_shardings)
    abstract_state = jax.eval_shape(init_fn, jax.random.key(0))
    abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                  abstract_state, state_shardings)
    step_fn = jax.jit(train_step, in_shardings=(state_shardings, batch_sharding),
                      out_shardings=(state_shardings, replicated), donate_argnums=0)
    steps_fn = None
    if t.steps_per_execution > 1:
        def train_steps(state: dict, batches: tuple[dict, ...]) -> tuple[dict, dict]:
            stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *batches)  # (K, B, T) each
            state, metrics = jax.lax.scan(train_step, state, stacked)
            return state, jax.tree.map(lambda m: m[-1], metrics)

        steps_fn = jax.jit(train_steps, in_shardings=(state_shardings, (batch_sharding,) * t.steps_per_execution),
                           out_shardings=(state_shardings, replicated), donate_argnums=0)
    eval_fn = jax.jit(eval_step, in_shardings=(param_shardings, batch_sharding), out_shardings=replicated)
    grads_fn = jax.jit(batch_grads, in_shardings=(param_shardings, batch_sharding),
                       out_shardings=(replicated, param_shardings))
    abstract_batch = {key: jax.ShapeDtypeStruct((t.global_batch, t.seq_len),
                                                jnp.float32 if key == "weights" else jnp.int32,
                                                sharding=batch_sharding)
                      for key in batch_keys(cfg.data.format)}
    return TrainProgram(
        config=cfg, mesh=mesh, graphdef=graphdef, optimizer=tx, abstract_state=abstract_state,
        state_shardings=state_shardings, abstract_batch=abstract_batch,
        batch_sharding=batch_sharding, init_fn=init_fn, step_fn=step_fn, eval_fn=eval_fn, grad_fn=grads_fn,
        param_count=sum(x.size for x in jax.tree.leaves(abs_params)), param_bytes=_nbytes(abs_params),
        opt_state_bytes=_nbytes(abs_opt), pipeline=pipelined,
        matmul_dtype=layout.matmul_dtype, steps_fn=steps_fn, layout=layout,
    )
