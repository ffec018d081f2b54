"""Mixture-of-experts feed-forward math: the router, dropless expert computation and the router's two losses.

Legend: T tokens (a flattened batch x sequence), D model width, F expert MLP width, E experts, k experts per token,
N = T k token-expert assignments.

Routing (`route`). The router's logits are computed and kept in float32 whatever the model's dtype (small
differences in them change which expert a token goes to). `softmax_topk` (Mixtral, Qwen2-MoE, Qwen3-MoE in
`transformers`): probabilities over all E experts, the k largest taken, optionally renormalised to sum to 1
(Mixtral and Qwen3-MoE do, Qwen2-MoE's `norm_topk_prob` defaults to not). `topk_softmax`: the k largest logits,
softmax over those k (Shazeer et al. 2017's noisy top-k gating without the noise). In exact arithmetic
`topk_softmax` equals `softmax_topk` with renormalisation; both are kept because a checkpoint's numerics follow
the order its framework used.

Dropless experts (`expert_ffn`). The N assignments are sorted by expert (a stable sort: within an expert, tokens
keep their order) and each expert's rows run through its weights as one grouped matmul, `jax.lax.ragged_dot`
(MegaBlocks, Gale et al. 2023: no token is dropped and nothing is padded to a capacity). The outputs go back to
their tokens weighted by the router. With a capacity C = ceil(capacity_factor N / E), an expert keeps its first C
assignments (token order) and the rest are dropped: their output is zero, so the token passes through the block's
residual alone for that expert (GShard, Lepikhin et al. 2020), and the dropped fraction is returned as a metric.

Losses. `load_balancing_loss`: Switch Transformer's auxiliary loss (Fedus et al. 2022, eq. 4) for top-k as
`transformers`' Mixtral computes it, E sum_e f_e P_e, with f_e the fraction of tokens whose top-k includes e and
P_e the mean router probability of e; k when routing is perfectly uniform, larger when it is not.
`router_z_loss`: ST-MoE's (Zoph et al. 2022, eq. 5), the mean over tokens of logsumexp(logits)^2, which keeps the
logits small.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

ROUTERS = ("softmax_topk", "topk_softmax")


def route(logits_te: jax.Array, k: int, router: str = "softmax_topk", normalize: bool = True
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each token's k experts and their weights (module docstring).

    Args:
      logits_te: (T, E) router logits, any float dtype (computed in float32); any leading dimensions in place of
        T ((B, T, E) gives (B, T, k) results).
      k: experts per token, 1 <= k <= E.
      router: "softmax_topk" or "topk_softmax".
      normalize: with softmax_topk, renormalise the k probabilities to sum to 1 (topk_softmax always sums to 1).
    Returns:
      (weights_tk float32, experts_tk int32 in [0, E), probs_te float32: the softmax over all E experts, which the
      load-balancing loss reads). Experts of a token are in descending weight order.
    Raises:
      ValueError: k outside [1, E] or an unknown router.
    """
    e = logits_te.shape[-1]
    if not 1 <= k <= e:
        raise ValueError(f"experts per token k={k}: allowed is 1 <= k <= {e} (the number of experts)")
    if router not in ROUTERS:
        raise ValueError(f"router {router!r}: allowed are {', '.join(ROUTERS)}")
    logits_te = logits_te.astype(jnp.float32)
    probs_te = jax.nn.softmax(logits_te, axis=-1)
    if router == "softmax_topk":
        weights_tk, experts_tk = top_k(probs_te, k)
        if normalize:
            weights_tk = weights_tk / jnp.sum(weights_tk, axis=-1, keepdims=True)
    else:
        top_tk, experts_tk = top_k(logits_te, k)
        weights_tk = jax.nn.softmax(top_tk, axis=-1)
    return weights_tk, experts_tk.astype(jnp.int32), probs_te


