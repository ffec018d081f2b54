"""Communication per step: every collective of a layout, its bytes, the mesh axes and link it runs on, and the
time it takes at that link's bandwidth.

Ring-algorithm volumes per device (Thakur et al. 2005; the NCCL "bus bandwidth" convention): an all-gather, a
reduce-scatter or an all-to-all of a tensor of B bytes moves (n - 1) / n * B bytes through each device's link; an
all-reduce moves twice that. Time = volume / bus bandwidth + (n - 1) ring steps x latency. Send/recv moves B bytes.

The per-step inventory (per device, most loaded pipeline stage) follows the layout:
  TP     (tensor)        per layer and microbatch: an all-gather entering and a reduce-scatter leaving each TP
                         region (with sequence parallelism; without it an all-reduce, the same bytes) of the
                         b x (T / c) x h activation (c = the `sequence` size), forward and backward, and again
                         in a full-remat recompute. Serial blocks have two TP regions per layer (attention, MLP),
                         parallel blocks one (MegaScale fig. 3a). The vocabulary-parallel embedding and logits add
                         one pair each (with pipelining, the stage that has one of them).
  SEQ    (sequence)      context parallelism: per layer and microbatch, attention all-gathers K and V (b x T x
                         G/t x K each, the whole sequence for this device's heads) in the forward and again in
                         the backward's recompute under any remat policy (only `none` saves the gathered copy),
                         and reduce-scatters dK and dV in the backward: (c - 1) / c of 2 b T (G / t) K elements
                         each way (`memory.gathered_kv_bytes`). K and V are one call (two in XLA; the latency
                         term is negligible at these sizes).
  FSDP   (fsdp)          per layer and microbatch (not under the zero2 rule set, whose fsdp axis joins DP's
                         reduce-scatter and all-gather): weights all-gathered for the forward and again for the
                         backward (in the compute dtype), gradients reduce-scattered (ZeRO-3).
  DP     (data, sequence) once per step after accumulation: all-reduce of the gradients (ZeRO-0), or reduce-
                         scatter of the gradients + all-gather of the updated parameters (ZeRO-1/2,
                         Megatron's distributed optimizer, MegaScale fig. 1). Parameters are replicated over
                         `sequence`, so its members' gradients are reduced with the data replicas'.
  PP     (pipeline)      per chunk boundary and microbatch: send the activation forward and its gradient back,
                         1/t of it per tensor rank (Narayanan et al. 2021 sec. 4.1 scatter/gather). msjax's
                         tick loop sends in every tick, V M + V P + P - 1 per direction, and spreads each
                         microbatch's output layer over the stages: an all-to-all of the last stage's output
                         and an all-gather of its gradient, (p - 1) / p of b T h / t each.
  EP     (expert)        expert parallelism (`msjax.planner.moe`), per MoE layer and microbatch: the dispatch's
                         all-to-all of the (ep, N, D) token buffer out and of the outputs back in each forward run
                         (twice under any remat policy), with one of the (ep, N) int32 expert ids out, and the
                         gradients' two in the backward. The buffers are fixed-size blocks of N rows per peer,
                         ep times the assignments a device really sends (XLA:CPU has no ragged all-to-all): what
                         the program sends is priced. `expert` stays inside a node (`layout.check_expert_split`).
                         With `tensor` > 1 the MoE output is summed over `tensor` by an all-reduce (a psum inside
                         the expert region) where a dense MLP reduce-scatters: one more all-gather's worth
                         ("TP all-gather (MoE output)") in each forward run.
  EMB    (pipeline)      tied embedding: the first and last stages all-reduce the embedding gradient. msjax's
                         stages all hold the embedding and output ends, and all-reduce their gradients over the
                         whole `pipeline` axis once per step.
"""

from __future__ import annotations

from msjax.config import Config
from msjax.hardware import Hardware
from msjax.parallel.zero_bubble import tick_plan
from msjax.planner import moe
from msjax.planner.layout import PlanLayout, Link, group_link, zero2_over_fsdp
from msjax.planner.memory import (
    DTYPE_BYTES, StageParams, ends_elements, gathered_kv_bytes, state_bytes_per_element,
)


