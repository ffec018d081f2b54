"""A mixture of experts' layer as the planner prices it: its shapes on a layout, FLOPs, memory traffic, the bytes
its activations take, and the all-to-alls of expert parallelism. `timing`, `memory` and `comm` read these, so each
fact about the MoE layer lives here once.

Legend as `msjax.parallel.expert`: per device and microbatch, T tokens in the expert region (b x T_seq / c: the
device's batch rows and `sequence` chunk, gathered over `tensor` as an MLP's input is), D model width, E experts,
k experts per token, N = T k assignments, ep the `expert` axis, El = E / ep the experts a device holds, F the expert
width and Fl = F / t its `tensor` share, R the rows the grouped matmuls see: ep N with expert parallelism (the
(ep, N, D) receive buffer, fixed-size blocks: ep times the real assignments), N without (`expert_ffn` on the
device's own assignments).

What the program does per MoE layer, forward (the backward twice the matmuls):
  router     (T_outer, D) x (D, E) in float32 on the residual stream's own tokens (split over sequence and
             tensor), softmax and top-k: 2 D E FLOPs per token.
  experts    k of E per token, a SwiGLU (3 matrices) or GeLU (2) MLP of width F, split over tensor: 2 k D F x
             matrices FLOPs per token. Grouped matmuls (`jax.lax.ragged_dot`) compute the real rows only; the
             busiest device's rows are `moe_imbalance` times the mean with expert parallelism (the step waits
             for it), the mean without (each device runs all E experts on its own N rows, however they fall).
  shared     shared experts every token goes through (an MLP of width shared_experts x F, split over tensor),
             and its per-token sigmoid gate (D x 1, float32).
  dispatch   with ep > 1 two all-to-alls over `expert` (tokens out, outputs back) of the (ep, N, D) buffer in the
             compute dtype, plus one of the (ep, N) int32 expert ids; the backward runs the two again on the
             gradients; under any remat policy the forward's run once more (nothing of the grouped path is a
             saveable dot: `ragged_dot` is not `dot_general`).
Model FLOPs (MFU) count the active parameters' matmuls (`msjax.flops.matmul_params`: the router, k experts,
the shared experts), the convention of Switch Transformer and MaxText; the padding rows the fixed-size buffers
carry are not counted anywhere (ragged_dot skips them).
"""

from __future__ import annotations

from dataclasses import dataclass

from msjax.config import Config
from msjax.planner.layout import DTYPE_BYTES, PlanLayout


@dataclass(frozen=True)
class MoeShapes:
    """A MoE layer's sizes on one device for one microbatch (module docstring's legend).

    Attributes:
      layers: MoE layers in the model (model.moe.every decides which).
      experts, k, ep, local_experts: E, k, the `expert` axis size, E / ep.
      width, local_width: F (model.moe.expert_ff, else model.d_ff) and F / t.
      shared_width: shared_experts x F (0: none); shared_gate: its per-token gate exists.
      matrices: weight matrices per expert (3 SwiGLU, 2 GeLU); columns: those on the input side (2 or 1).
      tokens: T, tokens per device in the expert region; outer_tokens: the residual stream's own (T / t with
        sequence parallelism), which the router reads.
      assignments: N = T k; rows: what the grouped matmuls see, ep N (ep > 1) or N.
      act_bytes: bytes per element of the compute dtype.
    """

    layers: int
    experts: int
    k: int
    ep: int
    local_experts: int
    width: int
    local_width: float
    shared_width: int
    shared_gate: bool
    matrices: int
    columns: int
    tokens: float
    outer_tokens: float
    assignments: float
    rows: float
    act_bytes: int


def moe_shapes(cfg: Config, layout: PlanLayout) -> MoeShapes | None:
    """The MoE layer's sizes on `layout` (see MoeShapes), or None for a dense model."""
    m = cfg.model
    mo = m.moe
    if not mo.num_experts:
        return None
    t, c, ep = layout.tensor, layout.sequence, layout.expert
    f = mo.expert_ff or m.ff_size
    gated = m.mlp == "swiglu"
    tokens = layout.microbatch_size * cfg.train.seq_len / c
    n = tokens * mo.experts_per_token
    return MoeShapes(
        layers=sum(mo.is_moe_layer(i) for i in range(m.num_layers)), experts=mo.num_experts,
        k=mo.experts_per_token, ep=ep, local_experts=mo.num_experts // ep, width=f, local_width=f / t,
        shared_width=mo.shared_experts * f, shared_gate=mo.shared_gate, matrices=3 if gated else 2,
        columns=2 if gated else 1, tokens=tokens,
        outer_tokens=tokens / (t if layout.sequence_parallel else 1), assignments=n, rows=ep * n if ep > 1 else n,
        act_bytes=DTYPE_BYTES[m.dtype])


def moe_fraction(cfg: Config) -> float:
    """The share of the layers that are MoE layers (0 for a dense model): the planner prices a layer as the
    average over the model's layers, which is exact for the step's totals on one stage."""
    mo = cfg.model.moe
    if not mo.num_experts:
        return 0.0
    return sum(mo.is_moe_layer(i) for i in range(cfg.model.num_layers)) / cfg.model.num_layers


