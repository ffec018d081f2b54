"""Per-device memory: parameters, gradients, optimizer state and activations.

Parameters are read from the model itself (`param_leaves`: `nnx.eval_shape` of `msjax.model.GPT`, nothing
allocated), leaf by leaf with their logical axis names, and split by the same rule set (`sharding_rules`), so the
analytic state bytes can be compared exactly with what XLA allocates (`msjax.planner.compile_check`).

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"),
sec. 4: bytes stored per transformer layer per microbatch, with s sequence length, b microbatch size, h hidden
size, a heads, t tensor-parallel size, 16-bit activations and 1-byte dropout masks:
    no parallelism (eq. 1):              s b h (34 + 5 a s / h)
    tensor parallelism (eq. 2):          s b h (10 + 24 / t + 5 a s / (h t))
    tensor + sequence parallelism (eq. 4): s b h / t (34 + 5 a s / h)
    selective recomputation (eq. 6):     s b h 34 / t          (attention core recomputed)
    full recomputation (sec. 4.3):       2 s b h               (layer input only)
and pipeline parallelism makes the first stage hold L layers' worth (1F1B: p microbatches of L/p layers),
times (1 + (p - 1) / (p v)) with v interleaved chunks (sec. 4.2.3). `korthikanti_layer_bytes` is that
per-layer count, generalised (component by component) to any MLP width, grouped-query heads, parallel blocks,
no dropout and fused (flash) attention; `layer_activation_bytes` maps msjax's remat policies onto it.

The `sequence` mesh axis (context parallelism, size c) divides every per-token activation by c, inside and
outside the TP regions, except the keys and values: attention all-gathers them over the axis, so each device
holds the whole sequence's K and V for its heads, 2 b T (G / t) K elements per layer and microbatch
(`gathered_kv_bytes`). Without remat autodiff saves that gathered copy for the backward (it is the attention's
input); under every remat policy only the local T/c projection outputs (dots policies) or the layer input (full)
are saved and the backward gathers K and V again, so the full-length copy is part of the working memory of the
layer being recomputed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

from msjax.config import Config, ModelConfig
from msjax.sharding_rules import RULE_SETS, logical_to_mesh_spec
from msjax.sharding_rules import axes as ax
from msjax.sharding_rules.rules import OPTIMIZER_STATE_RULES

from msjax.planner import moe
from msjax.planner.layout import DTYPE_BYTES, PlanLayout


# ---------------------------------------------------------------------------------------------------------------
# Parameter inventory: read from the model itself.


@dataclass(frozen=True)
class ParamLeaf:
    """One parameter array. `per_layer` leaves are stacked L times (leading `layers` axis, replicated)."""

    name: str
    shape: tuple[int, ...]
    names: tuple[str, ...]
    per_layer: bool
    where: str  # "first" (embedding end), "layers", "last" (output end); decides the pipeline stage

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@functools.lru_cache(maxsize=256)
def param_leaves(model_cfg, vocab: int) -> tuple[ParamLeaf, ...]:
    """Every parameter of `msjax.model.GPT` for this config, one entry per leaf (layer leaves unstacked).

    Derived from the model, not listed by hand: `msjax.model.abstract_model` (`nnx.eval_shape`, nothing
    allocated) of the config with scanned layers, so every layer leaf appears once with a leading `layers` axis,
    which is dropped here. Shapes and logical axis names are the model's own, so a learned position table exists
    only for `position=learned`, SwiGLU brings its gate, RMSNorm has no offset, and a tied model has no
    `lm_head`. Where a leaf lives: the layers' leaves on their stage; a table the embedding indexes by its first
    axis (`vocab` or `position` rows) at the embedding end; every other leaf (final norm, untied output
    projection) at the output end.

    Args:
      model_cfg: `msjax.config.ModelConfig`.
      vocab: padded vocabulary rows (`layout.resolve_vocab`).
    Returns:
      a tuple of ParamLeaf (cached per config and vocabulary: the search plans many layouts of one model).
    """
    import jax

    from msjax.model import abstract_model

    m = dataclasses.replace(model_cfg, vocab_size=vocab, scan_layers=True)
    _, params, specs = abstract_model(m)
    spec_of = dict(jax.tree_util.tree_flatten_with_path(
        specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[0])
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        names = tuple(spec_of[path])
        if names and names[0] == ax.LAYERS:
            out.append(ParamLeaf(".".join(keys[1:]), tuple(leaf.shape[1:]), names[1:], True, "layers"))
        else:
            where = "first" if names and names[0] in (ax.VOCAB, ax.POSITION) else "last"
            out.append(ParamLeaf(".".join(keys), tuple(leaf.shape), names, False, where))
    return tuple(out)


def shard_elements(leaf: ParamLeaf, rules_name: str, sizes: dict[str, int]) -> int:
    """Elements of one (unstacked) leaf held per device under the rule set (ceil per sharded dimension)."""
    spec = logical_to_mesh_spec(leaf.names, RULE_SETS[rules_name])
    n = 1
    for dim, entry in zip(leaf.shape, tuple(spec) + (None,) * (len(leaf.shape) - len(spec))):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        n *= -(-dim // math.prod(sizes[a] for a in axes))
    return n


def local_expert_elements(cfg: Config, layout: PlanLayout) -> float:
    """Elements of one MoE layer's expert weights a device computes with (its E / ep experts, their width split
    over tensor, gathered over fsdp): the (E, D, F) and (E, F, D) leaves over expert x tensor. 0 when dense."""
    leaves = param_leaves(cfg.model, layout.vocab)
    return sum(leaf.size for leaf in leaves if leaf.per_layer and leaf.names[:1] == (ax.EXP,)) / (
        layout.expert * layout.tensor)


@dataclass(frozen=True)
class StageParams:
    """Parameter elements held per device on one pipeline stage (before ZeRO over `data`).

    layer_elements: per device, one transformer layer. first_elements / last_elements: the embedding-end and
    output-end leaves (on stage 0 and stage p-1; a tied embedding is on both, as in Megatron-LM).
    """

    layer_elements: int
    first_elements: int
    last_elements: int
    layer_total: int  # unsharded elements of one layer
    embed_total: int  # unsharded elements of the token embedding
    layer_gathered: float = 0.0  # elements of one layer a device holds after FSDP's all-gather, before tensor's split

    @property
    def gathered(self) -> float:
        """Elements of one layer per tensor rank after FSDP's all-gather (the FSDP gather volumes and buffers):
        `layer_total` / t, or for a mixture of experts the device's own experts only (`layer_gathered`)."""
        return self.layer_gathered or self.layer_total