class Collective:
    """One kind of collective in a step (times and volumes computed once, at construction).

    Attributes:
      name: what it is for ("TP all-gather", "DP reduce-scatter", ...).
      group: "TP", "SEQ", "FSDP", "EP", "DP", "PP" or "EMB".
      axes: mesh axes of the group.
      op: "all-gather", "reduce-scatter", "all-reduce", "all-to-all" or "send/recv".
      size: devices in the group.
      tensor_bytes: bytes of the full tensor of one call.
      calls: calls per step (per device).
      link: the link it runs on.
      volume_per_call: bytes through one device's link per call.
      time_per_call, bytes_per_step, time_per_step: seconds / bytes.
    """

    __slots__ = ("name", "group", "axes", "op", "size", "tensor_bytes", "calls", "link", "volume_per_call",
                 "time_per_call", "bytes_per_step", "time_per_step")

    def __init__(self, name: str, group: str, axes: tuple[str, ...], op: str, size: int, tensor_bytes: float,
                 calls: float, link: Link):
        self.name, self.group, self.axes, self.op, self.size = name, group, axes, op, size
        self.tensor_bytes, self.calls, self.link = tensor_bytes, calls, link
        if op == "send/recv":
            self.volume_per_call, steps = tensor_bytes, 1
        else:
            factor = 2 if op == "all-reduce" else 1
            self.volume_per_call = factor * (size - 1) / size * tensor_bytes
            steps = factor * (size - 1)
        self.time_per_call = self.volume_per_call / link.bandwidth + steps * link.latency
        self.bytes_per_step = self.volume_per_call * calls
        self.time_per_step = self.time_per_call * calls

    def __repr__(self) -> str:
        return (f"Collective({self.name!r}, {self.op}, size={self.size}, bytes={self.tensor_bytes:.3g}, "
                f"calls={self.calls:g}, {self.link.kind})")


def tp_regions(layout: PlanLayout) -> int:
    """Tensor-parallel regions per layer: attention and MLP (serial), or one fused region (parallel)."""
    return 1 if layout.block == "parallel" else 2


def passes(layout: PlanLayout) -> float:
    """Forward passes of a layer per microbatch counting remat recompute (full remat reruns the forward)."""
    return 2.0 if layout.remat == "full" else 1.0


def kv_gathers(layout: PlanLayout) -> float:
    """K/V all-gathers over `sequence` per layer and microbatch: the forward's, plus one in the backward unless
    the gathered copy was saved (remat `none`): full remat reruns the forward, and the dots policies save only
    the local K/V projection outputs (an all-gather is not a dot), so the backward gathers them again. Checked on
    the compiled train step (fake CPU devices, 2-layer gpt_tiny with sequence = tensor = 2; XLA gathers K and V
    separately): 2 all-gathers over `sequence` per layer under `none`, 4 under `dots_no_batch`, `dots` (xla
    attention) and `full`."""
    return 1.0 if layout.remat == "none" else 2.0