def moe_gemm_flops(cfg: Config, layout: PlanLayout) -> dict[str, float]:
    """Forward matmul FLOPs of one MoE layer for one microbatch on one device, by part (module docstring):
    "router" (float32, the residual stream's tokens), "lin1" (the experts' input-side matrices, the mean device's
    rows) and "lin2" (their output matrices), "shared_lin1" / "shared_lin2" (the shared experts, and the shared
    gate in shared_lin1). FLOPs (floats); empty for a dense model."""
    s = moe_shapes(cfg, layout)
    if s is None:
        return {}
    d, t = cfg.model.d_model, layout.tensor
    return {"router": 2.0 * s.outer_tokens * d * s.experts,
            "lin1": 2.0 * s.assignments * d * s.local_width * s.columns,
            "lin2": 2.0 * s.assignments * s.local_width * d,
            "shared_lin1": 2.0 * s.tokens * d * s.shared_width / t * s.columns + (2.0 * s.tokens * d if s.shared_gate
                                                                                   else 0.0),
            "shared_lin2": 2.0 * s.tokens * s.shared_width / t * d}


def moe_elementwise_bytes(cfg: Config, layout: PlanLayout) -> float:
    """HBM bytes one MoE layer's memory-bound work reads and writes in the forward, per device and microbatch (an
    estimate, term by term): the router's float32 logits and probabilities (write, read, write); with ep > 1 the
    dispatch's passes over (R, D) rows in the compute dtype (write the send buffer, sort the received rows, scatter
    the outputs back into blocks: two passes each), without it the gather of the N rows; the float32 combine
    ((N, D) weighted outputs read, (T, D) sums written); the activation over the R x Fl intermediates (SwiGLU reads
    gate and up and writes their product, GeLU reads one and writes one: on every row of the fixed-size buffer);
    the shared experts' activation."""
    s = moe_shapes(cfg, layout)
    if s is None:
        return 0.0
    d, e = cfg.model.d_model, s.act_bytes
    router = 3 * 4.0 * s.outer_tokens * s.experts
    rows = e * s.rows * d * (6 if s.ep > 1 else 2)
    combine = 4.0 * (s.assignments + s.tokens) * d
    act = e * (s.columns + 1) * (s.rows * s.local_width + s.tokens * s.shared_width / layout.tensor)
    return router + rows + combine + act


def moe_all_to_all_bytes(cfg: Config, layout: PlanLayout) -> tuple[float, float]:
    """(token buffer, expert ids) bytes of one all-to-all call per device: the (ep, N, D) buffer in the compute
    dtype, as built (fixed-size blocks, ep times the assignments: what the program sends, not the N D it needs),
    and the (ep, N) int32 ids that travel with the forward dispatch. (0, 0) without expert parallelism."""
    s = moe_shapes(cfg, layout)
    if s is None or s.ep == 1:
        return 0.0, 0.0
    return s.act_bytes * s.ep * s.assignments * cfg.model.d_model, 4.0 * s.ep * s.assignments


def moe_dispatch_passes(layout: PlanLayout) -> float:
    """Forward runs of the dispatch per MoE layer and microbatch: 1, or 2 under any remat policy (the grouped
    path keeps nothing a dots policy saves, so the backward runs the forward's all-to-alls again)."""
    return 1.0 if layout.remat == "none" else 2.0


# What the compiled step keeps of one MoE layer for its backward without remat, counted in the buffer assignment
# and live ranges of the compiled step (XLA:CPU, jax 0.10.2; the moe_tiny-shaped layouts of
# tests/msjax/test_planner_moe.py's FIT_CASES), per tensor shape, in the compute dtype unless float32 is said:
#   (R, D) rows: the send buffer, the receive buffer and the received rows sorted by expert, 10 per 4 layers (the
#     last layer's backward starts before all of its are kept): 2.5 (ep > 1); the gathered rows of `expert_ffn`:
#     1 (ep = 1);
#   (N, D): each assignment's input row and its float32 weighted output: 1 + 1 (float32);
#   (T, D) float32: the combine's sums: 1;
#   (R, Fl): SwiGLU's gate and up outputs, the sigmoid and silu(gate): 4 (GeLU: 3, not measured);
#   the router's float32 input (T_outer, D), logits and probabilities (T_outer, E): 1 + 2;
#   one copy of the device's expert weights in the compute dtype (the transposes the backward reads);
#   with jax's dense fallback for ragged_dot (`PlanLayout.dense_groups`, XLA:CPU): the masked rows of every local
#     expert (El, R, D) and the masked hidden state (El, R, Fl) in the compute dtype, with their boolean masks.
MOE_SAVED_ROWS = {True: 2.5, False: 1}
MOE_SAVED_HIDDEN = {True: 4, False: 3}