def stage_params(cfg: Config, vocab: int, sizes: dict[str, int]) -> StageParams:
    leaves = param_leaves(cfg.model, vocab)
    rules = cfg.mesh.rules
    per = {w: sum(shard_elements(l, rules, sizes) for l in leaves if l.where == w) for w in ("first", "layers",
                                                                                              "last")}
    if cfg.model.tie_embeddings:  # the output projection reuses wte: Megatron keeps a copy on the last stage
        wte = next(l for l in leaves if l.name == "wte")
        per["last"] += shard_elements(wte, rules, sizes) if sizes["pipeline"] > 1 else 0
    gathered = 0.0
    if cfg.model.moe.num_experts:  # each device gathers only its E / ep experts over fsdp
        gathered = sum(l.size / (sizes.get("expert", 1) if l.names[:1] == (ax.EXP,) else 1)
                       for l in leaves if l.where == "layers")
    return StageParams(per["layers"], per["first"], per["last"],
                       sum(l.size for l in leaves if l.where == "layers"), vocab * cfg.model.d_model, gathered)


def total_params(cfg: Config, vocab: int) -> int:
    """All parameters of the model (unsharded), tied embedding counted once."""
    return sum(l.size * (cfg.model.num_layers if l.per_layer else 1) for l in param_leaves(cfg.model, vocab))


def active_params(cfg: Config, vocab: int) -> int:
    """Parameters a token uses (the published "active" count of a mixture of experts): `total_params` less, in
    each MoE layer, the experts it is not routed to (E - k of every (E, ...) expert weight); the total for a dense
    model."""
    mo = cfg.model.moe
    if not mo.num_experts:
        return total_params(cfg, vocab)
    per_expert = sum(l.size // mo.num_experts for l in param_leaves(cfg.model, vocab)
                     if l.per_layer and l.names[:1] == (ax.EXP,))  # the experts' weights, not the router's
    moe_layers = sum(mo.is_moe_layer(i) for i in range(cfg.model.num_layers))
    return total_params(cfg, vocab) - moe_layers * (mo.num_experts - mo.experts_per_token) * per_expert


def analytic_state_bytes(cfg: Config, vocab: int, sizes: dict[str, int]) -> dict[str, int]:
    """Per-device bytes of the msjax train state as `msjax.train_step` lays it out: params, optimizer moments
    (2 per parameter, in the parameter dtype, sharded like it, or over fsdp too under the `zero2` rule set), and
    the replicated scalars (step int32, rng uint32[2], four int32 optimizer counters: Adam's, the schedule's and
    `optax.apply_if_finite`'s two, and its `last_finite` bool, which is state though the compiled step never reads
    it). With pipeline stages, stacked layers are split over `pipeline` (L / p per device,
    `msjax.layout.pipeline_rules`); per-layer parameters and the embedding / output end are replicated over it.
    """
    pb = DTYPE_BYTES[cfg.model.param_dtype]
    L = cfg.model.num_layers
    if sizes.get("pipeline", 1) > 1 and cfg.model.scan_layers:
        L = L // sizes["pipeline"]
    params = sum(shard_elements(l, cfg.mesh.rules, sizes) * (L if l.per_layer else 1)
                 for l in param_leaves(cfg.model, vocab)) * pb
    # the moments follow the optimizer-state rules: the parameters' own, or fsdp-sharded under `zero2`
    opt_rules = OPTIMIZER_STATE_RULES.get(cfg.mesh.rules, cfg.mesh.rules)
    moments = sum(shard_elements(l, opt_rules, sizes) * (L if l.per_layer else 1)
                  for l in param_leaves(cfg.model, vocab)) * pb
    opt_state = 2 * moments + 4 * 4 + 1
    scalars = 4 + 8
    return {"params": params, "opt_state": opt_state, "scalars": scalars, "total": params + opt_state + scalars}


# ---------------------------------------------------------------------------------------------------------------
# Activations.


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            recompute: str = "none", *, ffn: int | None = None, q_width: int | None = None,
                            kv_width: int | None = None, dropout: bool = True, flash: bool = False,
                            parallel_block: bool = False, act_bytes: int = 2, kv_len: int | None = None,
                            seq_split: int = 1, gated: bool = False) -> float:
    """Bytes of activations one transformer layer stores for one microbatch (Korthikanti et al. 2022 sec. 4).

    With the defaults (ffn=4h, q/kv width h, dropout, no flash, serial block, 16-bit) this is exactly the
    paper's equations listed in the module docstring. Components (16-bit case, units of s*b*h bytes):
      attention: QKV input 2 | Q, K 4 | softmax output 2as/h | softmax dropout mask as/h | dropout output
                 2as/h | V 2 | output-projection input 2 | dropout mask 1
      MLP:       first linear input 2 | GeLU input 8 | second linear input 8 | dropout mask 1
      norms:     2 per LayerNorm input (two per serial block)
    Terms inside the TP regions (Q, K, V, scores, proj input, GeLU/linear-2 inputs) divide by t; the rest
    (norm inputs, linear inputs, dropout masks) divide by t only with sequence parallelism.

    Args:
      s, b, h, a: sequence length, microbatch size, hidden size, heads.
      t, sp: tensor-parallel size and Megatron sequence parallelism.
      recompute: "none", "selective" (attention core recomputed, eq. 6) or "full" (layer input only).
      ffn, q_width, kv_width: MLP width (4h), query width a*k (h), key/value width g*k (h) for GQA.
      dropout: store dropout masks and the dropped-out scores (the paper's GPT); False for msjax's model.
      flash: fused attention (no s x s scores; keeps a float32 log-sum-exp per query and head instead).
      parallel_block: one LayerNorm whose output feeds both the attention and the MLP (stored once).
      act_bytes: bytes per activation element (2 for bf16/fp16, 4 for float32).
      kv_len: keys per query held in the scores (default s).
      seq_split: context parallelism (the `sequence` mesh axis): every per-token tensor is split over this many
        devices, except K and V, which attention gathers whole (see the module docstring).
      gated: a gated MLP (SwiGLU): the gate and up projections' outputs are kept where GeLU keeps its input,
        three ffn-wide tensors in all instead of two.
    Returns:
      bytes per layer per microbatch on one device (float).
    """
    ffn = 4 * h if ffn is None else ffn
    q_width = h if q_width is None else q_width
    kv_width = h if kv_width is None else kv_width
    kv_len = s if kv_len is None else kv_len
    e = act_bytes
    tok = s * b
    mask = 1.0 if dropout else 0.0
    if recompute == "full":
        return e * tok * h / ((t if sp else 1) * seq_split)
    c = seq_split
    # Outside the TP regions: norm inputs, the (shared) input of QKV / linear-1, dropout masks.
    n_norm = 1 if parallel_block else 2
    shared_inputs = 1 if parallel_block else 2
    outer = tok * h * (e * n_norm + e * shared_inputs + 2 * mask) / ((t if sp else 1) * c)
    # Inside the TP regions (split over t, and over c except the gathered K and V).
    inner = tok * (e * q_width / c + e * kv_width  # Q (local queries) and K (gathered) for QK^T
                   + e * kv_width  # V (gathered)
                   + e * q_width / c  # output-projection input
                   + (3 if gated else 2) * e * ffn / c) / t  # GeLU input (SwiGLU: gate and up), linear-2 input
    scores = 0.0
    if recompute != "selective":
        if flash:
            scores = 4.0 * b * s * a / t / c  # float32 log-sum-exp per (local) query and head
        else:
            scores = b * a * s * kv_len * (e + mask + (e if dropout else 0)) / t / c
    return outer + inner + scores


