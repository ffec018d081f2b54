"""Planner: memory formulas against the paper's equations (arithmetic written out), the `sequence` axis (context
parallelism: memory, K/V collectives and compute, by hand), layout legality and errors, search legality, the
calibration and the baseline switch, hardware catalogue, command line."""

import dataclasses
import json
import math
from pathlib import Path

import pytest

from msjax import hardware
from msjax.config import ConfigError, apply_overrides, load_preset
from msjax.planner import PlanError, PlanOptions, make_plan, plan_text, search
from msjax.planner import memory as mem
from msjax.planner import timing
from msjax.planner.cli import parse_plan_args, run
from msjax.planner.layout import group_link, legal_virtual_stages, make_layout, mesh_sizes, replica_batch
from msjax.planner.options import COLLECTIVE_LATENCY, FLASH_BACKWARD_FACTOR
from msjax.planner.plan import evaluate, get_hardware
from msjax.planner.published import ROWS, predict

MiB = 2**20


# ---------------------------------------------------------------------------------------------------------------
# Korthikanti et al. 2022 activation memory, GPT-3 175B: s=2048, b=1, h=12288, a=96, t=8 (their Table 3 model).

S, B, H, A, T = 2048, 1, 12288, 96, 8
SBH = S * B * H


def test_no_parallelism_eq1():
    # sbh (34 + 5 a s / h) = sbh (34 + 5 * 96 * 2048 / 12288) = sbh (34 + 80) = 114 sbh
    assert mem.korthikanti_layer_bytes(S, B, H, A) == 114 * SBH


def test_tensor_parallel_eq2():
    # sbh (10 + 24 / t + 5 a s / (h t)) = sbh (10 + 3 + 10) = 23 sbh
    assert mem.korthikanti_layer_bytes(S, B, H, A, T) == 23 * SBH


def test_tensor_and_sequence_parallel_eq4():
    # sbh / t (34 + 5 a s / h) = 114 / 8 sbh = 14.25 sbh
    assert mem.korthikanti_layer_bytes(S, B, H, A, T, sp=True) == 14.25 * SBH


def test_selective_recompute_eq6():
    # 34 sbh / t = 4.25 sbh (the 5as/h attention-core term is recomputed)
    assert mem.korthikanti_layer_bytes(S, B, H, A, T, sp=True, recompute="selective") == 4.25 * SBH
    # without sequence parallelism the 10 sbh outside the TP regions stays whole: 10 + 24/8 = 13 sbh
    assert mem.korthikanti_layer_bytes(S, B, H, A, T, recompute="selective") == 13 * SBH


def test_full_recompute_keeps_the_layer_input():
    # 2 sbh per layer (16-bit input only)
    assert mem.korthikanti_layer_bytes(S, B, H, A, T, recompute="full") == 2 * SBH


def test_microbatch_and_variants_scale_as_derived():
    # b = 4 scales every term: 114 sbh x 4
    assert mem.korthikanti_layer_bytes(S, 4, H, A) == 114 * SBH * 4
    # no dropout: drop the two 1-byte masks (2 sbh) and, per score, the mask (1) and dropped output (2):
    # 32 sbh + 2 a s^2 b = sbh (32 + 2 * 96 * 2048 / 12288) = 64 sbh
    assert mem.korthikanti_layer_bytes(S, B, H, A, dropout=False) == 64 * SBH
    # flash attention, no dropout: 32 sbh + float32 log-sum-exp 4 a s b = sbh (32 + 4 * 96 / 12288)
    assert mem.korthikanti_layer_bytes(S, B, H, A, dropout=False, flash=True) == pytest.approx(
        SBH * (32 + 4 * 96 / 12288))
    # parallel block: one LayerNorm input (2) and one shared QKV / linear-1 input (2) instead of 4 + 4: 30 sbh
    # with dropout (34 - 4), plus the scores 5 a s / h = 80
    assert mem.korthikanti_layer_bytes(S, B, H, A, parallel_block=True) == 110 * SBH


def test_interleaved_pipeline_first_stage_holds_L_times_one_plus():
    # Korthikanti sec. 4.2.3: the first stage holds L (1 + (p - 1) / (p v)) layers' worth.
    # 175B, p = 8, v = 6, m = 32: in-flight chunk-microbatches 2 (p - 1) + (v - 1) p + 1 = 14 + 40 + 1 = 55, each
    # of L / (p v) = 2 layers -> 110 = 96 (1 + 7 / 48) layers.
    chunks = mem.in_flight_chunks(8, 6, 32)
    assert chunks == 55
    assert chunks * 96 / (8 * 6) == 96 * (1 + 7 / 48) == 110
    # plain 1F1B: p microbatches of L / p layers = L; fewer microbatches than stages caps it
    assert mem.in_flight_chunks(8, 1, 32) == 8 and mem.in_flight_chunks(8, 1, 3) == 3
    assert mem.in_flight_chunks(1, 1, 32) == 1


def _cfg175(**over):
    base = {"model.remat": "none", "train.global_batch": 6144}
    base.update(over)
    return apply_overrides(load_preset("gpt175b"), base)


def _one_sequence_microbatches(cfg, devices):
    """`cfg` with microbatches of one sequence per replica on `devices`, set by the keys a run reads."""
    sizes = mesh_sizes(cfg, devices)
    per_replica = replica_batch(cfg, sizes)
    if sizes["pipeline"] > 1:
        return apply_overrides(cfg, {"pipeline.microbatches": per_replica, "train.microbatches": 1})
    return apply_overrides(cfg, {"train.microbatches": per_replica})


def _layout(cfg, devices=12288, v=6, b=1, z=2, remat=None, **opt):
    opts = PlanOptions(devices=devices, **opt)
    hw = get_hardware(opts)
    return make_layout(cfg, opts, hw, mesh_sizes(cfg, devices), v, b, z, remat or cfg.model.remat), opts, hw


def test_msjax_remat_policies_hand_computed():
    # gpt175b (MegaScale: 128 heads, h = 12288, d_ff = 4h), t = 8, SP, bf16, flash, parallel block, no dropout.
    lay, _, _ = _layout(_cfg175())
    cfg = _cfg175()
    e, tok = 2, 2048
    # dots_no_batch: x, attention-projection output, linear-2 output (3h, split by t with SP) + Q, K, V (3h) and
    # linear-1 output (4h) inside TP regions (/t): e * tok * (3h / 8 + 7h / 8) = 2 * 2048 * 1.25 * 12288
    assert mem.layer_activation_bytes(cfg, lay, "dots_no_batch") == e * tok * 10 * H / 8
    # flash attention is not a dot, so `dots` keeps the same
    assert mem.layer_activation_bytes(cfg, lay, "dots") == e * tok * 10 * H / 8
    # full: the (sequence-split) layer input, 2 * 2048 * 12288 / 8
    assert mem.layer_activation_bytes(cfg, lay, "full") == e * tok * H / 8
    # none: outer (1 norm input + 1 shared input) * 2 / 8 = 0.5, inner (Q K V proj 4h + GeLU in + lin2 in 8h)
    # * 2 / 8 = 3, in units of tok * h bytes; plus the float32 log-sum-exp 4 * tok * 128 / 8
    assert mem.layer_activation_bytes(cfg, lay, "none") == pytest.approx(tok * H * 3.5 + 4 * tok * 128 / 8)