def top_k(x_te: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k largest values along the last axis and their indices (int32), largest first, the lower index first
    among equal values: `jax.lax.top_k`'s result, as k rounds of argmax and masking. Why not `jax.lax.top_k`:
    with the tokens split over the mesh GSPMD gathers every token's logits to one sort (seen: an all-gather of the
    whole batch's (B, T, E) logits per layer), where a maximum along E partitions like any reduction."""
    values, indices = [], []
    for _ in range(k):
        i_t = jnp.argmax(x_te, axis=-1)
        values.append(jnp.take_along_axis(x_te, i_t[..., None], axis=-1)[..., 0])
        indices.append(i_t.astype(jnp.int32))
        x_te = jnp.where(jax.nn.one_hot(i_t, x_te.shape[-1], dtype=bool), -jnp.inf, x_te)
    return jnp.stack(values, axis=-1), jnp.stack(indices, axis=-1)


def load_balancing_loss(probs_te: jax.Array, experts_tk: jax.Array) -> jax.Array:
    """E sum_e f_e P_e (module docstring): f_e the fraction of the T tokens with e among their k experts, P_e the
    mean of probs_te[:, e]. float32 scalar; k under uniform routing.

    Args:
      probs_te: (T, E) float32 router probabilities (`route`). experts_tk: (T, k) int32. Any leading dimensions
        in place of T, the same for both (means over all of them).
    """
    e = probs_te.shape[-1]
    tokens = tuple(range(probs_te.ndim - 1))
    return e * jnp.sum(expert_fractions(experts_tk, e) * experts_tk.shape[-1]
                       * jnp.mean(probs_te.astype(jnp.float32), axis=tokens))


def expert_fractions(experts_tk: jax.Array, e: int) -> jax.Array:
    """(E,) float32: the fraction of the T k assignments each expert got (sums to 1). experts_tk: (T, k) int32, or
    any leading dimensions in place of T.

    A mean of one-hot rows, not a scatter (`bincount`): under a batch split over the mesh a mean reduces each
    device's rows and sums E numbers over the devices, where a scatter into E bins has GSPMD gather every token's
    experts first."""
    return jnp.mean(jax.nn.one_hot(experts_tk, e, dtype=jnp.float32), axis=tuple(range(experts_tk.ndim)))


def router_z_loss(logits_te: jax.Array) -> jax.Array:
    """mean_t logsumexp(logits_t)^2 (ST-MoE eq. 5), float32 scalar. logits_te: (T, E), or any leading dimensions
    in place of T."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits_te.astype(jnp.float32), axis=-1)))


def report_rows(stats: dict) -> dict:
    """The MoE layers' statistics (`msjax.model.GPT.forward`: "aux_loss", "z_loss", "dropped" (L,), "load" (L, E),
    float32, one row per MoE layer) with each layer's "max_load" (L,) added: its most loaded expert's share over
    the mean's (1: even). Every value of `router_report` is a mean of these rows, so rows summed over microbatches
    (a pipeline's, accumulated by the stage that runs the layer) and divided by their count give the mean of the
    microbatches' reports."""
    load_le = stats["load"]
    return {**stats, "max_load": jnp.max(load_le, axis=-1) * load_le.shape[-1]}


def router_objective(aux_l: jax.Array, z_l: jax.Array, aux_coef: float, z_coef: float, layers: int) -> jax.Array:
    """What the router losses add to the training objective: (aux_coef sum_l aux_l + z_coef sum_l z_l) / layers,
    float32 scalar; with `layers` the model's MoE layer count it is each loss averaged over the layers times its
    coefficient, and a pipeline chunk's share of it over the chunk's own layers. aux_l, z_l: (l,) float32."""
    return (aux_coef * jnp.sum(aux_l) + z_coef * jnp.sum(z_l)) / layers


def router_report(rows: dict, aux_coef: float, z_coef: float) -> tuple[jax.Array, dict]:
    """(the router losses' share of the objective (`router_objective`), the step's MoE report): both losses
    unweighted, the dropped fraction and "moe_max_load" averaged over the layers, and "expert_load" (L, E), each
    expert's share of its layer's assignments. rows: `report_rows`' (or their mean over microbatches)."""
    aux, z = rows["aux_loss"], rows["z_loss"]
    return router_objective(aux, z, aux_coef, z_coef, aux.shape[0]), {
        "moe_aux_loss": jnp.mean(aux), "moe_z_loss": jnp.mean(z), "moe_dropped": jnp.mean(rows["dropped"]),
        "moe_max_load": jnp.mean(rows["max_load"]), "expert_load": rows["load"]}


def capacity(tokens: int, k: int, experts: int, capacity_factor: float) -> int | None:
    """Assignments an expert keeps: ceil(capacity_factor T k / E); None (dropless) for a factor of 0.
    Raises ValueError on a negative factor."""
    if capacity_factor < 0:
        raise ValueError(f"capacity factor {capacity_factor}: allowed is >= 0 (0: dropless)")
    return None if capacity_factor == 0 else math.ceil(capacity_factor * tokens * k / experts)


def grouped_mlp(x_nd: jax.Array, sizes_e: jax.Array, column_weights: Sequence[jax.Array], w_out_efd: jax.Array,
                activate: Callable[..., jax.Array]) -> jax.Array:
    """Rows grouped by expert through their expert's MLP: two (or three) grouped matmuls, `jax.lax.ragged_dot`.

    Args:
      x_nd: (N, D) rows in the compute dtype, the first sizes_e[0] for expert 0, the next sizes_e[1] for expert 1,
        and so on; rows past sum(sizes_e) (padding) belong to no expert and come out as zeros.
      sizes_e: (E,) int32 rows per expert.
      column_weights, w_out_efd, activate: as `expert_ffn`.
    Returns:
      (N, D) in x's dtype.
    """
    h_nf = activate(*(jax.lax.ragged_dot(x_nd, w, sizes_e) for w in column_weights))
    return jax.lax.ragged_dot(h_nf.astype(x_nd.dtype), w_out_efd, sizes_e)


def expert_ffn(x_td: jax.Array, weights_tk: jax.Array, experts_tk: jax.Array, column_weights: Sequence[jax.Array],
               w_out_efd: jax.Array, activate: Callable[..., jax.Array], keep: int | None = None
               ) -> tuple[jax.Array, jax.Array]:
    """sum over a token's k experts of weight x expert_e(x), each expert an MLP, by grouped matmuls (module
    docstring).

    Args:
      x_td: (T, D) tokens in the compute dtype.
      weights_tk: (T, k) float32 router weights; experts_tk: (T, k) int32 experts (`route`).
      column_weights: the experts' input-side matrices, each (E, D, F) ([gate, up] for SwiGLU, [in] for GeLU).
      w_out_efd: (E, F, D) the experts' output matrices.
      activate: (N, F) products of `column_weights`, in order -> (N, F) hidden state (the MLP's activation).
      keep: assignments each expert keeps (`capacity`); None: all (dropless).
    Returns:
      ((T, D) output in x's dtype, float32 fraction of the T k assignments dropped (0 when dropless)).
    """
    t, k = experts_tk.shape
    e = w_out_efd.shape[0]
    flat_n = experts_tk.reshape(-1)
    order_n = jnp.argsort(flat_n, stable=True)  # assignments grouped by expert, tokens in order within each
    token_n = order_n // k
    sizes_e = jnp.bincount(flat_n, length=e).astype(jnp.int32)
    y_nd = grouped_mlp(x_td[token_n], sizes_e, column_weights, w_out_efd, activate)
    gate_n = weights_tk.reshape(-1)[order_n]
    dropped = jnp.float32(0.0)
    if keep is not None:
        starts_e = jnp.cumsum(sizes_e) - sizes_e
        rank_n = jnp.arange(t * k) - starts_e[flat_n[order_n]]  # position of the assignment within its expert
        kept_n = rank_n < keep
        gate_n = jnp.where(kept_n, gate_n, 0.0)
        dropped = 1.0 - jnp.mean(kept_n.astype(jnp.float32))
    y_nd = y_nd.astype(jnp.float32) * gate_n[:, None]
    y_td = jnp.zeros((t, x_td.shape[-1]), jnp.float32).at[token_n].add(y_nd)
    return y_td.astype(x_td.dtype), dropped