def gathered_kv_bytes(cfg: Config, layout: PlanLayout) -> float:
    """Bytes of one layer's keys and values after attention's all-gather over `sequence`, per device and
    microbatch: 2 (K and V) x b x T x G / t x K x bytes per element (the whole sequence, this device's heads).

    It is the tensor each K/V all-gather produces (and each dK/dV reduce-scatter consumes) in `comm`, and the
    part of a layer's activations that the `sequence` axis does not divide.
    """
    m = cfg.model
    return 2.0 * DTYPE_BYTES[m.dtype] * layout.microbatch_size * cfg.train.seq_len * m.kv_heads / layout.tensor \
        * m.head_size


def layer_activation_bytes(cfg: Config, layout: PlanLayout, policy: str | None = None) -> float:
    """Bytes one layer keeps for one microbatch on one device under an msjax remat policy.

    none: everything autodiff keeps (Korthikanti's count, with the layout's dropout / flash / block type).
    full (`nothing_saveable`): the layer input only (split over t with sequence parallelism: Megatron-SP keeps
      the residual stream sequence-split, so the saved input is already 1/t; Korthikanti sec. 4.3 notes 2sbh/t).
    dots_no_batch (`checkpoint_dots_with_no_batch_dims`): the outputs of the weight matmuls (Q, K, V, output
      projection, linear 1, linear 2) and the layer input; norms, GeLU and the attention core are recomputed.
    dots (`checkpoint_dots`): as dots_no_batch plus the batched attention matmuls (QK^T scores and PV) when
      attention is materialised (impl xla); a fused attention kernel is not a dot, so it is recomputed.
    With context parallelism (`sequence` = c > 1) everything above is 1/c of the tokens, except that `none`
    keeps the gathered (whole-sequence) K and V; the dots policies keep the local K and V projection outputs
    (the gather is not a dot), so the backward gathers them again (counted in `comm`).
    """
    m = cfg.model
    policy = policy or layout.remat
    s = cfg.train.seq_len
    b, t, sx = layout.microbatch_size, layout.tensor, layout.sequence
    e = DTYPE_BYTES[m.dtype]
    h, f = m.d_model, m.ff_size
    qw, kvw = m.num_heads * m.head_size, m.kv_heads * m.head_size
    # MoE layers: their own tensors in place of the MLP's (`msjax.planner.moe`), averaged over the layers
    share = moe.moe_fraction(cfg)
    if policy in ("none", "full"):
        # Korthikanti's MLP terms are linear in its width: the dense layers' share of them
        dense = korthikanti_layer_bytes(
            s, b, h, m.num_heads, t, layout.sequence_parallel, policy, ffn=f * (1.0 - share), q_width=qw,
            kv_width=kvw, dropout=layout.dropout, flash=layout.flash, parallel_block=layout.block == "parallel",
            act_bytes=e, seq_split=sx, gated=m.mlp == "swiglu")
        if policy == "none" and share:
            dense += share * moe.moe_layer_bytes(cfg, layout, local_expert_elements(cfg, layout))
        return dense
    split_outer = (t if layout.sequence_parallel else 1) * sx
    tok = s * b
    # x, proj out, lin2 out | Q K V (local, before the K/V gather), lin1 out
    lin1 = (2 * f if m.mlp == "swiglu" else f) * (1.0 - share)  # SwiGLU's linear 1 is the gate and up projections
    saved = e * tok * (3 * h / split_outer + (qw + 2 * kvw + lin1) / (t * sx)) + share * moe.moe_stash_bytes(
        cfg, dataclasses.replace(layout, remat=policy))  # what the dots policies keep of a MoE layer
    if policy == "dots" and not layout.flash:
        saved += e * b * m.num_heads * s * s / t / sx + e * tok * qw / t / sx  # scores and PV output (local queries)
    return saved


