"""A plan's candidate layout: the mesh sizes, pipeline schedule and batch split of one plan, checked for legality.

Mesh axes are ordered outer to inner (pipeline, data, fsdp, sequence, tensor) as in `msjax.mesh`, and devices
are numbered in that row-major order, so the tensor axis is contiguous (inside a node) and the pipeline axis is
the most spread out (across nodes), as in Megatron-LM and MegaScale (sec. 2, "Combination of parallelism").

What each axis means to the planner (matching `sharding_rules` and `msjax.model`):
  tensor    Megatron TP (Shoeybi et al. 2019): heads, MLP width and vocabulary split. The residual stream between
            TP regions is split along the sequence over this axis too (Megatron-SP, Korthikanti et al. 2022):
            msjax always does so (`act_seq` -> (sequence, tensor)); `sequence_parallel` = False exists only for
            the megatron baseline.
  sequence  context parallelism with all-gathered keys and values (as Llama 3's, Dubey et al. 2024 sec.
            3.3.2): every per-token tensor is split along the sequence over this axis (`act_seq` and, inside the
            TP regions, `act_seq_inner`), so projections, MLP, norms and logits run on T/c tokens of the
            T-token sequence (c the axis size); attention all-gathers K and V over it (each member's queries
            attend the whole prefix) and reduce-scatters dK and dV in the backward. Chunks are contiguous, so
            the member holding the last chunk does the most causal attention work and paces the step.
            Parameters are replicated over it.
  fsdp      ZeRO-3 / FSDP: parameters, gradients and optimizer state split on `embed`; weights all-gathered
            before use, gradients reduce-scattered.
  expert    expert parallelism (GShard; `msjax.parallel.expert`): a mixture of experts' E experts split over it
            (E / ep per device), each token's k assignments sent to their experts' devices and back by two
            all-to-alls per MoE layer and pass; for every other layer one more data-parallel axis (the batch is
            split over data x fsdp x expert). Above 1 only for a mixture of experts, dividing its experts, and
            inside a node with sequence and tensor (`msjax.mesh.hybrid_shapes` never lets it span hosts).
  data      replicas; `zero_stage` 1/2 additionally shard optimizer state / gradients over it.
  pipeline  stages of L/p layers, each split into `virtual_stages` chunks (interleaved 1F1B).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from msjax.config import Config, ConfigError
from msjax.layout import check_model_split as check_run_split
from msjax.hardware import Hardware
from msjax.parallel.schedules import SCHEDULES, check as check_schedule
from msjax.planner.options import COLLECTIVE_LATENCY, PlanError, PlanOptions
from msjax.sharding_rules.axes import MESH_AXES
from msjax.sharding_rules.rules import OPTIMIZER_STATE_RULES

AXES = MESH_AXES
# Bytes per element of the config's dtype names.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
# The axes `--search` enumerates, in a candidate's `sizes` tuple (every mesh axis, in the mesh's order; `expert`
# stays 1 for a dense model).
SEARCH_AXES = AXES


def search_sizes(sizes_t: tuple[int, ...]) -> dict[str, int]:
    """Mesh axis sizes (every axis of AXES, in order) of a search candidate's SEARCH_AXES tuple."""
    found = dict(zip(SEARCH_AXES, sizes_t))
    return {a: found.get(a, 1) for a in AXES}


