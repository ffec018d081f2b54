"""The architectures msjax reads and writes in Hugging Face format: their config fields and their tensors.

GPT-2 (`GPT2LMHeadModel`, `transformers/models/gpt2/modeling_gpt2.py`): learned positions, LayerNorm, tanh-GeLU MLP
(`gelu_new`), biases everywhere, serial blocks, one fused Q/K/V projection `c_attn`, weights stored (in, out)
(`Conv1D`), output projection tied to the token embedding unless `tie_word_embeddings` is false.
Llama (`LlamaForCausalLM`, `transformers/models/llama/modeling_llama.py`): RoPE in the half-split layout, RMSNorm,
SwiGLU MLP (`gate_proj`, `up_proj`, `down_proj`), grouped-query heads, optional biases (`attention_bias`,
`mlp_bias`), untied output projection unless `tie_word_embeddings`; weights stored (out, in) (`nn.Linear`).
Qwen2/Qwen2.5 (`Qwen2ForCausalLM`) is Llama with biases on the q, k and v projections alone (no attention_bias
field); Qwen3 (`Qwen3ForCausalLM`) is Llama with `q_norm` and `k_norm`, RMSNorms over each query and key head
applied before RoPE. Their sliding-window options (`use_sliding_window`) are refused. Mistral
(`MistralForCausalLM`) is Llama without biases, with an optional sliding window (`sliding_window` W: each query
sees itself and the W-1 tokens before it, msjax's `model.attention.window`). Mixtral (`MixtralForCausalLM`) is
Mistral with every MLP a mixture of `num_local_experts` SwiGLU experts (`block_sparse_moe.experts.{e}.w1` gate,
`w3` up, `w2` down) and a router (`block_sparse_moe.gate`): softmax over the experts, the top
`num_experts_per_tok`, renormalised (msjax's `model.moe` with `router=softmax_topk`, `normalize_topk`).
Qwen2-MoE (`Qwen2MoeForCausalLM`) is Qwen2 with experts (`mlp.experts.{e}.gate_proj`, `up_proj`, `down_proj`),
a router (`mlp.gate`), top-k weights renormalised only with `norm_topk_prob`, and a shared expert every token goes
through (`mlp.shared_expert`, msjax's `shared_experts` x `expert_ff` wide) scaled by sigmoid(`mlp.shared_expert_gate`
x); layers are sparse every `decoder_sparse_step`-th (msjax's `model.moe.every`), dense otherwise. Qwen3-MoE
(`Qwen3MoeForCausalLM`) is Qwen3 with Qwen2-MoE's experts and router and no shared expert.

A `Rule` maps one HF tensor onto one or more msjax parameters of a layer (GPT-2's fused `c_attn` is three), or
onto one expert's slice of a parameter stacked over the experts, and back; `rules(arch, cfg)` lists them in the
order they are read. Every transform is a reshape, a transpose or a split/concatenation: the values are copied
exactly, so msjax -> HF -> msjax returns the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax.numpy as jnp
import numpy as np

from msjax.config import ConfigError, ModelConfig

GPT2 = "GPT2LMHeadModel"
LLAMA = "LlamaForCausalLM"
QWEN2 = "Qwen2ForCausalLM"
QWEN3 = "Qwen3ForCausalLM"
MISTRAL = "MistralForCausalLM"
MIXTRAL = "MixtralForCausalLM"
QWEN2_MOE = "Qwen2MoeForCausalLM"
QWEN3_MOE = "Qwen3MoeForCausalLM"
ARCHITECTURES = (GPT2, LLAMA, QWEN2, QWEN3, MISTRAL, MIXTRAL, QWEN2_MOE, QWEN3_MOE)
MODEL_TYPES = {"gpt2": GPT2, "llama": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3, "mistral": MISTRAL, "mixtral": MIXTRAL,
               "qwen2_moe": QWEN2_MOE, "qwen3_moe": QWEN3_MOE}
MOE_ARCHITECTURES = (MIXTRAL, QWEN2_MOE, QWEN3_MOE)


class HFConversionError(ConfigError):
    """A Hugging Face model or an msjax run that cannot be converted; the message names the field or tensor."""


# ---------------------------------------------------------------------------------------------------------------
# Configs.


def _get(hf: dict, key: str, default: Any = None) -> Any:
    return hf.get(key, default) if hf.get(key) is not None else default


def architecture_of(hf: dict, where: str) -> str:
    """The architecture a HF config.json describes (`architectures[0]`, else `model_type`).

    Raises:
      HFConversionError: an architecture not in ARCHITECTURES (naming the field and what is allowed).
    """
    archs = hf.get("architectures") or []
    if archs:
        if archs[0] not in ARCHITECTURES:
            raise HFConversionError(f"{where}: architectures={archs!r}; msjax converts "
                                    f"{', '.join(ARCHITECTURES)}")
        return archs[0]
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise HFConversionError(f"{where}: model_type={model_type!r} (and no architectures); msjax converts "
                                f"model_type {', '.join(repr(m) for m in MODEL_TYPES)}")
    return MODEL_TYPES[model_type]


def _require(where: str, hf: dict, key: str, allowed: Sequence[Any], default: Any = None) -> None:
    value = hf.get(key, default)
    if value not in allowed:
        raise HFConversionError(f"{where}: {key}={value!r} cannot be represented in msjax; allowed: "
                                f"{', '.join(repr(a) for a in allowed)}")


def _positive_int(where: str, hf: dict, key: str) -> int:
    value = hf.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise HFConversionError(f"{where}: {key}={value!r}; a positive integer is needed")
    return value


def model_overrides_from_hf(hf: dict, where: str) -> tuple[str, dict[str, Any]]:
    """(architecture, dotted `model.*` overrides) for a HF config.json.

    Raises:
      HFConversionError: an unsupported architecture, or a field msjax cannot represent (rotary scaling, another
        activation, attention biases without MLP biases, cross-attention, ...), naming the field.
    """
    arch = architecture_of(hf, where)
    if arch == GPT2:
        _require(where, hf, "activation_function", ("gelu_new", "gelu_pytorch_tanh"), "gelu_new")
        _require(where, hf, "scale_attn_weights", (True,), True)
        _require(where, hf, "scale_attn_by_inverse_layer_idx", (False,), False)
        _require(where, hf, "add_cross_attention", (False,), False)
        d, heads = _positive_int(where, hf, "n_embd"), _positive_int(where, hf, "n_head")
        if d % heads:
            raise HFConversionError(f"{where}: n_embd={d} is not divisible by n_head={heads}")
        inner = _get(hf, "n_inner")
        out = {"model.position": "learned", "model.norm": "layernorm", "model.mlp": "gelu", "model.use_bias": True,
               "model.num_layers": _positive_int(where, hf, "n_layer"), "model.d_model": d,
               "model.num_heads": heads, "model.num_kv_heads": 0, "model.head_dim": 0,
               "model.d_ff": 0 if inner is None or inner == 4 * d else int(inner),
               "model.max_seq_len": _positive_int(where, hf, "n_positions"),
               "model.norm_eps": float(_get(hf, "layer_norm_epsilon", 1e-5)),
               "model.tie_embeddings": bool(_get(hf, "tie_word_embeddings", True)), "model.attention.window": None}
    else:
        _require(where, hf, "hidden_act", ("silu",), "silu")
        qwen2, qwen3 = arch in (QWEN2, QWEN2_MOE), arch in (QWEN3, QWEN3_MOE)
        if qwen2 or qwen3:
            _require(where, hf, "use_sliding_window", (False,), False)
        window = _get(hf, "sliding_window") if arch in (MISTRAL, MIXTRAL) else None
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise HFConversionError(f"{where}: sliding_window={window!r}; a positive integer or null is needed")
        rope = dict(hf.get("rope_parameters") or {})
        scaling = hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
        if rope_type not in ROPE_TYPES:
            raise HFConversionError(f"{where}: rope_parameters.rope_type / rope_scaling={rope_type!r}: msjax's "
                                    f"RoPE scales frequencies as {', '.join(map(repr, ROPE_TYPES))}; allowed: those")
        base = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        params = {**scaling, **rope}  # transformers >= 5 writes rope_parameters, earlier releases rope_scaling
        if qwen3 and _get(hf, "attention_bias", False):
            raise HFConversionError(f"{where}: attention_bias=True: Qwen3's attention biases without MLP biases "
                                    "cannot be represented in msjax; allowed: false")
        if not qwen2 and _get(hf, "attention_bias", False) != _get(hf, "mlp_bias", False):
            raise HFConversionError(f"{where}: attention_bias={hf.get('attention_bias')!r} and mlp_bias="
                                    f"{hf.get('mlp_bias')!r}: msjax has one switch for biases (model.use_bias); "
                                    "allowed: both true or both false")
        d, heads = _positive_int(where, hf, "hidden_size"), _positive_int(where, hf, "num_attention_heads")
        head_dim = _get(hf, "head_dim")
        if head_dim is None and d % heads:
            raise HFConversionError(f"{where}: hidden_size={d} is not divisible by num_attention_heads={heads} "
                                    "and there is no head_dim")
        kv = _get(hf, "num_key_value_heads", heads)
        out = {"model.position": "rope", "model.rope_base": float(base), "model.norm": "rmsnorm",
               "model.mlp": "swiglu", "model.use_bias": arch == LLAMA and bool(_get(hf, "attention_bias", False)),
               "model.qkv_bias": arch == QWEN2 or (arch == QWEN2_MOE and bool(_get(hf, "qkv_bias", True))),
               "model.qk_norm": qwen3,
               "model.num_layers": _positive_int(where, hf, "num_hidden_layers"), "model.d_model": d,
               "model.num_heads": heads, "model.num_kv_heads": 0 if kv == heads else int(kv),
               "model.head_dim": 0 if head_dim is None or head_dim * heads == d else int(head_dim),
               "model.d_ff": _positive_int(where, hf, "intermediate_size"),
               "model.max_seq_len": _positive_int(where, hf, "max_position_embeddings"),
               "model.norm_eps": float(_get(hf, "rms_norm_eps", 1e-6)),
               "model.tie_embeddings": bool(_get(hf, "tie_word_embeddings", False)),
               **_rope_scaling_from_hf(where, rope_type, params)}
        out["model.attention.window"] = window
        if arch in MOE_ARCHITECTURES:
            out.update(_moe_from_hf(where, arch, hf))
    out["model.vocab_size"] = _positive_int(where, hf, "vocab_size")
    out["model.block"] = "serial"
    return arch, out


def _moe_from_hf(where: str, arch: str, hf: dict) -> dict[str, Any]:
    """The `model.moe.*` (and layer-layout) overrides of a Mixtral, Qwen2-MoE or Qwen3-MoE config.json."""
    out = {"model.moe.experts_per_token": _positive_int(where, hf, "num_experts_per_tok"),
           "model.moe.router": "softmax_topk",
           "model.moe.aux_loss_coef": float(_get(hf, "router_aux_loss_coef", 0.001))}
    if arch == MIXTRAL:
        _require(where, hf, "router_jitter_noise", (0, 0.0), 0.0)
        return {**out, "model.moe.num_experts": _positive_int(where, hf, "num_local_experts"),
                "model.moe.expert_ff": _positive_int(where, hf, "intermediate_size"), "model.moe.normalize_topk": True}
    _require(where, hf, "mlp_only_layers", ([], None), [])
    every = _positive_int(where, hf, "decoder_sparse_step")
    expert_ff = _positive_int(where, hf, "moe_intermediate_size")
    # the Hub's Qwen-MoE configs say num_experts; transformers 5 writes Qwen3-MoE's as num_local_experts
    experts = _positive_int(where, hf, "num_experts" if "num_experts" in hf else "num_local_experts")
    out.update({"model.moe.num_experts": experts, "model.moe.expert_ff": expert_ff,
                "model.moe.normalize_topk": bool(_get(hf, "norm_topk_prob", False)), "model.moe.every": every})
    if every > 1:  # sparse and dense layers differ: one parameter set per layer
        out["model.scan_layers"] = False
    if arch == QWEN2_MOE:
        shared = int(_get(hf, "shared_expert_intermediate_size", 0) or 0)
        if shared % expert_ff:
            raise HFConversionError(f"{where}: shared_expert_intermediate_size={shared} is not a multiple of "
                                    f"moe_intermediate_size={expert_ff}; msjax's shared experts are "
                                    "model.moe.shared_experts x expert_ff wide")
        out.update({"model.moe.shared_experts": shared // expert_ff, "model.moe.shared_gate": shared > 0})
    return out


def architecture_for(cfg: ModelConfig) -> str:
    """The HF architecture an msjax model exports to: GPT-2 for (learned, layernorm, gelu); for (rope, rmsnorm,
    swiglu) Qwen3 with query/key norms, Qwen2 with biases on q/k/v alone, Mistral with a sliding window, else Llama.

    Raises:
      HFConversionError: a model the chosen architecture cannot hold (parallel blocks, GPT-2 without biases or
        with grouped-query heads, a sliding window outside Mistral, MLP biases outside Llama, ...), naming every
        field that does not fit.
    """
    gpt2 = {"model.position": (cfg.position, "learned"), "model.norm": (cfg.norm, "layernorm"),
            "model.mlp": (cfg.mlp, "gelu"), "model.use_bias": (cfg.use_bias, True),
            "model.num_kv_heads": (cfg.kv_heads, cfg.num_heads),
            "model.head_dim": (cfg.head_size * cfg.num_heads, cfg.d_model)}
    llama = {"model.position": (cfg.position, "rope"), "model.norm": (cfg.norm, "rmsnorm"),
             "model.mlp": (cfg.mlp, "swiglu")}
    mo = cfg.moe
    common = {"model.block": (cfg.block, "serial")}
    # The Llama family member: Qwen3 for query/key norms, Qwen2 for biases on q/k/v alone, Mistral for a sliding
    # window, else Llama; with a mixture of experts, Qwen3-MoE, Qwen2-MoE or Mixtral.
    window = cfg.attention.window
    if cfg.position == "learned":
        target = GPT2
    elif mo.num_experts:
        target = QWEN3_MOE if cfg.qk_norm else QWEN2_MOE if (cfg.qkv_bias or mo.shared_experts) else MIXTRAL
    else:
        target = QWEN3 if cfg.qk_norm else QWEN2 if cfg.qkv_bias else MISTRAL if window is not None else LLAMA
    if target in MOE_ARCHITECTURES:  # dropless softmax-then-top-k routers, every one of them
        llama.update({"model.moe.router": (mo.router, "softmax_topk"),
                      "model.moe.capacity_factor": (mo.capacity_factor, 0.0)})
        if target == MIXTRAL:
            llama.update({"model.qkv_bias": (cfg.qkv_bias, False), "model.qk_norm": (cfg.qk_norm, False),
                          "model.moe.normalize_topk": (mo.normalize_topk, True),
                          "model.moe.shared_experts": (mo.shared_experts, 0), "model.moe.every": (mo.every, 1)})
        elif target == QWEN3_MOE:
            llama["model.moe.shared_experts"] = (mo.shared_experts, 0)
        else:  # Qwen2-MoE: the shared expert is gated
            llama["model.moe.shared_gate"] = (mo.shared_gate, mo.shared_experts > 0)
    else:  # the other families have no experts
        common["model.moe.num_experts"] = (mo.num_experts, 0)
    if target == GPT2:
        llama = {}
        gpt2.update({"model.qkv_bias": (cfg.qkv_bias, False), "model.qk_norm": (cfg.qk_norm, False)})
    elif target != LLAMA:
        llama.update({"model.use_bias": (cfg.use_bias, False)})  # none of them has MLP biases
        if target in (QWEN3, QWEN3_MOE):
            llama["model.qkv_bias"] = (cfg.qkv_bias, False)
    if target not in (MISTRAL, MIXTRAL):
        common["model.attention.window"] = (window, None)
    wants = {**(gpt2 if target == GPT2 else llama), **common}
    bad = [f"{k}={have!r} (needs {want!r})" for k, (have, want) in wants.items() if have != want]
    if bad:
        raise HFConversionError(f"this model cannot be written as {target} (chosen by model.position="
                                f"{cfg.position!r}, qkv_bias={cfg.qkv_bias}, qk_norm={cfg.qk_norm}, "
                                f"attention.window={window}): "
                                + "; ".join(bad).replace("model.head_dim=", "model.head_dim x "
                                                                                  "num_heads="))
    return target


# HF's rope types msjax computes (msjax.ops.rope.inverse_frequencies), with the fields each one reads:
# (HF field, msjax key under model.rope_scaling). A field in OPTIONAL_ROPE_FIELDS may be absent: msjax's default
# stands for it, and an export leaves out the ones whose default means "absent" (an attention factor of 0).
ROPE_TYPES = {"default": (), "linear": (("factor", "factor"),),
              "llama3": (("factor", "factor"), ("low_freq_factor", "low_freq_factor"),
                         ("high_freq_factor", "high_freq_factor"),
                         ("original_max_position_embeddings", "original_max_seq_len")),
              "yarn": (("factor", "factor"), ("original_max_position_embeddings", "original_max_seq_len"),
                       ("beta_fast", "beta_fast"), ("beta_slow", "beta_slow"),
                       ("attention_factor", "attention_factor"), ("mscale", "mscale"),
                       ("mscale_all_dim", "mscale_all_dim"), ("truncate", "truncate"))}
# (msjax key: its value when HF's field is absent; True when an export writes it even at that value)
OPTIONAL_ROPE_FIELDS = {"beta_fast": (32.0, True), "beta_slow": (1.0, True), "attention_factor": (0.0, False),
                        "mscale": (0.0, False), "mscale_all_dim": (0.0, False), "truncate": (True, False)}


def _rope_scaling_from_hf(where: str, rope_type: str, params: dict[str, Any]) -> dict[str, Any]:
    if rope_type == "default":
        return {"model.rope_scaling.type": "none"}
    out: dict[str, Any] = {"model.rope_scaling.type": rope_type}
    for hf_key, key in ROPE_TYPES[rope_type]:
        if params.get(hf_key) is None:
            if key in OPTIONAL_ROPE_FIELDS:
                continue  # the config's default is the reference's
            raise HFConversionError(f"{where}: rope type {rope_type!r} needs rope_parameters.{hf_key}; it is missing")
        out[f"model.rope_scaling.{key}"] = params[hf_key]
    return out


def _rope_parameters_for(cfg: ModelConfig) -> dict[str, Any]:
    """HF's rope_parameters (transformers >= 5; rope_scaling before) of an msjax model."""
    rs = cfg.rope_scaling
    if rs.type == "none":
        return {"rope_type": "default", "rope_theta": cfg.rope_base}
    written = {}
    for hf_key, key in ROPE_TYPES[rs.type]:
        value = getattr(rs, key)
        default, always = OPTIONAL_ROPE_FIELDS.get(key, (None, True))
        if always or value != default:
            written[hf_key] = value
    return {"rope_type": rs.type, "rope_theta": cfg.rope_base, **written}