def rolled(model_cfg: ModelConfig, layers: int) -> bool:
    """Whether `layers` layers run as a loop of more than one iteration, which decides what the compiled step keeps
    for the backward (`msjax_layer_activation_bytes`): stacked layers under a scan of ceil(layers / scan_unroll)
    iterations. XLA removes a loop of one iteration (a pipeline chunk of one layer, a scan unrolled whole), which
    then counts as unrolled; per-layer parameters always run unrolled."""
    return model_cfg.scan_layers and -(-layers // model_cfg.scan_unroll) > 1


def msjax_layer_activation_bytes(cfg: Config, layout: PlanLayout, scanned: bool | None = None) -> float:
    """Bytes one layer of msjax's model keeps for its backward without remat, per microbatch and device, as the
    compiled train step holds them (the `none` policy of the msjax baseline; other policies: `layer_activation_bytes`).

    Source: the buffer assignment and live ranges XLA dumps for the compiled step (`--xla_dump_to
    --xla_dump_hlo_as_text --xla_dump_buffer_assignment_analysis=true`, jax 0.10.2, XLA:CPU): the buffers live at
    the step's peak (the start of the backward), for gpt_tiny (unrolled layers) and gpt_125m (scanned layers) on
    fsdp / tensor / sequence / pipeline meshes (docs/planner.md, "What the compiled step holds"). Korthikanti's
    count (`korthikanti_layer_bytes`) is Megatron's hand-written backward with 16-bit dropout masks; autodiff
    keeps more: the LayerNorm's centred input next to its output, the GeLU's tanh. In units of (b x tokens x
    width) elements of the compute dtype, with the residual stream split over (tensor, sequence) (Megatron-SP and
    context parallelism) and the TP regions over tensor:
      unrolled layers (`scan_layers=False`, or a scan unrolled whole; XLA fuses the elementwise chains across the
      layer):
        residual stream (b, T / (t c), D): 6 serial, 3 parallel (layer input, LayerNorm centred input and
          output, the attention-residual sum)
        TP-region inputs gathered over tensor (b, T / c, D): 2 serial, 1 parallel (what QKV and linear 1 read)
        Q and the attention output (b, T / c, q width / t): 2; K and V (b, T / c, kv width / t): 2, or with
          context parallelism (c > 1) the gathered whole-sequence K and V (b, T, kv width / t): 3 (XLA keeps the
          gathered copy in two layouts)
        MLP (b, T / c, F / t): 3 (linear-1 output, the GeLU's tanh, the GeLU output); SwiGLU 5 (below)
        attention (b, a / t, T / c, T): with grouped heads (G < H) 2 (the probabilities twice, though
          `msjax.ops.softmax`'s backward reads them once: XLA's fusions compute them once per consumer shape,
          (b, a, T, T) and the grouped (b, g, r, T, T), and keeps both), without 1 (no group axis); fused
          attention keeps a float32 log-sum-exp per query and head instead
      scanned layers (a rolled scan, `rolled`; the loop stores what jax's partial evaluation saves, unfused):
        residual stream 4 per LayerNorm (8 serial, 4 parallel), no gathered copies, Q K V O as above, MLP 6,
        attention 1 (the probabilities alone: what `msjax.ops.softmax` saves; autodiff of jax.nn.softmax
        saved 2).
    `scanned` (default `rolled(model, num_layers)`): whether the layers run inside a loop of more than one
    iteration; XLA removes a loop of one iteration (a pipeline chunk of one layer), so that counts as unrolled.
    Returns:
      bytes (float).
    """
    m = cfg.model
    scanned = rolled(m, m.num_layers) if scanned is None else scanned
    e = DTYPE_BYTES[m.dtype]
    b, T, t, c = layout.microbatch_size, cfg.train.seq_len, layout.tensor, layout.sequence
    d, f = m.d_model, m.ff_size
    qw, kvw = m.num_heads * m.head_size, m.kv_heads * m.head_size
    parallel = layout.block == "parallel"
    out_split = (t if layout.sequence_parallel else 1) * c
    if scanned:
        stream, gathered, mlp = (4 if parallel else 8), 0, 6
    else:
        stream, gathered, mlp = (2 if parallel else 4), (1 if parallel else 2), 3
    if m.mlp == "swiglu":
        # autodiff of down(silu(gate) * up) keeps the gate and up outputs, the sigmoid, silu(gate) and the
        # product: five F-wide tensors where GeLU keeps three (linear-1 output, tanh, GeLU output). Checked on
        # the compiled step of llama_tiny (unrolled layers: fsdp 8, tensor 2 x fsdp 4; test_planner_compile);
        # the scanned count is GeLU's plus the same two, not measured.
        mlp += 2
    tok = b * T
    # K and V: local (b, T / c) without context parallelism; gathered whole over `sequence` with it, where XLA
    # also keeps the gathered copy in its pre-transpose layout (3 whole-sequence K/V-width tensors)
    kv = 2 * kvw / (t * c) if c == 1 else 3 * kvw / t
    # a mixture of experts' layers keep their own tensors in place of the MLP's (`moe.moe_layer_bytes`), averaged
    # over the layers with the dense ones
    dense = 1.0 - moe.moe_fraction(cfg)
    acts = e * tok * (stream * d / out_split + gathered * d / c + 2 * qw / (t * c) + kv + dense * mlp * f / (t * c))
    acts += (1.0 - dense) * moe.moe_layer_bytes(cfg, layout, local_expert_elements(cfg, layout))
    if cfg.mesh.tp_overlap == "collective_matmul" and t > 1:
        # the decomposed rings (msjax.parallel.collective_matmul) are differentiated step by step, so autodiff
        # keeps each ring step's chunks: the QKV and linear-1 partial outputs twice, linear 1's once more, and
        # the gathered input chunks (measured: 3.7 MB per gpt_tiny layer at t = 2, b T = 512, float32)
        acts += e * tok * (2 * (qw + 2 * kvw) / t + 3 * f / t + 2 * d / t) / c
    if layout.flash:
        acts += 4.0 * tok * m.num_heads / (t * c)
    else:
        # unrolled, XLA keeps the probabilities once per consumer shape: twice with grouped heads (G < H), once
        # without (`msjax.ops.attention.xla_attention` then has no group axis)
        grouped = m.kv_heads < m.num_heads
        acts += (2 if grouped and not scanned else 1) * e * b * m.num_heads / t * (T / c) * T
    return acts


def msjax_ends_bytes(cfg: Config, layout: PlanLayout) -> dict[str, float]:
    """Per-device buffers of the model's two ends in msjax's compiled step, for one microbatch (same source as
    `msjax_layer_activation_bytes`):

      logits: the float32 logits and their softmax (b, T / c, V / t), 2 x 4 b T V / (t c); with context
        parallelism (c > 1) also the logits gathered over `sequence` for the loss, 4 b T V / t.
      embedding: `GPT.embed` gathers the whole table before the lookup (so the gather reads whole rows), and the
        lookup's gradient is a float32 scatter-add into a whole (V, D) buffer: 4 V D bytes whenever the table is
        split (t x fsdp > 1; otherwise that buffer is the table's gradient, counted with the gradients).
      head_table: the tied output projection reads the table gathered over fsdp (V / t, D) in the parameter dtype
        (fsdp > 1; the untied `lm_head` likewise).
      stream: the embedding output and the final norm's input and output (b, T / (t c), D) x 2, and the gathered
        input of the output projection (b, T / c, D) x 2.
    Returns:
      dict of bytes (floats): logits, embedding, head_table, stream.
    """
    m = cfg.model
    e, pe = DTYPE_BYTES[m.dtype], DTYPE_BYTES[m.param_dtype]
    b, T, t, c = layout.microbatch_size, cfg.train.seq_len, layout.tensor, layout.sequence
    V, d = layout.vocab, m.d_model
    out_split = (t if layout.sequence_parallel else 1) * c
    split_table = t * layout.fsdp > 1
    # with context parallelism the loss reads the logits gathered over `sequence` (b, T, V / t) besides the local two
    return {"logits": 2 * 4.0 * b * T * V / (t * c) + (4.0 * b * T * V / t if c > 1 else 0.0),
            "embedding": 4.0 * V * d if split_table else 0.0,
            "head_table": pe * V * d / t if layout.fsdp > 1 else 0.0,
            "stream": e * b * T * d * (2 / out_split + 2 / c)}


def in_flight_chunks(pipeline: int, virtual: int, microbatches: int) -> int:
    """Chunk-microbatches whose activations the first pipeline stage holds at its peak.

    Megatron-LM's schedules: 1F1B warms up p - 1 forwards (then one more in flight); interleaved 1F1B warms up
    2 (p - 1) + (v - 1) p chunk forwards. Both are capped by the m v chunk-microbatches of the step. Without
    pipelining (p = 1) one microbatch is in flight (gradient accumulation frees it after its backward).
    """
    if pipeline == 1:
        return virtual
    warmup = pipeline - 1 if virtual == 1 else 2 * (pipeline - 1) + (virtual - 1) * pipeline
    return min(microbatches * virtual, warmup + 1)


# XLA assigns a step's transient buffers offsets in one temp allocation by heap simulation; buffers of different
# sizes and lifetimes leave holes, so the allocation (`memory_analysis().temp_size_in_bytes`) exceeds the peak of
# simultaneously live bytes (HloLiveRange's "peak usage", `compile_check.xla_live_peak`). The planner adds this
# fraction of its transient (non-argument) bytes for them. Fitted, not derived: the value that minimises the
# largest error of the total against the compiled step (argument + temp + output - alias bytes; XLA:CPU, jax
# 0.10.2) over the non-pipelined layouts of the compile check's CASES (tests/msjax/test_planner_compile.py,
# `HEAP_FIT_CASES`: 0.117, largest error 7.1%; any value from 0.077 to 0.157 keeps them within 10%), and checked
# on the non-pipelined layouts it was not fitted on (collective matmul, scanned layers with FSDP prefetch, zero2,
# a Llama block: errors -6% to +8%). The pipelined step has its own allowance (`PIPELINE_PACKING`).
HEAP_PACKING = 0.117


@dataclass(frozen=True)
class MemoryReport:
    """Per-device memory of the most loaded pipeline stage, bytes.

    params, grads, optimizer: model state. activations: stored layer activations of all in-flight
    microbatches. working: transient peak on top (one layer's full activations while it is recomputed under
    remat, which includes its gathered K and V under context parallelism; the output logits and their gradient
    in float32 for one microbatch; FSDP's gathered weights of two layers). total vs capacity (= memory_fraction
    x device memory).

    Phases (msjax's step; `grads_in_backward` not None): the activations peak at the start of the backward, when
    few gradients exist yet, and the gradients peak at the optimizer update, when the activations are freed, so
      total = params + optimizer + max(activations + working + grads_in_backward, grads_at_update + update)
    with grads_in_backward the gradient buffers live through the backward (the float32 accumulators a loop
    carries: gradient accumulation, the pipeline's tick loop), grads_at_update those still live at the update
    (None: all of `grads`) and update the optimizer's float32 temporaries (and any regrouped copy) before they are
    applied. Measured in the compiled steps' buffer assignment and live ranges (docs/planner.md).
    Without phases (the megatron baseline) every part is added. `labels` say in words what each part holds
    (keys params, grads, optimizer, activations, working), for the report.
    """

    params: float
    grads: float
    optimizer: float
    activations: float
    working: float
    capacity: float
    device_memory: float
    per_layer_activation: float
    in_flight_layers: float
    grads_in_backward: float | None = None
    update: float = 0.0
    grads_at_update: float | None = None
    labels: dict = field(default_factory=dict)
    packing_fraction: float = HEAP_PACKING

    def label(self, part: str, default: str) -> str:
        """What the `part` row holds (the report's row label): the report function's own words, else `default`."""
        return self.labels.get(part, default)

    @property
    def backward_peak(self) -> float:
        """Transient bytes of the backward phase (msjax's step): activations, working memory and the gradient
        buffers live through the backward."""
        return self.activations + self.working + (self.grads_in_backward or 0.0)

    @property
    def update_peak(self) -> float:
        """Transient bytes of the update phase (msjax's step): the gradients still live at the optimizer update
        (`grads_at_update`, all of `grads` when None) and the optimizer's temporaries (`update`)."""
        return (self.grads if self.grads_at_update is None else self.grads_at_update) + self.update

    @property
    def transient(self) -> float:
        """Bytes beyond the parameters and optimizer state at the step's peak (the larger phase)."""
        if self.grads_in_backward is None:
            return self.grads + self.activations + self.working
        return max(self.backward_peak, self.update_peak)

    @property
    def packing(self) -> float:
        """msjax's step: the holes XLA leaves when it packs the transient buffers into its one temp allocation
        (`packing_fraction` of the transient bytes: `HEAP_PACKING`, or `PIPELINE_PACKING` for the pipelined
        step); 0 for the megatron baseline."""
        return self.packing_fraction * self.transient if self.grads_in_backward is not None else 0.0

    @property
    def total(self) -> float:
        return self.params + self.optimizer + self.transient + self.packing

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


def state_bytes_per_element(cfg: Config, layout: PlanLayout) -> tuple[float, float, float]:
    """(param, grad, optimizer) bytes per parameter element on a device before ZeRO division.

    msjax: parameters in model.param_dtype, gradients accumulated in float32 (msjax.train_step), two optimizer
    moments in the parameter dtype (optax's default). megatron: bf16 parameters, float32 main gradients, and
    float32 master weights + two moments (12 bytes; Megatron-LM's mixed-precision optimizer).
    """
    if layout.baseline == "megatron":
        return 2.0, 4.0, 12.0
    pb = DTYPE_BYTES[cfg.model.param_dtype]
    return float(pb), 4.0, 2.0 * pb


def memory_report(cfg: Config, layout: PlanLayout, stage: StageParams, device_memory: float,
                  memory_fraction: float) -> MemoryReport:
    """Memory of the most loaded stage. Stage 0 holds the embedding and the most in-flight activations;
    the last stage holds the output layer and the logits; with p = 1 one device holds everything."""
    L, p, v = cfg.model.num_layers, layout.pipeline, layout.virtual_stages
    layers = L // p
    pe, ge, oe = state_bytes_per_element(cfg, layout)
    d = layout.data
    per_layer = layer_activation_bytes(cfg, layout)
    if layout.baseline == "msjax":
        if p > 1:
            return _msjax_pipeline_report(cfg, layout, stage, device_memory, memory_fraction)
        return _msjax_report(cfg, layout, stage, device_memory, memory_fraction)
    chunks = in_flight_chunks(p, v, layout.microbatches)
    in_flight_layers = chunks * layers / v
    e = DTYPE_BYTES[cfg.model.dtype]
    s, b, t = cfg.train.seq_len, layout.microbatch_size, layout.tensor
    logits = 2 * 4 * b * s * layout.vocab / t / layout.sequence
    remat_working = layer_activation_bytes(cfg, layout, "none") if layout.remat != "none" else 0.0
    fsdp_buffers = 2 * e * stage.gathered / t if layout.fsdp > 1 else 0.0
    candidates = []
    for where in (("first",), ("last",)) if p > 1 else (("first", "last"),):
        elements = layers * stage.layer_elements
        elements += stage.first_elements if "first" in where else 0
        elements += stage.last_elements if "last" in where else 0
        acts = per_layer * in_flight_layers if "first" in where else per_layer * min(layers, layers * chunks / v)
        if "first" in where:
            acts += e * b * s * cfg.model.d_model / t / layout.sequence * chunks / v  # embedding outputs
        work = remat_working + fsdp_buffers + (logits if "last" in where else 0.0)
        params = pe * elements
        grads = ge * elements / (d if layout.zero_stage >= 2 else 1)
        opt = oe * elements / (d if layout.zero_stage >= 1 else 1)
        candidates.append((params + grads + opt + acts + work, params, grads, opt, acts, work))
    _, params, grads, opt, acts, work = max(candidates)
    return MemoryReport(params, grads, opt, acts, work, memory_fraction * device_memory, device_memory, per_layer,
                        in_flight_layers)


def activation_table(cfg: Config, layout: PlanLayout) -> dict[str, float]:
    """Per-layer activation bytes under every remat policy (for the report): what msjax's pipelined step stashes
    per layer and microbatch (`stash_layer_bytes`), else Korthikanti's count (`layer_activation_bytes`)."""
    import dataclasses

    policies = ("none", "dots_no_batch", "dots", "full")
    if layout.baseline == "msjax" and layout.pipeline > 1:
        scanned = rolled(cfg.model, cfg.model.num_layers // (layout.pipeline * layout.virtual_stages))
        return {p: stash_layer_bytes(cfg, dataclasses.replace(layout, remat=p), scanned) for p in policies}
    return {p: layer_activation_bytes(cfg, layout, p) for p in policies}



def msjax_per_layer(cfg: Config, layout: PlanLayout, scanned: bool | None = None) -> float:
    """Stored bytes per layer and microbatch in msjax's step: `msjax_layer_activation_bytes` without remat, the
    remat policy's saved tensors (`layer_activation_bytes`) with it."""
    if layout.remat == "none":
        return msjax_layer_activation_bytes(cfg, layout, scanned)
    return layer_activation_bytes(cfg, layout)


def optimizer_elements(cfg: Config, layout: PlanLayout, stage: StageParams, layers: int) -> int:
    """Elements per device of one parameter copy laid out like the gradients and optimizer state: the
    parameters' own layout, except the `zero2` rule set, which shards them over fsdp where the parameters are
    replicated (`sharding_rules.optimizer_state_rules`)."""
    if cfg.mesh.rules not in OPTIMIZER_STATE_RULES:
        return layers * stage.layer_elements + stage.first_elements + stage.last_elements
    import dataclasses

    ocfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, rules=OPTIMIZER_STATE_RULES[cfg.mesh.rules]))
    ostage = stage_params(ocfg, layout.vocab, layout.axis_sizes())
    return layers * ostage.layer_elements + ostage.first_elements + ostage.last_elements