def test_state_memory_per_device_175b():
    # 96 layers x 12 h^2 (+ biases, norms) over t = 8, p = 8: one stage holds 12 layers; stage 0 also the
    # embedding (64000 x 12288 / 8) and positions (2048 x 12288, replicated over tensor).
    cfg = _cfg175()
    lay, opts, hw = _layout(cfg)
    stage = mem.stage_params(cfg, 64000, lay.axis_sizes())
    h, f = 12288, 4 * 12288
    # weights / 8, TP-split biases (q, k, v, mlp-in) / 8, replicated: one LayerNorm's scale + bias (parallel
    # block), the attention-output and MLP-output biases = 4h
    layer = (4 * h * h + 2 * h * f) // 8 + (3 * h + f) // 8 + 4 * h
    assert stage.layer_elements == layer
    assert stage.first_elements == 64000 * h // 8 + 2048 * h
    rep = mem.memory_report(cfg, lay, stage, hw.memory_bytes, 0.95)
    # msjax's pipelined step (msjax.parallel.pipeline): every stage holds both ends, so also the final norm's
    # scale and bias (2h, replicated), and no second copy of the tied embedding
    first = 12 * layer + stage.first_elements + 2 * h
    assert rep.params == 4 * first  # float32 parameters
    assert rep.optimizer == pytest.approx(8 * first / 192)  # two float32 moments, ZeRO over data = 192
    assert rep.grads == pytest.approx(2 * 4 * first / 192)  # float32 accumulators + optimizer input, ZeRO-2
    # the stash: V P + P + 1 = 6 x 8 + 8 + 1 = 57 slots of one chunk's residuals (12 / 6 = 2 layers, scanned),
    # remat none, flash attention, parallel block, bf16 (e = 2), b T = 2048 tokens, t = 8 with sequence
    # parallelism (memory.stash_layer_bytes): the LayerNorm's float32 input, bf16 output and float32 deviation
    # per token, split over t: 2048 (6 h + 4) / 8; Q, K, V and the attention output (4 h) and six MLP-width
    # tensors (6 x 4h) over t: 2 x 2048 x 28 h / 8; the float32 log-sum-exp of 128 / 8 heads: 4 x 2048 x 16;
    # and 6 carried activations of the tick loop, 2 b T h / t each
    per_layer = 2048 * (6 * h + 4) / 8 + 2 * 2048 * 28 * h / 8 + 4 * 2048 * 16
    assert rep.per_layer_activation == per_layer
    assert rep.activations == pytest.approx(57 * 2 * per_layer + 6 * 2 * 2048 * h / 8)


def test_megatron_state_bytes():
    # Megatron-LM mixed precision: bf16 params 2 + float32 grads 4 + float32 master and two moments 12 = 18 B
    lay, _, _ = _layout(_cfg175(), baseline="megatron")
    assert mem.state_bytes_per_element(_cfg175(), lay) == (2.0, 4.0, 12.0)


# ---------------------------------------------------------------------------------------------------------------
# The `sequence` axis: context parallelism with all-gathered K and V (sharding_rules act_seq / act_seq_inner).
# gpt_13b: h = 5120, 40 heads of K = 128, no GQA (G = 40), d_ff = 4h, T = 2048, serial block, bf16 (e = 2), fused
# attention, no dropout; 64 A100s as data x sequence x tensor = 4 x 2 x 8, microbatch b = 1.

H13, T13 = 5120, 2048


def _cfg13(sequence=2, tensor=8, remat="full"):
    return apply_overrides(load_preset("gpt_13b"), {"mesh.sequence": sequence, "mesh.tensor": tensor,
                                                     "model.remat": remat})


def _layout13(sequence=2, tensor=8, remat="full", devices=64):
    cfg = _cfg13(sequence, tensor, remat)
    lay, opts, hw = _layout(cfg, devices=devices, v=1, b=1, z=1)
    return cfg, lay, opts, hw


def test_chunk_attended_keys_hand_computed():
    # one chunk: the whole-sequence mean (T + 1) / 2
    assert timing.chunk_attended_keys(2048, None, 1) == 1024.5
    # two chunks: the last holds queries 1025..2048, which attend i keys each: mean (1025 + 2048) / 2
    assert timing.chunk_attended_keys(2048, None, 2) == 1536.5
    # four: queries 1537..2048, mean (1537 + 2048) / 2
    assert timing.chunk_attended_keys(2048, None, 4) == 1792.5
    # window 512: every query of the last half attends 512 keys
    assert timing.chunk_attended_keys(2048, 512, 2) == 512.0
    # window 1536: queries 1025..1536 attend i keys (mean 1280.5), 1537..2048 attend 1536: (1280.5 + 1536) / 2
    assert timing.chunk_attended_keys(2048, 1536, 2) == 1408.25


def test_sequence_axis_activation_memory_hand_computed():
    cfg, lay, _, _ = _layout13()
    tok, h, e = T13, H13, 2
    # K and V gathered over `sequence`: 2 x b x T x (G / t) x K x e = 2 * 2048 * 5 * 128 * 2 = 5 MiB per layer
    assert mem.gathered_kv_bytes(cfg, lay) == 2 * 2048 * 5 * 128 * 2 == 5 * MiB
    # none, in units of tok * h bytes (tok = b T = 2048 tokens):
    #   outside the TP regions, 2 norm inputs + 2 linear inputs at e = 2, / (t c) = 8 / 16:        0.5
    #   inside, e / t = 2 / 8 times (Q 1/2 + K 1 + V 1 + proj-in 1/2 + GeLU-in 4/2 + lin2-in 4/2):  1.75
    #   (K and V are the gathered whole-sequence copies, 2 * 2 / 8 = 0.5: the part c does not divide)
    #   plus the float32 log-sum-exp of the local T / c = 1024 queries x 40 / 8 heads:              4 * 1024 * 5
    none = tok * h * 2.25 + 4 * 1024 * 5
    assert mem.layer_activation_bytes(cfg, lay, "none") == none
    # c = 1 at the same t: 8 / 8 = 1 outside, 2 / 8 * 12 = 3 inside, log-sum-exp 4 * 2048 * 5: every term but
    # K and V halves (4 -> 2.25 = 4 / 2 + 0.5 / 2)
    _, lay1, _, _ = _layout13(sequence=1)
    assert mem.layer_activation_bytes(cfg, lay1, "none") == tok * h * 4 + 4 * 2048 * 5
    # dots_no_batch: x, proj out, lin2 out (3h) + the local Q, K, V (3h) and lin1 out (4h), all / (t c):
    # 2 * 10 / 16 = 1.25 (the gather is not a dot: local K and V are saved, the backward gathers again)
    assert mem.layer_activation_bytes(cfg, lay, "dots_no_batch") == tok * h * 1.25
    assert mem.layer_activation_bytes(cfg, lay, "dots") == tok * h * 1.25  # fused attention: no scores to keep
    # full: the layer input, split over (sequence, tensor): 2 / 16 = 0.125
    assert mem.layer_activation_bytes(cfg, lay, "full") == tok * h * 0.125
    # msjax's compiled step keeps more than Korthikanti's count without remat (mem.msjax_layer_activation_bytes,
    # scanned layers, serial block, flash): residual stream 8 x h / (t c) = 0.5, Q and attention output
    # 2 x h / (t c) = 0.125, K and V gathered whole over `sequence` 3 x h / t = 0.375, MLP 6 x 4h / (t c) = 1.5,
    # in units of e tok h, and the float32 log-sum-exp
    msjax_none = e * tok * h * (0.5 + 0.125 + 0.375 + 1.5) + 4 * 2048 * 40 / 16
    assert mem.msjax_layer_activation_bytes(cfg, lay) == msjax_none
    # working memory under full remat: that one layer recomputed; the float32 logits + their softmax of the local
    # 1024 tokens over 50304 / 8 vocabulary rows, and the logits gathered over `sequence` for the loss
    # (2048 tokens); the float32 gradient of the gathered embedding table (50304 x 5120); no FSDP buffers
    stage = mem.stage_params(cfg, lay.vocab, lay.axis_sizes())
    rep = mem.memory_report(cfg, lay, stage, 80 * 2**30, 0.95)
    assert rep.working == msjax_none + 2 * 4 * 1024 * 50304 / 8 + 4 * 2048 * 50304 / 8 + 4 * 50304 * 5120
    # stored: 40 layers x the (sequence, tensor)-split input 2 * 2048 * 5120 / 16, and the ends' residual stream
    # (embedding output and final norm input / output 2 x / 16, the output projection's gathered input 2 x / 2)
    assert rep.activations == 40 * tok * h * 0.125 + 2 * 2048 * 5120 * (2 / 16 + 2 / 2)