def hf_config_for(arch: str, cfg: ModelConfig, special: dict[str, int | None]) -> dict[str, Any]:
    """The HF config.json of an msjax model (float32, no dropout: msjax trains without it). `special`: bos/eos/pad
    token ids (or None)."""
    tokens = {f"{k}_token_id": v for k, v in special.items()}
    if arch == GPT2:
        return {"architectures": [GPT2], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
                "n_positions": cfg.max_seq_len, "n_embd": cfg.d_model, "n_layer": cfg.num_layers,
                "n_head": cfg.num_heads, "n_inner": None if cfg.ff_size == 4 * cfg.d_model else cfg.ff_size,
                "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps,
                "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
                "dtype": "float32", **tokens}
    model_type = {v: k for k, v in MODEL_TYPES.items()}[arch]
    family = ({} if arch == LLAMA else {"sliding_window": cfg.attention.window} if arch in (MISTRAL, MIXTRAL)
              else {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.num_layers})
    mo = cfg.moe
    if arch == MIXTRAL:
        family.update({"num_local_experts": mo.num_experts, "num_experts_per_tok": mo.experts_per_token,
                       "router_aux_loss_coef": mo.aux_loss_coef, "output_router_logits": False,
                       "router_jitter_noise": 0.0})
    elif arch in (QWEN2_MOE, QWEN3_MOE):
        # both spellings of the expert count: the Hub's (num_experts) and transformers 5's for Qwen3-MoE
        family.update({"num_experts": mo.num_experts, "num_experts_per_tok": mo.experts_per_token,
                       **({"num_local_experts": mo.num_experts} if arch == QWEN3_MOE else {}),
                       "moe_intermediate_size": mo.expert_ff or cfg.ff_size, "norm_topk_prob": mo.normalize_topk,
                       "decoder_sparse_step": mo.every, "mlp_only_layers": [],
                       "router_aux_loss_coef": mo.aux_loss_coef, "output_router_logits": False})
        if arch == QWEN2_MOE:
            family.update({"shared_expert_intermediate_size": mo.shared_experts * (mo.expert_ff or cfg.ff_size),
                           "qkv_bias": cfg.qkv_bias})
    return {"architectures": [arch], "model_type": model_type, **family, "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "intermediate_size": (cfg.moe.expert_ff or cfg.ff_size) if arch == MIXTRAL else cfg.ff_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_size,
            "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
            # transformers >= 5 reads rope_parameters, earlier releases rope_theta
            "rope_theta": cfg.rope_base, "rope_parameters": _rope_parameters_for(cfg),
            **({"rope_scaling": _rope_parameters_for(cfg)} if cfg.rope_scaling.type != "none" else {}),
            "attention_bias": cfg.use_bias, "mlp_bias": cfg.use_bias, "tie_word_embeddings": cfg.tie_embeddings,
            "initializer_range": cfg.init_std, "attention_dropout": 0.0, "dtype": "float32", **tokens}