def fsdp_gathered_bytes(cfg: Config, layout: PlanLayout, stage: StageParams, layers: int) -> float:
    """FSDP's gathered weights live at the peak, per device (parameter dtype, split over tensor only):
    unrolled layers without remat keep every layer's gathered weights from the forward to the backward (GSPMD
    gathers each weight once and both passes read it: measured, all L layers' (D, F / t), (F / t, D) ... in the
    compiled gpt_tiny step); scanned or rematerialised layers gather again in the backward, so two layers (the
    one computing and the next, prefetched). Zero without fsdp (and under `zero2`, whose parameters are whole)."""
    if layout.fsdp == 1 or cfg.mesh.rules == "zero2":
        return 0.0
    n = layers if (not rolled(cfg.model, layers) and layout.remat == "none") else 2
    return n * DTYPE_BYTES[cfg.model.param_dtype] * stage.gathered / layout.tensor


def _msjax_report(cfg: Config, layout: PlanLayout, stage: StageParams, device_memory: float,
                  memory_fraction: float) -> MemoryReport:
    """Memory of msjax's train step without pipeline stages (`msjax.train_step`), at its peak, the start of the
    backward (source: the compiled step's buffer assignment, see `msjax_layer_activation_bytes`):
      params, optimizer: the state (ZeRO over data and the `zero2` rule set dividing the optimizer state).
      grads: float32, one copy (two with gradient accumulation: the sum carried by the loop and the
        microbatch's own).
      activations: L layers of one microbatch (`msjax_per_layer`) and the ends' residual stream.
      working: the float32 logits and softmax, the gathered embedding table's float32 gradient, the output
        projection's gathered table, FSDP's gathered weights (`fsdp_gathered_bytes`), and, under remat, the
        layer being recomputed.
    """
    L = cfg.model.num_layers
    pe, _, oe = state_bytes_per_element(cfg, layout)
    d = layout.data
    elements = L * stage.layer_elements + stage.first_elements + stage.last_elements
    o_elements = optimizer_elements(cfg, layout, stage, L)
    per_layer = msjax_per_layer(cfg, layout)
    ends = msjax_ends_bytes(cfg, layout)
    params = pe * elements
    copies = 2 if cfg.train.microbatches > 1 else 1
    grads = copies * 4.0 * o_elements / (d if layout.zero_stage >= 2 else 1)
    opt = oe * o_elements / (d if layout.zero_stage >= 1 else 1)
    acts = L * per_layer + ends["stream"]
    remat_working = msjax_layer_activation_bytes(cfg, layout) if layout.remat != "none" else 0.0
    work = ends["logits"] + ends["embedding"] + ends["head_table"] + fsdp_gathered_bytes(cfg, layout, stage, L) \
        + remat_working
    return MemoryReport(params, grads, opt, acts, work, memory_fraction * device_memory, device_memory, per_layer,
                        float(L), grads_in_backward=grads / copies * (copies - 1))