def test_sequence_axis_collectives_hand_computed():
    cfg, lay, _, hw = _layout13()
    plan = evaluate(cfg, PlanOptions(devices=64), hw, lay)
    colls = {c.name: c for c in plan.collectives}
    ag, rs = colls["SEQ all-gather (K, V)"], colls["SEQ reduce-scatter (dK, dV)"]
    # per step: 1024 / 4 replicas = 256 microbatches of b = 1, 40 layers; full remat gathers K and V in the forward
    # and again in the recompute: 2 * 40 * 256 = 20480 all-gathers, 40 * 256 = 10240 reduce-scatters
    assert (ag.calls, rs.calls) == (20480, 10240)
    # each of the 5 MiB K/V tensor: (c - 1) / c = 1/2 through each device's link
    assert ag.tensor_bytes == rs.tensor_bytes == 5 * MiB
    assert ag.volume_per_call == rs.volume_per_call == 2.5 * MiB
    # tensor = 8 fills a node, so the two members of a sequence group are in different nodes: the network, one
    # NIC per member at 25 GB/s x 0.8 efficiency; one ring step of 10 us latency
    assert ag.link.kind == "inter" and ag.link.bandwidth == 25e9 * 0.8
    assert ag.time_per_call == pytest.approx(2.5 * MiB / 20e9 + COLLECTIVE_LATENCY["inter"])
    assert ag.bytes_per_step == 20480 * 2.5 * MiB
    # TP collectives carry the residual stream's (sequence, tensor) chunk gathered over tensor: b (T / c) h e
    assert colls["TP all-gather"].tensor_bytes == 1024 * 5120 * 2
    # nothing hides them: exposed = 256 x 40 x (2 gathers + 1 reduce-scatter)
    assert plan.time.exposed["SEQ"] == pytest.approx(256 * 40 * (2 * ag.time_per_call + rs.time_per_call))
    assert plan.time.hidden["SEQ"] == 0.0
    # remat none saves the gathered copy: one gather per layer and microbatch
    cfg0, lay0, _, hw0 = _layout13(remat="none")
    colls0 = {c.name: c for c in evaluate(cfg0, PlanOptions(devices=64), hw0, lay0).collectives}
    assert colls0["SEQ all-gather (K, V)"].calls == 10240
    # tensor = 4 x sequence = 2 on 8 GPUs: the group sits inside one node (NVLink, 300 GB/s x 0.8)
    cfg8, lay8, _, hw8 = _layout13(tensor=4, devices=8)
    colls8 = {c.name: c for c in evaluate(cfg8, PlanOptions(devices=8), hw8, lay8).collectives}
    link = colls8["SEQ all-gather (K, V)"].link
    assert link.kind == "intra" and link.bandwidth == 300e9 * 0.8
    # K and V of 40 / 4 heads: twice the bytes of the tensor = 8 case
    assert colls8["SEQ all-gather (K, V)"].tensor_bytes == 10 * MiB
    # sequence = 1: no SEQ collective at all
    _, lay1, _, _ = _layout13(sequence=1)
    assert not [c for c in evaluate(_cfg13(sequence=1), PlanOptions(devices=64), hw, lay1).collectives
                if c.group == "SEQ"]


def test_sequence_axis_halves_per_token_compute_at_the_same_devices():
    # 64 GPUs either way: data 8 x tensor 8, or data 4 x sequence 2 x tensor 8.
    cfg1, lay1, opts, hw = _layout13(sequence=1)
    cfg2, lay2, _, _ = _layout13(sequence=2)
    rates = timing.Rates.of(hw, opts)
    lt1, lt2 = timing.layer_times(cfg1, lay1, rates), timing.layer_times(cfg2, lay2, rates)
    # per layer and microbatch of b = 1 sequence: GEMMs and elementwise work run on T / 2 tokens
    for k in lt1.gemm:
        assert lt2.gemm[k] == pytest.approx(lt1.gemm[k] / 2)
    assert lt2.elem == pytest.approx(lt1.elem / 2)
    # attention: half the queries, and the pacing member (the last chunk) attends 1536.5 keys per query instead of
    # the 1024.5 average: 1/2 x 1536.5 / 1024.5 = 0.75 of the c = 1 time
    assert lt2.attn == pytest.approx(lt1.attn / 2 * 1536.5 / 1024.5)

    # Per step, same per-device work per microbatch: c = 1 with b = 4 and c = 2 with b = 8 (8192 tokens per device,
    # 128 / 4 = 256 / 8 = 32 microbatches per replica), so the TP collectives are the same calls and bytes.
    lay1 = _layout(cfg1, devices=64, v=1, b=4, z=1)[0]
    lay2 = _layout(cfg2, devices=64, v=1, b=8, z=1)[0]
    p1, p2 = evaluate(cfg1, opts, hw, lay1), evaluate(cfg2, opts, hw, lay2)
    assert lay1.microbatches == lay2.microbatches == 32
    tp = lambda plan: [(c.calls, c.tensor_bytes) for c in plan.collectives if c.group == "TP"]  # noqa: E731
    assert tp(p1) == tp(p2)
    # compute differs by the imbalance only: 32 microbatches x 40 layers x attention (forward 1 + backward 2.5 +
    # full-remat recompute 1) x (1536.5 / 1024.5 - 1) of the b = 4, c = 1 attention time (= 4 x the b = 1 one)
    extra = 32 * 40 * (2 + FLASH_BACKWARD_FACTOR) * 4 * lt1.attn * (1536.5 / 1024.5 - 1)
    assert p2.time.compute == pytest.approx(p1.time.compute + extra)
    assert 0 < extra < 0.05 * p1.time.compute  # T = 2048: attention is a small share
    # model FLOPs per token do not change; the step grows by the imbalance and the exposed K/V traffic (the rest:
    # DP overlap window and the optimizer over 1/4 instead of 1/8 of the state, under 0.1%), so MFU drops
    assert p2.model_flops_per_token == p1.model_flops_per_token
    assert p2.time.step == pytest.approx(p1.time.step + extra + p2.time.exposed["SEQ"], rel=1e-3)
    assert p2.mfu < p1.mfu


def test_sequence_parallel_switch_is_megatron_only():
    with pytest.raises(PlanError, match=r"--sequence_parallel=false: the msjax train step always .*megatron"):
        make_plan(_cfg13(), PlanOptions(devices=64, sequence_parallel=False))
    plan = make_plan(_one_sequence_microbatches(_cfg13(), 64),
                     PlanOptions(devices=64, sequence_parallel=False, baseline="megatron", tune_microbatches=False,
                                 zero_stage=1))
    assert not plan.layout.sequence_parallel
    # without SP the residual stream is split over `sequence` only: the full-remat input is 2 tok h / 2
    assert plan.memory.per_layer_activation == 2 * T13 * H13 / 2


# ---------------------------------------------------------------------------------------------------------------
# Errors for impossible requests name the problem.


def test_more_stages_than_layers():
    cfg = apply_overrides(load_preset("gpt_tiny"), {"mesh.pipeline": 8})
    with pytest.raises(PlanError, match=r"mesh.pipeline=8 stages is more than model.num_layers=4"):
        make_plan(cfg, PlanOptions(devices=8))


def test_tensor_not_dividing_heads():
    cfg = apply_overrides(load_preset("gpt_tiny"), {"mesh.tensor": 4})  # 6 heads
    with pytest.raises(PlanError, match=r"model.num_heads=6 is not divisible by .*mesh.tensor=4"):
        make_plan(cfg, PlanOptions(devices=8))


def test_unknown_hardware():
    with pytest.raises(PlanError, match=r"unknown hardware 'x100'.*a100-80g"):
        make_plan(load_preset("gpt_tiny"), PlanOptions(devices=8, hardware="x100"))