# ---------------------------------------------------------------------------------------------------------------
# Tensors.


@dataclass(frozen=True)
class Rule:
    """One HF tensor <-> msjax parameters.

    Attributes:
      hf: the HF tensor's name (without the `transformer.` prefix GPT-2 checkpoints may or may not carry).
      params: the msjax parameter paths it holds, within the layer (`attn.wq`) or the model (`wte`).
      layer: the layer index, or None for a model-level tensor.
      to_msjax: HF array -> the arrays of `params` (numpy or jax: reshapes, transposes, splits only).
      to_hf: the arrays of `params` -> the HF array.
      expert: the tensor is this expert's slice of parameters stacked over the experts (leading `exp` axis
        after any `layers` axis); None for a whole parameter.
    """

    hf: str
    params: tuple[str, ...]
    layer: int | None
    to_msjax: Callable[[Any], list[Any]]
    to_hf: Callable[[list[Any]], Any]
    expert: int | None = None


def _one(f: Callable[[Any], Any]) -> Callable[[Any], list[Any]]:
    return lambda x: [f(x)]


def _pad_rows(v_pad: int) -> Callable[[Any], Any]:
    """(V, D) -> (V_pad, D): the padding rows are zero (as msjax initialises them)."""
    return lambda x: jnp.pad(x, ((0, v_pad - x.shape[0]), (0, 0)))