def stash_layer_bytes(cfg: Config, layout: PlanLayout, scanned: bool | None = None) -> float:
    """Bytes one layer's residuals take in a stash slot of msjax's pipelined step, per device: what the
    forward's `jax.vjp` saves for the backward under `model.remat`'s `jax.checkpoint` policy
    (`msjax.parallel.pipeline`). Read off the residual pytrees of the step (`PipelinedGrads.stash_entry`; checked
    leaf by leaf in tests/msjax/test_planner.py). In (b x T) tokens x width, with the residual stream split
    over (tensor, sequence) by Megatron-SP and context parallelism and the TP regions over tensor (local queries
    over sequence):
      none (everything but values of the parameters alone): per LayerNorm (or RMSNorm) its float32 input, its
        output (compute dtype) and a float32 reciprocal deviation per token; Q, K, V and the attention output;
        six MLP-width tensors (linear-1 output and GeLU's intermediates, or SwiGLU's gate, up and theirs); RoPE's
        cosine and sine tables (`rope_table_bytes`; once per slot when scanned); materialised attention's
        probabilities (compute dtype) and float32 scores, per layer when layers are unrolled (with the mask and a
        float32 copy: 9 bytes per score beside the compute-dtype ones), per layer 4 bytes when scanned (the mask
        is loop-invariant: `stash_entry_invariant_bytes`); a fused kernel's float32 log-sum-exp instead.
      dots_no_batch: the layer input (and, serial, the attention residual: the second LayerNorm's input), Q, K
        and V (local: the gather is not a dot), the linear-1 output (SwiGLU: gate and up); everything else is
        recomputed.
      dots: dots_no_batch plus materialised attention's two batched products (scores and P V) in float32.
      full: the layer input.
    Returns:
      bytes (float).
    """
    m = cfg.model
    scanned = rolled(m, m.num_layers) if scanned is None else scanned
    e = DTYPE_BYTES[m.dtype]
    b, T, t, c = layout.microbatch_size, cfg.train.seq_len, layout.tensor, layout.sequence
    tok, d, f = b * T, m.d_model, m.ff_size
    qw, kvw = m.num_heads * m.head_size, m.kv_heads * m.head_size
    outer = (t if layout.sequence_parallel else 1) * c  # the residual stream's split
    n_ln = 1 if layout.block == "parallel" else 2
    scores = b * (m.num_heads / t) * (T / c) * T  # materialised scores per layer, per device
    if layout.remat == "full":
        return e * tok * d / outer + moe.moe_fraction(cfg) * moe.moe_stash_bytes(cfg, layout)
    if layout.remat in ("dots_no_batch", "dots"):
        share = moe.moe_fraction(cfg)  # MoE layers: their own saved dots in place of the MLP's
        lin1 = (2 * f if m.mlp == "swiglu" else f) * (1.0 - share)  # SwiGLU's linear 1 is the gate and up
        saved = e * tok * ((1 + (n_ln - 1)) * d / outer + (qw + 2 * kvw + lin1) / (t * c)) \
            + share * moe.moe_stash_bytes(cfg, layout)
        if layout.remat == "dots" and not layout.flash:
            saved += 4.0 * (scores + tok * qw / (t * c))
        return saved
    kv = 2 * kvw / (t * c) if c == 1 else 2 * kvw / t  # with c > 1 the gathered, whole-sequence K and V
    share = moe.moe_fraction(cfg)  # MoE layers: their own residuals in place of the MLP's (not measured here)
    saved = n_ln * tok * ((4 + e) * d + 4) / outer + e * tok * (2 * qw / (t * c) + kv + (1.0 - share) * 6 * f / (t * c))
    if share:
        saved += share * moe.moe_stash_bytes(cfg, layout)
    if not scanned:
        saved += rope_table_bytes(cfg, layout)
    if layout.flash:
        return saved + 4.0 * tok * m.num_heads / (t * c)
    extra = e if e != 4 else 0  # float32 compute: the compute-dtype probabilities are the float32 ones
    return saved + scores * ((9 + extra) if not scanned else (4 + extra))


