"""Optimizers from optax (a well-kept library: no reason to own these): AdamW or LAMB with warmup + cosine
decay, global-norm clipping and a weight-decay mask."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from msjax.config import OptimizerConfig

# Matmul weights take weight decay; norms, biases and embedding tables do not, as minGPT's configure_optimizers
# sorts them. (nanoGPT and Megatron-LM decay every matrix, the embedding tables included.)
DECAYED = frozenset({"wq", "wk", "wv", "wo", "w_gate", "w_in", "w_out", "lm_head"})


def decay_mask(params: dict) -> dict:
    """Pytree of bools like `params`: True where weight decay applies (by parameter name, since stacked layers
    make every norm scale 2-D)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key in DECAYED, params)


def lr_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to `lr` over `warmup_steps`, then cosine decay to `min_lr` at `decay_steps`
    (0: `total_steps`), constant after (Loshchilov & Hutter 2017, SGDR eq. 5 without restarts)."""
    decay_steps = max(cfg.decay_steps or total_steps, cfg.warmup_steps + 1)
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup_steps, decay_steps, end_value=cfg.min_lr)
    # Evaluated one step ahead so the first update is not taken at lr 0 (nanoGPT: lr * (it + 1) / (warmup + 1)).
    return lambda count: schedule(count + 1)


def learning_rates(cfg: OptimizerConfig, total_steps: int) -> np.ndarray:
    """(total_steps,) float32: the learning rate of every step, step s at index s - 1 (one jitted evaluation of
    `lr_schedule`, on the host's CPU device)."""
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        return np.asarray(jax.jit(jax.vmap(lr_schedule(cfg, total_steps)))(jnp.arange(total_steps)))


# optax.apply_if_finite applies an update only when every gradient is finite, else leaves the inner state as it
# was and emits zero updates; past this many consecutive non-finite steps it would apply them anyway, so the
# limit is set beyond any run (the loop's `train.nonfinite` policy decides what happens instead).
_NEVER_APPLY_NONFINITE = 2**30


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    """The full update rule: clip_by_global_norm(grad_clip) then AdamW or LAMB with the schedule and mask, inside
    `optax.apply_if_finite`: a step with a non-finite gradient (hence non-finite norm or loss) changes neither
    the parameters nor the optimizer state, and `opt_state.total_notfinite` counts such steps (`skipped_steps`).

    LAMB: You et al. 2020, "Large Batch Optimization for Deep Learning", Algorithm 2 (optax.lamb).
    """
    schedule = lr_schedule(cfg, total_steps)
    kwargs = dict(learning_rate=schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                  mask=decay_mask)
    opt = optax.adamw(**kwargs) if cfg.name == "adamw" else optax.lamb(**kwargs)
    parts = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
    return optax.apply_if_finite(optax.chain(*parts, opt), max_consecutive_errors=_NEVER_APPLY_NONFINITE)


def skipped_steps(opt_state: optax.ApplyIfFiniteState) -> jax.Array:
    """int32 scalar: how many steps `make_optimizer`'s update left out because a gradient was not finite."""
    return opt_state.total_notfinite