def test_device_count_and_batch_errors():
    cfg = apply_overrides(load_preset("gpt175b"), {"mesh.tensor": 8, "mesh.pipeline": 8})
    with pytest.raises(PlanError, match=r"--devices=100 is not a multiple of .* = 64"):
        make_plan(cfg, PlanOptions(devices=100))
    with pytest.raises(PlanError, match=r"train.global_batch=6144 .* does not split over data x fsdp x expert = "
                                        r"5 x 1 x 1"):
        make_plan(apply_overrides(cfg, {"train.global_batch": 6144}), PlanOptions(devices=320))
    with pytest.raises(PlanError, match=r"pipeline.virtual_stages=5 does not divide the 12 layers"):
        make_plan(apply_overrides(cfg, {"pipeline.virtual_stages": 5}),
                  PlanOptions(devices=512, tune_virtual_stages=False))
    with pytest.raises(PlanError, match=r"--zero_stage=3: .*fsdp"):
        make_plan(cfg, PlanOptions(devices=512, zero_stage=3))


# ---------------------------------------------------------------------------------------------------------------
# Links, legality of the free knobs, search.


def test_links_follow_the_mesh_order():
    lay, _, hw = _layout(_cfg175())
    assert group_link(lay, ("tensor",), hw).kind == "intra"  # 8 contiguous GPUs: one node
    dp = group_link(lay, ("data",), hw)
    assert dp.kind == "inter" and dp.members_per_node == 1
    assert dp.bandwidth == pytest.approx(25e9 * hw.inter_link_efficiency)
    # a flat ring over 16 GPUs (two nodes, 8 per node): min(NVLink, 8 NICs)
    flat = dataclasses.replace(lay, pipeline=1, data=16, tensor=1)
    link = group_link(flat, ("data",), hw)
    assert link.members_per_node == 8
    assert link.bandwidth == pytest.approx(min(300e9 * hw.intra_link_efficiency, 8 * 25e9 * hw.inter_link_efficiency))


def test_legal_virtual_stages():
    # 12 layers per stage; interleaving needs m % p == 0
    assert legal_virtual_stages(96, 8, 32) == [1, 2, 3, 4, 6, 12]
    assert legal_virtual_stages(96, 8, 12) == [1]
    assert legal_virtual_stages(96, 1, 7) == [1]


