"""Typed configuration: the one place defaults live.

A run is described by one frozen `Config` made of sections (model, mesh, pipeline, optimizer, data, train,
checkpoint, storage, supervisor, observe).
Named presets in `configs/<name>.py` hold an `OVERRIDES` dict of dotted keys that differ from these defaults;
`--config` also takes a path to a preset file of the same form anywhere, or to a YAML or JSON file of keys (nested
sections or dotted keys), a run directory's own `config.json` included (`load_preset`); the command line adds more
dotted overrides (`--train.steps=200 --mesh.tensor=2`). Every key and value is
checked: an unknown key, a value of the wrong type or a value outside its allowed set raises `ConfigError`
naming the key and what is allowed (the Levanter/draccus and torchtitan way of doing configs).

Cross-field checks that do not need devices live in `Config.validate()`; checks against the devices present
(mesh size) live in `msjax.mesh.make_mesh`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import json
import math
import os
import pkgutil
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence


class ConfigError(ValueError):
    """A preset, key or value the configuration does not accept; the message names it and what is allowed."""


# ---- path values: what a path key may hold (msjax.paths reads and writes them) --------------------------------

# Object stores msjax.paths serves; any other scheme is refused.
OBJECT_STORE_SCHEMES = ("gs", "s3")
# Path keys that must stay local, and why (named in the error). The other path keys (checkpoint.dir, data.paths,
# data.tokenizer_path) may be local paths or object-storage URLs.
LOCAL_PATH_KEYS = {
    "train.run_dir": "metrics and TensorBoard events are appended to it as the run goes; put checkpoints on object "
                     "storage with checkpoint.dir and the corpus with data.paths",
    "checkpoint.local_dir": "Orbax writes every checkpoint there first (object storage is the persistent tier, "
                            "checkpoint.dir)",
    "data.cache_dir": "the token cache is memory-mapped by the loader",
}
_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*)://(?P<rest>.*)$", re.DOTALL)
# `gs:/bucket` (one slash, e.g. after os.path.normpath) names a URL, not a relative directory `gs:`.
_ONE_SLASH = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]+):/(?!/)")


def url_scheme(value: str) -> str | None:
    """The scheme of a path value in lower case (`"gs"`, `"s3"`, `"file"`, ...), or None for a plain local path."""
    m = _URL.match(value)
    return m.group("scheme").lower() if m else None


def _check_rope_scaling(m: "ModelConfig") -> None:
    rs = m.rope_scaling
    if rs.type == "none":
        return
    if m.position != "rope":
        raise ConfigError(f"model.rope_scaling.type={rs.type!r} scales RoPE's frequencies; model.position="
                          f"{m.position!r} has none (set model.position=rope, or model.rope_scaling.type=none)")
    if not (math.isfinite(rs.factor) and rs.factor >= 1.0):
        raise ConfigError(f"model.rope_scaling.factor={rs.factor}: allowed is a finite number >= 1 (Llama 3.1: 8)")
    if rs.type in ("llama3", "yarn") and rs.original_max_seq_len <= 0:
        raise ConfigError(f"model.rope_scaling.original_max_seq_len={rs.original_max_seq_len}: {rs.type} scaling "
                          "needs the context before scaling, an integer > 0 (Llama 3.1: 8192, Qwen2.5: 32768)")
    if rs.type == "yarn" and not (0 < rs.beta_slow < rs.beta_fast and math.isfinite(rs.beta_fast)
                                  and rs.attention_factor >= 0 and rs.mscale >= 0 and rs.mscale_all_dim >= 0):
        raise ConfigError(f"model.rope_scaling: beta_fast={rs.beta_fast}, beta_slow={rs.beta_slow}, "
                          f"attention_factor={rs.attention_factor}, mscale={rs.mscale}, mscale_all_dim="
                          f"{rs.mscale_all_dim}: yarn needs 0 < beta_slow < beta_fast (32, 1) and factors >= 0")
    if rs.type == "llama3":
        if not (0 < rs.low_freq_factor < rs.high_freq_factor and math.isfinite(rs.high_freq_factor)):
            raise ConfigError(f"model.rope_scaling.low_freq_factor={rs.low_freq_factor}, high_freq_factor="
                              f"{rs.high_freq_factor}: allowed are finite numbers 0 < low < high (Llama 3.1: 1, 4)")


def check_path_value(value: str, key: str) -> None:
    """Checks the form of a path value for `key`, reading nothing: a scheme other than gs://, s3:// and file://,
    a URL for a key in LOCAL_PATH_KEYS, a URL without a bucket, or a one-slash URL (`gs:/bucket`, which a
    filesystem would take for a relative directory) is refused. (msjax.paths.check adds whether the scheme's
    package is installed.)

    Raises:
      ConfigError: naming the key, the value and what is allowed.
    """
    m = _URL.match(value)
    if m is None:
        bad = _ONE_SLASH.match(value)
        if bad is not None:
            fixed = f"{bad.group('scheme')}://{value[bad.end():]}"
            raise ConfigError(f"{key}={value!r} looks like a URL with one slash after '{bad.group('scheme')}:'; "
                              f"write {fixed!r} (or ./{value} for a local directory of that name)")
        return
    scheme, rest = m.group("scheme").lower(), m.group("rest")
    if scheme == "file":
        return check_path_value(rest, key)
    if scheme not in OBJECT_STORE_SCHEMES:
        raise ConfigError(f"{key}={value!r}: scheme '{scheme}://' is not supported; allowed: a local path, gs:// "
                          "(Google Cloud Storage), s3:// (Amazon S3 or an S3-compatible store)")
    if key in LOCAL_PATH_KEYS:
        raise ConfigError(f"{key}={value!r} must be a local path: {LOCAL_PATH_KEYS[key]}")
    if not rest.partition("/")[0]:
        raise ConfigError(f"{key}={value!r} names no bucket; allowed: {scheme}://bucket/path")


# The metrics sinks `train.loggers` may name (msjax.metrics).
LOGGERS = ("jsonl", "tensorboard", "wandb")


@dataclass(frozen=True)
class AttentionConfig:
    """Causal self-attention.

    Attributes:
      window: sliding-window size W (each query sees itself and the W-1 keys before it, MegaScale sec. 3.1);
        None means full causal attention.
      impl: which implementation the dispatch point `msjax.ops.attention` uses: `xla` (plain JAX reference),
        `pallas` (our sliding-window flash kernel), `cudnn` (`jax.nn.dot_product_attention`), `auto`.
    """

    window: int | None = None
    impl: Literal["auto", "xla", "pallas", "cudnn"] = "auto"


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts feed-forward in place of the MLP (`msjax.ops.moe`, `msjax.model.MoE`).

    Attributes:
      num_experts: experts E per MoE layer; 0 keeps the dense MLP.
      experts_per_token: k, the experts each token is routed to (1 <= k <= E; Mixtral and Qwen3-MoE: 2 and 8).
      expert_ff: each expert's MLP width; 0 takes model.d_ff. Experts use model.mlp (gelu or swiglu).
      shared_experts: experts every token goes through besides its k (Qwen2-MoE: one, DeepSeek-MoE: several),
        as one MLP of shared_experts x expert_ff; 0 for none.
      shared_gate: the shared experts' output is scaled by sigmoid(x . w) per token (Qwen2-MoE).
      every: layer i is an MoE layer when (i + 1) % every == 0 (Qwen2-MoE's decoder_sparse_step); above 1 only
        with model.scan_layers=false (stacked layers share one structure).
      router: softmax_topk (softmax over all experts, then the k largest: Mixtral, Qwen) or topk_softmax (the k
        largest logits, softmax over them).
      normalize_topk: with softmax_topk, the k weights renormalised to sum to 1 (Mixtral, Qwen3-MoE: true;
        Qwen2-MoE: false).
      capacity_factor: 0 is dropless (every assignment computed); above 0 each expert keeps its first
        ceil(factor x tokens x k / E) assignments in the batch's token order (the same ones on any mesh) and the
        rest pass through the residual (a logged fraction).
      aux_loss_coef: weight of the load-balancing loss in the training loss (Switch Transformer: 0.01).
      z_loss_coef: weight of the router z-loss (ST-MoE: 0.001).
    """

    num_experts: int = 0
    experts_per_token: int = 2
    expert_ff: int = 0
    shared_experts: int = 0
    shared_gate: bool = False
    every: int = 1
    router: Literal["softmax_topk", "topk_softmax"] = "softmax_topk"
    normalize_topk: bool = True
    capacity_factor: float = 0.0
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) has the mixture of experts."""
        return self.num_experts > 0 and (layer + 1) % self.every == 0


@dataclass(frozen=True)
class RopeScalingConfig:
    """RoPE frequency scaling, which stretches a model's trained context (`msjax.ops.rope.inverse_frequencies`).

    Attributes:
      type: none; linear (every frequency divided by `factor`: positions interpolated, Chen et al. 2023); llama3
        (Llama 3.1's: wavelengths longer than original_max_seq_len / low_freq_factor divided by `factor`, shorter
        than original_max_seq_len / high_freq_factor kept, those between interpolated smoothly; Meta's reference
        code and `transformers`' `_compute_llama3_parameters`); yarn (YaRN, Peng et al. 2023, as Qwen2.5's long
        context uses it: dimensions turning fewer than beta_slow times over original_max_seq_len interpolated by
        `factor`, more than beta_fast times kept, a linear ramp between; cos and sin scaled by the attention
        factor; `transformers`' `_compute_yarn_parameters`).
      factor: the scaling factor (Llama 3.1: 8; Qwen2.5 at 128K: 4).
      low_freq_factor: llama3's low-frequency bound (Llama 3.1: 1).
      high_freq_factor: llama3's high-frequency bound (Llama 3.1: 4).
      original_max_seq_len: llama3's and yarn's context before scaling (Llama 3.1: 8192; Qwen2.5: 32768).
      beta_fast: yarn's ramp bound where frequencies stay as they were, in rotations over original_max_seq_len
        (the paper's 32).
      beta_slow: yarn's ramp bound where frequencies are divided by `factor`, in rotations (the paper's 1).
      attention_factor: yarn's scale of cos and sin; 0 derives it from `factor` (0.1 ln(factor) + 1), or from
        mscale and mscale_all_dim when both are set (DeepSeek's ratio).
      mscale: yarn's DeepSeek-style attention factor numerator term; 0: unset.
      mscale_all_dim: yarn's DeepSeek-style attention factor denominator term; 0: unset.
      truncate: yarn rounds its ramp's bounds to whole dimensions (floor, ceil), as the paper's code does.
    """

    type: Literal["none", "linear", "llama3", "yarn"] = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 0.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer: GPT-2/3 (Radford et al. 2019; Brown et al. 2020) or Llama-style (Touvron et al.
    2023), serial or parallel blocks (GPT-J, PaLM).

    GPT-2 is the default: learned positions, LayerNorm, GeLU MLP, biases, tied embeddings. Llama is
    `position=rope`, `norm=rmsnorm`, `mlp=swiglu`, `use_bias=false`, `tie_embeddings=false` with grouped-query
    heads (`num_kv_heads`); any mix of the two is allowed.

    vocab_size 0 takes the tokenizer's vocabulary; the embedding is padded up to a multiple of `vocab_multiple`
    so the vocab axis shards evenly and matmuls stay aligned (padding rows start at zero and stay zero: their
    logits are masked, so they get no gradient). `num_kv_heads`, `head_dim` and `d_ff` of 0 take `num_heads`,
    `d_model // num_heads` and `4 * d_model` (set `d_ff` for SwiGLU: Llama uses about 8/3 d_model).

    Attributes:
      vocab_size: vocabulary size V; 0 takes the tokenizer's.
      vocab_multiple: embedding rows are padded up to a multiple of this.
      num_layers: transformer blocks L.
      d_model: model width D.
      num_heads: query heads H.
      num_kv_heads: key/value heads (grouped-query attention); 0 means num_heads.
      head_dim: head dimension K; 0 means d_model // num_heads.
      d_ff: MLP width F; 0 means 4 * d_model.
      max_seq_len: the longest sequence: rows of the learned position table, or RoPE's trained context (the
        longest train.seq_len, prompt + generated tokens allowed).
      block: serial (GPT-2) or parallel (GPT-J/PaLM: attention and MLP from the same norm, summed).
      position: learned (GPT-2: a (max_seq_len, D) table added to the token embedding) or rope (rotary
        embeddings of queries and keys, Su et al. 2021; Llama).
      rope_base: RoPE's frequency base theta (Llama 2: 10000, Llama 3: 500000).
      rope_scaling: RoPE's frequency scaling (model.rope_scaling.*; Llama 3.1-3.3: llama3, factor 8).
      norm: layernorm (Ba et al. 2016; GPT-2) or rmsnorm (Zhang and Sennrich 2019; Llama; no offset).
      mlp: gelu (two matrices, tanh-approximated GeLU as GPT-2) or swiglu (three matrices, down(silu(gate x) *
        up x); Shazeer 2020; Llama).
      tie_embeddings: the output projection reuses the token embedding.
      use_bias: biases in linear layers, and LayerNorm's offset (RMSNorm has none).
      qkv_bias: biases on the query, key and value projections alone (Qwen2, Qwen2.5); use_bias implies them.
      qk_norm: a norm (model.norm, gain shared by the heads) over each query and key head, before RoPE (Qwen3).
      norm_eps: the norms' epsilon.
      init_std: standard deviation of the normal weight initialisation.
      remat: activation recomputation policy of each block (jax.checkpoint).
      scan_layers: stacked layers (one parameter array per kind of parameter, leading `layers` axis) run by one
        jax.lax.scan (fast compile), instead of per-layer parameters and a Python loop.
      scan_unroll: layers per iteration of that scan (jax.lax.scan's `unroll`); num_layers or more unrolls it
        completely: straight-line code with the parameters still stacked. On XLA:CPU a rolled scan's backward is
        ~2x a Python loop's, while per-layer parameters multiply the optimizer's and the norms' small ops by L;
        a shallow model on CPU gets both wins from a full unroll (docs/cpu_speed.md).
      param_dtype: dtype the parameters are stored in.
      dtype: dtype of the activations and matmuls.
      matmul_dtype: the weight matmuls' operands: "activations" (in `dtype`), "bfloat16" (rounded to bf16,
        accumulated in float32, forward and backward: mixed precision under float32 activations), or "auto"
        (bfloat16 where the backend's bf16 matmuls are faster: GPU, TPU, a CPU whose AMX-BF16 this process may
        use; `dtype` elsewhere). See `msjax.ops.matmul`.
      attention: attention settings (model.attention.*).
      moe: a mixture of experts in place of the MLP (model.moe.*; num_experts 0: dense).
    """

    vocab_size: int = 0
    vocab_multiple: int = 128
    num_layers: int = 4
    d_model: int = 256
    num_heads: int = 4
    num_kv_heads: int = 0
    head_dim: int = 0
    d_ff: int = 0
    max_seq_len: int = 256
    block: Literal["serial", "parallel"] = "serial"
    position: Literal["learned", "rope"] = "learned"
    rope_base: float = 10000.0
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    mlp: Literal["gelu", "swiglu"] = "gelu"
    tie_embeddings: bool = True
    use_bias: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    norm_eps: float = 1e-5
    init_std: float = 0.02
    remat: Literal["none", "full", "dots", "dots_no_batch"] = "none"
    scan_layers: bool = True
    scan_unroll: int = 1
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    dtype: Literal["float32", "bfloat16"] = "float32"
    matmul_dtype: Literal["activations", "bfloat16", "auto"] = "activations"
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.d_model // self.num_heads

    @property
    def ff_size(self) -> int:
        return self.d_ff or 4 * self.d_model

    def padded_vocab(self, vocab_size: int | None = None) -> int:
        """Embedding rows: `vocab_size` (or this config's) rounded up to `vocab_multiple`."""
        v = vocab_size or self.vocab_size
        m = self.vocab_multiple
        return -(-v // m) * m


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh sizes and the sharding rule set (see `sharding_rules`).

    Axis order (outer to inner): pipeline, data, fsdp, expert, sequence, tensor; the innermost axes get the
    fastest links (NVLink/ICI), as in MaxText and Megatron-LM. `data=-1` takes whatever devices remain.

    Communication overlap (`msjax.parallel`, docs/overlap.md): `tp_overlap` hides Megatron-SP's all-gather and
    reduce-scatter behind the matmuls (`xla`: XLA's windowed einsum flags; `collective_matmul`: our decomposed
    shard_map rings); `fsdp_prefetch` all-gathers layer i+1's FSDP-sharded weights while layer i computes.

    Attributes:
      pipeline: pipeline-parallel stages (PP).
      data: data-parallel replicas (DP); -1 takes the devices that remain.
      fsdp: fully sharded data parallelism (ZeRO-3) ways.
      expert: expert-parallel ways (EP): a mixture of experts' experts split over it, its tokens sent to them by
        all-to-all; every other layer sees it as data parallelism. Above 1 only for MoE models.
      sequence: sequence/context-parallel ways (SP).
      tensor: tensor-parallel ways (TP, Megatron-style).
      rules: the sharding rule set (sharding_rules.RULE_SETS) mapping logical axes to mesh axes.
      tp_overlap: none | xla | collective_matmul (see above).
      fsdp_prefetch: all-gather layer i+1's FSDP-sharded weights during layer i.
    """

    pipeline: int = 1
    data: int = -1
    fsdp: int = 1
    expert: int = 1
    sequence: int = 1
    tensor: int = 1
    rules: str = "fsdp_tp"
    tp_overlap: Literal["none", "xla", "collective_matmul"] = "none"
    fsdp_prefetch: bool = False

    def axis_sizes(self) -> dict[str, int]:
        return {
            "pipeline": self.pipeline,
            "data": self.data,
            "fsdp": self.fsdp,
            "expert": self.expert,
            "sequence": self.sequence,
            "tensor": self.tensor,
        }


@dataclass(frozen=True)
class PipelineConfig:
    """Pipeline parallelism over the `pipeline` mesh axis (interleaved 1F1B; see msjax/parallel/pipeline.py and
    docs/pipeline.md). Only read when mesh.pipeline > 1.

    Attributes:
      microbatches: M, microbatches per pipeline flush; 0 takes mesh.pipeline (the fewest that fill the
        pipeline; raise it to shrink the bubble (P - 1) / (V M + P - 1)). Each of the `train.microbatches`
        gradient-accumulation rounds of a step is one pipeline flush of M microbatches, so a microbatch holds
        train.global_batch / (train.microbatches x M) sequences.
      virtual_stages: V, model chunks per stage (Narayanan et al. 2021 sec. 2.2); a chunk holds
        model.num_layers / (mesh.pipeline x V) layers. V > 1 needs M to be a multiple of mesh.pipeline.
      schedule: "interleaved", msjax's interleaved 1F1B (each tick a forward and a backward on every stage), or a
        schedule run from its action table, one pass a tick (msjax/parallel/schedules.py, zero_bubble.py): "1f1b"
        (V = 1), "zb-h1" (V = 1) and "zb-v" (V = 2), the last two with each backward split into its input and
        weight gradients (Qi et al. 2024), the weight gradients filling the bubble.
    """

    microbatches: int = 0
    virtual_stages: int = 1
    schedule: Literal["interleaved", "1f1b", "zb-h1", "zb-v"] = "interleaved"


@dataclass(frozen=True)
class OptimizerConfig:
    """optax optimizer with linear warmup then cosine decay to `min_lr` (Loshchilov & Hutter 2017).

    LAMB (You et al. 2020) is MegaScale's large-batch optimizer; AdamW (Loshchilov & Hutter 2019) the default.
    decay_steps 0 decays over the whole run (`train.steps`). Weight decay skips norms, biases and embeddings.

    Attributes:
      name: adamw or lamb.
      lr: peak learning rate (after warmup).
      min_lr: learning rate at the end of the cosine decay.
      warmup_steps: steps of linear warmup from 0.
      decay_steps: steps of cosine decay; 0 decays over train.steps.
      b1: first-moment decay (Adam beta1).
      b2: second-moment decay (Adam beta2).
      eps: Adam epsilon.
      weight_decay: decoupled weight decay (not on norms, biases, embeddings).
      grad_clip: global gradient-norm clipping threshold; 0 disables.
    """

    name: Literal["adamw", "lamb"] = "adamw"
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    decay_steps: int = 0
    b1: float = 0.9
    b2: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0


@dataclass(frozen=True)
class DataConfig:
    """Corpus, tokenizer and loader.

    paths empty: the running interpreter's standard-library sources (real text on every machine with Python).
    Otherwise `.txt`, `.jsonl` (field `text_field`) or `.parquet` (column `text_field`) files or directories,
    local or in object storage (`gs://bucket/prefix`, `s3://bucket/prefix`: streamed, see `storage`).
    cache_dir empty: the token cache lives in the user's cache directory (`$XDG_CACHE_HOME/msjax/tokens`, see
    `msjax.runtime.cache_home`), not in the working directory.

    Attributes:
      paths: corpus files or directories (local, gs:// or s3://), comma-separated; empty: the standard-library
        sources.
      text_field: JSON field / parquet column holding the text.
      tokenizer: bpe (byte-level BPE trained on the corpus), byte (UTF-8 bytes) or char (nanoGPT's).
      tokenizer_path: a HF tokenizer.json (local, gs:// or s3://) to use instead of training one (with
        tokenizer=bpe).
      bpe_vocab_size: vocabulary size of the trained BPE.
      val_fraction: share of the corpus held out for validation (by file, else the stream's tail).
      on_decode_error: error (stop, naming file and byte offset) or skip (leave the file out) on invalid UTF-8.
      cache_dir: token cache directory (local: the loader memory-maps it); empty: $XDG_CACHE_HOME/msjax/tokens.
      prefetch: batches prepared ahead by the loader thread.
      seed: seed of the batch sampler.
      format: text (a corpus, sampled as random windows of its token stream) or chat (supervised fine-tuning:
        JSONL files of {"messages": [{"role", "content"}, ...]}, rendered with the chat template, the loss on the
        assistant's tokens only; `msjax.data.sft`). Chat needs a Hugging Face tokenizer (data.tokenizer_path).
      pack: chat: pack several examples into each sequence (segment ids keep them apart; positions restart per
        example), or one example per sequence, padded.
      too_long: chat: an example longer than train.seq_len + 1 tokens is an error naming it, or truncated.
      chat_template: chat: a Jinja template file (.jinja); empty: the template beside data.tokenizer_path (the
        `hf/` directory `convert.py --from_hf` writes into a run).
    """

    paths: tuple[str, ...] = ()
    text_field: str = "text"
    tokenizer: Literal["bpe", "byte", "char"] = "bpe"
    tokenizer_path: str = ""
    bpe_vocab_size: int = 4096
    val_fraction: float = 0.05
    on_decode_error: Literal["error", "skip"] = "error"
    cache_dir: str = ""
    prefetch: int = 2
    seed: int = 0
    format: Literal["text", "chat"] = "text"
    pack: bool = True
    too_long: Literal["error", "truncate"] = "error"
    chat_template: str = ""


@dataclass(frozen=True)
class TrainConfig:
    """Training loop. `global_batch` sequences of `seq_len` tokens per step, split into `microbatches`
    gradient-accumulation steps. Intervals are in steps; 0 disables.

    Attributes:
      steps: optimizer steps of the run.
      seq_len: tokens per sequence T.
      global_batch: sequences per step B, over all devices.
      microbatches: gradient-accumulation steps per optimizer step.
      steps_per_execution: optimizer steps run by one call of the compiled program (a `jax.lax.scan` over that
        many batches), as Keras's `steps_per_execution` and TensorFlow's TPU `iterations_per_loop`. On XLA:CPU each
        call of the step costs ~0.3-0.8 ms in which no op runs (the runtime waking the thread that starts the next
        call) plus ~0.8 ms of host dispatch on the cores the step computes on: with steps of ~25 ms, 10 steps per
        call made the shakespeare_char step 6-10% shorter (docs/cpu_speed.md). The loop, its hooks and its metrics
        see the steps calls end at; a call never runs past a step the loop acts on (a log, evaluation, checkpoint,
        observer window or GC step, the last step): where one falls inside the next K steps, the loop runs single
        steps up to it, so intervals that are multiples of K keep every call K steps long. A stop request or
        preemption notice takes effect after the call in progress.
      seed: seed of the parameter initialisation.
      eval_every: steps between validation losses; 0 evaluates only at the end.
      eval_batches: validation batches per evaluation.
      log_every: steps between logged metrics (loss, tokens/s, MFU); 0 logs only the last step.
      sample_tokens: tokens sampled at the end; 0 skips sampling.
      sample_temperature: softmax temperature of that sample.
      run_dir: local directory for config, metrics, TensorBoard events and (unless checkpoint.dir is set)
        checkpoints.
      progress: show a progress bar.
      loggers: where the loop's metrics go (loss, grad norm, learning rate, tokens/s, MFU, validation loss), any of
        jsonl (<run_dir>/metrics.jsonl), tensorboard (<run_dir>/tb) and wandb (Weights & Biases: `pip install
        msjax[wandb]`; project from $WANDB_PROJECT, default "msjax"; $WANDB_MODE=offline works without an
        account), comma-separated.
      nonfinite: a step whose loss or gradient norm is not finite never updates the state (msjax.faults):
        `skip` goes on with the next batch and counts it (metric `skipped`); `stop` ends the run with an error,
        leaving the newest verified checkpoint as the point `--resume` rolls back to.
    """

    steps: int = 1000
    seq_len: int = 256
    global_batch: int = 16
    microbatches: int = 1
    steps_per_execution: int = 1
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 20
    log_every: int = 10
    sample_tokens: int = 256
    sample_temperature: float = 0.8
    run_dir: str = "runs/default"
    progress: bool = True
    loggers: tuple[str, ...] = ("jsonl", "tensorboard")
    nonfinite: Literal["skip", "stop"] = "skip"


@dataclass(frozen=True)
class CheckpointConfig:
    """Verified two-stage Orbax checkpoints (msjax.checkpoint) every `every` steps (0: only at the end and on a
    stop), written asynchronously. The persistent tier `dir` (default `<run_dir>/checkpoints`) keeps the last
    `keep`; the optional local tier `local_dir` (host RAM such as /dev/shm, or a local disk, a path that may exist
    separately on every host; "" = none) takes each process's own shards first and keeps the newest `local_keep`
    for fast restore, and each process's background copy moves its part on to `dir`. `dir` may be object storage
    (`gs://bucket/run1`, `s3://bucket/run1`; see `storage`): checkpoints are then written to `local_dir` (or,
    without one, a staging directory in the user's cache) and copied up with their integrity record last.
    `resume` restores the newest verified checkpoint of either tier. `timeout_s` bounds every wait on a checkpoint
    write (seconds).

    Attributes:
      dir: persistent-tier checkpoint directory (local, gs:// or s3://); empty: <train.run_dir>/checkpoints.
      every: steps between checkpoints (one is always written at the end and on a stop).
      keep: checkpoints kept in the persistent tier.
      async_save: write in the background while training goes on.
      resume: continue from the newest verified checkpoint (also --resume).
      local_dir: local tier (host RAM such as /dev/shm, or a local disk; per host; local paths only); empty: none.
      local_keep: checkpoints kept in the local tier.
      local_replicas: other hosts that also keep each process's local part (peer replicas,
        msjax.checkpoint.peers): with 1, a job that loses one host still resumes from its newest local step.
        Needs a local tier and several processes; 0: none.
      persistent_every: steps between the checkpoints that also go on to the persistent tier, a multiple of
        `every` (0: every checkpoint); the others stay in the local tier and its peer replicas. The last step, a
        stop, a requested checkpoint and a preemption always go on. Needs a local tier.
      timeout_s: bound on every wait for a checkpoint write, seconds.
      replica_restore: on restore, state replicated over the `data` axis (> 1) is read by one data-parallel
        replica and broadcast to the others, bit for bit (msjax.checkpoint.replica); off, or where it does not
        apply (state split over `data`, a process spanning replicas), every replica reads.
    """

    dir: str = ""
    every: int = 500
    keep: int = 3
    async_save: bool = True
    resume: bool = False
    local_dir: str = ""
    local_keep: int = 1
    local_replicas: int = 0
    persistent_every: int = 0
    timeout_s: float = 600.0
    replica_restore: bool = True


@dataclass(frozen=True)
class StorageConfig:
    """Object storage (msjax.paths): how `gs://` and `s3://` paths in any key (checkpoint.dir, data.paths,
    data.tokenizer_path) are reached. Credentials come from each backend's own chain (for S3: AWS_ACCESS_KEY_ID and
    AWS_SECRET_ACCESS_KEY, ~/.aws or an instance role; for GCS: application default credentials).

    Attributes:
      s3_endpoint: URL of an S3-compatible server (MinIO, Ceph, moto: http://host:port); empty: AWS itself, or
        the AWS_ENDPOINT_URL environment variable.
      s3_region: S3 region; empty: AWS_REGION / AWS_DEFAULT_REGION / ~/.aws/config.
      s3_profile: the named profile of ~/.aws/credentials and ~/.aws/config to take credentials (and, unless set
        here, endpoint and region) from; empty: AWS_PROFILE, else the default chain.
      gcs_endpoint: URL of a GCS-compatible server (an emulator); empty: Google's, or STORAGE_EMULATOR_HOST.
      gcs_credentials: a service-account key file (JSON) to authenticate to GCS with; empty: application default
        credentials (none at all with gcs_endpoint: emulators take anonymous requests).
      timeout_s: bound on connecting to and on each read from object storage, seconds.
      prefixes: settings bound to a path prefix, so that one process reaches several stores (a corpus on one, the
        checkpoints on another): each entry is `<prefix> <key>=<value> ...`, e.g.
        `s3://corpus s3_endpoint=http://minio-a:9000 s3_profile=data`, with keys among PREFIX_SETTINGS. A path takes
        the settings above, then those of each prefix that contains it, shortest first, so the longest prefix wins
        a key set twice (prefixes match whole path components: `s3://corpus` covers `s3://corpus/a`, not
        `s3://corpus2`).
    """

    s3_endpoint: str = ""
    s3_region: str = ""
    s3_profile: str = ""
    gcs_endpoint: str = ""
    gcs_credentials: str = ""
    timeout_s: float = 60.0
    prefixes: tuple[str, ...] = ()

    def prefix_settings(self) -> list[tuple[str, dict[str, Any]]]:
        """(prefix without a trailing slash, the settings it replaces) of each `prefixes` entry, longest first.

        Raises:
          ConfigError: an entry without settings, a prefix that is not a gs:// or s3:// URL with a bucket, a key
            not in PREFIX_SETTINGS or not `key=value`, a bad timeout, a prefix given twice.
        """
        return [(prefix, dict(settings)) for prefix, settings in _parse_prefixes(tuple(self.prefixes))]

    def for_path(self, url: str) -> "StorageConfig":
        """The settings that reach `url` (see `prefixes`), with no prefixes of their own. Raises ConfigError as
        prefix_settings."""
        merged: dict[str, Any] = {}
        # Shortest first: the longer prefix wins.
        for prefix, settings in reversed(_parse_prefixes(tuple(self.prefixes))):
            if url == prefix or url.startswith(prefix + "/"):
                merged.update(settings)
        return dataclasses.replace(self, prefixes=(), **merged)


# The StorageConfig fields a storage.prefixes entry may set.
PREFIX_SETTINGS = ("s3_endpoint", "s3_region", "s3_profile", "gcs_endpoint", "gcs_credentials", "timeout_s")


@functools.lru_cache(maxsize=32)
def _parse_prefixes(prefixes: tuple[str, ...]) -> tuple[tuple[str, dict[str, Any]], ...]:
    """StorageConfig.prefix_settings, parsed once per tuple of entries: msjax.paths asks at every object operation.
    Callers must not change the dicts (prefix_settings hands out copies)."""
    out: dict[str, dict[str, Any]] = {}
    for entry in prefixes:
        prefix, *pairs = entry.split() or [""]
        where = f"storage.prefixes entry {entry!r}"
        if not pairs:
            raise ConfigError(f"{where} binds no settings; allowed: '<prefix> <key>=<value> ...' with keys "
                              f"{', '.join(PREFIX_SETTINGS)}")
        check_path_value(prefix, "storage.prefixes")
        if url_scheme(prefix) not in OBJECT_STORE_SCHEMES:
            raise ConfigError(f"{where}: the prefix {prefix!r} is not an object-storage URL; allowed: "
                              "gs://bucket[/path] or s3://bucket[/path]")
        prefix = prefix.rstrip("/")
        if prefix in out:
            raise ConfigError(f"{where}: the prefix {prefix!r} is given settings twice")
        settings: dict[str, Any] = {}
        for pair in pairs:
            key, eq, value = pair.partition("=")
            if not eq or key not in PREFIX_SETTINGS:
                raise ConfigError(f"{where}: {pair!r} is not a setting; allowed: <key>=<value> with keys "
                                  f"{', '.join(PREFIX_SETTINGS)}")
            settings[key] = coerce(f"{where}: {key}", _field_type(StorageConfig, key), value)
        if not (math.isfinite(settings.get("timeout_s", 1.0)) and settings.get("timeout_s", 1.0) > 0):
            raise ConfigError(f"{where}: timeout_s={settings['timeout_s']}: allowed is a finite number of "
                              "seconds > 0")
        out[prefix] = settings
    return tuple(sorted(out.items(), key=lambda item: -len(item[0])))


@dataclass(frozen=True)
class SupervisorConfig:
    """The supervisor that watches a multi-process run and heals it (`msjax.supervise`): heartbeats, failure
    detection, self-check diagnostics, restarts within a budget with exponential backoff, re-planning.

    A launcher runs a job under the supervisor with `msjax-launch --supervise` (msjax.launch). Times are seconds.

    Attributes:
      heartbeat_period_s: how often each worker sends its heartbeat (its step, with a TTL of the timeout; the one
        heartbeat of msjax.control.hook, supervised or not).
      heartbeat_timeout_s: a worker whose last heartbeat is older than this is failed (a hang, SIGSTOP).
      startup_timeout_s: a worker that has sent no heartbeat this long after its start is failed.
      stall_timeout_s: a worker whose step has not advanced this long while another's did is failed, and so is
        every worker when none advanced this long with heartbeats still coming (a job-wide hang) (0: off; set
        it above the longest checkpoint save or evaluation).
      restart_budget: restarts allowed over the whole run; one more failure ends it with a report.
      backoff_s: delay before a restart is min(backoff_s * 2**k, backoff_max_s), k the failures in a row before
        it (0-based; an attempt that trained resets k, as Kubernetes' CrashLoopBackOff does).
      backoff_max_s: the longest delay before a restart (see backoff_s).
      stop_grace_s: after SIGTERM, how long workers get to save and exit before SIGKILL (when a worker is dead,
        hung or stalled the others cannot step or save: one heartbeat period and a half second at most then,
        msjax.supervise.supervisor.stop_grace).
      diagnose: run the self-checks on every host after a failure and exclude the hosts that fail.
      exclude_after_deaths: a host on which workers died this many times over the run is excluded as a host
        failing its self-checks is, even when they pass (a death: an error exit, an abort or SIGKILL, the OOM
        killer's and a dying node's signal; not a stop by SIGTERM/SIGINT, a hang or a stall:
        msjax.supervise.detect.died), so a host that keeps killing workers does not spend the restart budget; 0:
        never.
      standby: keep a warm standby worker per host (jax and the stack imported) for restarts (local backend;
        msjax.launch.standby).
      diagnose_timeout_s: the diagnostics' time limit (a host that does not answer in time fails).
      diag_min_matmul_flops: the per-device matmul rate below which a host fails its speed check, FLOP/s; 0
        takes 0.1 x the catalogue peak on accelerators and 1e9 on CPU.
      health_check: a site's own node health check, run on every host with the self-checks (a shell command,
        e.g. `nhc` or the script a SLURM site runs as HealthCheckProgram; MSJAX_HOST names the host): a non-zero
        exit fails the host; empty: none.
      spares: extra hosts held back to replace excluded ones (local backend: extra processes).
      replan: when hosts are excluded and no spare is left, re-plan the same global batch onto the devices left.
      replan_hardware: the planner's hardware model for re-planning (empty: the catalogue entry of the devices,
        a100-80g as a stand-in on CPU).
    """

    heartbeat_period_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    startup_timeout_s: float = 300.0
    stall_timeout_s: float = 0.0
    restart_budget: int = 3
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    stop_grace_s: float = 10.0
    diagnose: bool = True
    exclude_after_deaths: int = 2
    standby: bool = True
    diagnose_timeout_s: float = 120.0
    diag_min_matmul_flops: float = 0.0
    health_check: str = ""
    spares: int = 0
    replan: bool = True
    replan_hardware: str = ""

    def check(self) -> None:
        """Range checks; raises ConfigError naming the key."""
        for key in ("heartbeat_period_s", "heartbeat_timeout_s", "startup_timeout_s", "diagnose_timeout_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"supervisor.{key}={getattr(self, key)}: allowed is a number of seconds > 0")
        for key in ("stall_timeout_s", "backoff_s", "backoff_max_s", "stop_grace_s", "diag_min_matmul_flops",
                    "restart_budget", "spares", "exclude_after_deaths"):
            if getattr(self, key) < 0:
                raise ConfigError(f"supervisor.{key}={getattr(self, key)}: allowed is a value >= 0")
        if self.heartbeat_timeout_s <= self.heartbeat_period_s:
            raise ConfigError(f"supervisor.heartbeat_timeout_s={self.heartbeat_timeout_s} must be longer than "
                              f"supervisor.heartbeat_period_s={self.heartbeat_period_s} (else every worker fails)")


@dataclass(frozen=True)
class ObserveConfig:
    """Observability (`msjax/observe`): per-rank step timing, Python GC control, stragglers, profiling.

    Attributes:
      per_rank: every process writes per-step timing, loss, grad norm, lr, tokens/s and MFU to
        `<run_dir>/ranks/rank<i>.jsonl`, and its timing figures to TensorBoard (`<run_dir>/tb/rank<i>`).
      gc_every: automatic garbage collection is off during training and every process collects at the same
        step every `gc_every` steps (torchtitan's gc_freq); 0 leaves Python's automatic collection on.
      window: steps per straggler window: at its end the ranks' per-step figures (own compute timed inside the
        step, host lag, host stall) are gathered and compared (0: no exchange, and no timing inside the step).
      threshold: a rank is a straggler when one of its figures is >= threshold x the other ranks' median in each
        of the last `persist` windows.
      persist: consecutive windows a rank must stand out in before it is flagged.
      own_compute: time each device's own forward and backward from inside the step (two host callbacks per
        device and step, msjax.parallel.arrival), a straggler figure; off by default: on XLA:CPU the callbacks'
        presence slowed the step by about 12% (docs/stragglers.md), and their cost on GPUs is not measured.
      probe: also time a collective-free compute probe at window ends, a second signal: reported and scored,
        never flagging a rank by itself (multi-process runs only: one process has no peer to compare with).
      probe_budget: the most the probe may take, as a fraction of the window's wall time (window x the median
        step time); its chain of matmuls is sized to that at every window end
        (msjax.observe.timing.ComputeProbe).
      profile_steps: "K:N" captures a jax.profiler trace of steps K..K+N-1 into `<run_dir>/profile/`; empty:
        none.
      profile_signal_steps: steps traced when SIGUSR1 asks for a profile (single-process runs).
      exclude_stragglers: under the supervisor, record each flagged straggler's host in the run's excluded
        hosts (the control plane's Redis), so the next restart leaves it out and re-plans (msjax/supervise);
        needs window.
    """

    per_rank: bool = True
    gc_every: int = 50
    window: int = 20
    threshold: float = 1.5
    persist: int = 2
    own_compute: bool = False
    probe: bool = True
    probe_budget: float = 0.005
    profile_steps: str = ""
    profile_signal_steps: int = 3
    exclude_stragglers: bool = False


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)
    name: str = "default"

    def pipeline_microbatches(self, stages: int | None = None) -> int:
        """M, the microbatches one step sends through the pipeline per replica: `pipeline.microbatches`, or the
        stage count when it is 0 (the smallest M that fills a 1F1B pipeline); 1 without pipeline stages.
        `stages`: the pipeline axis size (default mesh.pipeline). The one statement of this rule: the step, the
        schedule and the planner read it here or through `msjax.layout.Layout.microbatches`."""
        p = self.mesh.pipeline if stages is None else stages
        return (self.pipeline.microbatches or p) if p > 1 else 1

    def _check_chat(self) -> None:
        """data.format=chat: the layouts its packed, weighted batches run on (its tokenizer and template are checked
        where the data is read, `msjax.data.sft`)."""
        if self.data.format != "chat":
            return
        from msjax.sharding_rules import OPTIMIZER_STATE_RULES  # local import: sharding_rules must not import msjax

        refused = [(self.mesh.pipeline > 1, f"mesh.pipeline={self.mesh.pipeline} (the pipeline's microbatches "
                                            "carry no segment ids yet)"),
                   (self.mesh.tp_overlap == "collective_matmul", "mesh.tp_overlap=collective_matmul (its block "
                                                                 "computes positions from the shard, not the batch)"),
                   (self.mesh.rules in OPTIMIZER_STATE_RULES, f"mesh.rules={self.mesh.rules} (ZeRO-2 averages the "
                                                              "devices' means; a weighted loss is no mean of them)"),
                   (self.model.attention.impl == "cudnn", "model.attention.impl=cudnn (takes no segment ids here)")]
        for bad, what in refused:
            if bad:
                raise ConfigError(f"data.format=chat does not run with {what}; allowed: mesh.pipeline=1, "
                                  "mesh.tp_overlap other than collective_matmul, a rule set without ZeRO-2, "
                                  "model.attention.impl auto, xla or pallas")

    def _check_moe(self) -> None:
        mo, ep = self.model.moe, self.mesh.expert
        if mo.num_experts < 0:
            raise ConfigError(f"model.moe.num_experts={mo.num_experts}: allowed is an integer >= 0 (0: dense MLP)")
        if not mo.num_experts:
            if ep > 1:
                raise ConfigError(f"mesh.expert={ep}: an expert-parallel axis needs a mixture-of-experts model "
                                  "(model.moe.num_experts > 0); allowed for a dense model: mesh.expert=1")
            return
        if mo.num_experts % ep:
            raise ConfigError(f"mesh.expert={ep}: the model's model.moe.num_experts={mo.num_experts} experts must "
                              "split evenly over it; allowed: a divisor of model.moe.num_experts")
        if ep > 1 and self.mesh.rules == "zero2":
            raise ConfigError(f"mesh.expert={ep} with mesh.rules=zero2: the ZeRO-2 reduction does not split experts; "
                              "allowed: mesh.rules=fsdp_tp, fsdp, tp or dp")
        if not 1 <= mo.experts_per_token <= mo.num_experts:
            raise ConfigError(f"model.moe.experts_per_token={mo.experts_per_token}: allowed is 1 <= k <= "
                              f"model.moe.num_experts={mo.num_experts}")
        for key in ("expert_ff", "shared_experts"):
            if getattr(mo, key) < 0:
                raise ConfigError(f"model.moe.{key}={getattr(mo, key)}: allowed is an integer >= 0")
        if not (math.isfinite(mo.capacity_factor) and mo.capacity_factor >= 0):
            raise ConfigError(f"model.moe.capacity_factor={mo.capacity_factor}: allowed is a number >= 0 "
                              "(0: dropless)")
        for key in ("aux_loss_coef", "z_loss_coef"):
            if not (math.isfinite(getattr(mo, key)) and getattr(mo, key) >= 0):
                raise ConfigError(f"model.moe.{key}={getattr(mo, key)}: allowed is a finite number >= 0")
        if mo.every < 1 or (mo.every > 1 and self.model.scan_layers):
            raise ConfigError(f"model.moe.every={mo.every}: allowed is an integer >= 1, above 1 only with "
                              "model.scan_layers=false (stacked layers share one structure)")
        if self.mesh.pipeline > 1 and mo.every > 1:
            raise ConfigError(f"model.moe.every={mo.every} with mesh.pipeline={self.mesh.pipeline}: a pipeline "
                              "stacks its chunks' layers, so they must all be alike; allowed: model.moe.every=1, "
                              "or mesh.pipeline=1")
        if self.mesh.tp_overlap == "collective_matmul":
            raise ConfigError(f"model.moe.num_experts={mo.num_experts} with mesh.tp_overlap=collective_matmul: the "
                              "collective matmul decomposes a dense MLP; allowed: mesh.tp_overlap=none or xla")
        if self.mesh.fsdp_prefetch:
            raise ConfigError(f"model.moe.num_experts={mo.num_experts} with mesh.fsdp_prefetch=true: the prefetching "
                              "scan does not carry the router's statistics yet; allowed: mesh.fsdp_prefetch=false")

    def validate(self) -> "Config":
        """Cross-field checks that need no devices. Returns self; raises ConfigError naming the key."""
        m, a, t = self.model, self.model.attention, self.train
        _positive(self, "model.num_layers", "model.d_model", "model.num_heads", "model.max_seq_len",
                  "model.vocab_multiple", "train.steps", "train.seq_len", "train.global_batch",
                  "train.microbatches", "checkpoint.keep", "checkpoint.local_keep", "data.prefetch")
        self.supervisor.check()
        _check_optimizer(self.optimizer)
        if self.checkpoint.every < 0:
            raise ConfigError(f"checkpoint.every={self.checkpoint.every}: allowed is an integer >= 0 (0: save "
                              "only at the end and on a stop)")
        c = self.checkpoint
        local_tier = bool(c.local_dir) or url_scheme(c.dir) in OBJECT_STORE_SCHEMES
        if c.local_replicas < 0 or (c.local_replicas and not local_tier):
            raise ConfigError(f"checkpoint.local_replicas={c.local_replicas}: allowed is an integer >= 0, above 0 "
                              "only with a local tier to replicate (checkpoint.local_dir, or checkpoint.dir on "
                              "object storage)")
        off_interval = c.every > 0 and c.persistent_every % c.every != 0
        if c.persistent_every < 0 or (c.persistent_every and (not local_tier or off_interval)):
            raise ConfigError(f"checkpoint.persistent_every={c.persistent_every}: allowed is 0, or a multiple of "
                              f"checkpoint.every={c.every} with a local tier to keep the other checkpoints "
                              "(checkpoint.local_dir, or checkpoint.dir on object storage)")
        if not (math.isfinite(self.checkpoint.timeout_s) and self.checkpoint.timeout_s > 0):
            raise ConfigError(f"checkpoint.timeout_s={self.checkpoint.timeout_s}: allowed is a finite number of "
                              "seconds > 0")
        for key in ("train.run_dir", "checkpoint.dir", "checkpoint.local_dir", "data.tokenizer_path",
                    "data.cache_dir"):
            if get_key(self, key):
                check_path_value(get_key(self, key), key)
        for value in self.data.paths:
            check_path_value(value, "data.paths")
        if not (math.isfinite(self.storage.timeout_s) and self.storage.timeout_s > 0):
            raise ConfigError(f"storage.timeout_s={self.storage.timeout_s}: allowed is a finite number of seconds > 0")
        self.storage.prefix_settings()
        if t.eval_batches < 0 or t.eval_every < 0 or t.log_every < 0:
            raise ConfigError(f"train.eval_batches={t.eval_batches}, train.eval_every={t.eval_every}, "
                              f"train.log_every={t.log_every}: allowed are integers >= 0 (0 disables)")
        self._check_steps_per_execution()
        if m.num_kv_heads and m.num_heads % m.num_kv_heads:
            raise ConfigError(f"model.num_heads={m.num_heads} must be a multiple of model.num_kv_heads="
                              f"{m.num_kv_heads} (grouped-query attention)")
        if not m.head_dim and m.d_model % m.num_heads:
            raise ConfigError(f"model.d_model={m.d_model} must be divisible by model.num_heads={m.num_heads} "
                              "(or set model.head_dim)")
        if m.position == "rope" and m.head_size % 2:
            raise ConfigError(f"model.position='rope' rotates pairs of head dimensions; the head dimension "
                              f"{m.head_size} is odd (set model.head_dim, or model.d_model / model.num_heads, even)")
        if not (math.isfinite(m.rope_base) and m.rope_base > 1.0):
            raise ConfigError(f"model.rope_base={m.rope_base}: allowed is a finite number > 1 (e.g. 10000)")
        _check_rope_scaling(m)
        if not (math.isfinite(m.norm_eps) and m.norm_eps > 0):
            raise ConfigError(f"model.norm_eps={m.norm_eps}: allowed is a finite number > 0")
        if m.scan_unroll < 1 or (m.scan_unroll > 1 and not m.scan_layers):
            raise ConfigError(f"model.scan_unroll={m.scan_unroll}: allowed is an integer >= 1 (layers per scan "
                              f"iteration), above 1 only with model.scan_layers=true (no scan to unroll otherwise)")
        if a.window is not None and a.window < 1:
            raise ConfigError(f"model.attention.window={a.window}: allowed is an integer >= 1, or None for full "
                              "causal attention")
        self._check_moe()
        if t.seq_len > m.max_seq_len:
            raise ConfigError(f"train.seq_len={t.seq_len} is longer than the model's positions "
                              f"(model.max_seq_len={m.max_seq_len})")
        unknown = [name for name in t.loggers if name not in LOGGERS]
        if unknown:
            raise ConfigError(f"train.loggers={','.join(t.loggers)}: unknown {', '.join(map(repr, unknown))}; allowed: "
                              f"{', '.join(LOGGERS)} (comma-separated, any of them)")
        if t.global_batch % t.microbatches:
            raise ConfigError(f"train.global_batch={t.global_batch} must be divisible by train.microbatches="
                              f"{t.microbatches}")
        if not 0.0 < self.data.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction={self.data.val_fraction}: allowed is 0 < value < 1")
        mesh = self.mesh.axis_sizes()
        for axis, size in mesh.items():
            if size < 1 and not (axis == "data" and size == -1):
                raise ConfigError(f"mesh.{axis}={size}: allowed is an integer >= 1"
                                  + (" (or -1: the devices that remain)" if axis == "data" else ""))
        o = self.observe
        if o.gc_every < 0 or o.window < 0 or o.persist < 1 or o.threshold <= 1.0 or o.profile_signal_steps < 1:
            raise ConfigError(f"observe: gc_every={o.gc_every}, window={o.window}, persist={o.persist}, threshold="
                              f"{o.threshold}, profile_signal_steps={o.profile_signal_steps}: allowed is gc_every "
                              ">= 0, window >= 0, persist >= 1, threshold > 1, profile_signal_steps >= 1")
        if not (0.0 < o.probe_budget < 1.0):
            raise ConfigError(f"observe.probe_budget={o.probe_budget}: allowed is a fraction of the window's wall "
                              "time, 0 < probe_budget < 1 (e.g. 0.005)")
        if o.profile_steps:
            first, _, count = o.profile_steps.partition(":")
            if not (first.isdigit() and count.isdigit() and int(first) >= 1 and int(count) >= 1):
                raise ConfigError(f"observe.profile_steps={o.profile_steps!r}: allowed is 'K:N' with first step "
                                  "K >= 1 and N >= 1 steps (e.g. '10:3'), or '' for none")
        if o.exclude_stragglers and not o.window:
            raise ConfigError("observe.exclude_stragglers=true needs observe.window >= 1 (stragglers are found at "
                              "window ends)")
        self._check_chat()
        _check_pipeline(self)
        # The model over the configured axes (data aside: -1 until the devices are known); the rule set's fit to
        # them is checked where the devices are (msjax.layout), as the equivalence tests run any rule set anywhere.
        check_model_split(self, {**self.mesh.axis_sizes(), "data": 1}, rules=False)
        from msjax.sharding_rules import RULE_SETS  # local import: sharding_rules must not import msjax

        if self.mesh.rules not in RULE_SETS:
            raise ConfigError(f"mesh.rules={self.mesh.rules!r} is unknown; allowed: {sorted(RULE_SETS)}")
        if self.mesh.tp_overlap == "collective_matmul":
            sp_rules = sorted(k for k, r in RULE_SETS.items() if r["act_seq"] == ("sequence", "tensor"))
            if self.mesh.rules not in sp_rules:
                raise ConfigError(f"mesh.tp_overlap=collective_matmul decomposes Megatron-SP, which mesh.rules="
                                  f"{self.mesh.rules!r} does not use; allowed rule sets: {', '.join(sp_rules)}")
            if self.mesh.sequence > 1 and a.impl not in ("auto", "xla"):
                raise ConfigError(f"model.attention.impl={a.impl!r} takes no query offset, which context "
                                  "parallelism (mesh.sequence > 1) with mesh.tp_overlap=collective_matmul needs; "
                                  "allowed: auto, xla")
        return self

    def _check_steps_per_execution(self) -> None:
        """`train.steps_per_execution` (K): >= 1, and 1 for what acts on every single step."""
        k = self.train.steps_per_execution
        if k < 1:
            raise ConfigError(f"train.steps_per_execution={k}: allowed is an integer >= 1")
        if k > 1 and self.train.nonfinite == "stop":
            raise ConfigError(f"train.nonfinite=stop stops at the exact step whose loss is not finite, which needs "
                              f"train.steps_per_execution=1 (it is {k}); allowed with K > 1: train.nonfinite=skip")
        if k > 1 and self.observe.own_compute:
            raise ConfigError(f"observe.own_compute times every step from inside it, which needs "
                              f"train.steps_per_execution=1 (it is {k})")


def _check_optimizer(o: OptimizerConfig) -> None:
    """Rejects optimizer settings that would train on garbage: a NaN or negative learning rate, a negative
    warmup, a NaN or negative clip norm (0 means no clipping), betas outside [0, 1), eps <= 0."""
    for key, value in (("lr", o.lr), ("min_lr", o.min_lr), ("weight_decay", o.weight_decay)):
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"optimizer.{key}={value}: allowed is a finite number >= 0")
    for key, value in (("warmup_steps", o.warmup_steps), ("decay_steps", o.decay_steps)):
        if value < 0:
            raise ConfigError(f"optimizer.{key}={value}: allowed is an integer >= 0")
    if not (math.isfinite(o.grad_clip) and o.grad_clip >= 0):
        raise ConfigError(f"optimizer.grad_clip={o.grad_clip}: allowed is a finite global norm > 0, or 0 for no "
                          "clipping")
    for key, value in (("b1", o.b1), ("b2", o.b2)):
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"optimizer.{key}={value}: allowed is 0 <= value < 1")
    if not (math.isfinite(o.eps) and o.eps > 0):
        raise ConfigError(f"optimizer.eps={o.eps}: allowed is a finite number > 0")


def _check_pipeline(cfg: Config) -> None:
    """Divisibility of layers and batch for pipeline parallelism; raises ConfigError naming the key."""
    p, pc, t = cfg.mesh.pipeline, cfg.pipeline, cfg.train
    if pc.microbatches < 0:
        raise ConfigError(f"pipeline.microbatches={pc.microbatches}: allowed is an integer >= 1, or 0 (= "
                          "mesh.pipeline)")
    if pc.virtual_stages < 1:
        raise ConfigError(f"pipeline.virtual_stages={pc.virtual_stages}: allowed is an integer >= 1")
    if p == 1:
        if pc.virtual_stages > 1:
            raise ConfigError(f"pipeline.virtual_stages={pc.virtual_stages} needs mesh.pipeline > 1")
        if pc.schedule != "interleaved":
            raise ConfigError(f"pipeline.schedule={pc.schedule} needs mesh.pipeline > 1")
        return
    chunks = {"1f1b": 1, "zb-h1": 1, "zb-v": 2}.get(pc.schedule)  # the chunks per stage each table runs
    if chunks is not None and pc.virtual_stages != chunks:
        raise ConfigError(f"pipeline.schedule={pc.schedule} runs {chunks} chunk(s) per stage: allowed is "
                          f"pipeline.virtual_stages={chunks}, got {pc.virtual_stages}")
    if chunks is not None and cfg.mesh.tp_overlap == "collective_matmul":
        raise ConfigError(f"pipeline.schedule={pc.schedule} taps each weight matmul of a block, which "
                          "mesh.tp_overlap=collective_matmul computes its own way; allowed: pipeline.schedule="
                          "interleaved, or mesh.tp_overlap none or xla")
    m, v, L = cfg.pipeline_microbatches(), pc.virtual_stages, cfg.model.num_layers
    if L % (p * v):
        raise ConfigError(f"model.num_layers={L} is not divisible by mesh.pipeline x pipeline.virtual_stages = "
                          f"{p} x {v} (every stage chunk holds the same number of layers)")
    if t.global_batch % (t.microbatches * m):
        raise ConfigError(f"train.global_batch={t.global_batch} is not divisible by train.microbatches x "
                          f"pipeline.microbatches = {t.microbatches} x {m}")
    if v > 1 and m % p and pc.schedule == "interleaved":
        raise ConfigError(f"pipeline.microbatches={m} must be a multiple of mesh.pipeline={p} for the interleaved "
                          f"schedule (pipeline.virtual_stages={v} > 1; Narayanan et al. 2021 sec. 2.2)")


def check_model_split(cfg: "Config", sizes: dict[str, int], vocab: int | None = None, rules: bool = True) -> None:
    """Divisibility of the model over mesh `sizes` (layers over pipeline; heads, MLP width and, when given, the
    padded vocabulary `vocab` over tensor; the embedding over fsdp; the sequence over sequence) and, with `rules`,
    whether the rule set splits what each axis above 1 is for (a run and a plan refuse an axis whose work would
    only be repeated; the step itself computes the same function either way). Raises ConfigError naming the key
    that does not divide."""
    m, t, p, f, s = cfg.model, sizes["tensor"], sizes["pipeline"], sizes["fsdp"], sizes["sequence"]
    if p > m.num_layers:
        raise ConfigError(f"mesh.pipeline={p} stages is more than model.num_layers={m.num_layers} layers")
    if m.num_layers % p:
        raise ConfigError(f"model.num_layers={m.num_layers} is not divisible by mesh.pipeline={p} stages")
    for key, value in (("model.num_heads", m.num_heads), ("model.num_kv_heads", m.kv_heads),
                       ("model.d_model", m.d_model), ("model.d_ff", m.ff_size),
                       *((("vocabulary (padded)", vocab),) if vocab else ())):
        if value % t:
            raise ConfigError(f"{key}={value} is not divisible by the tensor-parallel size mesh.tensor={t}")
    if m.d_model % f:
        raise ConfigError(f"model.d_model={m.d_model} is not divisible by mesh.fsdp={f} (FSDP splits the embed "
                          "axis)")
    if cfg.train.seq_len % s:
        raise ConfigError(f"train.seq_len={cfg.train.seq_len} is not divisible by the sequence-parallel size "
                          f"mesh.sequence={s}")
    if not rules:
        return
    from msjax.sharding_rules import OPTIMIZER_STATE_RULES, RULE_SETS  # local: sharding_rules must not import msjax
    from msjax.sharding_rules import axes as ax

    rules = RULE_SETS[cfg.mesh.rules]
    if t > 1 and rules.get(ax.HEADS) != "tensor":
        raise ConfigError(f"mesh.tensor={t} but rule set mesh.rules={cfg.mesh.rules!r} splits nothing over the "
                          "tensor axis (the work would be repeated t times); use 'tp' or 'fsdp_tp'")
    if f > 1 and rules.get(ax.EMBED) != "fsdp" and cfg.mesh.rules not in OPTIMIZER_STATE_RULES:
        raise ConfigError(f"mesh.fsdp={f} but rule set mesh.rules={cfg.mesh.rules!r} shards no parameter over "
                          "fsdp (that is plain data parallelism); use 'fsdp', 'fsdp_tp' or 'zero2', or set mesh.data "
                          "instead")
    if s > 1 and rules.get(ax.ACT_SEQ_INNER) != "sequence":
        raise ConfigError(f"mesh.sequence={s} but rule set mesh.rules={cfg.mesh.rules!r} does not split the "
                          "sequence; use 'tp' or 'fsdp_tp'")


def _positive(cfg: Config, *keys: str) -> None:
    for key in keys:
        value = get_key(cfg, key)
        if value < 1:
            raise ConfigError(f"{key}={value}: allowed is an integer >= 1")


# ---------------------------------------------------------------------------------------------------------------
# Dotted keys: reading, overriding and parsing values from strings.


def get_key(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def flat_keys(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """All leaf keys of a config as {dotted key: value}."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out.update(flat_keys(value, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = value
    return out


def _field_type(cls: type, name: str) -> Any:
    return typing.get_type_hints(cls)[name]


def describe_type(tp: Any) -> str:
    """What a field of type `tp` accepts, in words ("int", "one of 'serial', 'parallel'", "int or None")."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(a) for a in typing.get_args(tp))
    if origin is tuple:
        return "a comma-separated list"
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))


def coerce(key: str, tp: Any, value: Any) -> Any:
    """Converts `value` (a string from the command line, or a Python value from a preset) to type `tp`.

    Strings: bools accept true/false/1/0/yes/no, `X | None` accepts none/null, tuples a comma-separated list,
    ints may hold underscores. Raises ConfigError "`key`=`value`: allowed is ..." on anything else.
    """
    origin = typing.get_origin(tp)
    bad = ConfigError(f"{key}={value!r}: allowed is {describe_type(tp)}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise bad
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if type(None) in args and (value is None or (isinstance(value, str) and value.lower() in ("none", "null"))):
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(key, arg, value)
            except ConfigError:
                pass
        raise bad
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise bad
        return tuple(str(v) for v in value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise bad
    if tp is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        try:
            return int(str(value).replace("_", ""))
        except ValueError:
            raise bad from None
    if tp is float:
        if isinstance(value, bool):
            raise bad
        try:
            return float(value)
        except (TypeError, ValueError):
            raise bad from None
    if tp is str:
        if not isinstance(value, str):
            raise bad
        return value
    raise ConfigError(f"{key}: cannot set a value of type {describe_type(tp)}")


def apply_overrides(cfg: Config, overrides: Mapping[str, Any]) -> Config:
    """Returns a copy of `cfg` with dotted keys replaced; raises ConfigError on unknown keys or bad values."""
    for key, value in overrides.items():
        cfg = _replace_one(cfg, key, value, key.split("."))
    return cfg


def _replace_one(node: Any, full_key: str, value: Any, parts: list[str]) -> Any:
    names = [f.name for f in dataclasses.fields(node)]
    head = parts[0]
    if head not in names:
        prefix = full_key[: len(full_key) - len(".".join(parts))]
        allowed = sorted(f"{prefix}{n}" for n in names)
        raise ConfigError(f"unknown config key {full_key!r}; allowed at this level: {', '.join(allowed)}")
    current = getattr(node, head)
    if len(parts) == 1:
        if dataclasses.is_dataclass(current):
            raise ConfigError(f"{full_key!r} is a section; set one of its keys, e.g. {full_key}."
                              f"{dataclasses.fields(current)[0].name}=...")
        new = coerce(full_key, _field_type(type(node), head), value)
    else:
        if not dataclasses.is_dataclass(current):
            raise ConfigError(f"unknown config key {full_key!r}: {'.'.join(full_key.split('.')[:-len(parts) + 1])} "
                              "has no sub-keys")
        new = _replace_one(current, full_key, value, parts[1:])
    return dataclasses.replace(node, **{head: new})


def preset_names() -> list[str]:
    from msjax import configs

    return sorted(m.name for m in pkgutil.iter_modules(configs.__path__) if not m.name.startswith("_"))


CONFIG_FILE_SUFFIXES = (".py", ".yaml", ".yml", ".json")


def load_preset(name: str) -> Config:
    """The config `--config=name` stands for: a preset `configs/<name>.py` applied to the defaults, or a file.

    Files (anything with a path separator or one of `CONFIG_FILE_SUFFIXES`, or a directory holding
    `config.json`):
      .py: a preset file like those in configs/ (`OVERRIDES`: a dict of dotted keys); the run is named after the
        file.
      .json, .yaml/.yml: a mapping of keys, as nested sections (`{"model": {"d_model": 64}}`) or dotted keys
        (`{"model.d_model": 64}`), applied to the defaults; `name` names the run (else the file's name). A run
        directory's `config.json` (every key, written by the run) reproduces that run exactly.
    Several, comma-separated (`runs/llama,chat_sft`): each later one's keys applied on top of the first (a preset's
    OVERRIDES, a file's keys), the run keeping the first one's name: a run or model with a recipe laid over it.
    Not validated (flags may still change it; `Config.validate` comes after).

    Raises:
      ConfigError: an unknown preset name (naming the allowed ones), a missing or unreadable file, a file that is
        not a mapping of keys, or an unknown key or bad value in it (naming the file and the key).
    """
    if "," in name:
        first, *more = [part.strip() for part in name.split(",")]
        cfg = load_preset(first)
        for part in more:
            try:
                cfg = apply_overrides(cfg, _preset_overrides(part))
            except ConfigError as e:
                raise ConfigError(f"--config={name!r}: {e}") from None
        return cfg
    path = Path(name).expanduser()
    is_file = path.suffix in CONFIG_FILE_SUFFIXES or "/" in name or os.sep in name or path.is_dir()
    if not is_file:
        names = preset_names()
        if name not in names:
            raise ConfigError(f"unknown preset --config={name!r}; allowed: {', '.join(names)}, or a path to a "
                              f"{', '.join(CONFIG_FILE_SUFFIXES)} file (a run directory's config.json reproduces "
                              "that run)")
        module = importlib.import_module(f"msjax.configs.{name}")
        return apply_overrides(Config(name=name), module.OVERRIDES)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"--config={name!r}: no such file")
    if path.suffix not in CONFIG_FILE_SUFFIXES:
        raise ConfigError(f"--config={name!r}: allowed file types are {', '.join(CONFIG_FILE_SUFFIXES)}")
    overrides = _read_config_file(path)
    run_name = overrides.pop("name", path.parent.name if path.name == "config.json" else path.stem)
    try:
        return apply_overrides(Config(name=str(run_name)), overrides)
    except ConfigError as e:
        raise ConfigError(f"--config={name!r}: {e}") from None


def _preset_overrides(name: str) -> dict[str, Any]:
    """The dotted keys one preset name or config file of `load_preset` sets (without the name a file may hold)."""
    if not name:
        raise ConfigError("an empty name between commas")
    path = Path(name).expanduser()
    if path.suffix in CONFIG_FILE_SUFFIXES or "/" in name or os.sep in name or path.is_dir():
        if path.is_dir() and (path / "config.json").is_file():
            path = path / "config.json"
        if not path.is_file() or path.suffix not in CONFIG_FILE_SUFFIXES:
            raise ConfigError(f"{name!r}: no such file (allowed: {', '.join(CONFIG_FILE_SUFFIXES)})")
        overrides = _read_config_file(path)
        overrides.pop("name", None)
        return overrides
    if name not in preset_names():
        raise ConfigError(f"unknown preset {name!r}; allowed: {', '.join(preset_names())}")
    return dict(importlib.import_module(f"msjax.configs.{name}").OVERRIDES)


def _read_config_file(path: Path) -> dict[str, Any]:
    """The dotted overrides a config file holds (see `load_preset`)."""
    if path.suffix == ".py":
        spec = importlib.util.spec_from_file_location(f"msjax_config_file_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - any error in the user's file: name the file and the error
            raise ConfigError(f"--config={str(path)!r}: the preset file failed to run: {type(e).__name__}: {e}"
                              ) from None
        doc = getattr(module, "OVERRIDES", None)
        if not isinstance(doc, dict):
            raise ConfigError(f"--config={str(path)!r}: a preset file defines OVERRIDES, a dict of dotted keys "
                              "(like the files in configs/)")
        return dict(doc)
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".json":
            doc = json.loads(text)
        else:
            import yaml  # PyYAML, a dependency already (the Kubernetes manifest)

            doc = yaml.safe_load(text)
    except (json.JSONDecodeError, ValueError) as e:
        raise ConfigError(f"--config={str(path)!r}: not valid {path.suffix[1:].upper()}: {e}") from None
    except Exception as e:  # noqa: BLE001 - yaml.YAMLError and its subclasses
        raise ConfigError(f"--config={str(path)!r}: not valid YAML: {e}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"--config={str(path)!r}: the file must hold a mapping of config keys (sections or "
                          f"dotted keys), not a {type(doc).__name__}")
    return _dotted(doc)


def _dotted(doc: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections -> dotted keys (`{"model": {"d_model": 64}}` -> `{"model.d_model": 64}`); dotted keys kept."""
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if isinstance(value, Mapping):
            out.update(_dotted(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_from_flags(pairs: Sequence[tuple[str, str]], default_preset: str = "gpt_tiny") -> Config:
    """A validated Config from (key, value) flags: `config` picks the preset, `resume` is shorthand for
    `checkpoint.resume`, every other key is a dotted override. Raises ConfigError naming a bad key or value."""
    preset, overrides = default_preset, {}
    for key, value in pairs:
        if key == "config":
            preset = value
        else:
            overrides["checkpoint.resume" if key == "resume" else key] = value
    return apply_overrides(load_preset(preset), overrides).validate()


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
