"""Human-readable tables and JSON for plans, searches and compile checks."""

from __future__ import annotations

import dataclasses

from msjax.planner import memory as mem
from msjax.planner.plan import Plan, run_overrides
from msjax.planner.search import SearchResult, reason_kind

GiB = 2**30
GB = 1e9


def _gib(x: float) -> str:
    return f"{x / GiB:8.2f}"


def _si(x: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _seconds(x: float) -> str:
    return f"{x * 1e3:9.1f} ms" if x < 1 else f"{x:9.3f} s "


def plan_text(plan: Plan) -> str:
    """The full per-device report of one plan."""
    cfg, lay, hw, m, t = plan.config, plan.layout, plan.hardware, plan.memory, plan.time
    mc = cfg.model
    L = mc.num_layers
    lines = []
    add = lines.append
    active = f", {plan.active_params / 1e9:.1f}B active per token" if plan.active_params != plan.total_params else ""
    add(f"msjax plan: {cfg.name} ({plan.total_params / 1e9:.1f}B parameters{active}) on {lay.devices:,} x {hw.name}")
    add(f"  device: {hw.memory_bytes / GiB:.0f} GiB, {hw.peak_flops / 1e12:.0f} TFLOP/s bf16, HBM "
        f"{hw.hbm_bandwidth / GB:.0f} GB/s, intra-node {hw.intra_node_bandwidth / GB:.0f} GB/s, network "
        f"{hw.inter_node_bandwidth / GB:.3g} GB/s per device, {hw.devices_per_node} devices and "
        f"{hw.nics_per_node} NICs per node  [{hw.source}]")
    add(f"  model: {plan.options.baseline} design" + (" (no overlap, serial blocks, no window, FlashAttention-1)"
                                                     if lay.baseline == "megatron" else ""))
    add("")
    add("Layout")
    per_stage = L // lay.pipeline
    sched = "interleaved 1F1B" if lay.virtual_stages > 1 else ("1F1B" if lay.pipeline > 1 else "no pipeline")
    if lay.schedule != "interleaved":
        sched = f"{lay.schedule}, run from its action table"
    add(f"  pipeline   {lay.pipeline} stages x {lay.virtual_stages} virtual ({sched}); {per_stage} layers per stage, "
        f"{per_stage // lay.virtual_stages} per chunk")
    cp = " (context parallel: K/V all-gathered)" if lay.sequence > 1 else ""
    add(f"  data       {lay.data} (ZeRO-{lay.zero_stage} over data)    fsdp {lay.fsdp} (ZeRO-3)    "
        f"{f'expert {lay.expert}    ' if cfg.model.moe.num_experts else ''}sequence "
        f"{lay.sequence}{cp}    tensor {lay.tensor} (sequence parallel {'on' if lay.sequence_parallel else 'off'})")
    add(f"  batch      {cfg.train.global_batch} sequences x {cfg.train.seq_len} tokens; microbatch "
        f"{lay.microbatch_size} x {lay.microbatches} per replica per step")
    add(f"  model      {L} layers, d_model {mc.d_model}, {mc.num_heads} heads ({mc.kv_heads} kv), d_ff {mc.ff_size}, "
        f"vocab {lay.vocab}; position {mc.position}, norm {mc.norm}, mlp {mc.mlp}, "
        f"{'tied' if mc.tie_embeddings else 'untied'} head, biases {'on' if mc.use_bias else 'off'}; block "
        f"{lay.block}, window {lay.window}, attention "
        f"{'fused (flash)' if lay.flash else 'materialised (xla)'}, remat {lay.remat}, {mc.dtype} activations, "
        f"{mc.param_dtype} parameters, {cfg.optimizer.name}")
    mo = mc.moe
    if mo.num_experts:
        add(f"  experts    {mo.num_experts} experts of width {mo.expert_ff or mc.ff_size}, top-{mo.experts_per_token}"
            f"{f', {mo.shared_experts} shared' if mo.shared_experts else ''} (every {mo.every} layer(s)); expert "
            f"{lay.expert} ({mo.num_experts // lay.expert} experts per device); load imbalance {lay.moe_imbalance:g} "
            "assumed (--moe_imbalance: the busiest device's assignments over the mean"
            f"{', priced on its grouped matmuls' if lay.expert > 1 else '; no effect without expert parallelism'})")
    for k, v in plan.auto.items():
        add(f"  auto       {k} = {v}")
    overrides, note = run_overrides(plan)
    add("  run with   " + " ".join(f"--{k}={v}" for k, v in overrides.items()) + (f"  ({note})" if note else ""))
    add("")
    add(f"{'Memory per device (most loaded stage)':74s}GiB")
    pe, ge, oe = mem.state_bytes_per_element(cfg, lay)
    row = lambda label, value: add(f"  {label:70s}{_gib(value)}")  # noqa: E731
    row(m.label("params", f"parameters ({pe:.0f} B/param)"), m.params)
    row(m.label("grads", f"gradients ({ge:.0f} B/param{', sharded over data' if lay.zero_stage >= 2 else ''})"),
        m.grads)
    row(m.label("optimizer", f"optimizer ({cfg.optimizer.name}, {oe:.0f} B/param"
                             f"{', sharded over data' if lay.zero_stage >= 1 else ''})"), m.optimizer)
    if m.grads_in_backward is None:
        row(m.label("activations", f"activations ({m.in_flight_layers:.1f} layer-microbatches x "
                                   f"{m.per_layer_activation / 2**20:.1f} MiB)"), m.activations)
    else:  # msjax's step (memory.MemoryReport: phases)
        row(m.label("activations", f"activations stored ({m.per_layer_activation / 2**20:.1f} MiB per layer, "
                                   "microbatch)"), m.activations)
    row(m.label("working", "working (layer being recomputed, logits, FSDP gather buffers)"), m.working)
    if m.grads_in_backward is not None:
        phase = "backward" if m.backward_peak >= m.update_peak else "update"
        row(f"transient peak ({phase}; other phase {_gib(min(m.backward_peak, m.update_peak)).strip()} GiB)",
            m.transient)
        row(f"XLA heap-packing allowance ({m.packing_fraction:.0%} of transient)", m.packing)
    add(f"  {'total':70s}{_gib(m.total)}  of {m.capacity / GiB:.1f} GiB usable "
        f"({plan.options.memory_fraction:.0%} of {m.device_memory / GiB:.0f}): {'fits' if m.fits else 'DOES NOT FIT'}")
    table = mem.activation_table(cfg, lay)
    add("  per layer per microbatch by remat policy: "
        + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in table.items()))
    # why this remat: the same layout's total under each policy (cheapest recompute first)
    stage = mem.stage_params(cfg, lay.vocab, lay.axis_sizes())
    totals = {r: mem.memory_report(cfg, dataclasses.replace(lay, remat=r), stage, m.device_memory,
                                   plan.options.memory_fraction) for r in ("none", "dots_no_batch", "dots", "full")}
    add("  total by remat policy (this layout): " + ", ".join(
        f"{r} {t.total / GiB:.1f} GiB{'' if t.fits else ' (does not fit)'}" for r, t in totals.items())
        + f"; model.remat={lay.remat}")
    add("")
    add("Communication per step per device")
    add(f"  {'collective':34s} {'axes':17s} {'link':6s} {'GB/s':>6s} {'calls':>8s} {'GB/step':>9s} {'time':>12s}")
    for c in plan.collectives:
        add(f"  {c.name:34s} {'x'.join(c.axes) + f' ({c.size})':17s} {c.link.kind:6s} "
            f"{c.link.bandwidth / GB:6.0f} {c.calls:8.0f} {c.bytes_per_step / GB:9.2f} {_seconds(c.time_per_step)}")
    add("")
    add("Time per step (the pacing stage)")
    add(f"  {'compute':40s}{_seconds(t.compute)}   (" + " + ".join(
        f"{k} {_seconds(v).strip()}" for k, v in t.parts.items()) + ")")
    others = ", ".join(f"{name} {_seconds(p['bubble']).strip()}" for name, p in plan.schedules.items()
                       if name != lay.schedule)
    add(f"  {'pipeline bubble':40s}{_seconds(t.bubble)}" + (f"   ({lay.schedule}; the best layout of each other "
                                                            f"schedule: {others})" if others else ""))
    for k in sorted(t.comm_total):
        add(f"  {k + ' communication exposed':40s}{_seconds(t.exposed.get(k, 0.0))}   (of "
            f"{_seconds(t.comm_total[k]).strip()}; hidden {_seconds(t.hidden.get(k, 0.0)).strip()})")
    add(f"  {'contention under hidden communication':40s}{_seconds(t.contention)}")
    add(f"  {'optimizer update':40s}{_seconds(t.optimizer)}")
    if t.link_bound:
        add(f"  bound by the {t.link_bound}: links busy {t.link_busy['inter']:.3f} s (network), "
            f"{t.link_busy['intra']:.3f} s (intra-node) per step, more than the sum above")
    add(f"  {'step':40s}{_seconds(t.step)}")
    add("")
    add("Throughput")
    if not m.fits:  # a layout that cannot run has no throughput
        add(f"  none: this layout does not fit in memory ({m.total / GiB:.2f} GiB needed per device, "
            f"{m.capacity / GiB:.1f} GiB usable); the step times above are what it would take if it did")
        return "\n".join(lines)
    add(f"  {plan.tokens_per_second:,.0f} tokens/s;  {plan.days:.2f} days for {plan.options.token_budget / 1e9:g}B "
        "tokens")
    add(f"  MFU {plan.mfu:.1%} (msjax FLOPs: {plan.model_flops_per_token / 1e9:.1f} GFLOP/token, causal"
        f"{', window' if lay.window else ''}"
        f"{', active parameters: router, top-k and shared experts' if mc.moe.num_experts else ''}),"
        f"  {plan.mfu_paper:.1%} (Megatron-LM formula: "
        f"{plan.paper_flops_per_token / 1e9:.1f} GFLOP/token);  HFU {plan.hfu:.1%}")
    return "\n".join(lines)