def test_search_returns_only_layouts_that_divide_and_fit():
    cfg = apply_overrides(load_preset("gpt_1_3b"), {"train.global_batch": 64})
    opts = PlanOptions(devices=16, hardware="a100-40g")
    result = search(cfg, opts, workers=1)
    assert result.ranked, "nothing fits"
    m = cfg.model
    for c in result.ranked:
        p, d, f, ep, s, t = c.sizes  # every mesh axis; expert stays 1 for a dense model
        assert p * d * f * s * t == 16 and ep == 1
        assert m.num_layers % p == 0 and (m.num_layers // p) % c.virtual_stages == 0
        assert m.num_heads % t == 0 and m.ff_size % t == 0 and m.d_model % f == 0
        assert cfg.train.seq_len % s == 0
        per_replica = cfg.train.global_batch // (d * f)
        assert cfg.train.global_batch % (d * f) == 0 and per_replica % c.microbatch_size == 0
        micro = per_replica // c.microbatch_size
        assert c.virtual_stages == 1 or micro % p == 0
        assert c.memory <= opts.memory_fraction * hardware.lookup("a100-40g").memory_bytes
    assert [c.mfu for c in result.ranked] == sorted((c.mfu for c in result.ranked), reverse=True)
    # every rejection carries a reason, and a mesh that does not divide is among them with the planner's message
    assert all(c.reason for c in result.rejected)
    assert any("model.num_layers=24 is not divisible by mesh.pipeline=16" in c.reason for c in result.rejected)
    # the best candidate re-plans to the same prediction
    best = result.best_plan(cfg, opts)
    assert best.mfu == pytest.approx(result.ranked[0].mfu)


def test_search_rejects_what_cannot_fit():
    # 175B on 8 GPUs of 40 GB cannot hold even its parameters
    result = search(load_preset("gpt175b"), PlanOptions(devices=8, hardware="a100-40g"), workers=1)
    assert not result.ranked
    assert result.reason_counts().get("out of memory", 0) > 0


# ---------------------------------------------------------------------------------------------------------------
# Calibration, the baseline switch, published rows.


def test_calibration_row_reproduced():
    row = next(r for r in ROWS if r.role == "calibration")
    res = predict(row)
    assert res["step_s"] == pytest.approx(row.step_s, rel=0.01)  # 6.34 s, MegaScale Table 2
    assert res["plan"].tokens_per_second == pytest.approx(1984.0e3, rel=0.01)


def test_stored_constant_is_the_calibrated_one():
    # If the model's physics changes, re-run the calibration and update msjax.hardware.A100_MATMUL_EFFICIENCY.
    from msjax.planner.published import calibrate_matmul_efficiency

    assert calibrate_matmul_efficiency() == pytest.approx(hardware.A100_MATMUL_EFFICIENCY, abs=2e-3)


def test_megatron_baseline_is_slower_and_exposes_everything():
    row = next(r for r in ROWS if r.role == "calibration")
    ms = predict(row)["plan"]
    mg = predict(dataclasses.replace(row, system="megatron"))["plan"]
    assert mg.layout.block == "serial" and mg.layout.window is None
    assert not mg.options.overlap_tp and not mg.options.overlap_dp
    assert mg.time.contention == 0.0
    assert mg.time.exposed["TP"] == pytest.approx(mg.time.comm_total["TP"])
    # paper: 55.2% vs 41.2% (1.34x); the planner must at least order them and show a clear gap
    assert mg.mfu_paper < ms.mfu_paper * 0.9


def test_published_rows_within_fifteen_percent():
    for row in ROWS:
        res = predict(row)
        assert res["fits"], row.label
        assert res["predicted"] == pytest.approx(row.published, rel=0.15), row.label


def test_sliding_window_cuts_attention_time():
    cfg = apply_overrides(_one_sequence_microbatches(_cfg175(), 12288), {"pipeline.virtual_stages": 6})
    fixed = PlanOptions(devices=12288, tune_virtual_stages=False, tune_microbatches=False, zero_stage=2)
    full = make_plan(cfg, fixed)
    swa = make_plan(apply_overrides(cfg, {"model.attention.window": 512}), fixed)
    assert (full.layout.virtual_stages, full.layout.microbatch_size) == (6, 1)
    assert swa.time.step < full.time.step
    assert swa.model_flops_per_token < full.model_flops_per_token


# ---------------------------------------------------------------------------------------------------------------
# Hardware catalogue and command line.


def test_catalogue_entries_and_user_file(tmp_path):
    for name in ("a100-40g", "a100-80g", "h100", "h200", "b200", "tpu-v4", "tpu-v5e", "tpu-v5p"):
        hw = hardware.lookup(name)
        assert hw.peak_flops > 1e14 and hw.memory_bytes > 1e10 and hw.source
    assert hardware.for_device_kind("NVIDIA H100 80GB HBM3").name == "h100"
    assert hardware.for_device_kind("cpu") is None
    path = tmp_path / "hw.json"
    path.write_text(json.dumps([{"name": "my-gpu", "peak_flops": 5e14, "memory_bytes": 96e9, "hbm_bandwidth": 3e12,
                                 "intra_node_bandwidth": 4e11, "inter_node_bandwidth": 5e10,
                                 "devices_per_node": 8, "nics_per_node": 8}]))
    assert hardware.lookup("my-gpu", str(path)).matmul_efficiency == hardware.A100_MATMUL_EFFICIENCY
    plan = make_plan(load_preset("gpt_tiny"), PlanOptions(devices=8, hardware="my-gpu", hardware_file=str(path)))
    assert plan.hardware.name == "my-gpu"
    path.write_text(json.dumps([{"name": "bad", "peak_flops": 1}]))
    with pytest.raises(ValueError, match="missing fields"):
        hardware.load_catalogue(str(path))


def test_cli_parses_planner_and_config_flags(tmp_path):
    cfg, opts, actions = parse_plan_args(["--config=gpt175b", "--devices", "12288", "--hardware=h100",
                                          "--global_batch=6144", "--mesh.tensor=8", "--baseline", "megatron",
                                          "--search", "--top=5", "--model.remat", "none"])
    assert (cfg.train.global_batch, cfg.mesh.tensor, cfg.model.remat) == (6144, 8, "none")
    assert (opts.devices, opts.hardware, opts.baseline) == (12288, "h100", "megatron")
    assert actions["search"] and actions["top"] == 5
    with pytest.raises(ConfigError, match="unknown config key 'mesh.tensr'"):
        parse_plan_args(["--config=gpt_tiny", "--devices=8", "--mesh.tensr=2"])
    with pytest.raises(PlanError, match="--devices=N is required"):
        parse_plan_args(["--config=gpt_tiny"])
    out = tmp_path / "plan.json"
    result = run(["--config=gpt_tiny", "--devices=8", "--mesh.fsdp=8", f"--json={out}"], out=open("/dev/null", "w"))
    saved = json.loads(out.read_text())
    assert saved["plan"]["layout"]["fsdp"] == 8 and math.isfinite(saved["plan"]["throughput"]["mfu"])
    assert result["plan"]["memory"]["fits"]


def test_msjax_pipeline_prices_each_microbatch_once():
    # msjax.parallel.pipeline runs each chunk's forward and backward once per microbatch (plus only what the
    # remat policy recomputes, as on one device) and the output layer once, spread over the stages (1/P each).
    # Written out against the planner's own per-layer and output-layer times, for gpt175b at P = 8, V = 6.
    for remat in ("none", "dots_no_batch", "full"):
        cfg = _cfg175(**{"model.remat": remat})
        lay, opts, hw = _layout(cfg)
        rates = timing.Rates.of(hw, opts)
        lt, ot = timing.layer_times(cfg, lay, rates), timing.output_times(cfg, lay, rates)
        stage = mem.stage_params(cfg, lay.vocab, lay.axis_sizes())
        st = timing.step_time(cfg, lay, hw, opts, stage)
        layers, m, p = 96 // 8, lay.microbatches, 8
        assert st.parts["forward"] == pytest.approx(m * (layers * lt.fwd + ot.fwd / p), rel=1e-12)
        assert st.parts["backward"] == pytest.approx(m * (layers * lt.bwd + ot.bwd / p), rel=1e-12)
        assert st.parts["recompute"] == pytest.approx(m * layers * lt.recompute, rel=1e-12)
        assert (st.parts["recompute"] == 0.0) == (remat == "none")
        assert st.compute == pytest.approx(sum(st.parts.values()), rel=1e-12)
        # the hardware runs every stage's chunks in the bubble's busy ticks too: (V M + P - 1) / (V M) of them
        assert st.hw_flops_per_step == pytest.approx(m * layers * lt.hw_flops * (6 * m + 7) / (6 * m)
                                                     + m * ot.hw_flops / p)
        # the Megatron baseline's last stage runs the whole output layer and paces the pipeline
        mlay, mopts, _ = _layout(cfg, baseline="megatron", sequence_parallel=True)
        mst = timing.step_time(cfg, mlay, hw, mopts, stage)
        mrates = timing.Rates.of(hw, mopts.effective())
        mlt, mot = timing.layer_times(cfg, mlay, mrates), timing.output_times(cfg, mlay, mrates)
        assert mst.compute == pytest.approx(m * (layers * (mlt.fwd + mlt.bwd + mlt.recompute) + mot.fwd + mot.bwd),
                                            rel=1e-12)


def test_flagship_plan_prices_the_step_that_runs():
    """The flagship command with no other flag (gpt175b's own remat) at MegaScale's efficiency, and with
    model.remat=none nothing recomputed."""
    cfg, opts, _ = parse_plan_args(["--config=gpt175b", "--devices=12288", "--hardware=a100-80g",
                                    "--global_batch=6144", "--mesh.tensor=8", "--mesh.pipeline=8"])
    plan = make_plan(cfg, opts)
    assert plan.fits and plan.mfu >= 0.55, plan.mfu
    none = make_plan(apply_overrides(cfg, {"model.remat": "none"}), opts)
    assert none.fits and none.time.parts["recompute"] == 0.0 and none.mfu >= plan.mfu


def test_a_plan_that_does_not_fit_exits_3_and_gives_no_throughput(capsys):
    from msjax.planner.cli import EXIT_DOES_NOT_FIT, main

    assert main(["--config=gpt175b", "--devices=8", "--mesh.pipeline=1"]) == EXIT_DOES_NOT_FIT
    out = capsys.readouterr()
    assert "DOES NOT FIT" in out.out and "MFU" not in out.out and "tokens/s" not in out.out
    assert "none: this layout does not fit in memory" in out.out and "exit status 3" in out.err
    assert main(["--config=gpt175b", "--devices=8", "--hardware=a100-40g", "--search"]) == EXIT_DOES_NOT_FIT
    out = capsys.readouterr()
    assert "nothing fits" in out.out and "no layout fits" in out.err
    assert main(["--config=gpt_tiny", "--devices=8", "--mesh.fsdp=8"]) == 0
    # every memory row of msjax's pipelined step says what it holds
    plan = make_plan(apply_overrides(load_preset("gpt175b"), {"pipeline.virtual_stages": 6}),
                     PlanOptions(devices=12288, tune_virtual_stages=False))
    text = plan_text(plan)
    assert "gradients: float32 accumulators + the optimizer's input (2 x 4 B/param" in text
    assert "stash: 57 slots x 2 layers x 48.0 MiB (dots_no_batch, bfloat16) + carries" in text
    assert "total by remat policy (this layout): none " in text


# The layouts the presets' docstrings name (scripts/plan.py flags); each must fit with the preset's own settings.
PRESET_LAYOUTS = [
    ("gpt175b", "--devices=64 --mesh.tensor=8 --mesh.pipeline=8"),
    ("gpt175b", "--devices=12288 --global_batch=6144 --mesh.tensor=8 --mesh.pipeline=8"),
    *[("gpt530b", f"--devices={n} --global_batch={n} --mesh.tensor=8 --mesh.pipeline=35") for n in (2240, 4480, 11200)],
    ("llama3_70b", "--devices=512 --hardware=h100 --mesh.tensor=8 --mesh.pipeline=4"),
    *[(name, "--devices=64 --hardware=h100")  # the preset's own mesh: tensor 8 (qwen2_5_7b: 4, its 28 heads)
      for name in ("llama3_8b", "llama3_1_8b", "mistral_7b", "qwen2_5_7b", "qwen3_8b")],
]


@pytest.mark.parametrize("preset, flags", PRESET_LAYOUTS)
def test_presets_fit_the_layouts_their_docstrings_name(preset, flags, capsys):
    from msjax.configs import __path__ as configs_path
    from msjax.planner.cli import main

    doc = (Path(configs_path[0]) / f"{preset}.py").read_text()
    devices = flags.split()[0].split("=")[1]
    assert f"{int(devices):,}" in doc or devices in doc, f"{preset}'s docstring does not name {flags}"
    assert main([f"--config={preset}", *flags.split()]) == 0, capsys.readouterr()
    assert ": fits" in capsys.readouterr().out


def test_a_presets_remat_that_does_not_fit_is_raised_to_the_cheapest_that_does(capsys):
    """MegaScale's 530B layout under the interleaved schedule: the preset's remat (none) needs 79.4 GiB of the 76
    usable; the planner takes dots, the first policy in REMATS that fits, and says so. A policy the user sets is
    kept, and refused."""
    from msjax.planner.cli import EXIT_DOES_NOT_FIT, main

    flags = ["--config=gpt530b", "--devices=2240", "--hardware=a100-80g", "--global_batch=2240",
             "--mesh.tensor=8", "--mesh.pipeline=35", "--pipeline.schedule=interleaved"]
    assert load_preset("gpt530b").model.remat == "none"
    assert main(flags) == 0
    out = capsys.readouterr().out
    assert "auto       remat = dots (model.remat=none needs 79.4 of 76.0 GiB; dots is the cheapest policy that fits" \
        in out, out
    assert "--model.remat=dots" in out and "fits" in out and "remat dots," in out
    assert main([*flags, "--model.remat=none"]) == EXIT_DOES_NOT_FIT
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "auto       remat" not in out
    # a preset policy that fits is kept even where a cheaper one would not (gpt175b pins dots_no_batch)
    cfg, opts, _ = parse_plan_args(["--config=gpt175b", "--devices=64", "--mesh.tensor=8", "--mesh.pipeline=8"])
    plan = make_plan(cfg, opts)
    assert plan.fits and plan.layout.remat == "dots_no_batch" and "remat" not in plan.auto


# Llama's blocks: RoPE, RMSNorm, SwiGLU, grouped-query heads, no biases, untied output projection
_LLAMA = {"model.position": "rope", "model.norm": "rmsnorm", "model.mlp": "swiglu", "model.use_bias": False,
          "model.tie_embeddings": False, "model.num_kv_heads": 2}


@pytest.mark.parametrize("scan_layers, block, dtype, llama, matmul_dtype", [
    (True, "serial", "float32", False, "activations"), (True, "parallel", "bfloat16", False, "activations"),
    (False, "serial", "bfloat16", False, "activations"), (False, "parallel", "float32", False, "activations"),
    (True, "serial", "float32", True, "activations"), (False, "serial", "bfloat16", True, "activations"),
    (True, "serial", "float32", False, "bfloat16")])
def test_stash_bytes_are_the_steps_residuals(scan_layers, block, dtype, llama, matmul_dtype):
    """The planner's stash slot (`memory.stash_layer_bytes` x layers per chunk + `stash_entry_invariant_bytes`)
    is, to the byte, what the pipelined step's forward saves for its backward (`PipelinedGrads.stash_entry`,
    the residual pytree of the chunk's vjp), under every remat policy, for chunks of one layer (unrolled) and
    of two (a scan when layers are stacked), for GPT and Llama blocks. The weight matmuls run through
    msjax.ops.matmul's custom VJP here (float32 on XLA:CPU, and bf16-rounded operands anywhere), whose products
    the dots policies save by name: without that they would keep only the layer input, as under "full"."""
    import jax

    from msjax.config import Config
    from msjax.mesh import make_mesh
    from msjax.planner.preflight import cpu_hardware
    from msjax.train_step import build_train_program

    base = {"model.d_model": 48, "model.num_heads": 4, "model.d_ff": 80, "model.max_seq_len": 16,
            "train.seq_len": 16, "train.global_batch": 6, "mesh.data": 1, "model.vocab_size": 100,
            "mesh.pipeline": 2, "model.scan_layers": scan_layers, "model.block": block, "model.dtype": dtype,
            "model.matmul_dtype": matmul_dtype, **(_LLAMA if llama else {})}
    for remat, layers in [(r, 4) for r in ("none", "dots_no_batch", "dots", "full")] + [("none", 2)]:
        cfg = apply_overrides(Config(), {**base, "model.remat": remat, "model.num_layers": layers}).validate()
        program = build_train_program(cfg, make_mesh(cfg.mesh, jax.devices()[:2]))
        stash = sum(a.size * a.dtype.itemsize for a in program.pipeline.stash_entry(3))
        lay = make_layout(cfg, PlanOptions(devices=2), cpu_hardware(1e12), {**cfg.mesh.axis_sizes(), "data": 1}, 1,
                          3, 0, remat)
        chunk = layers // 2
        scanned = scan_layers and chunk > 1
        assert chunk * mem.stash_layer_bytes(cfg, lay, scanned) + mem.stash_entry_invariant_bytes(
            cfg, lay, scanned) == stash, (remat, layers)


@pytest.mark.parametrize("preset, params", [("llama3_8b", 8_030_261_248), ("llama3_1_8b", 8_030_261_248),
                                            ("llama3_70b", 70_553_706_496), ("qwen2_5_7b", 7_615_616_512),
                                            ("qwen3_8b", 8_190_735_360), ("mistral_7b", 7_241_732_096),
                                            ("gpt175b", 174_770_774_016)])
def test_parameter_inventory_is_the_models_own(preset, params):
    """The planner's parameters come from the model (`nnx.eval_shape`): Llama 3's, Qwen2.5 7B's, Qwen3 8B's and
    Mistral 7B's published totals (the Hugging Face checkpoints' parameter counts: no position table under RoPE, SwiGLU's gate, RMSNorm without offsets, an
    untied head), and GPT-3 175B by hand: 96 parallel blocks of 12 h^2 weights and 11 h of biases and LayerNorm
    (one per block), the 64,000-row token and 2048-row position tables, the final LayerNorm."""
    cfg = load_preset(preset)
    vocab = cfg.model.padded_vocab()
    assert mem.total_params(cfg, vocab) == params
    if preset == "gpt175b":
        h = 12288
        assert params == 96 * (12 * h * h + 11 * h) + (64000 + 2048) * h + 2 * h
    names = {leaf.name for leaf in mem.param_leaves(cfg.model, vocab)}
    llama = preset.startswith(("llama", "qwen", "mistral"))  # the Llama family
    assert ("wpe" in names) != llama and ("mlp.w_gate" in names) == llama and ("lm_head" in names) == llama
    assert ("ln1.bias" in names) != llama
    assert ("attn.bq" in names) == (preset in ("qwen2_5_7b", "gpt175b"))  # Qwen2's biases: on q, k and v alone
    assert ("attn.bo" in names) == (preset == "gpt175b")
    assert ("attn.q_norm.scale" in names) == (preset == "qwen3_8b")


def test_llama_timing_prices_three_mlp_matrices():
    """SwiGLU's MLP is three D x F matmuls: the planner's per-layer GEMM FLOPs are 2 x tokens x (the attention
    projections + 3 D F) / t, the model's own FLOP count (msjax.flops) per layer."""
    cfg = apply_overrides(load_preset("llama3_8b"), {"mesh.tensor": 8})
    plan = make_plan(cfg, PlanOptions(devices=8, hardware="h100"))
    lay, m = plan.layout, cfg.model
    rates = timing.Rates(1.0, 1.0, 1e30)  # one FLOP per second: times are FLOPs
    lt = timing.layer_times(cfg, lay, rates)
    tok = lay.microbatch_size * cfg.train.seq_len
    d, f, qw, kvw = m.d_model, m.ff_size, m.num_heads * m.head_size, m.kv_heads * m.head_size
    assert sum(lt.gemm.values()) == pytest.approx(2 * tok * (d * (2 * qw + 2 * kvw) + 3 * d * f) / 8)
    assert "position rope, norm rmsnorm, mlp swiglu" in plan_text(plan)


# A mixture of experts on the Llama block: 4 SwiGLU experts of width 24, top-2, a gated shared expert.
_MOE = {**_LLAMA, "model.moe.num_experts": 4, "model.moe.experts_per_token": 2, "model.moe.expert_ff": 24,
        "model.moe.shared_experts": 1, "model.moe.shared_gate": True}


@pytest.mark.parametrize("block", [{}, _LLAMA, _MOE], ids=["gpt", "llama", "moe"])
def test_planner_step_flops_are_the_executed_steps(block):
    """The planner's hardware FLOPs of a step (GEMMs, attention core, output layer; forward and backward, one
    device, no remat) equal the matmul FLOPs of the traced gradient (`msjax.flops.executed_matmul_flops`), for a
    GPT block, a Llama block and a mixture of experts (the router's D x E, the k active experts' grouped matmuls,
    counted by their real rows, the shared expert and its gate), less the one contraction the model's softmax
    backward adds per score row (2 B H T T per layer, element-wise work the planner prices as memory traffic).
    MFU's model FLOPs are the active parameters' (`msjax.flops.flops_per_token`)."""
    import jax
    import jax.numpy as jnp

    from msjax.config import Config
    from msjax.flops import executed_matmul_flops, flops_per_token
    from msjax.model import abstract_model, apply

    cfg = apply_overrides(Config(), {
        "model.num_layers": 3, "model.d_model": 32, "model.num_heads": 4, "model.d_ff": 48, "model.max_seq_len": 16,
        "model.vocab_size": 100, "model.attention.impl": "xla", "train.seq_len": 16, "train.global_batch": 4,
        "mesh.data": 1, **block}).validate()
    plan = make_plan(cfg, PlanOptions(devices=1, hardware="a100-80g"))
    assert plan.layout.remat == "none" and not plan.layout.flash
    graphdef, params, _ = abstract_model(dataclasses.replace(cfg.model, vocab_size=plan.layout.vocab))
    tokens = jax.ShapeDtypeStruct((4, 16), jnp.int32)

    def loss(p, t):
        return apply(graphdef, p, t).astype(jnp.float32).sum()

    executed = executed_matmul_flops(jax.grad(loss), params, tokens)
    softmax_rows = 2 * 4 * 4 * 16 * 16 * 3
    assert plan.time.hw_flops_per_step == pytest.approx(executed - softmax_rows, rel=1e-12)
    assert plan.model_flops_per_token == flops_per_token(cfg.model, 16, plan.layout.vocab)
    assert (plan.active_params < plan.total_params) == bool(cfg.model.moe.num_experts)


def test_zero2_rule_set_is_priced_as_zero2_not_fsdp():
    """mesh.rules=zero2 over an fsdp axis of F is ZeRO-2 (the rule set decides): one gradient reduce-scatter and one
    parameter all-gather per step, no per-layer weight gathers, the optimizer update on 1/F of the state. The
    planner prices it as the same ZeRO-2 over a data axis of F (the planner's own zero_stage=2), collective for
    collective, with the same step time."""
    base = {"mesh.tensor": 8, "train.global_batch": 64, "model.remat": "full"}
    rules_cfg = apply_overrides(load_preset("llama3_8b"), {**base, "mesh.rules": "zero2", "mesh.fsdp": 8,
                                                            "mesh.data": 1})
    data_cfg = apply_overrides(load_preset("llama3_8b"), {**base, "mesh.rules": "tp", "mesh.data": 8})
    rules = make_plan(_one_sequence_microbatches(rules_cfg, 64),
                      PlanOptions(devices=64, hardware="h100", zero_stage=0, tune_microbatches=False))
    data = make_plan(_one_sequence_microbatches(data_cfg, 64),
                     PlanOptions(devices=64, hardware="h100", zero_stage=2, tune_microbatches=False))
    assert not [c for c in rules.collectives if c.group == "FSDP"]

    def dp(plan):
        return sorted((c.op, c.size, c.tensor_bytes, c.calls, c.link.kind) for c in plan.collectives if c.group == "DP")

    assert dp(rules) == dp(data) and len(dp(rules)) == 2
    assert rules.time.optimizer == pytest.approx(data.time.optimizer, rel=1e-12)
    assert rules.time.step == pytest.approx(data.time.step, rel=1e-12)


def test_run_overrides_express_the_plan_in_the_config():
    """The planner's choices (mesh, interleaving, microbatches, ZeRO-2 over data, remat) come back as config keys:
    the flagship's config with them applied validates, and planning that config with nothing left to choose gives
    the same layout and step time; the report prints them as flags."""
    from msjax.planner.plan import run_overrides

    cfg = apply_overrides(load_preset("gpt175b"), {"train.global_batch": 6144})
    plan = make_plan(cfg, PlanOptions(devices=12288, hardware="a100-80g"))
    overrides, note = run_overrides(plan)
    assert note == "" and plan.layout.zero_stage >= 1
    assert overrides["mesh.rules"] == "zero2" and overrides["mesh.fsdp"] == 192 and overrides["mesh.data"] == 1
    run_cfg = apply_overrides(cfg, overrides).validate()
    # The config alone (no planner choice) plans the same step: the interleaving and microbatch are its keys.
    again = make_plan(run_cfg, PlanOptions(devices=12288, hardware="a100-80g", zero_stage=0,
                                           tune_virtual_stages=False, tune_microbatches=False))
    assert again.layout.virtual_stages == plan.layout.virtual_stages
    assert again.layout.microbatch_size == plan.layout.microbatch_size
    assert run_cfg.pipeline.microbatches == again.layout.microbatches == plan.layout.microbatches
    assert again.time.step == pytest.approx(plan.time.step, rel=1e-12) and again.mfu >= 0.55
    assert "run with   --mesh.pipeline=8 --mesh.data=1 --mesh.fsdp=192" in plan_text(plan)
    # ZeRO over data beside an FSDP axis has no rule set: said, and not pretended
    cfg = apply_overrides(load_preset("gpt_tiny"), {"mesh.fsdp": 2, "mesh.tensor": 2})
    plan = make_plan(cfg, PlanOptions(devices=8, hardware="a100-80g", zero_stage=1))
    overrides, note = run_overrides(plan)
    assert "has no rule set" in note and overrides["mesh.rules"] == "fsdp_tp" and overrides["mesh.data"] == 2


def test_plan_prints_a_schedule_grid_with_its_bubble(tmp_path, capsys):
    """`plan.py --schedule=NAME` prints the action table on the plan's stages and microbatches, and every
    schedule's bubble beside it (the closed forms the tables reach, tests/msjax/test_schedules.py)."""
    from msjax.parallel.schedules import ActionTable
    from msjax.planner.cli import main

    flags = ["--config=gpt_tiny", "--devices=8", "--mesh.pipeline=4", "--mesh.data=2", "--pipeline.microbatches=8",
             "--tune_microbatches=false", "--tune_virtual_stages=false"]
    assert main([*flags, "--schedule=zb-v", f"--json={tmp_path / 'plan.json'}"]) == 0
    out = capsys.readouterr().out
    want = ActionTable("zb-v", 4, 2, 8)
    assert want.text() in out and "idle 3 per stage" in out
    got = json.loads((tmp_path / "plan.json").read_text())["schedule"]
    assert got["ticks"] == want.ticks and got["bubble"] == pytest.approx(want.bubble)
    assert got["bubble_by_schedule"] == pytest.approx({"1f1b": 9 / 33, "interleaved": 9 / 33, "zb-h1": 3 / 27,
                                                       "zb-v": 3 / 51})
    assert main([*flags, "--schedule=zb-h2"]) == 2
    assert "--schedule=zb-h2: allowed are 1f1b, interleaved, zb-h1, zb-v" in capsys.readouterr().err
    assert main(["--config=gpt_tiny", "--devices=8", "--schedule=zb-h1"]) == 2
    assert "the plan has no pipeline stages" in capsys.readouterr().err


# Pipeline schedules: the planner prices each table as the step runs it and picks the fastest that fits.

@pytest.mark.parametrize("over", [{}, {"model.block": "parallel"}, _LLAMA, {**_LLAMA, "model.dtype": "bfloat16"}],
                         ids=["gpt", "parallel", "llama", "llama-bf16"])
def test_w_slot_bytes_are_the_steps_tap_pairs(over):
    """The planner's W slot (`memory.w_pair_layer_bytes` x layers per chunk) is, to the byte, what a table
    schedule's step keeps for a deferred weight-gradient pass (`TablePipelinedGrads.w_entry`: each weight
    matmul's (x, dy), an input shared with an earlier matmul kept once): GPT and parallel blocks (whose MLP
    reads attention's input), Llama (grouped-query K and V, SwiGLU's gate and up), float32 and bfloat16."""
    import jax

    from msjax.config import Config
    from msjax.mesh import make_mesh
    from msjax.planner.preflight import cpu_hardware
    from msjax.train_step import build_train_program

    base = {"model.d_model": 48, "model.num_heads": 4, "model.d_ff": 80, "model.max_seq_len": 16,
            "train.seq_len": 16, "train.global_batch": 6, "mesh.data": 1, "model.vocab_size": 100,
            "mesh.pipeline": 2, "model.num_layers": 4, "pipeline.schedule": "zb-h1", **over}
    cfg = apply_overrides(Config(), base).validate()
    program = build_train_program(cfg, make_mesh(cfg.mesh, jax.devices()[:2]))
    kept = sum(a.size * a.dtype.itemsize for a in program.pipeline.w_entry(3))
    lay = make_layout(cfg, PlanOptions(devices=2), cpu_hardware(1e12), {**cfg.mesh.axis_sizes(), "data": 1}, 1, 3,
                      0, "none", "zb-h1")
    assert 2 * mem.w_pair_layer_bytes(cfg, lay) == kept


@pytest.mark.parametrize("name, p, v, m", [("zb-h1", 4, 1, 8), ("zb-h1", 3, 1, 5), ("zb-v", 4, 2, 8),
                                           ("zb-v", 2, 2, 6), ("1f1b", 4, 1, 8)])
def test_flush_seconds_counts_a_tables_ticks_and_its_slowest_passes(name, p, v, m):
    """`zero_bubble.flush_seconds`, the planner's price of a table: never less than a stage's own passes, never
    more than every tick at the slowest pass; with equal passes the zero-bubble tables take exactly their ticks
    (some ring or the loss is in use every tick); and a longer B costs more than its own extra seconds, which a
    closed-form bubble would not show."""
    from msjax.parallel.zero_bubble import action_table, flush_seconds, tick_plan

    plan, table = tick_plan(name, p, v, m), action_table(name, p, v, m)
    assert v * m * 3 <= flush_seconds(plan, (1.0, 1.0, 1.0)) <= table.ticks
    if name.startswith("zb"):
        assert flush_seconds(plan, (1.0, 1.0, 1.0)) == table.ticks
    f, b, w = 1.0, 1.5, 0.75
    slow = flush_seconds(plan, (f, b, w), 0.25)
    assert v * m * (f + b + w) + m * 0.25 <= slow <= table.ticks * b + m * 0.25
    assert slow - flush_seconds(plan, (f, 1.0, w), 0.25) > v * m * 0.5  # each stage's own B grew by V M x 0.5


def test_flush_seconds_of_a_two_stage_1f1b_by_hand():
    """P = 2, M = 1, 1f1b, F 3 s, B 1 s, W 1 s, output layer 0.5 s. Stage 0's F ends at 3, the ring waits for it
    (stage 1 starts F at 3), stage 1's F ends at 6 and the output layer's tick at 6.5 on both; stage 1's B ends at
    7.5 (its ring waits stage 0 too), its W at 8.5; stage 0, idle in tick 3, runs B in tick 4 from 7.5 to 8.5 and W
    to 9.5. Without the ring's wait stage 1's F would start at 0 and the flush end at 6.5."""
    from msjax.parallel.zero_bubble import flush_seconds, tick_plan

    assert flush_seconds(tick_plan("1f1b", 2, 1, 1), (3.0, 1.0, 1.0), 0.5) == 9.5


def test_the_planner_prices_every_schedule_and_picks_the_fastest_that_fits(capsys):
    """With no --pipeline.schedule the planner prices each schedule's best layout, each under the remat rule (the
    config's policy, else the cheapest that fits), and takes the fastest that fits, saying why. On the flagship
    and on MegaScale's 530B layout that is the interleaved step (V = 12 and 3: its bubble is already small, and a
    table with V <= 2 pays for lock-stepped ticks of unequal F, B and W), though at 530B zb-h1's 1F1B stash fits
    without recomputation where the interleaved step needs dots. A schedule on the command line is kept."""
    from msjax.planner.cli import main

    cfg, opts, _ = parse_plan_args(["--config=gpt175b", "--devices=12288", "--hardware=a100-80g"])
    plan = make_plan(cfg, opts)
    assert plan.layout.schedule == "interleaved" and list(plan.schedules)[0] == "interleaved"
    assert set(plan.schedules) == {"interleaved", "1f1b", "zb-h1", "zb-v"}
    steps = [s["step"] for s in plan.schedules.values()]
    assert steps == sorted(steps) and plan.schedules["zb-v"]["virtual_stages"] == 2
    assert plan.auto["schedule"].startswith("interleaved (fastest that fits; best step by schedule: interleaved")
    assert "(interleaved; the best layout of each other schedule: zb-v" in plan_text(plan)
    flags = ["--config=gpt530b", "--devices=2240", "--hardware=a100-80g", "--global_batch=2240",
             "--mesh.tensor=8", "--mesh.pipeline=35"]
    assert main(flags) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "auto       schedule" in x)
    assert line.startswith("  auto       schedule = interleaved (fastest that fits; best step by schedule: "
                           "interleaved") and "remat dots; zb-h1" in line and "1f1b" in line, line
    assert "auto       remat = dots" in out and "--pipeline.schedule=interleaved" in out
    assert main([*flags, "--pipeline.schedule=zb-h1"]) == 0
    out = capsys.readouterr().out
    assert "auto       schedule" not in out and "zb-h1, run from its action table" in out and "remat none" in out
    assert "W: 36 slots x 3 layers" in out  # the table's own stash and W slots (P + 1 each on stage 0)