def stash_entry_invariant_bytes(cfg: Config, layout: PlanLayout, scanned: bool | None = None) -> float:
    """Bytes of a stash slot shared by the chunk's layers: with scanned layers, no remat and materialised
    attention, the causal mask and its float32 companion, hoisted out of the layer loop but per microbatch
    (b x a/t x T/c x T x 5 bytes), and with RoPE its tables (`rope_table_bytes`, hoisted likewise); 0 otherwise."""
    m = cfg.model
    scanned = rolled(m, m.num_layers) if scanned is None else scanned
    if layout.remat != "none" or not scanned:
        return 0.0
    b, T, t, c = layout.microbatch_size, cfg.train.seq_len, layout.tensor, layout.sequence
    mask = 0.0 if layout.flash else 5.0 * b * (m.num_heads / t) * (T / c) * T
    return mask + rope_table_bytes(cfg, layout)


def w_pair_layer_bytes(cfg: Config, layout: PlanLayout) -> float:
    """Bytes one layer's weight-gradient inputs take in a W slot of a table schedule's step, per device: each
    weight matmul's input x and output gradient dy (`msjax.parallel.split_backward`; `TablePipelinedGrads.w_entry`,
    checked to the byte in tests/msjax/test_planner.py), in the compute dtype. A matmul that reads an earlier one's
    x keeps none (K and V read Q's input; SwiGLU's up reads the gate's; a parallel block's MLP reads attention's).
    Residual-stream-wide tensors (the projections' inputs, the output projections' gradients) are split like
    the stream, over (tensor, sequence); the TP regions' tensors (Q, K, V, the attention output, the MLP's
    hidden) over tensor x sequence, as XLA lays them out in the compiled step.
    Returns:
      bytes (float).
    """
    m = cfg.model
    e = DTYPE_BYTES[m.dtype]
    b, T, t, c = layout.microbatch_size, cfg.train.seq_len, layout.tensor, layout.sequence
    outer = (t if layout.sequence_parallel else 1) * c
    qw, kvw, f = m.num_heads * m.head_size, m.kv_heads * m.head_size, m.ff_size
    lin1 = 2 * f if m.mlp == "swiglu" else f
    stream = (1 if layout.block == "parallel" else 2) + 2  # inputs of Q and of the MLP; dy of both projections out
    regions = (qw + 2 * kvw) + qw + lin1 + f  # dy of Q, K, V; x of the attention output; dy of linear 1; x of 2
    return e * b * T * (stream * m.d_model / outer + regions / (t * c))


def rope_table_bytes(cfg: Config, layout: PlanLayout) -> float:
    """Bytes of RoPE's cosine and sine tables that autodiff keeps for the rotation's backward when nothing is
    rematerialised: two (T / c, K) tables in the compute dtype (the same for every sequence of the microbatch
    and every head); 0 for learned positions. Read off the pipelined step's residuals (a Llama block in
    tests/msjax/test_planner.py); with context parallelism (c > 1) the local positions' tables are assumed."""
    m = cfg.model
    if m.position != "rope":
        return 0.0
    return 2.0 * DTYPE_BYTES[m.dtype] * cfg.train.seq_len / layout.sequence * m.head_size