def plan_dict(plan: Plan) -> dict:
    """JSON-ready dict of a plan (bytes, seconds, FLOP counts in SI units)."""
    lay, t, m = plan.layout, plan.time, plan.memory
    return {
        "config": plan.config.name,
        "model": {k: getattr(plan.config.model, k) for k in ("position", "norm", "mlp", "tie_embeddings",
                                                              "use_bias")},
        "hardware": dataclasses.asdict(plan.hardware),
        "options": dataclasses.asdict(plan.options),
        "layout": dataclasses.asdict(lay),
        "auto": plan.auto,
        "schedules": plan.schedules,
        "run_overrides": run_overrides(plan)[0],
        "memory": {"params": m.params, "grads": m.grads, "optimizer": m.optimizer, "activations": m.activations,
                   "working": m.working, "total": m.total, "capacity": m.capacity, "fits": m.fits,
                   "per_layer_activation": m.per_layer_activation, "in_flight_layers": m.in_flight_layers,
                   "labels": m.labels,
                   "per_layer_by_remat": mem.activation_table(plan.config, lay)},
        "collectives": [{"name": c.name, "group": c.group, "axes": list(c.axes), "op": c.op, "size": c.size,
                         "link": c.link.kind, "bus_bandwidth": c.link.bandwidth, "calls": c.calls,
                         "tensor_bytes": c.tensor_bytes, "bytes_per_step": c.bytes_per_step,
                         "seconds_per_step": c.time_per_step} for c in plan.collectives],
        "time": {"step": t.step, "compute": t.compute, "compute_parts": t.parts, "bubble": t.bubble,
                 "optimizer": t.optimizer,
                 "contention": t.contention, "exposed": t.exposed, "hidden": t.hidden, "comm_total": t.comm_total,
                 "microbatch": t.microbatch_time, "link_busy": t.link_busy, "link_bound": t.link_bound},
        # a layout that does not fit has no throughput (null), only its step-time breakdown above
        "throughput": {"tokens_per_step": plan.tokens_per_step,
                       **{k: (v if m.fits else None) for k, v in (
                           ("tokens_per_second", plan.tokens_per_second), ("mfu", plan.mfu),
                           ("mfu_megatron_formula", plan.mfu_paper), ("hfu", plan.hfu), ("days", plan.days))},
                       "token_budget": plan.options.token_budget,
                       "model_flops_per_token": plan.model_flops_per_token,
                       "megatron_flops_per_token": plan.paper_flops_per_token},
        "total_params": plan.total_params,
        "active_params": plan.active_params,
    }


