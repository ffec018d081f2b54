"""Named rule sets: logical axis name -> mesh axis (or tuple of mesh axes, or None for replicated).

- `dp`: pure data parallelism; every parameter replicated, the batch split over `data` and `fsdp`.

In every rule set the batch is also split over `expert`, and the experts of a mixture of experts (`exp`) over it
(expert parallelism, GShard / Megatron-Core: each device of an expert group holds E / expert of the experts and
its own batch rows; tokens reach their experts by all-to-all, `msjax.parallel.expert`). Without MoE layers, and
with `expert` of size 1, this changes nothing.
- `fsdp`: ZeRO-3 / FSDP (Rajbhandari et al. 2020): parameters, gradients and optimizer state sharded over
  `fsdp` on their `embed` dimension; XLA all-gathers a layer's weights before use and reduce-scatters its
  gradients. The batch is split over `data` and `fsdp`.
- `fsdp_tp`: FSDP plus Megatron tensor parallelism (Shoeybi et al. 2019): attention heads, the MLP hidden
  dimension and the vocabulary split over `tensor`. Between the TP regions the residual stream's sequence
  dimension is split over `tensor` as well (Megatron sequence parallelism, Korthikanti et al. 2022: GSPMD turns
  each TP all-reduce into a reduce-scatter + all-gather and norms run on 1/tp of the tokens) and over
  `sequence` (context parallelism: queries and the MLP stay split over `sequence`; attention all-gathers keys and
  values over it).
- `tp`: tensor, sequence and context parallelism with data parallelism, no FSDP.
- `zero2`: ZeRO stage 2 (Rajbhandari et al. 2020, sec. 5.2; MegaScale trains with it) with `tp`'s tensor,
  sequence and context parallelism: parameters replicated over `fsdp` (no per-layer gathers in the forward and
  backward), gradients and optimizer state sharded over it on `embed` (`OPTIMIZER_STATE_RULES`): each step
  reduce-scatters the gradients once and all-gathers the updated parameters once.

A mesh axis of size 1 is a no-op, so `fsdp_tp` (the default) serves every layout this step supports.
"""

from __future__ import annotations

from typing import Mapping, Sequence, Union

from jax.sharding import PartitionSpec

from .axes import (
    ACT_BATCH, ACT_EMBED, ACT_HEAD_DIM, ACT_HEADS, ACT_KV_HEADS, ACT_MLP, ACT_SEQ, ACT_SEQ_INNER, ACT_VOCAB,
    BATCH_AXES, EMBED, EXP, EXPERT, FSDP,
    HEAD_DIM, HEADS, KV_HEADS, LAYERS, MLP, NORM, POSITION, SEQUENCE, TENSOR, VOCAB,
)

MeshAxes = Union[str, tuple[str, ...], None]
Rules = Mapping[str, MeshAxes]

_BATCH = BATCH_AXES
_REPLICATED_PARAMS: Rules = {
    VOCAB: None, EMBED: None, MLP: None, HEADS: None, KV_HEADS: None, HEAD_DIM: None, LAYERS: None, NORM: None,
    POSITION: None, EXP: EXPERT,
}
_DP_ACTIVATIONS: Rules = {
    ACT_BATCH: _BATCH, ACT_SEQ: None, ACT_SEQ_INNER: None, ACT_EMBED: None, ACT_HEADS: None, ACT_KV_HEADS: None,
    ACT_HEAD_DIM: None, ACT_MLP: None, ACT_VOCAB: None,
}
_TP_PARAMS: Rules = {VOCAB: TENSOR, MLP: TENSOR, HEADS: TENSOR, KV_HEADS: TENSOR}
_TP_ACTIVATIONS: Rules = {ACT_SEQ: (SEQUENCE, TENSOR), ACT_SEQ_INNER: SEQUENCE, ACT_HEADS: TENSOR,
                          ACT_KV_HEADS: TENSOR, ACT_MLP: TENSOR, ACT_VOCAB: TENSOR}

RULE_SETS: dict[str, Rules] = {
    "dp": {**_REPLICATED_PARAMS, **_DP_ACTIVATIONS},
    "fsdp": {**_REPLICATED_PARAMS, EMBED: FSDP, **_DP_ACTIVATIONS},
    "tp": {**_REPLICATED_PARAMS, **_TP_PARAMS, **_DP_ACTIVATIONS, **_TP_ACTIVATIONS},
    "fsdp_tp": {**_REPLICATED_PARAMS, EMBED: FSDP, **_TP_PARAMS, **_DP_ACTIVATIONS, **_TP_ACTIVATIONS},
    "zero2": {**_REPLICATED_PARAMS, **_TP_PARAMS, **_DP_ACTIVATIONS, **_TP_ACTIVATIONS},
}

# Rule sets whose gradients and optimizer state are laid out differently from their parameters (ZeRO-1/2).
OPTIMIZER_STATE_RULES: dict[str, str] = {"zero2": "fsdp_tp"}


def optimizer_state_rules(name: str) -> Rules:
    """The rules for the gradients and optimizer state of rule set `name` (its own unless it is ZeRO-2)."""
    return RULE_SETS[OPTIMIZER_STATE_RULES.get(name, name)]


def logical_to_mesh_spec(names: Sequence[str | None], rules: Rules) -> PartitionSpec:
    """PartitionSpec for an array whose dimensions carry logical `names` under `rules`.

    A mesh axis already used by an earlier dimension is dropped from later ones (an array may not be split
    twice over the same axis), as flax's `logical_to_mesh_axes` does.

    Raises:
      KeyError: a name that the rule set does not know (the message lists the names it knows).
    """
    used: set[str] = set()
    out: list[MeshAxes] = []
    for name in names:
        if name is None:
            out.append(None)
            continue
        if name not in rules:
            raise KeyError(f"logical axis {name!r} has no rule; known: {sorted(rules)}")
        axes = rules[name]
        axes_t = (axes,) if isinstance(axes, str) else tuple(axes or ())
        kept = tuple(a for a in axes_t if a not in used)
        used.update(kept)
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return PartitionSpec(*out)