def inventory(cfg: Config, layout: PlanLayout, hw: Hardware, stage: StageParams) -> list[Collective]:
    """Every collective of one step on the most loaded device (see module docstring)."""
    m = cfg.model
    e = DTYPE_BYTES[m.dtype]
    pe, ge, _ = state_bytes_per_element(cfg, layout)
    s, b = cfg.train.seq_len, layout.microbatch_size
    p, v, mb, t, sx, f = (layout.pipeline, layout.virtual_stages, layout.microbatches, layout.tensor,
                         layout.sequence, layout.fsdp)
    layers = m.num_layers // p
    act = e * b * s * m.d_model  # the full b x s x h activation, bytes
    out: list[Collective] = []
    links: dict = {}

    def add(name, group, axes, op, size, tensor_bytes, calls):
        if size > 1 and calls > 0 and tensor_bytes > 0:
            link = links.get(axes)
            if link is None:
                link = links[axes] = group_link(layout, axes, hw)
            out.append(Collective(name, group, axes, op, size, tensor_bytes, calls, link))

    regions = tp_regions(layout)
    fwd_like = passes(layout)
    # TP: per region one collective in, one out, in each forward-like pass and in the backward; the
    # vocabulary-parallel embedding (first stage) and logits (last stage) add one pair each.
    msjax_pp = p > 1 and layout.baseline == "msjax"
    ends = mb * (2.0 if p == 1 else 1.0 + (1.0 / p if msjax_pp else 0.0))  # msjax: every stage both, logits 1/p
    tp_calls = layers * mb * regions * (fwd_like + 1.0) + ends
    tp_act = act / sx
    add("TP all-gather", "TP", ("tensor",), "all-gather", t, tp_act, tp_calls)
    add("TP reduce-scatter", "TP", ("tensor",), "reduce-scatter", t, tp_act, tp_calls)
    # SEQ (context parallelism): K and V gathered for each forward-like pass, dK and dV reduce-scattered once.
    if sx > 1:
        kv = gathered_kv_bytes(cfg, layout)
        add("SEQ all-gather (K, V)", "SEQ", ("sequence",), "all-gather", sx, kv, layers * mb * kv_gathers(layout))
        add("SEQ reduce-scatter (dK, dV)", "SEQ", ("sequence",), "reduce-scatter", sx, kv, layers * mb)
    # EP (expert parallelism): the dispatch's all-to-alls per MoE layer; the psum of the MoE output over tensor.
    moe_layers = layers * moe.moe_fraction(cfg)
    if moe_layers:
        tokens, ids = moe.moe_all_to_all_bytes(cfg, layout)
        runs = moe_layers * mb * moe.moe_dispatch_passes(layout)
        add("EP all-to-all (tokens)", "EP", ("expert",), "all-to-all", layout.expert, tokens,
            2 * runs + 2 * moe_layers * mb)
        add("EP all-to-all (expert ids)", "EP", ("expert",), "all-to-all", layout.expert, ids, runs)
        add("TP all-gather (MoE output)", "TP", ("tensor",), "all-gather", t, tp_act, moe_layers * mb * fwd_like)
    # FSDP (ZeRO-3 over fsdp): gather weights for each forward-like pass and the backward; scatter gradients.
    # Under the zero2 rule set the fsdp axis holds ZeRO-2 instead: its collectives are the DP group's below.
    zero2 = zero2_over_fsdp(cfg, layout)
    if not zero2:
        layer_w = stage.gathered / t  # a mixture of experts' device gathers its own experts
        embed_w = stage.embed_total / t
        add("FSDP all-gather (weights)", "FSDP", ("fsdp",), "all-gather", f, e * layer_w,
            layers * mb * (fwd_like + 1.0))
        add("FSDP reduce-scatter (grads)", "FSDP", ("fsdp",), "reduce-scatter", f, ge * layer_w, layers * mb)
        add("FSDP all-gather (embedding)", "FSDP", ("fsdp",), "all-gather", f, e * embed_w, mb * 2.0)
        add("FSDP reduce-scatter (embedding)", "FSDP", ("fsdp",), "reduce-scatter", f, ge * embed_w, mb)
    # DP over data (and sequence, where parameters are replicated too), once per step; with the zero2 rule set
    # over fsdp as well: a reduce-scatter over fsdp and an all-reduce of the shards over the rest move
    # 2 (1 - 1 / (d f)) of the bytes, what one reduce-scatter + all-gather over the whole group moves.
    elements = layers * stage.layer_elements + (ends_elements(cfg, layout, stage) if msjax_pp else
                                                max(stage.first_elements, stage.last_elements))
    dp_axes = ("data",) + (("fsdp",) if zero2 else ()) + (("sequence",) if sx > 1 else ())
    n_dp = layout.data * sx * (f if zero2 else 1)
    if layout.zero_stage == 0 and not zero2:
        add("DP all-reduce (grads)", "DP", dp_axes, "all-reduce", n_dp, ge * elements, 1)
    else:
        add("DP reduce-scatter (grads)", "DP", dp_axes, "reduce-scatter", n_dp, ge * elements, 1)
        add("DP all-gather (params)", "DP", dp_axes, "all-gather", n_dp, pe * elements, 1)
    # PP: per chunk boundary per microbatch, activation forward and gradient backward (1/t per tensor rank).
    if p > 1 and msjax_pp:
        p2p = act / t / sx
        if layout.schedule == "interleaved":  # both rings every busy tick
            sends = (v * mb + v * p + p - 1,) * 2
        else:  # a table sends on a ring only in ticks where some stage's pass is routed on it (zb-v's V shape
            # puts activations and gradients on both rings: the two rows are the rings, to p + 1 and to p - 1)
            plan = tick_plan(layout.schedule, p, v, mb)
            sends = (int(plan.send_next.sum()), int(plan.send_prev.sum()))
        add("PP send/recv (activations)", "PP", ("pipeline",), "send/recv", p, p2p, sends[0])
        add("PP send/recv (gradients)", "PP", ("pipeline",), "send/recv", p, p2p, sends[1])
        add("PP all-to-all (output layer input)", "PP", ("pipeline",), "all-to-all", p, p2p, mb)
        add("PP all-gather (output layer gradient)", "PP", ("pipeline",), "all-gather", p, p2p, mb)
        add("EMB all-reduce (ends over pipeline)", "EMB", ("pipeline",), "all-reduce", p,
            ge * ends_elements(cfg, layout, stage), 1)
    elif p > 1:
        p2p = act / t / sx
        add("PP send/recv (activations)", "PP", ("pipeline",), "send/recv", p, p2p, mb * v)
        add("PP send/recv (gradients)", "PP", ("pipeline",), "send/recv", p, p2p, mb * v)
        if m.tie_embeddings:
            add("EMB all-reduce (tied embedding)", "EMB", ("pipeline",), "all-reduce", 2,
                ge * stage.embed_total / t / f, 1)
    return out