def search_text(result: SearchResult, top: int = 20, title: str = "") -> str:
    lines = [title or "msjax search",
             f"  {result.meshes:,} mesh shapes, {result.legal_meshes:,} divide the model and batch; "
             f"{len(result.ranked):,} layouts fit, {len(result.rejected):,} rejected; "
             f"{result.evaluated:,} step-time evaluations in {result.seconds:.1f} s", ""]
    if result.ranked:
        lines.append(f"  {'rank':>4s} {'MFU':>6s} {'step':>9s} {'memory':>9s}  layout")
        for i, c in enumerate(result.ranked[:top], 1):
            lines.append(f"  {i:4d} {c.mfu:6.1%} {c.step:8.3f}s {c.memory / GiB:7.1f}Gi  {c.describe()}")
        best = {}  # the best-ranked layout of each pipeline schedule, with its rank
        for i, c in enumerate(result.ranked, 1):
            if c.sizes[0] > 1:
                best.setdefault(c.schedule, (i, c))
        if len(best) > 1:
            lines += ["", "  best by pipeline schedule:"]
            lines += [f"  {i:4d} {c.mfu:6.1%} {c.step:8.3f}s {c.memory / GiB:7.1f}Gi  {c.describe()}"
                      for i, c in best.values()]
    else:
        lines.append("  nothing fits")
    lines += ["", "  rejected, by reason:"]
    examples: dict[str, str] = {}
    for c in result.rejected:
        examples.setdefault(reason_kind(c.reason), f"{c.describe()}: {c.reason}")
    for kind, count in result.reason_counts().items():
        lines.append(f"    {count:8,d}  {kind}")
        lines.append(f"              e.g. {examples[kind]}")
    return "\n".join(lines)


def search_dict(result: SearchResult) -> dict:
    return {"meshes": result.meshes, "legal_meshes": result.legal_meshes, "evaluated": result.evaluated,
            "seconds": result.seconds, "ranked": [c.to_dict() for c in result.ranked],
            "rejected": [c.to_dict() for c in result.rejected], "rejected_by_reason": result.reason_counts()}