def rules(arch: str, cfg: ModelConfig) -> list[Rule]:
    """Every tensor of `arch` for the msjax model `cfg`, model-level tensors first, then layer by layer."""
    d, h, g, k, v = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_size, cfg.vocab_size
    v_pad = cfg.padded_vocab()
    pad = _pad_rows(v_pad)
    out: list[Rule] = []
    if arch == GPT2:
        out += [Rule("wte.weight", ("wte",), None, _one(pad), lambda p: p[0][:v]),
                Rule("wpe.weight", ("wpe",), None, _one(lambda x: x), lambda p: p[0]),
                Rule("ln_f.weight", ("ln_f.scale",), None, _one(lambda x: x), lambda p: p[0]),
                Rule("ln_f.bias", ("ln_f.bias",), None, _one(lambda x: x), lambda p: p[0])]
        if not cfg.tie_embeddings:  # (V, D) -> (D, V_pad)
            out.append(Rule("lm_head.weight", ("lm_head",), None, _one(lambda x: pad(x).T), lambda p: p[0][:, :v].T))
        for i in range(cfg.num_layers):
            pre = f"h.{i}."
            out += [
                Rule(pre + "ln_1.weight", ("ln1.scale",), i, _one(lambda x: x), lambda p: p[0]),
                Rule(pre + "ln_1.bias", ("ln1.bias",), i, _one(lambda x: x), lambda p: p[0]),
                # Conv1D (D, 3 D) = [q | k | v] columns -> three (D, H, K)
                Rule(pre + "attn.c_attn.weight", ("attn.wq", "attn.wk", "attn.wv"), i,
                     lambda x: [x[:, j * d:(j + 1) * d].reshape(d, h, k) for j in range(3)],
                     lambda p: _concat([w.reshape(d, h * k) for w in p], axis=1)),
                Rule(pre + "attn.c_attn.bias", ("attn.bq", "attn.bk", "attn.bv"), i,
                     lambda x: [x[j * d:(j + 1) * d].reshape(h, k) for j in range(3)],
                     lambda p: _concat([b.reshape(h * k) for b in p], axis=0)),
                Rule(pre + "attn.c_proj.weight", ("attn.wo",), i, _one(lambda x: x.reshape(h, k, d)),
                     lambda p: p[0].reshape(h * k, d)),
                Rule(pre + "attn.c_proj.bias", ("attn.bo",), i, _one(lambda x: x), lambda p: p[0]),
                Rule(pre + "ln_2.weight", ("ln2.scale",), i, _one(lambda x: x), lambda p: p[0]),
                Rule(pre + "ln_2.bias", ("ln2.bias",), i, _one(lambda x: x), lambda p: p[0]),
                Rule(pre + "mlp.c_fc.weight", ("mlp.w_in",), i, _one(lambda x: x), lambda p: p[0]),
                Rule(pre + "mlp.c_fc.bias", ("mlp.b_in",), i, _one(lambda x: x), lambda p: p[0]),
                Rule(pre + "mlp.c_proj.weight", ("mlp.w_out",), i, _one(lambda x: x), lambda p: p[0]),
                Rule(pre + "mlp.c_proj.bias", ("mlp.b_out",), i, _one(lambda x: x), lambda p: p[0]),
            ]
        return out
    out += [Rule("model.embed_tokens.weight", ("wte",), None, _one(pad), lambda p: p[0][:v]),
            Rule("model.norm.weight", ("ln_f.scale",), None, _one(lambda x: x), lambda p: p[0])]
    if not cfg.tie_embeddings:
        out.append(Rule("lm_head.weight", ("lm_head",), None, _one(lambda x: pad(x).T), lambda p: p[0][:, :v].T))
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        # nn.Linear stores (out, in): q (H K, D) -> (D, H, K); o (D, H K) -> (H, K, D); MLP (F, D) -> (D, F)
        out += [
            Rule(pre + "input_layernorm.weight", ("ln1.scale",), i, _one(lambda x: x), lambda p: p[0]),
            Rule(pre + "self_attn.q_proj.weight", ("attn.wq",), i, _one(lambda x: x.T.reshape(d, h, k)),
                 lambda p: p[0].reshape(d, h * k).T),
            Rule(pre + "self_attn.k_proj.weight", ("attn.wk",), i, _one(lambda x: x.T.reshape(d, g, k)),
                 lambda p: p[0].reshape(d, g * k).T),
            Rule(pre + "self_attn.v_proj.weight", ("attn.wv",), i, _one(lambda x: x.T.reshape(d, g, k)),
                 lambda p: p[0].reshape(d, g * k).T),
            Rule(pre + "self_attn.o_proj.weight", ("attn.wo",), i, _one(lambda x: x.T.reshape(h, k, d)),
                 lambda p: p[0].reshape(h * k, d).T),
            Rule(pre + "post_attention_layernorm.weight", ("ln2.scale",), i, _one(lambda x: x), lambda p: p[0]),
        ]
        if cfg.moe.is_moe_layer(i):  # router (E, D) -> (D, E); each expert's (F, D) / (D, F) transposed
            moe = pre + ("block_sparse_moe." if arch == MIXTRAL else "mlp.")
            names = (("w1", "w_gate"), ("w3", "w_in"), ("w2", "w_out")) if arch == MIXTRAL else \
                (("gate_proj", "w_gate"), ("up_proj", "w_in"), ("down_proj", "w_out"))
            out.append(Rule(moe + "gate.weight", ("mlp.router",), i, _one(lambda x: x.T), lambda p: p[0].T))
            for e in range(cfg.moe.num_experts):
                out += [Rule(f"{moe}experts.{e}.{w}.weight", (f"mlp.{ours}",), i, _one(lambda x: x.T),
                             lambda p: p[0].T, expert=e) for w, ours in names]
            if cfg.moe.shared_experts:  # Qwen2-MoE's shared expert, an MLP, and its gate (1, D) -> (D, 1)
                out += [Rule(f"{moe}shared_expert.{w}.weight", (f"mlp.shared.{ours}",), i, _one(lambda x: x.T),
                             lambda p: p[0].T) for w, ours in names]
                out.append(Rule(moe + "shared_expert_gate.weight", ("mlp.shared_gate",), i, _one(lambda x: x.T),
                                lambda p: p[0].T))
        else:
            out += [
                Rule(pre + "mlp.gate_proj.weight", ("mlp.w_gate",), i, _one(lambda x: x.T), lambda p: p[0].T),
                Rule(pre + "mlp.up_proj.weight", ("mlp.w_in",), i, _one(lambda x: x.T), lambda p: p[0].T),
                Rule(pre + "mlp.down_proj.weight", ("mlp.w_out",), i, _one(lambda x: x.T), lambda p: p[0].T),
            ]
        if cfg.use_bias or cfg.qkv_bias:
            out += [
                Rule(pre + "self_attn.q_proj.bias", ("attn.bq",), i, _one(lambda x: x.reshape(h, k)),
                     lambda p: p[0].reshape(h * k)),
                Rule(pre + "self_attn.k_proj.bias", ("attn.bk",), i, _one(lambda x: x.reshape(g, k)),
                     lambda p: p[0].reshape(g * k)),
                Rule(pre + "self_attn.v_proj.bias", ("attn.bv",), i, _one(lambda x: x.reshape(g, k)),
                     lambda p: p[0].reshape(g * k)),
            ]
        if cfg.qk_norm:
            out += [Rule(pre + "self_attn.q_norm.weight", ("attn.q_norm.scale",), i, _one(lambda x: x),
                         lambda p: p[0]),
                    Rule(pre + "self_attn.k_norm.weight", ("attn.k_norm.scale",), i, _one(lambda x: x),
                         lambda p: p[0])]
        if cfg.use_bias:
            out += [
                Rule(pre + "self_attn.o_proj.bias", ("attn.bo",), i, _one(lambda x: x), lambda p: p[0]),
                Rule(pre + "mlp.gate_proj.bias", ("mlp.b_gate",), i, _one(lambda x: x), lambda p: p[0]),
                Rule(pre + "mlp.up_proj.bias", ("mlp.b_in",), i, _one(lambda x: x), lambda p: p[0]),
                Rule(pre + "mlp.down_proj.bias", ("mlp.b_out",), i, _one(lambda x: x), lambda p: p[0]),
            ]
    return out


def _concat(parts: list[Any], axis: int) -> Any:
    return (np if all(isinstance(p, np.ndarray) for p in parts) else jnp).concatenate(parts, axis=axis)


# Buffers some HF checkpoints carry that are not parameters (GPT-2's causal-mask buffers in old checkpoints, Llama's
# precomputed rotary frequencies in old ones): skipped on import.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def hf_name_in_file(arch: str, name: str) -> str:
    """Our rule name -> the canonical name in a checkpoint `transformers` writes (GPT-2's `transformer.` prefix
    on everything but lm_head)."""
    if arch == GPT2 and not name.startswith("lm_head"):
        return "transformer." + name
    return name


def canonical_name(arch: str, name: str) -> str:
    """A tensor name found in a checkpoint -> our rule name (GPT-2: with or without `transformer.`)."""
    if arch == GPT2 and name.startswith("transformer."):
        return name[len("transformer."):]
    return name