@dataclass(frozen=True)
class PlanLayout:
    """One candidate layout the planner prices (every size explicit): the mesh, schedule and batch split of
    `msjax.layout.Layout` plus the choices a plan searches over (remat, ZeRO stage, microbatch size) and the
    baseline it models. A run's own layout is `msjax.layout.Layout`; `make_layout` checks a candidate with the
    run's rules (`msjax.layout.check_model_split`).

    Attributes:
      pipeline, data, fsdp, sequence, tensor, expert: mesh axis sizes (their product is the device count).
      virtual_stages: model chunks per pipeline stage (1 = plain 1F1B).
      microbatch_size: sequences per microbatch per replica (b).
      microbatches: microbatches per step per replica (m).
      zero_stage: 0, 1 or 2 over the data axis.
      remat: msjax remat policy ("none", "dots_no_batch", "dots", "full").
      sequence_parallel: Megatron-SP over the tensor axis (always, when tensor > 1, for the msjax baseline).
      block: "serial" or "parallel" transformer block.
      window: sliding-window size or None.
      flash: attention runs as a fused (flash) kernel: no T x T scores in memory, masked blocks skipped.
      dropout: dropout masks are stored (Megatron's GPT recipe; the msjax model has no dropout).
      vocab: padded vocabulary rows.
      baseline: "msjax" or "megatron".
      schedule: the pipeline schedule (`pipeline.schedule`: "interleaved", or "1f1b", "zb-h1", "zb-v" run from
        their action tables, `msjax.parallel.zero_bubble`); "interleaved" without pipeline stages.
      dense_groups: a mixture of experts' grouped matmuls (`jax.lax.ragged_dot`) run as jax's fallback, one dense
        matmul per group over every row with the other groups' rows masked to zero (XLA:CPU; the compile check's
        backend), instead of a grouped GEMM over each group's rows (GPU and TPU, where jax emits the ragged-dot
        instruction); priced in memory (`memory.moe_layer_bytes`).
      moe_imbalance: `PlanOptions.moe_imbalance`, the busiest expert-parallel device's assignments over the mean.
    """

    pipeline: int
    data: int
    fsdp: int
    sequence: int
    tensor: int
    virtual_stages: int
    microbatch_size: int
    microbatches: int
    zero_stage: int
    remat: str
    sequence_parallel: bool
    block: str
    window: int | None
    flash: bool
    dropout: bool
    vocab: int
    baseline: str
    schedule: str = "interleaved"
    expert: int = 1
    dense_groups: bool = False
    moe_imbalance: float = 1.0

    @property
    def devices(self) -> int:
        return self.pipeline * self.data * self.fsdp * self.expert * self.sequence * self.tensor

    def axis_sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}

    def describe(self) -> str:
        sched = f" {self.schedule}" if self.schedule != "interleaved" else ""
        ep = f" ep={self.expert}" if self.expert > 1 else ""
        return (f"pp={self.pipeline}x{self.virtual_stages}v{sched} dp={self.data} fsdp={self.fsdp}{ep} "
                f"sp={self.sequence} tp={self.tensor} mb={self.microbatch_size}x{self.microbatches} "
                f"zero={self.zero_stage} remat={self.remat}")


@dataclass(frozen=True)
class Link:
    """The link a collective over a group of mesh axes runs on.

    Attributes:
      kind: "intra" (all members in one node: NVLink / ICI) or "inter" (crosses the network).
      bandwidth: achievable bus bandwidth per device, bytes/s (datasheet x link efficiency).
      latency: software + hop latency per ring step, seconds.
      members_per_node: members of one group that share a node.
    """

    kind: str
    bandwidth: float
    latency: float
    members_per_node: int


def group_link(layout: PlanLayout, axes: tuple[str, ...], hw: Hardware) -> Link:
    """See `_group_link` (cached on the axis sizes)."""
    return _group_link(tuple(getattr(layout, a) for a in AXES), axes, hw)


