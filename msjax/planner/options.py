"""Planner knobs the training config does not have, the error type, and the documented model constants.

`PlanOptions` holds what only the planner has: the device count and hardware, whether it chooses the pipeline's
interleaving and microbatch size or takes the config's, the ZeRO stage over `data`, Megatron sequence parallelism
for the megatron baseline, which overlaps to assume, efficiency overrides, and the `baseline` switch. Every value a
run also reads (mesh sizes, model, batch, remat policy, `pipeline.virtual_stages`, `pipeline.microbatches`,
`train.microbatches`) comes from the normal `Config`, its one source.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from msjax.config import ConfigError

BASELINES = ("msjax", "megatron")
# msjax's remat policies, least recompute (and most memory) first: `dots` saves every matmul output,
# `dots_no_batch` only those without batch dimensions (the weight matmuls), `full` only each block's input.
REMATS = ("none", "dots", "dots_no_batch", "full")


class PlanError(ConfigError):
    """A request the planner cannot lay out (the message names the knob and what is allowed).

    A ConfigError subclass, so scripts catch both the same way.
    """


@dataclass(frozen=True)
class PlanOptions:
    """Layout choices and model assumptions beyond `Config`.

    Attributes:
      devices: accelerators in the job.
      hardware: catalogue key (`msjax.hardware.CATALOGUE`) or a name from `hardware_file`.
      hardware_file: optional JSON with extra devices (`msjax.hardware.load_catalogue`).
      tune_virtual_stages: choose the interleaving (`pipeline.virtual_stages`: model chunks per pipeline stage,
        Narayanan et al. 2021 sec. 2.2.2) for the best predicted MFU; false takes the config's value.
      tune_microbatches: choose the microbatch size (sequences per microbatch per data-parallel replica; a run
        sets it with `pipeline.microbatches`, or `train.microbatches` without pipeline stages) for the best
        predicted MFU; false takes the config's: global_batch / (replicas x train.microbatches x M), M =
        pipeline.microbatches (0: mesh.pipeline) with pipeline stages, else 1. Without pipeline stages and with
        train.microbatches > 1 the config's is taken either way. A plan prints the flags that run its choices.
      zero_stage: what is sharded over the `data` axis (Rajbhandari et al. 2020): 0 nothing (what the msjax
        train step does), 1 optimizer state, 2 optimizer state and gradients. Sharding parameters too (ZeRO-3)
        is the `fsdp` mesh axis; the `zero2` rule set (`mesh.rules`) makes that axis ZeRO-2 instead, priced from
        the rule set, not from this option. -1 picks the smallest stage that fits.
      sequence_parallel: Megatron-SP (Korthikanti et al. 2022 sec. 4.2.2): between tensor-parallel regions the
        activations are split over the `tensor` axis along the sequence (all-gather / reduce-scatter instead of
        all-reduce; same bytes, 1/t of the activation memory). msjax always does this when tensor > 1 (its rule
        sets map `act_seq` to (sequence, tensor)), so the switch exists only for `--baseline=megatron`
        comparisons (Narayanan et al. 2021 ran without it); False with the msjax baseline is a PlanError.
      baseline: "msjax" models msjax's design (block type and window from the config, all overlaps below on);
        "megatron" models the Megatron-LM baseline of MegaScale's Table 2: no overlap, serial blocks, no
        sliding window (and its FlashAttention-1 kernels, mixed-precision optimizer state and dropout masks).
      overlap_tp: tensor-parallel collectives run as collective matmuls (MegaScale sec. 3.2, fig. 3; Wang et al.
        2023), hidden behind the GEMMs they feed.
      overlap_fsdp: FSDP / ZeRO parameter all-gathers are prefetched one layer (chunk) ahead.
      overlap_dp: data-parallel gradient reduce-scatter runs during the backward pass of later chunks.
      overlap_pp: pipeline send/recv is decoupled and asynchronous (MegaScale sec. 3.2, fig. 4).
      matmul_efficiency, attention_efficiency, hbm_efficiency: override the hardware's achievable fractions
        (0 keeps the default).
      memory_fraction: share of device memory the plan may use (the rest: allocator fragmentation, NCCL and
        cuBLAS workspaces). JAX preallocates 75% by default; set XLA_PYTHON_CLIENT_MEM_FRACTION to match.
      token_budget: tokens to train on for the "days to train" figure (MegaScale Table 2 uses 300B).
      stragglers: not modelled (MegaScale sec. 6.3 measured ~0.7% MFU from slow hosts); kept 0.
      moe_imbalance: a mixture of experts' load imbalance with expert parallelism (mesh.expert > 1): the
        assignments the busiest device's experts receive over the mean (>= 1). Dropless routing waits for that
        device, so its grouped-matmul time scales by this factor; the all-to-alls do not (their blocks are fixed
        size, `msjax.parallel.expert`), nor does a layer without expert parallelism (each device runs all E
        experts on its own T k assignments, however they fall). Default 1.25: the capacity factor Switch
        Transformer trains with (Fedus et al. 2022, sec. 2.2 and Table 1: 1.0 to 2.0, 1.25 the middle
        setting), i.e. what those systems provision for the busiest expert under an auxiliary load-balancing
        loss; Megatron-Core's dropless token dispatchers likewise pay the busiest rank's load. It is an
        assumption, not a measurement: msjax's `expert_load.jsonl` (every layer's per-expert fractions, written
        by a run) gives a run's own value.
    """

    devices: int = 8
    hardware: str = "a100-80g"
    hardware_file: str = ""
    tune_virtual_stages: bool = True
    tune_microbatches: bool = True
    zero_stage: int = -1
    sequence_parallel: bool = True
    baseline: Literal["msjax", "megatron"] = "msjax"
    overlap_tp: bool = True
    overlap_fsdp: bool = True
    overlap_dp: bool = True
    overlap_pp: bool = True
    matmul_efficiency: float = 0.0
    attention_efficiency: float = 0.0
    hbm_efficiency: float = 0.0
    memory_fraction: float = 0.95
    token_budget: float = 300e9
    moe_imbalance: float = 1.25

    def validate(self) -> "PlanOptions":
        """Range checks; returns self. Raises PlanError naming the option."""
        if self.devices < 1:
            raise PlanError(f"--devices={self.devices}: allowed is an integer >= 1")
        if self.zero_stage not in (-1, 0, 1, 2):
            raise PlanError(f"--zero_stage={self.zero_stage}: allowed is -1 (auto), 0, 1 or 2; ZeRO-3 is the "
                            "fsdp mesh axis (--mesh.fsdp=N)")
        if self.baseline not in BASELINES:
            raise PlanError(f"--baseline={self.baseline!r}: allowed is one of {', '.join(BASELINES)}")
        if not self.sequence_parallel and self.baseline == "msjax":
            raise PlanError("--sequence_parallel=false: the msjax train step always splits the residual stream's "
                            "sequence over `tensor` (Megatron-SP; sharding_rules maps act_seq to (sequence, "
                            "tensor)), so this switch only applies with --baseline=megatron")
        for name in ("matmul_efficiency", "attention_efficiency", "hbm_efficiency"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise PlanError(f"--{name}={value}: allowed is 0 < value <= 1 (0 keeps the default)")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise PlanError(f"--memory_fraction={self.memory_fraction}: allowed is 0 < value <= 1")
        if not (self.moe_imbalance >= 1.0 and self.moe_imbalance < float("inf")):
            raise PlanError(f"--moe_imbalance={self.moe_imbalance}: allowed is a finite number >= 1 (the busiest "
                            "expert-parallel device's assignments over the mean; 1: perfectly balanced)")
        if self.token_budget <= 0:
            raise PlanError(f"--token_budget={self.token_budget}: allowed is a positive number of tokens")
        return self

    def effective(self) -> "PlanOptions":
        """The options with the baseline switch applied (megatron: every overlap off)."""
        if self.baseline == "megatron":
            return dataclasses.replace(self, overlap_tp=False, overlap_fsdp=False, overlap_dp=False,
                                       overlap_pp=False)
        return self


# ---------------------------------------------------------------------------------------------------------------
# Model constants. Each is physical (a bandwidth fraction, a kernel efficiency, a byte count) and sourced; the one
# fitted number is the A100 GEMM efficiency in msjax.hardware (docs/planner.md, "Calibration").

# FlashAttention-2 (Dao 2023, abstract and fig. 5-6): 50-73% of A100 peak forward, lower backward; the causal
# kernels sit at the low end. Relative to peak FLOP/s, applied to attention-core FLOPs (QK^T and PV).
ATTENTION_EFFICIENCY = 0.5
# FlashAttention-1 (Dao et al. 2022) reaches "only 25-40% of the theoretical maximum FLOPs/s" on A100 (Dao 2023,
# sec. 1). The megatron baseline uses it: Megatron-LM of mid-2023 (MegaScale's commit 285068c8) called the
# FlashAttention-1 interface, and MegaScale sec. 3.3 lists FlashAttention-2 among its improvements over it.
ATTENTION_EFFICIENCY_FA1 = 0.3
# Streaming (memory-bound) kernels: fraction of datasheet HBM bandwidth reached. Assumed; bandwidthTest / STREAM
# style copies reach ~80-90% on A100 and H100.
HBM_EFFICIENCY = 0.8
# Per-collective software latency (NCCL launch + first hop), seconds. Assumed order of magnitude from
# nccl-tests small-message latencies; it only matters for many tiny collectives.
COLLECTIVE_LATENCY = {"intra": 5e-6, "inter": 10e-6}
# Bytes of HBM traffic per parameter for one optimizer step in float32 (read param, grad, m, v; write param, m,
# v = 7 x 4 bytes); LAMB reads the update and parameter once more for the layer norms (You et al. 2020, alg. 2).
OPTIMIZER_BYTES_PER_PARAM = {"adamw": 28, "lamb": 36}
# Compute that runs while a collective is overlapped with it is slowed down by contention for SMs, HBM bandwidth and
# power: 18.9% on average over GPT / LLaMA layers on A100, H100, MI250 (Lee et al. 2025, "Characterizing
# Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning", arXiv 2507.03114, abstract).
# Charged on the hidden communication time.
OVERLAP_SLOWDOWN = 0.189
# Attention backward does 2.5x the forward FLOPs in FlashAttention (it recomputes QK^T; Dao 2023 sec. 3.1.2),
# 2x for a plain (materialised) attention.
FLASH_BACKWARD_FACTOR = 2.5