def moe_layer_bytes(cfg: Config, layout: PlanLayout, local_expert_elements: float) -> float:
    """Bytes one MoE layer keeps for its backward without remat, per device and microbatch (the counts above),
    including the shared experts' MLP intermediates (as the dense MLP's: `memory.msjax_layer_activation_bytes`'
    count of F-wide tensors, not measured for a shared expert). 0 for a dense model.

    Args:
      local_expert_elements: the device's expert-weight elements of one layer (router excluded).
    """
    s = moe_shapes(cfg, layout)
    if s is None:
        return 0.0
    d, e = cfg.model.d_model, s.act_bytes
    gated = s.columns == 2
    saved = (e * s.rows * d * MOE_SAVED_ROWS[s.ep > 1] + (e + 4.0) * s.assignments * d + 4.0 * s.tokens * d
             + e * s.rows * s.local_width * MOE_SAVED_HIDDEN[gated]
             + 4.0 * s.outer_tokens * (d + 2 * s.experts) + e * local_expert_elements)
    if s.shared_width:
        saved += e * s.tokens * s.shared_width / layout.tensor * (5 if gated else 3)
    return saved + moe_dense_fallback_bytes(cfg, layout)


def moe_dense_fallback_bytes(cfg: Config, layout: PlanLayout) -> float:
    """Bytes the backend's dense fallback for `ragged_dot` keeps in one MoE layer, per device and microbatch, where
    it runs (`PlanLayout.dense_groups`: XLA:CPU): the masked rows of every local expert (El, R, D) and the masked
    hidden state (El, R, Fl) in the compute dtype, with their boolean masks (counted in the compiled step); 0 on a
    backend with grouped matmuls, and for a dense model."""
    s = moe_shapes(cfg, layout)
    if s is None or not layout.dense_groups:
        return 0.0
    return (s.act_bytes + 1) * s.local_experts * s.rows * (cfg.model.d_model + s.local_width)


def moe_stash_bytes(cfg: Config, layout: PlanLayout) -> float:
    """Bytes one MoE layer's residuals take in a stash slot of the pipelined step, per device, in place of the dense
    MLP's (`memory.stash_layer_bytes`): what the chunk's `jax.vjp` saves under `model.remat`'s policy, read off the
    residual pytrees (`PipelinedGrads.stash_entry`, under the step's expert-parallel tracing; checked against it in
    tests/msjax/test_planner_moe.py on expert 1-3, k 2-3, SwiGLU and GeLU, shared experts with and without their
    gate, tensor 2). Unlike the compiled step's buffers (`moe_layer_bytes`), the stash holds jaxpr values, so no
    backend's lowering of `ragged_dot` and no parameter copy is in it. By policy:
      full: three float32 scalars (the layer's router-loss residuals).
      dots, dots_no_batch: those, the router's float32 logits (T_outer, E) and the shared experts' matmul outputs
        (plain dots: input side and output) and gate logits; the grouped matmuls are not dots and are recomputed.
      none: beside the attention and norms' (the dense formula less its MLP), the router's (per residual-stream
        token: one more float32 and one fewer compute-dtype (D,) row, four more float32 scalars, k ids, k weights,
        the top-k rounds' probabilities and masks over E, three token masks and counts); the combine's float32
        (T, D) sums; per assignment its ids and weight (16 bytes) and its float32 weighted output row; without
        expert parallelism its gathered input rows (one per input-side matrix) and six (N, Fl) hidden tensors;
        with it the send/receive bookkeeping per assignment (an index pair, a mask row, an input row) and per
        received row R (ids, six (R, Fl) hidden tensors, the rows before and after sorting: 2 + columns, their
        mask, and the send buffer (ep, N, D)); the shared experts' six (T, Fs) hidden tensors and two (T, D) ones,
        and with their gate two float32 (T, D) rows and two float32 logits per token; (E,) counts. With the gate,
        dots keep the shared output (T, D) and the gate's logit too."""
    s = moe_shapes(cfg, layout)
    if s is None:
        return 0.0
    d, e, k, experts = cfg.model.d_model, s.act_bytes, s.k, s.experts
    scalars = 12.0
    if layout.remat == "full":
        return scalars
    fs = s.shared_width / layout.tensor
    if layout.remat in ("dots", "dots_no_batch"):
        shared = s.tokens * s.columns * e * fs if s.shared_width else 0.0
        return scalars + 4.0 * s.outer_tokens * experts + shared + (s.tokens * (e * d + 4) if s.shared_gate else 0.0)
    router = s.outer_tokens * ((4 - e) * d + 16 + 9 + 8 * k + experts * (4 * (k + 1) + (k - 1)))
    assigned = s.assignments * (16 + 4 * d) + 4.0 * s.tokens * d
    if s.ep == 1:
        grouped = s.assignments * (6 * e * s.local_width + s.columns * e * d)
    else:
        grouped = (s.assignments * (16 + (e + 1) * d)
                   + s.rows * (8 + 6 * e * s.local_width + (3 + s.columns) * e * d + d))
    shared = s.tokens * (6 * e * fs + 2 * e * d) if s.shared_width else 0.0
    if s.shared_gate:
        shared += s.tokens * (8 * d + 8)
    return scalars + router + assigned + grouped + shared + 16.0 * experts