@functools.lru_cache(maxsize=65536)
def _group_link(sizes_t: tuple[int, ...], axes: tuple[str, ...], hw: Hardware) -> Link:
    """Which link a collective over `axes` uses, and its bus bandwidth per device.

    A group whose members all sit in one node runs at the intra-node bandwidth. A group spanning nodes is
    limited by the network: its k members inside one node each drive their own NIC (rail-optimised clusters,
    MegaScale sec. 3.6), so the bus bandwidth is min(intra, k x per-device network bandwidth) — the usual
    NCCL ring / tree result (k = 1 for a DP group with one GPU per node, k = 8 for a flat 8-GPU-per-node ring).
    """
    sizes = dict(zip(AXES, sizes_t))
    strides, stride = {}, 1
    for a in reversed(AXES):
        strides[a] = stride
        stride *= sizes[a]
    node = hw.devices_per_node
    size = math.prod(sizes[a] for a in axes)
    k = math.prod(min(sizes[a], max(1, node // strides[a])) for a in axes)
    intra = hw.intra_node_bandwidth * hw.intra_link_efficiency
    if k >= size:
        return Link("intra", intra, COLLECTIVE_LATENCY["intra"], size)
    inter = hw.inter_node_bandwidth * hw.inter_link_efficiency
    return Link("inter", min(intra, k * inter), COLLECTIVE_LATENCY["inter"], k)


def resolve_vocab(cfg: Config) -> int:
    """The padded vocabulary the model would use: model.vocab_size, else the tokenizer's size from the data
    config (bpe: data.bpe_vocab_size; byte: 256). Raises PlanError when it cannot be known."""
    m = cfg.model
    v = m.vocab_size
    if not v:
        if cfg.data.tokenizer == "bpe":
            v = cfg.data.bpe_vocab_size
        elif cfg.data.tokenizer == "byte":
            v = 256
        else:
            raise PlanError("model.vocab_size is 0 and the char tokenizer's size depends on the corpus; "
                            "set --model.vocab_size=N")
    return m.padded_vocab(v)


def mesh_sizes(cfg: Config, devices: int) -> dict[str, int]:
    """Axis sizes with data=-1 filled in for `devices`. Raises PlanError naming the mismatch."""
    sizes = cfg.mesh.axis_sizes()
    fixed = math.prod(v for k, v in sizes.items() if not (k == "data" and v == -1))
    if sizes["data"] == -1:
        if devices % fixed:
            raise PlanError(f"--devices={devices} is not a multiple of pipeline x fsdp x expert x sequence x tensor "
                            f"= {sizes['pipeline']} x {sizes['fsdp']} x {sizes['expert']} x {sizes['sequence']} x "
                            f"{sizes['tensor']} = {fixed}")
        sizes["data"] = devices // fixed
    total = math.prod(sizes.values())
    if total != devices:
        raise PlanError(f"mesh pipeline x data x fsdp x expert x sequence x tensor = {total} devices, but --devices="
                        f"{devices}; set the sizes to multiply to the device count (or --mesh.data=-1)")
    return sizes


def check_model_split(cfg: Config, sizes: dict[str, int], vocab: int) -> None:
    """Divisibility of the model over the mesh (`msjax.layout.check_model_split`, the run's own check). Raises
    PlanError naming the key that does not divide."""
    try:
        check_run_split(cfg, sizes, vocab)
    except ConfigError as e:
        raise PlanError(str(e)) from None


def check_expert_split(cfg: Config, sizes: dict[str, int], hw: Hardware) -> None:
    """The `expert` axis on this model and cluster: the config's own rules (`Config._check_moe`: a mixture of
    experts, experts that split evenly, not the zero2 rule set) for a mesh the search made up, and the
    mesh's: expert x sequence x tensor inside a node (`msjax.mesh.hybrid_shapes` keeps them off the network, so
    the all-to-alls run on NVLink / ICI). Raises PlanError naming the key and what is allowed."""
    ep, mo = sizes.get("expert", 1), cfg.model.moe
    if ep == 1:
        return
    if not mo.num_experts:
        raise PlanError(f"mesh.expert={ep}: an expert-parallel axis needs a mixture-of-experts model "
                        "(model.moe.num_experts > 0); allowed for a dense model: mesh.expert=1")
    if mo.num_experts % ep:
        raise PlanError(f"mesh.expert={ep} splits the model.moe.num_experts={mo.num_experts} experts unevenly; "
                        "allowed: a divisor of model.moe.num_experts")
    if cfg.mesh.rules == "zero2":
        raise PlanError(f"mesh.expert={ep} with mesh.rules=zero2: the ZeRO-2 reduction does not split experts; "
                        "allowed: mesh.rules=fsdp_tp, fsdp, tp or dp")
    inner = ep * sizes["sequence"] * sizes["tensor"]
    node = hw.devices_per_node
    # (a catalogue entry's node; `preflight.cpu_hardware`, which stands in for fake CPU devices and unknown kinds,
    # says 1 and is not checked)
    if node > 1 and math.prod(sizes.values()) > node and node % inner:
        raise PlanError(f"mesh.expert={ep} x mesh.sequence={sizes['sequence']} x mesh.tensor={sizes['tensor']} = "
                        f"{inner} devices does not fit a node of {node} ({hw.name}): expert, sequence and tensor "
                        f"stay inside a host (msjax.mesh); allowed: a product dividing {node}")


def zero2_over_fsdp(cfg: Config, layout: "PlanLayout") -> bool:
    """Whether the `fsdp` axis holds ZeRO-2, not ZeRO-3: a rule set whose gradients and optimizer state are laid
    out apart from its parameters (`sharding_rules.OPTIMIZER_STATE_RULES`, the `zero2` rule set) replicates the
    parameters over `fsdp` and shards the rest; the step then reduce-scatters the gradients and all-gathers the
    updated parameters once per step, with no per-layer gathers (the rule set decides, not a planner option)."""
    return layout.fsdp > 1 and cfg.mesh.rules in OPTIMIZER_STATE_RULES


def legal_virtual_stages(num_layers: int, pipeline: int, microbatches: int) -> list[int]:
    """Chunk counts v for interleaved 1F1B: v divides the layers per stage, and (v > 1) the microbatch count is
    a multiple of the stage count (Megatron-LM's requirement for the interleaved schedule)."""
    per_stage = num_layers // pipeline
    if pipeline == 1:
        return [1]
    return [v for v in range(1, per_stage + 1)
            if per_stage % v == 0 and (v == 1 or microbatches % pipeline == 0)]


def replica_batch(cfg: Config, sizes: dict[str, int]) -> int:
    """Sequences per step per (data x fsdp x expert) replica. Raises PlanError when the batch does not split."""
    g, r = cfg.train.global_batch, sizes["data"] * sizes["fsdp"] * sizes.get("expert", 1)
    if g % r:
        raise PlanError(f"train.global_batch={g} (--global_batch) does not split over data x fsdp x expert = "
                        f"{sizes['data']} x {sizes['fsdp']} x {sizes.get('expert', 1)} = {r} replicas")
    return g // r


def config_microbatch_size(cfg: Config, sizes: dict[str, int]) -> int:
    """The microbatch the training config runs on this mesh: global_batch / (replicas x train.microbatches x M),
    M = `pipeline.microbatches` (0: mesh.pipeline, as the train step reads it) with pipeline stages, else 1.
    Raises PlanError when that does not divide."""
    per_replica = replica_batch(cfg, sizes)
    m = cfg.pipeline_microbatches(sizes["pipeline"])
    if per_replica % (cfg.train.microbatches * m):
        what = f"train.microbatches={cfg.train.microbatches}" + (
            f" x pipeline.microbatches={m}" if sizes["pipeline"] > 1 else "")
        raise PlanError(f"{what} does not divide the {per_replica} sequences each replica gets per step")
    return per_replica // (cfg.train.microbatches * m)


def attention_is_flash(cfg: Config, hw: Hardware) -> bool:
    """Whether `model.attention.impl` resolves to a fused kernel on this hardware (msjax.ops.attention):
    pallas and cudnn are fused; auto is cudnn on GPU for 16-bit inputs, pallas on TPU and xla on CPU
    (`resolve_impl`); xla materialises the T x T scores."""
    impl = cfg.model.attention.impl
    if impl == "auto":
        if hw.name.startswith("tpu"):
            return True
        if hw.name == "cpu":  # msjax.ops.attention.resolve_impl: the xla path on CPU (Pallas only interprets)
            return False
        return cfg.model.dtype == "bfloat16"
    return impl in ("pallas", "cudnn")


def schedule_choices(cfg: Config, opts: PlanOptions, pipeline: int, fixed: bool) -> list[str]:
    """Pipeline schedules a plan may take: `pipeline.schedule` when the user set it (`fixed`), else every one the
    step runs on this layout (the table schedules tap each weight matmul, which the collective matmul computes
    its own way, and the megatron baseline is interleaved 1F1B only)."""
    if pipeline == 1:
        return ["interleaved"]
    if fixed:
        return [cfg.pipeline.schedule]
    if opts.baseline == "megatron" or cfg.mesh.tp_overlap == "collective_matmul":
        return ["interleaved"]
    return list(SCHEDULES)


def schedule_virtual_stages(schedule: str, legal: list[int]) -> list[int]:
    """The chunk counts `schedule` runs among the `legal` interleavings: all of them for interleaved 1F1B, one
    for 1f1b and zb-h1, two for zb-v (`msjax.parallel.schedules.check`)."""
    fixed = {"1f1b": 1, "zb-h1": 1, "zb-v": 2}.get(schedule)
    return legal if fixed is None else [v for v in legal if v == fixed]


def make_layout(cfg: Config, opts: PlanOptions, hw: Hardware, sizes: dict[str, int], virtual_stages: int,
                microbatch_size: int, zero_stage: int, remat: str, schedule: str = "interleaved") -> PlanLayout:
    """A checked PlanLayout for explicit choices. Raises PlanError naming what does not divide."""
    vocab = resolve_vocab(cfg)
    check_model_split(cfg, sizes, vocab)
    check_expert_split(cfg, sizes, hw)
    per_replica = replica_batch(cfg, sizes)
    if per_replica % microbatch_size:
        raise PlanError(f"microbatch size {microbatch_size} does not divide the {per_replica} sequences per "
                        f"replica (train.global_batch={cfg.train.global_batch} over data x fsdp x expert = "
                        f"{sizes['data'] * sizes['fsdp'] * sizes.get('expert', 1)})")
    m = per_replica // microbatch_size
    p, L = sizes["pipeline"], cfg.model.num_layers
    if (L // p) % virtual_stages:
        raise PlanError(f"pipeline.virtual_stages={virtual_stages} does not divide the {L // p} layers per "
                        "pipeline stage")
    if virtual_stages > 1 and p == 1:
        raise PlanError(f"pipeline.virtual_stages={virtual_stages} needs pipeline parallelism (mesh.pipeline > 1)")
    if virtual_stages > 1 and m % p and schedule == "interleaved":
        raise PlanError(f"interleaved 1F1B (pipeline.virtual_stages={virtual_stages}) needs the {m} microbatches "
                        f"per step to be a multiple of mesh.pipeline={p}")
    if schedule != "interleaved":
        if p == 1:
            raise PlanError(f"pipeline.schedule={schedule} needs pipeline parallelism (mesh.pipeline > 1)")
        try:
            check_schedule(schedule, p, virtual_stages, m)
        except ValueError as err:
            raise PlanError(str(err)) from None
    t = sizes["tensor"]
    sp = opts.sequence_parallel and t > 1
    if sp and (cfg.train.seq_len // sizes["sequence"]) % t:
        how = ("(or --sequence_parallel=false)" if opts.baseline == "megatron" else
               "(msjax always splits the residual stream over tensor)")
        raise PlanError(f"sequence parallelism splits the {cfg.train.seq_len // sizes['sequence']}-token "
                        f"sequence over mesh.tensor={t}; it does not divide {how}")
    megatron = opts.baseline == "megatron"
    return PlanLayout(
        pipeline=p, data=sizes["data"], fsdp=sizes["fsdp"], expert=sizes.get("expert", 1), sequence=sizes["sequence"],
        tensor=t,
        virtual_stages=virtual_stages, microbatch_size=microbatch_size, microbatches=m, zero_stage=zero_stage,
        remat=remat, sequence_parallel=sp, block="serial" if megatron else cfg.model.block,
        window=None if megatron else cfg.model.attention.window, flash=attention_is_flash(cfg, hw),
        dropout=megatron, vocab=vocab, baseline=opts.baseline, schedule=schedule,
        dense_groups=hw.name == "cpu", moe_imbalance=opts.moe_imbalance,
    )


def fast_replace(layout: PlanLayout, **changes) -> PlanLayout:
    """dataclasses.replace without re-running __init__ (the search makes ~10^6 variants of checked layouts;
    only fields that need no re-checking may be changed this way: remat, zero_stage, and a microbatch size /
    virtual-stage count that the caller took from the legal lists)."""
    new = object.__new__(PlanLayout)
    new.__dict__.update(layout.__dict__)
    new.__dict__.update(changes)
    return new
