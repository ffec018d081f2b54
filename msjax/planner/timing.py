"""Step time: compute from FLOPs and bytes, communication from `comm`, overlap modelled term by term.

Compute (per device, per layer and microbatch):
  GEMMs      2 x tokens x weight-elements / t FLOPs forward (the MLP: three D x F matrices for SwiGLU, two
             for GeLU), twice that backward (input and weight gradients), at peak x matmul_efficiency.
  attention  4 x tokens x (a / t) x head_dim x k_bar FLOPs forward (QK^T and PV), where k_bar is the mean
             number of keys a query attends: causal and window-aware for fused kernels, which skip masked
             blocks (msjax.flops.mean_attended_keys); the full sequence for materialised (xla) attention.
             Backward 2.5x forward for fused kernels (FlashAttention recomputes QK^T), 2x otherwise. Fused
             kernels run at peak x attention_efficiency (FlashAttention-2 level for msjax's cuDNN / Pallas kernels,
             FlashAttention-1 level for the megatron baseline), materialised ones at the GEMM rate plus the
             softmax's memory traffic.
  elementwise  norms, residual adds and the MLP activation (GeLU, or SwiGLU's silu(gate) x up) are
             memory-bound: bytes read + written / (HBM bandwidth x hbm_efficiency); backward twice the forward
             traffic. RoPE's rotation of Q and K is a small elementwise term inside attention's input, not priced.
  recompute  full remat reruns the forward; dots / dots_no_batch rerun the elementwise ops (and the attention
             core when it is not saved).
  output     the vocabulary projection and softmax cross-entropy: on the last stage (Megatron's pipeline), or
             spread over the stages, 1/p of the tokens each (msjax's, `msjax.parallel.pipeline`).
  sequence   context parallelism (axis size c) gives each member T/c contiguous tokens: every term above runs
             on T/c tokens, and attention on its T/c queries against the keys they attend. Fused kernels skip
             masked blocks, so the member with the last chunk does the most work and paces the step
             (`chunk_attended_keys`; for causal attention (2c - 1) T / (2c) + 1/2 keys per query against
             (T + 1) / 2 on average, 1.5x at c = 2); materialised attention computes every masked score, so it is
             balanced (T keys per query on every member).

Overlap (msjax design; every term is exposed in the megatron baseline):
  TP         each all-gather / reduce-scatter is a collective matmul with the GEMM it feeds or drains (MegaScale
             fig. 3: parallel blocks fuse them into the MLP's two linears); it is exposed by
             max(0, T_comm - T_gemm (t - 1) / t) (the first of the t chunks computes with no transfer under it).
  FSDP       a layer's weights are all-gathered while the previous layer computes (prefetch): exposed by
             max(0, T_gather - T_layer), and likewise gradient reduce-scatters in the backward.
  PP         decoupled asynchronous send/recv (MegaScale fig. 4): only the pipeline fill and drain wait on
             transfers, 2 (p v - 1) of them; without overlap every chunk's receive is on the critical path.
  DP         reduce-scatter of a chunk's gradients starts when its last backward ends (MegaScale sec. 3.2):
             the last chunk's share (1/v of it; with p = 1, the last layer's bucket) is exposed, or whatever does
             not fit in the cool-down's backward compute. The parameter all-gather (ZeRO-1/2) runs chunk by
             chunk ahead of the forward: the first chunk's share waits with nothing to hide behind, the rest is
             exposed only beyond the warm-up's forward compute.
  SEQ        exposed, on the critical path of every layer: the K/V all-gather (forward and backward
             recompute) and the dK/dV reduce-scatter over `sequence`. An assumption, the conservative one, and how
             Llama 3 (Dubey et al. 2024, sec. 3.3.2) describes this all-gather design: it accepts the gather's
             latency on the critical path as small next to attention (their K and V are small under GQA). XLA's
             scheduler could hide part of it behind the query projection (the only GEMM of the layer that does not
             need K and V); not modelled. The same for both baselines.
  Contention hidden communication is not free: the compute under it runs OVERLAP_SLOWDOWN (18.9%, Lee et al.
             2025) slower, charged on the hidden time.
  Bubble     interleaved 1F1B idles (p - 1) / v microbatch-times per step (Narayanan et al. 2021 sec. 2.2.2); it
             cannot be hidden. The slowest stage sets the pace.
  Tables     1f1b, zb-h1 and zb-v (`pipeline.schedule`) run one pass a tick from an action table, the backward
             split into B (input gradient) and W (weight-gradient GEMMs, no collective; Qi et al. 2024): the flush
             is simulated tick by tick with each pass's own time (`zero_bubble.flush_seconds`: a tick that uses
             a ring ends when both neighbours' passes have, the output layer's ticks when every stage's have), so
             the price counts what lock-stepped ticks cost when F, B and W differ, not the paper's bubble.
  Optimizer  memory-bound over the (ZeRO-sharded) state, after the gradients are reduced; not overlapped.
  Links      every collective on the network (on NVLink / ICI) shares each device's NIC (ports): the step is at
             least the sum of their times on each kind of link, whatever overlaps (`link_bound` says when this
             binds, e.g. tensor parallelism across nodes competing with FSDP traffic).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from msjax import flops as model_flops
from msjax.config import Config
from msjax.hardware import Hardware
from msjax.planner import comm as comm_mod
from msjax.planner import moe
from msjax.planner.layout import PlanLayout, zero2_over_fsdp
from msjax.parallel.schedule import bubble_fraction, in_flight
from msjax.parallel.zero_bubble import action_table, flush_seconds, tick_plan
from msjax.planner.memory import DTYPE_BYTES, StageParams, ends_elements, in_flight_chunks
from msjax.planner.options import (
    ATTENTION_EFFICIENCY, ATTENTION_EFFICIENCY_FA1, FLASH_BACKWARD_FACTOR, HBM_EFFICIENCY, OPTIMIZER_BYTES_PER_PARAM,
    OVERLAP_SLOWDOWN, PlanOptions,
)


@dataclass(frozen=True)
class Rates:
    """Achievable rates: GEMM and attention FLOP/s, HBM bytes/s."""

    gemm: float
    attention: float
    hbm: float

    @staticmethod
    def of(hw: Hardware, opts: PlanOptions) -> "Rates":
        mm = opts.matmul_efficiency or hw.matmul_efficiency
        default_attention = ATTENTION_EFFICIENCY_FA1 if opts.baseline == "megatron" else ATTENTION_EFFICIENCY
        at = opts.attention_efficiency or default_attention
        hb = opts.hbm_efficiency or HBM_EFFICIENCY
        return Rates(hw.peak_flops * mm, hw.peak_flops * at, hw.hbm_bandwidth * hb)


@dataclass(frozen=True)
class LayerTimes:
    """Seconds for one layer and one microbatch on one device.

    gemm: forward GEMM time per linear (qkv, out, lin1, lin2). attn, elem: forward attention-core and
    elementwise time. fwd / bwd / recompute: totals per pass. hw_flops: hardware FLOPs of fwd + bwd + recompute.
    """

    gemm: dict
    attn: float
    elem: float
    fwd: float
    bwd: float
    recompute: float
    hw_flops: float
    fwd_flops: float = 0.0  # one forward pass (GEMMs and attention core)


def chunk_attended_keys(seq_len: int, window: int | None, chunks: int) -> float:
    """Mean keys per query of the last of `chunks` contiguous query chunks (causal, optional sliding window).

    With context parallelism each member of the `sequence` axis holds one contiguous chunk of T / chunks
    queries and attends them against the gathered keys; a fused kernel skips masked blocks, so query i costs
    min(i, W) keys, and the last chunk, whose queries attend the longest prefixes, is the most work.
    Sum_{i=1..x} min(i, W) = x (x + 1) / 2 for x <= W, else W (W + 1) / 2 + (x - W) W, so the last chunk's mean
    is (sum(T) - sum(T - T / chunks)) / (T / chunks): for causal attention (2 chunks - 1) T / (2 chunks) + 1/2.
    One chunk is `msjax.flops.mean_attended_keys`, the whole-sequence mean.
    """
    if chunks == 1:
        return model_flops.mean_attended_keys(seq_len, window)
    w = seq_len if window is None else min(window, seq_len)

    def prefix(x: int) -> float:
        return x * (x + 1) / 2 if x <= w else w * (w + 1) / 2 + (x - w) * w

    n = seq_len // chunks
    return (prefix(seq_len) - prefix(seq_len - n)) / n


def layer_times(cfg: Config, layout: PlanLayout, rates: Rates) -> LayerTimes:
    """Times of one layer for one microbatch on the pacing device (see the module docstring)."""
    m = cfg.model
    s, b, t, sx = cfg.train.seq_len, layout.microbatch_size, layout.tensor, layout.sequence
    e = DTYPE_BYTES[m.dtype]
    h, f = m.d_model, m.ff_size
    qw, kvw = m.num_heads * m.head_size, m.kv_heads * m.head_size
    tok = b * s / sx  # tokens (and queries) per member of the sequence axis: its chunk
    gated = m.mlp == "swiglu"  # SwiGLU's linear 1 is two D x F matrices (gate and up), GeLU's one
    widths = {"qkv": h * (qw + 2 * kvw), "out": qw * h, "lin1": (2 if gated else 1) * h * f, "lin2": f * h}
    gemm_flops = {k: 2.0 * tok * w / t for k, w in widths.items()}
    gemm = {k: fl / rates.gemm for k, fl in gemm_flops.items()}
    # A mixture of experts' layers (`msjax.planner.moe`): the router, the active experts and the shared ones in
    # place of the MLP, averaged over the layers; the experts' grouped matmuls take the busiest device's time
    # (`moe_imbalance` with expert parallelism), the FLOPs executed stay the mean's.
    share = moe.moe_fraction(cfg)
    if share:
        mg = moe.moe_gemm_flops(cfg, layout)
        busiest = layout.moe_imbalance if layout.expert > 1 else 1.0
        for lin in ("lin1", "lin2"):
            routed = mg[lin] + mg[f"shared_{lin}"] + (mg["router"] if lin == "lin1" else 0.0)
            gemm_flops[lin] = (1.0 - share) * gemm_flops[lin] + share * routed
            gemm[lin] = (1.0 - share) * gemm[lin] + share * (routed + (busiest - 1.0) * mg[lin]) / rates.gemm
    # Keys per query on the pacing member: the last chunk's for fused kernels (masked blocks skipped), every key
    # for materialised attention (masked scores are computed too).
    k_bar = chunk_attended_keys(s, layout.window, sx) if layout.flash else float(s)
    attn_flops = 4.0 * tok * (m.num_heads / t) * m.head_size * k_bar
    outer_tok = b * s / ((t if layout.sequence_parallel else 1) * sx)
    n_ln = 1 if layout.block == "parallel" else 2
    residual = 4 if layout.block == "parallel" else 6  # reads + writes of the residual adds, in units of h
    # the MLP activation reads and writes (b T / c, F / t) tensors: GeLU reads one and writes one, SwiGLU reads
    # the gate and up projections and writes their product
    elem_bytes = e * (outer_tok * h * (2 * n_ln + residual) + (1.0 - share) * tok * (3 if gated else 2) * f / t) \
        + share * moe.moe_elementwise_bytes(cfg, layout)
    if layout.flash:
        attn = attn_flops / rates.attention
    else:  # materialised scores: batched matmuls plus softmax traffic (write scores, read, write probs)
        elem_bytes += 3 * e * b * (m.num_heads / t) * (s / sx) * s
        attn = attn_flops / rates.gemm
    elem = elem_bytes / rates.hbm
    fwd = sum(gemm.values()) + attn + elem
    bwd = 2 * sum(gemm.values()) + (FLASH_BACKWARD_FACTOR if layout.flash else 2.0) * attn + 2 * elem
    attn_bwd_factor = FLASH_BACKWARD_FACTOR if layout.flash else 2.0
    hw_flops = sum(gemm_flops.values()) * 3 + attn_flops * (1 + attn_bwd_factor)
    if layout.remat == "full":
        recompute = fwd
        hw_flops += sum(gemm_flops.values()) + attn_flops
    elif layout.remat == "dots_no_batch" or (layout.remat == "dots" and layout.flash):
        recompute = elem + attn
        hw_flops += attn_flops
    elif layout.remat == "dots":
        recompute = elem
    else:
        recompute = 0.0
    return LayerTimes(gemm, attn, elem, fwd, bwd, recompute, hw_flops, sum(gemm_flops.values()) + attn_flops)


@dataclass(frozen=True)
class OutputTimes:
    """Seconds per microbatch for the whole output layer (vocabulary projection + cross-entropy)."""

    fwd: float
    bwd: float
    hw_flops: float


def output_times(cfg: Config, layout: PlanLayout, rates: Rates) -> OutputTimes:
    s, b, t, sx = cfg.train.seq_len, layout.microbatch_size, layout.tensor, layout.sequence
    tok = b * s / sx  # logits are split over the sequence axis (act_seq) and the vocabulary over tensor
    flops = 2.0 * tok * cfg.model.d_model * layout.vocab / t
    elem = 3 * 4 * tok * layout.vocab / t / rates.hbm  # float32 logits: write, softmax read + write
    return OutputTimes(flops / rates.gemm + elem, 2 * flops / rates.gemm + elem, 3 * flops)


@dataclass
class StepTime:
    """Step-time breakdown, seconds (per device on the slowest stage), and derived throughput.

    compute: fwd + bwd + recompute of all microbatches on the stage that sets the pace (no bubble), and `parts`
    the same by part: "forward", "backward" (the output layer's included where the stage runs it) and
    "recompute" (what the remat policy runs again; 0 at `none`). exposed:
    communication on the critical path by group; compute + bubble + exposed + contention + optimizer = step
    (unless a link bound sets it). hidden: communication time overlapped with compute, by group. bubble:
    pipeline idle time. optimizer: the parameter update. link_busy: seconds each kind of link ("inter",
    "intra") is busy per step; link_bound: which one sets the step time when it exceeds the overlap model's
    ("" when none does).
    contention: the slowdown of compute that runs under hidden collectives (OVERLAP_SLOWDOWN x hidden time).
    """

    step: float
    compute: float
    bubble: float
    optimizer: float
    exposed: dict = field(default_factory=dict)
    hidden: dict = field(default_factory=dict)
    comm_total: dict = field(default_factory=dict)
    microbatch_time: float = 0.0
    hw_flops_per_step: float = 0.0
    link_busy: dict = field(default_factory=dict)
    link_bound: str = ""
    contention: float = 0.0
    parts: dict = field(default_factory=dict)


def step_time(cfg: Config, layout: PlanLayout, hw: Hardware, opts: PlanOptions, stage: StageParams,
              collectives: list | None = None) -> StepTime:
    """Predicted step time of `layout` (see module docstring for the overlap model)."""
    if opts.baseline == "megatron":
        opts = opts.effective()
    rates = Rates.of(hw, opts)
    lt = layer_times(cfg, layout, rates)
    ot = output_times(cfg, layout, rates)
    colls = comm_mod.inventory(cfg, layout, hw, stage) if collectives is None else collectives
    per_call: dict[str, float] = {}
    total: dict[str, float] = {}
    busy = {"inter": 0.0, "intra": 0.0}
    dp_rs = dp_ag = emb = pp_steps = 0.0
    for c in colls:
        per_call.setdefault(c.name, c.time_per_call)
        group = {"EMB": "DP"}.get(c.group, c.group)  # reported with the overlap it shares
        total[group] = total.get(group, 0.0) + c.time_per_step
        busy[c.link.kind] += c.time_per_step
        if c.group == "DP":
            if c.op == "all-gather":
                dp_ag += c.time_per_step
            else:
                dp_rs += c.time_per_step
        elif c.group == "EMB":
            emb += c.time_per_step
        elif c.group == "PP":
            pp_steps += c.time_per_step
    p, v, mb, t = layout.pipeline, layout.virtual_stages, layout.microbatches, layout.tensor
    layers = cfg.model.num_layers // p
    exposed: dict[str, float] = {}
    call = lambda name: per_call.get(name, 0.0)  # noqa: E731

    # TP per layer per microbatch.
    ag, rs = call("TP all-gather"), call("TP reduce-scatter")
    g = lt.gemm
    if layout.block == "parallel":
        pairs_fwd = [(ag, g["lin1"]), (rs, g["lin2"])]
        pairs_bwd = [(rs, 2 * g["lin1"]), (ag, 2 * g["lin2"])]
    else:
        pairs_fwd = [(ag, g["qkv"]), (rs, g["out"]), (ag, g["lin1"]), (rs, g["lin2"])]
        pairs_bwd = [(rs, 2 * g["qkv"]), (ag, 2 * g["out"]), (rs, 2 * g["lin1"]), (ag, 2 * g["lin2"])]
    hide = (t - 1) / t if opts.overlap_tp else 0.0
    fwd_tp = sum(max(0.0, c - gm * hide) for c, gm in pairs_fwd)
    bwd_tp = sum(max(0.0, c - gm * hide) for c, gm in pairs_bwd)
    # a MoE layer's output is summed over tensor by an all-reduce at the end of the expert region, after its last
    # matmul: nothing to hide it under
    fwd_tp += moe.moe_fraction(cfg) * call("TP all-gather (MoE output)")
    tp_layer = fwd_tp * (2.0 if layout.remat == "full" else 1.0) + bwd_tp
    # Output layer: gather before the logits GEMM, scatter its gradient; the embedding's pair is exposed.
    out_gemm = ot.fwd
    tp_out = max(0.0, ag - out_gemm * hide) + max(0.0, rs - 2 * out_gemm * hide)
    tp_embed = ag + rs

    # FSDP per layer per microbatch.
    f_ag, f_rs = call("FSDP all-gather (weights)"), call("FSDP reduce-scatter (grads)")
    if opts.overlap_fsdp:
        fsdp_layer = (max(0.0, f_ag - lt.fwd) + max(0.0, f_ag + f_rs - lt.bwd)
                      + (max(0.0, f_ag - lt.recompute) if layout.remat == "full" else 0.0))
        fsdp_embed = 0.0
    else:
        fsdp_layer = f_ag * (2.0 if layout.remat == "full" else 1.0) + f_ag + f_rs
        fsdp_embed = 2 * call("FSDP all-gather (embedding)") + call("FSDP reduce-scatter (embedding)")

    # SEQ (context parallelism) per layer per microbatch: exposed (module docstring).
    seq_layer = (call("SEQ all-gather (K, V)") * comm_mod.kv_gathers(layout)
                 + call("SEQ reduce-scatter (dK, dV)")) if layout.sequence > 1 else 0.0

    # EP (expert parallelism) per layer per microbatch, averaged over the layers: each forward run of the dispatch
    # (twice under remat, `moe.moe_dispatch_passes`) sends the tokens out, the ids with them, and the outputs back,
    # and the backward sends the gradients both ways; the tokens wait for them (on the critical path), except that
    # msjax runs the shared experts while the dispatch's tokens are in flight (`msjax.parallel.expert`), which
    # hides that much of the first all-to-all of each direction.
    share = moe.moe_fraction(cfg)
    a2a, ids = call("EP all-to-all (tokens)"), call("EP all-to-all (expert ids)")
    ep_f = ep_layer = 0.0
    if share and a2a:
        mg = moe.moe_gemm_flops(cfg, layout)
        shared = (mg["shared_lin1"] + mg["shared_lin2"]) / rates.gemm if layout.baseline == "msjax" else 0.0
        ep_f = share * (max(0.0, a2a - shared) + a2a + ids)
        ep_layer = ep_f * moe.moe_dispatch_passes(layout) + share * (max(0.0, a2a - 2 * shared) + a2a)

    per_layer = lt.fwd + lt.bwd + lt.recompute
    table = p > 1 and layout.baseline == "msjax" and layout.schedule != "interleaved"
    passes = (0.0, 0.0, 0.0)
    if table:
        # A table schedule runs each chunk's backward as two passes (`msjax.parallel.split_backward`): B, the input
        # gradient (and the remat recompute), whose TP collectives hide under its one GEMM per linear, not two;
        # and W, the weight-gradient GEMMs alone (no collective: its inputs were stashed as B left them).
        w_gemm = sum(g.values())
        bwd_tp = sum(max(0.0, c - gm / 2 * hide) for c, gm in pairs_bwd)
        tp_f, tp_b = fwd_tp, bwd_tp + (fwd_tp if layout.remat == "full" else 0.0)
        tp_layer = tp_f + tp_b
        fsdp_f = max(0.0, f_ag - lt.fwd) if opts.overlap_fsdp else f_ag
        seq_f = call("SEQ all-gather (K, V)") if layout.sequence > 1 else 0.0
        lc = layers // v
        passes = (lc * (lt.fwd + tp_f + fsdp_f + seq_f + ep_f),
                  lc * (lt.bwd - w_gemm + lt.recompute + tp_b + fsdp_layer - fsdp_f + seq_layer - seq_f
                        + ep_layer - ep_f),
                  lc * w_gemm)
    # Compute of a microbatch on the pacing stage, by part: forward, backward, remat recompute and the output
    # layer (`parts`); with p = 1 one device has everything.
    if p > 1 and layout.baseline == "msjax":
        # msjax's pipeline (msjax.parallel.pipeline): every stage runs its chunks' forward and backward in each
        # busy tick (the bubble's idle stages masked, priced by the bubble below); the output layer and loss
        # run once per microbatch spread over the stages (1/p of the tokens each, its input all-to-all'ed over
        # `pipeline` and its gradient all-gathered back, on the critical path of that tick), and the embedding
        # with its tensor-parallel pair on every stage. All stages alike: no stage paces the others. (The
        # all-to-all and all-gather are added with the PP exposure below.)
        ends = (ot.fwd + ot.bwd + tp_out) / p + tp_embed
        # with the collective matmul (`mesh.tp_overlap`) the step stashes each chunk's input and runs the chunk
        # again in its backward (`PipelinedGrads._chunk_vjp`): one more forward per layer
        again = lt.fwd + fwd_tp if (cfg.mesh.tp_overlap == "collective_matmul" and t > 1) else 0.0
        stages = [(layers * (per_layer + again), layers * tp_layer, layers * fsdp_layer + fsdp_embed,
                   layers * seq_layer, layers * ep_layer)]
        parts = {"forward": layers * lt.fwd + ot.fwd / p, "backward": layers * lt.bwd + ot.bwd / p,
                 "recompute": layers * (lt.recompute + again)}
        layer_part = sum(stages[0])
    else:
        # Per microbatch on the first stage (embedding end) and the last (output layer). The slowest stage sets
        # the pipeline's pace (compute, TP, FSDP and SEQ exposure are its own).
        ends = 0.0
        stages = [(layers * per_layer, layers * tp_layer + tp_embed, layers * fsdp_layer + fsdp_embed,
                   layers * seq_layer, layers * ep_layer),
                  (layers * per_layer + ot.fwd + ot.bwd, layers * tp_layer + tp_out, layers * fsdp_layer + fsdp_embed,
                   layers * seq_layer, layers * ep_layer)]
        if p == 1:
            stages = [(stages[1][0], stages[0][1] + tp_out, stages[0][2], stages[0][3], stages[0][4])]
        last = p == 1 or sum(stages[-1]) >= sum(stages[0])
        parts = {"forward": layers * lt.fwd + (ot.fwd if last else 0.0),
                 "backward": layers * lt.bwd + (ot.bwd if last else 0.0), "recompute": layers * lt.recompute}
        layer_part = max(sum(st) for st in stages)
    compute_mb, tp_mb, fsdp_mb, seq_mb, ep_mb = max(stages, key=sum)
    t_mb = layer_part + ends
    if table:
        # the table as the step runs it: its ticks, each stage's pass of each, coupled over the rings
        pipeline_time = flush_seconds(tick_plan(layout.schedule, p, v, mb), passes, ends)
    else:
        # (P - 1) / (V M + P - 1) of the layers' time is bubble: the function the train step prints at start-up.
        pipeline_time = mb * layer_part / (1.0 - bubble_fraction(p, v, mb)) + mb * ends
    bubble = pipeline_time - mb * t_mb
    exposed["TP"] = mb * tp_mb + (mb * (tp_out / p + tp_embed) if ends else 0.0)
    exposed["FSDP"] = mb * fsdp_mb
    if layout.sequence > 1:
        exposed["SEQ"] = mb * seq_mb
    if ep_mb:
        exposed["EP"] = mb * ep_mb

    # PP send/recv.
    if p > 1:
        p2p = call("PP send/recv (activations)")
        spread = mb * (call("PP all-to-all (output layer input)") + call("PP all-gather (output layer gradient)"))
        exposed["PP"] = (2 * (p * v - 1) * p2p + spread) if opts.overlap_pp else pp_steps
    # DP (+ tied-embedding sync).
    if opts.overlap_dp:
        units = v if p > 1 else layers
        if table:
            chunks_in_flight = action_table(layout.schedule, p, v, mb).in_flight(0)
        elif layout.baseline == "msjax" and p > 1:
            chunks_in_flight = in_flight(p, v, mb)
        else:
            chunks_in_flight = in_flight_chunks(p, v, mb)
        bwd_window = chunks_in_flight / v * layers * (lt.bwd + lt.recompute)
        fwd_window = chunks_in_flight / v * layers * lt.fwd
        red = dp_rs + emb
        # The first chunk's gather has no compute in front of it; the rest overlap the warm-up forwards.
        gather = dp_ag / units + max(0.0, dp_ag * (units - 1) / units - fwd_window)
        exposed["DP"] = max(red / units, red - bwd_window) + gather
    else:
        exposed["DP"] = dp_rs + dp_ag + emb
    # Optimizer update over the local (ZeRO-sharded) state.
    ends_held = ends_elements(cfg, layout, stage) if (p > 1 and layout.baseline == "msjax") else \
        max(stage.first_elements, stage.last_elements)
    elements = layers * stage.layer_elements + ends_held
    local = elements / ((layout.data if layout.zero_stage >= 1 else 1)
                        * (layout.fsdp if zero2_over_fsdp(cfg, layout) else 1))
    optimizer = local * OPTIMIZER_BYTES_PER_PARAM[cfg.optimizer.name] / rates.hbm
    hidden = {k: max(0.0, total.get(k, 0.0) - exposed.get(k, 0.0)) for k in total}
    contention = OVERLAP_SLOWDOWN * sum(hidden.values())
    step = pipeline_time + exposed.get("PP", 0.0) + exposed["DP"] + optimizer + contention
    # A link carries one thing at a time: all collectives on the network (or on NVLink / ICI) together must
    # fit in the step, whatever the overlap model says. Collectives of different mesh axes share each
    # device's NIC (and NVLink ports), so a layout can be network-bound even when every group overlaps.
    bound = max(busy.values())
    link_bound = ""
    if bound > step:
        link_bound = "network" if busy["inter"] >= busy["intra"] else "intra-node links"
        step = bound
    if table:  # each pass once: no stage runs a masked pass
        hw_flops = mb * layers * lt.hw_flops + mb * ot.hw_flops / p
    elif p > 1 and layout.baseline == "msjax":
        # what the hardware executes: every stage's chunks in all V M + P - 1 busy ticks (the bubble's masked
        # runs included), 1/p of each microbatch's output layer
        hw_flops = mb * layers * lt.hw_flops * (v * mb + p - 1) / (v * mb) + mb * ot.hw_flops / p
    else:
        paced_by_last = p == 1 or stages[-1] == max(stages, key=sum)
        hw_flops = mb * (layers * lt.hw_flops + (ot.hw_flops if paced_by_last else 0.0))
    return StepTime(step=step, compute=mb * sum(parts.values()), bubble=bubble, optimizer=optimizer,
                    exposed={k: v_ for k, v_ in exposed.items() if v_ or k in total}, hidden=hidden,
                    comm_total=total, microbatch_time=t_mb, hw_flops_per_step=hw_flops, link_busy=busy,
                    link_bound=link_bound, contention=contention, parts={k: mb * x for k, x in parts.items()})


def model_flops_per_token(cfg: Config, layout: PlanLayout, megatron_convention: bool = False) -> float:
    """Model FLOPs per token (msjax.flops) for the layout's model (the megatron baseline has no window)."""
    mc = cfg.model
    if layout.window != mc.attention.window:
        mc = dataclasses.replace(mc, attention=dataclasses.replace(mc.attention, window=layout.window))
    return model_flops.flops_per_token(mc, cfg.train.seq_len, layout.vocab, megatron_convention)