def test_a_table_schedule_is_priced_without_masked_passes():
    """The table step runs each pass once (no stage computes on stale data), so its hardware FLOPs are the model's
    own passes, where the interleaved step's include its bubble's masked passes; and its bubble is what its
    simulated flush adds to the passes."""
    cfg = apply_overrides(load_preset("gpt175b"), {"mesh.pipeline": 8, "mesh.tensor": 8, "mesh.data": 1})
    hw = get_hardware(PlanOptions(devices=64))
    sizes = {"pipeline": 8, "data": 1, "fsdp": 1, "sequence": 1, "tensor": 8}
    table = evaluate(cfg, PlanOptions(devices=64), hw, make_layout(cfg, PlanOptions(devices=64), hw, sizes, 1, 1, 0,
                                                                    "dots_no_batch", "zb-h1"))
    inter = evaluate(cfg, PlanOptions(devices=64), hw, make_layout(cfg, PlanOptions(devices=64), hw, sizes, 1, 1, 0,
                                                                    "dots_no_batch"))
    m, p = table.layout.microbatches, 8
    assert inter.time.hw_flops_per_step == pytest.approx(table.time.hw_flops_per_step * (m + p - 1) / m, rel=0.01)
    assert table.time.bubble > 0 and table.time.compute == pytest.approx(inter.time.compute, rel=1e-12)


def test_search_ranks_the_table_schedules_beside_the_interleaved_layouts(capsys):
    from msjax.planner.cli import main

    flags = ["--config=gpt530b", "--devices=2240", "--hardware=a100-80g", "--global_batch=2240", "--search",
             "--top=3"]
    assert main(flags) == 0
    out = capsys.readouterr().out
    best = out.split("best by pipeline schedule:")[1].split("rejected")[0]
    assert " zb-h1 " in best and " 1f1b " in best
    found = search(load_preset("gpt530b"), PlanOptions(devices=2240, hardware="a100-80g"))
    kinds = {c.schedule for c in found.ranked}
    assert {"interleaved", "zb-h1", "1f1b"} <= kinds
    assert [c.mfu for c in found.ranked] == sorted((c.mfu for c in found.ranked), reverse=True)