def _msjax_pipeline_report(cfg: Config, layout: PlanLayout, stage: StageParams, device_memory: float,
                           memory_fraction: float) -> MemoryReport:
    """Memory of a stage of msjax's pipelined step (`msjax.parallel.pipeline`), which differs from Megatron's:
    every stage holds the embedding and output ends (replicated over `pipeline`, one copy of a tied embedding);
    activations are the stash, `Schedule.slots` + 1 slots of one chunk's residuals (`stash_layer_bytes` per
    layer under the remat policy, `stash_entry_invariant_bytes`) on every stage, allocated whatever the
    microbatches in flight, and the tick loop's carried activations; the gradients are float32 accumulators
    through the loop ((P, V, Lc, ...) layers and the ends) and the optimizer's input at the update; the working
    memory is the largest of a tick's parts (`_pipeline_working`); at the update the optimizer's float32
    temporaries (`PIPELINE_UPDATE_COPIES`).
    """
    from msjax.parallel.schedule import Schedule, in_flight

    p, v, m = layout.pipeline, layout.virtual_stages, layout.microbatches
    layers = cfg.model.num_layers // p
    chunk_layers = layers // v
    pe, _, oe = state_bytes_per_element(cfg, layout)
    d = layout.data
    scanned = rolled(cfg.model, chunk_layers)  # the chunk is a scan of Lc layers (one: no loop)
    slots = Schedule(p, v, m if v == 1 or m % p == 0 else p).slots
    per_layer = stash_layer_bytes(cfg, layout, scanned)
    entry = chunk_layers * per_layer + stash_entry_invariant_bytes(cfg, layout, scanned)
    x_bytes = DTYPE_BYTES[cfg.model.dtype] * layout.microbatch_size * cfg.train.seq_len * cfg.model.d_model / (
        (layout.tensor if layout.sequence_parallel else 1) * layout.sequence)
    rerun = cfg.mesh.tp_overlap == "collective_matmul" and layout.tensor > 1
    if rerun:  # the collective matmul's chunks are stashed by their input and run again in the backward
        per_layer, entry = x_bytes / chunk_layers, x_bytes
    table = layout.schedule != "interleaved"
    w_layer = 0.0
    if table:
        # a table's stash is its own (interval-coloured slots), beside the W slots of the (x, dy) pairs its
        # waiting weight-gradient passes read, and the inbox of activations and gradients waiting for a pass
        from msjax.parallel.zero_bubble import action_table, tick_plan

        plan = tick_plan(layout.schedule, p, v, m)
        slots = plan.res_slots
        w_layer = w_pair_layer_bytes(cfg, layout)
        acts = ((slots + 1) * entry + (plan.w_slots + 1) * chunk_layers * w_layer
                + (plan.inbox_slots + 1 + PIPELINE_CARRIES) * x_bytes)
    else:
        acts = (slots + 1) * entry + PIPELINE_CARRIES * x_bytes
    ends = ends_elements(cfg, layout, stage)
    stage_elements = layers * stage.layer_elements + ends
    # what the device stores: stacked layers are split over `pipeline`; per-layer parameters
    # (scan_layers=False) are replicated over it, so every device stores, and updates, all L layers
    stored_layers = layers if cfg.model.scan_layers else cfg.model.num_layers
    elements = stored_layers * stage.layer_elements + ends
    zero1 = d if layout.zero_stage >= 1 else 1
    zero2 = d if layout.zero_stage >= 2 else 1
    params = pe * elements
    opt = oe * elements / zero1
    accumulators = 4.0 * stage_elements
    grads = (accumulators + 4.0 * elements) / zero2
    # the regrouped (P, V, Lc, ...) copy of the stage's layers (V > 1, or per-layer parameters)
    regroup = pe * layers * stage.layer_elements if (v > 1 or not cfg.model.scan_layers) else 0.0
    work = _pipeline_working(cfg, layout, stage, chunk_layers, entry, ends, scanned) + regroup \
        + fsdp_gathered_bytes(cfg, layout, stage, 2)
    if rerun:  # the chunk's activations while its backward runs it again
        work += chunk_layers * stash_layer_bytes(cfg, layout, scanned)
    update = PIPELINE_UPDATE_COPIES * 4.0 * elements / zero1
    if cfg.model.scan_layers and v > 1:
        # Stacked layers interleaved over the stages (`PipelinedGrads.stage`, V > 1) move in P rounds of
        # ppermute, into a regrouped copy and back for the gradients. In the compiled 175B step (pp8 x tp8,
        # V = 3) XLA held, at that phase, the stash, the float32 accumulators, two float32 copies of the stage's
        # layers and a round's buffer at once: that phase is priced as the backward's (it is the larger).
        width = -(-v // p)
        moving = (accumulators + 2 * 4.0 * layers * stage.layer_elements
                  + 4.0 * width * chunk_layers * stage.layer_elements)
        work = max(work, moving - accumulators / zero2)
    e_name = cfg.model.dtype
    labels = {
        "params": f"parameters ({pe:.0f} B/param: {stored_layers} layers and the embedding/output ends)",
        "grads": f"gradients: float32 accumulators + the optimizer's input (2 x 4 B/param"
                 f"{', sharded over data' if layout.zero_stage >= 2 else ''})",
        "optimizer": f"optimizer ({cfg.optimizer.name}, {oe:.0f} B/param"
                     f"{', sharded over data' if layout.zero_stage >= 1 else ''})",
        "activations": f"stash: {slots + 1} slots x {chunk_layers} layers x {per_layer / 2**20:.1f} MiB "
                       f"({layout.remat}, {e_name}) + "
                       + (f"W: {plan.w_slots + 1} slots x {chunk_layers} layers x {w_layer / 2**20:.1f} MiB + "
                          f"inbox {plan.inbox_slots + 1} + carries" if table else "carries"),
        "working": "working (a tick's backward, output layer or embedding gradient; regrouped layers)",
    }
    flight = action_table(layout.schedule, p, v, m).in_flight(0) if table else in_flight(p, v, m)
    return MemoryReport(params, grads, opt, acts, work, memory_fraction * device_memory, device_memory, per_layer,
                        flight * chunk_layers, grads_in_backward=accumulators / zero2, update=update,
                        grads_at_update=4.0 * elements / zero2, labels=labels, packing_fraction=PIPELINE_PACKING)


# The pipelined step's memory constants (docs/planner.md, "msjax's pipelined step"). Counted: the tick loop's
# carried activations, in residual-stream activations (the forward and backward inputs, the loss gradient, the
# tick's two outputs and the embedding); the float32 copies of the stored state the optimizer's update holds
# beyond its input gradients. Fitted on tests/msjax/test_planner_compile.py's PIPELINE_FIT_CASES and checked on
# the pipelined layouts of its MEMORY_CASES, which they were not fitted on: the layers' activations live while a
# chunk's backward recomputes under remat (up to 2: XLA overlaps a layer's recompute with the next one's
# backward), and the holes XLA's packing leaves, as a fraction of the transient bytes (4% minimises the largest
# error over the fit cases, 3.5%).
PIPELINE_CARRIES = 6
PIPELINE_UPDATE_COPIES = 1.0
PIPELINE_BACKWARD_TEMPS = 2.0
PIPELINE_PACKING = 0.04


def _pipeline_working(cfg: Config, layout: PlanLayout, stage: StageParams, chunk_layers: int, entry: float,
                      ends: float, scanned: bool) -> float:
    """The largest transient of a tick of msjax's pipelined step, bytes per device: the forward slot (a scanned
    chunk's stacked residuals before they enter the stash), the backward slot (the chunk's weight gradients in
    the parameter dtype and, under remat, the layer being recomputed; the stash slot it reads is read in
    place), the output layer (float32 logits and softmax of the stage's T / P tokens and the ends'
    gradients) or the embedding gradient (the gathered table's float32 gradient when the table is split, and the
    ends' gradients)."""
    m = cfg.model
    pe = DTYPE_BYTES[m.param_dtype]
    b, T, t, c = layout.microbatch_size, cfg.train.seq_len, layout.tensor, layout.sequence
    V, d = layout.vocab, m.d_model
    layer = msjax_layer_activation_bytes(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                                                            remat="none")),
                                         dataclasses.replace(layout, remat="none"), False)
    recompute = min(chunk_layers, PIPELINE_BACKWARD_TEMPS) * layer if layout.remat != "none" else 0.0
    # a MoE layer's grouped matmuls under a backend's dense fallback hold their masked copies while they run
    # (not in the stash: the stash holds jaxpr values)
    recompute += moe.moe_fraction(cfg) * moe.moe_dense_fallback_bytes(cfg, layout)
    # weights cast to the compute dtype inside the vjp (recomputed, never stashed), in both slots
    casts = DTYPE_BYTES[m.dtype] * chunk_layers * stage.layer_elements if m.dtype != m.param_dtype else 0.0
    backward = pe * chunk_layers * stage.layer_elements + recompute + casts
    # a scanned chunk's residuals come out of the scan stacked, one slot's worth, before they enter the stash
    forward = (entry if scanned else 0.0) + casts
    output = 3 * 4.0 * b * T * V / (t * c * layout.pipeline) + 4.0 * ends
    embedding = (4.0 * V * d if t * layout.fsdp > 1 else 0.0) + 4.0 * ends
    return max(forward, backward, output, embedding)


def ends_elements(cfg: Config, layout: PlanLayout, stage: StageParams) -> int:
    """Elements per device of the embedding and output ends in msjax's pipelined step, where every stage holds
    both (replicated over `pipeline`) and a tied embedding once: `stage_params`' first and last elements less
    the Megatron-style copy it puts on the last stage."""
    copy = _tied_copy(cfg, layout) if cfg.model.tie_embeddings and layout.pipeline > 1 else 0
    return stage.first_elements + stage.last_elements - copy


def _tied_copy(cfg: Config, layout: PlanLayout) -> int:
    """Elements per device of the tied-embedding copy `stage_params` puts on the last stage."""
    leaves = param_leaves(cfg.model, layout.vocab)
    wte = next(l for l in leaves if l.name == "wte")
    return shard_elements(wte, cfg.mesh.rules, layout.axis_sizes())
