"""Decoder-only transformer in Flax NNX: single-device math that names its axes. GPT-2/3 and Llama-style blocks.

Legend: B batch, T sequence, S key/cache length, D model width, H query heads, G key/value heads, K head dim,
F MLP width, V vocabulary (padded), L layers.

Blocks are pre-norm. `block="serial"` is GPT-2/3 and Llama: x + attn(norm1(x)), then + mlp(norm2(x)).
`block="parallel"` is the parallel formulation of GPT-J, PaLM (Chowdhery et al. 2022, sec. 2) and MegaScale
(sec. 3.1): x + attn(norm(x)) + mlp(norm(x)), so the two branches' tensor-parallel collectives can be fused and
overlapped. The pieces are chosen by the config: `position` learned (a table added to the token embedding) or
rope (rotary embeddings of queries and keys, `msjax.ops.rope`), `norm` layernorm or rmsnorm, `mlp` gelu (two
matrices) or swiglu (three: `w_gate`, `w_in` (up), `w_out` (down)), biases on or off, tied or untied output
projection. GPT-2 is (learned, layernorm, gelu, biases, tied); Llama is (rope, rmsnorm, swiglu, no biases,
untied) with grouped-query heads. Checkpoints of both convert to and from Hugging Face (`msjax.hf`). With
`model.moe` a block's feed-forward is a mixture of experts (`MoE`, its math in `msjax.ops.moe`), whose router
statistics `GPT.forward` returns beside the logits for the training objective.

Parallelism is not written here: parameters carry logical axis names (`sharding_rules.axes`) and activations pass
through `msjax.sharding.constrain`; the rule set picked in the config decides the layout. What changes how the model
computes is applied from `msjax.parallel`, which this module never imports, at five declared points
(`msjax.sharding.applied`: run a block, scan the stacked layers, mark the backward's end, run a weight matmul, run a
mixture of experts' experts). A block declares what such a transform may use of it: `Block.parallel`, `ln1`/`ln2`,
the attention's `wq`, `wk`, `wv`, `wo`, `finish_qkv()`, `window`, `impl` and dtypes, the MLP's `column_weights()`,
`activate()` and `w_out` (the collective matmul's view of a block), the MoE's `column_weights()`, `activate()`,
`w_out`, `shared` and `shared_gate` (expert parallelism's view). A new block type is a class here plus, where it
needs one, a transform there. With `scan_layers=True` layers are created stacked (leading `layers` axis, parameters
under `blocks`) and run with `jax.lax.scan`, so compile time does not grow with depth: the choice for deep models.
`scan_layers=False` keeps one parameter set per layer (`layers.0`, `layers.1`, ...) and a Python loop, as MaxText
does; for shallow models on CPU its backward pass is faster, the scan paying for per-iteration slices and gradient
stacking.

Decoding (`GPT.decode`, used by `msjax.generate`) runs the same blocks on new tokens at given positions against a
KV cache (`KVCache`): S slots per layer, S = the window for sliding-window attention (a ring: position p lives in
slot p mod S) and the longest sequence otherwise.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, replace
from typing import Any, Iterator

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from flax import nnx

from msjax.config import ModelConfig
from msjax.ops.attention import attention, attention_at_positions
from msjax.ops import matmul
from msjax.ops import moe as moe_ops
from msjax.ops.layer_norm import layer_norm
from msjax.ops.rms_norm import rms_norm
from msjax.ops.rope import rope
from msjax.sharding import applied, constrain
from msjax.sharding_rules import axes as ax

# The name every weight matmul's product carries (`dense`): a product computed through msjax.ops.matmul's custom
# VJP is no `dot_general` to the dots policies, which save it by this name instead.
WEIGHT_MATMUL = "weight_matmul"
_cp = jax.checkpoint_policies
REMAT_POLICIES = {
    "full": _cp.nothing_saveable,
    "dots": _cp.save_from_both_policies(_cp.checkpoint_dots, _cp.save_only_these_names(WEIGHT_MATMUL)),
    "dots_no_batch": _cp.save_from_both_policies(_cp.checkpoint_dots_with_no_batch_dims,
                                                 _cp.save_only_these_names(WEIGHT_MATMUL)),
}

KV_NAMES = (ax.ACT_BATCH, None, ax.ACT_KV_HEADS, ax.ACT_HEAD_DIM)  # layout of one layer's cached keys (B, S, G, K)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str, ...], std: float | None, dtype) -> nnx.Param:
    """A parameter with logical axis names; std None means ones (norm scale), 0.0 zeros (biases)."""
    if std is None:
        value = jnp.ones(shape, dtype)
    elif std == 0.0:
        value = jnp.zeros(shape, dtype)
    else:
        value = std * jax.random.normal(rngs.params(), shape, dtype)
    return nnx.Param(value, out_sharding=names)


def _vocab_param(rngs: nnx.Rngs, cfg: ModelConfig, shape: tuple[int, ...], names: tuple[str, ...], axis: int
                 ) -> nnx.Param:
    """An embedding or output projection whose `axis` runs over the padded vocabulary: the padding entries (ids >=
    vocab_size) start at zero. Their logits are masked, so they get no gradient and stay zero: a checkpoint holds
    nothing in them, and a Hugging Face round trip (which keeps only the real vocabulary) is exact."""
    value = cfg.init_std * jax.random.normal(rngs.params(), shape, jnp.dtype(cfg.param_dtype))
    real = jnp.arange(shape[axis]) < cfg.vocab_size
    real = real.reshape([-1 if i == axis else 1 for i in range(len(shape))])
    return nnx.Param(jnp.where(real, value, 0.0).astype(value.dtype), out_sharding=names)


def _matmul_setting(cfg: ModelConfig) -> tuple[jnp.dtype, bool]:
    """(operand dtype, own backward) of the weight matmuls under `cfg` (`msjax.ops.matmul.resolve` and
    `own_backward`): resolved once per block, and taken by its attention and MLP."""
    operand_dtype = matmul.resolve(cfg.matmul_dtype, cfg.dtype)
    return operand_dtype, matmul.own_backward(operand_dtype, cfg.dtype)


class Norm(nnx.Module):
    """LayerNorm (Ba et al. 2016) or RMSNorm (Zhang and Sennrich 2019) over the last axis, computed in float32 with
    a hand-written backward (`msjax.ops`). LayerNorm has an offset when `use_bias`; RMSNorm never has one."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, size: int | None = None, axis: str = ax.NORM):
        """size: the normalised axis (default d_model; a head's K for query/key norms); axis: its logical name."""
        dt = jnp.dtype(cfg.param_dtype)
        size = size or cfg.d_model
        self.rms = cfg.norm == "rmsnorm"
        self.scale = _param(rngs, (size,), (axis,), None, dt)
        self.bias = _param(rngs, (size,), (axis,), 0.0, dt) if cfg.use_bias and not self.rms else None
        self.eps = cfg.norm_eps

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        if self.rms:
            return rms_norm(x_btd, self.scale[...], self.eps).astype(x_btd.dtype)  # msjax/ops/rms_norm.py
        bias = None if self.bias is None else self.bias[...]
        return layer_norm(x_btd, self.scale[...], bias, self.eps).astype(x_btd.dtype)  # msjax/ops/layer_norm.py


@dataclass(frozen=True)
class WeightMatmul:
    """A weight matmul `einsum(spec, x, w)` out in the activations' dtype `dt`, its operands rounded to `matmul_dt`
    with float32 accumulation, through `msjax.ops.matmul`'s backward where `own_backward` (`matmul.own_backward`);
    plain in `dt`, left to autodiff, elsewhere. `input_grad` and `weight_grad` are the two halves of its backward,
    the same products autodiff (or the own backward) computes, for a transform that runs them apart (the
    pipeline's split backward)."""

    spec: str
    dt: Any
    matmul_dt: Any
    own_backward: bool

    def __call__(self, x: jax.Array, w: jax.Array) -> jax.Array:
        if not self.own_backward:
            return jnp.einsum(self.spec, x, w.astype(self.dt))
        return checkpoint_name(matmul.einsum(self.spec, x, w, self.matmul_dt).astype(self.dt), WEIGHT_MATMUL)

    def input_grad(self, w: jax.Array, dy: jax.Array, x_dtype) -> jax.Array:
        """d(output)/dx applied to `dy`, in `x_dtype`."""
        if self.own_backward:
            return matmul.input_grad(self.spec, w, dy, self.matmul_dt).astype(x_dtype)
        a, b, c = self._indices()
        return jnp.einsum(f"{c},{b}->{a}", dy, w.astype(self.dt)).astype(x_dtype)

    def weight_grad(self, x: jax.Array, dy: jax.Array, w_dtype) -> jax.Array:
        """d(output)/dw applied to `dy`, in `w_dtype`."""
        if self.own_backward:
            return matmul.weight_grad(self.spec, x, dy, self.matmul_dt).astype(w_dtype)
        a, b, c = self._indices()
        return jnp.einsum(f"{a},{c}->{b}", x, dy).astype(w_dtype)

    def _indices(self) -> tuple[str, str, str]:
        """The spec's x, w and output indices ("btd,df->btf" -> btd, df, btf)."""
        ins, out = self.spec.replace(" ", "").split("->")
        a, b = ins.split(",")
        return a, b, out


def dense(spec: str, x: jax.Array, w: jax.Array, dt, matmul_dt, own_backward: bool) -> jax.Array:
    """`WeightMatmul(spec, dt, matmul_dt, own_backward)(x, w)`, or, where a transform asks for every weight matmul
    (`msjax.sharding.Parallelism.weight_matmul`: the pipeline's split backward), what it makes of it."""
    op = WeightMatmul(spec, dt, matmul_dt, own_backward)
    transform = applied().weight_matmul
    return op(x, w) if transform is None else transform(op, x, w)


def default_positions(t: int) -> jax.Array:
    """Positions 0 .. T-1 as (1, T) int32 (broadcast over the batch): every training sequence starts at 0."""
    return jnp.arange(t, dtype=jnp.int32)[None]


@jax.tree_util.register_dataclass
@dataclass
class Packing:
    """Several examples packed into each row of a batch (supervised fine-tuning, `msjax.data.sft`).

    Attributes:
      segments_bt: int32 (B, T): which example of its row a token belongs to; a query attends only keys of its
        own segment (and, as always, causally). Padding has a segment of its own (0 by convention).
      positions_bt: int32 (B, T): each token's position inside its example (0 at the example's first token), what
        rotary or learned position embeddings see, so a packed example is computed as if it stood alone.
    """

    segments_bt: jax.Array
    positions_bt: jax.Array


class Attention(nnx.Module):
    """Multi-head causal self-attention with grouped-query heads, an optional sliding window and optional RoPE.
    `matmuls`: its weight matmuls' (operand dtype, own backward), the block's `_matmul_setting`."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, matmuls: tuple[jnp.dtype, bool]):
        d, h, g, k = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_size
        dt, std = jnp.dtype(cfg.param_dtype), cfg.init_std
        # GPT-2's scaled init of residual projections: std / sqrt(2 L).
        out_std = std / (2 * cfg.num_layers) ** 0.5
        self.wq = _param(rngs, (d, h, k), (ax.EMBED, ax.HEADS, ax.HEAD_DIM), std, dt)
        self.wk = _param(rngs, (d, g, k), (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM), std, dt)
        self.wv = _param(rngs, (d, g, k), (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM), std, dt)
        self.wo = _param(rngs, (h, k, d), (ax.HEADS, ax.HEAD_DIM, ax.EMBED), out_std, dt)
        self.qkv_bias = cfg.use_bias or cfg.qkv_bias
        if self.qkv_bias:
            self.bq = _param(rngs, (h, k), (ax.HEADS, ax.HEAD_DIM), 0.0, dt)
            self.bk = _param(rngs, (g, k), (ax.KV_HEADS, ax.HEAD_DIM), 0.0, dt)
            self.bv = _param(rngs, (g, k), (ax.KV_HEADS, ax.HEAD_DIM), 0.0, dt)
        if cfg.use_bias:
            self.bo = _param(rngs, (d,), (ax.NORM,), 0.0, dt)
        if cfg.qk_norm:  # one gain per head dimension, shared by the heads (Qwen3)
            self.q_norm = Norm(cfg, rngs, size=k, axis=ax.HEAD_DIM)
            self.k_norm = Norm(cfg, rngs, size=k, axis=ax.HEAD_DIM)
        self.qk_norm = cfg.qk_norm
        self.use_bias = cfg.use_bias
        self.rope_base = cfg.rope_base if cfg.position == "rope" else None
        self.rope_scaling = cfg.rope_scaling
        self.window = cfg.attention.window
        self.impl = cfg.attention.impl
        self.dtype = jnp.dtype(cfg.dtype)
        self.matmul_dtype, self.own_backward = matmuls

    def finish_qkv(self, q_bthk: jax.Array, k_btgk: jax.Array, v_btgk: jax.Array, positions_bt: jax.Array
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Biases, query/key norms and rotary embeddings on projected queries, keys and values, in that order (also
        called by `msjax.parallel.collective_matmul` on its own projections). positions_bt: int32 (B or 1, T)."""
        dt = self.dtype
        if self.qkv_bias:
            q_bthk = q_bthk + self.bq[...].astype(dt)
            k_btgk = k_btgk + self.bk[...].astype(dt)
            v_btgk = v_btgk + self.bv[...].astype(dt)
        if self.qk_norm:  # over each head's K, before RoPE (Qwen3's order)
            q_bthk, k_btgk = self.q_norm(q_bthk), self.k_norm(k_btgk)
        if self.rope_base is not None:
            q_bthk = rope(q_bthk, positions_bt, self.rope_base, self.rope_scaling)  # msjax/ops/rope.py
            k_btgk = rope(k_btgk, positions_bt, self.rope_base, self.rope_scaling)
        return q_bthk, k_btgk, v_btgk

    def project(self, x_btd: jax.Array, positions_bt: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries (B, T, H, K), keys and values (B, T, G, K) of `x_btd` at `positions_bt`."""
        dt, mt, own = self.dtype, self.matmul_dtype, self.own_backward
        q_bthk = dense("btd,dhk->bthk", x_btd, self.wq[...], dt, mt, own)
        k_btgk = dense("btd,dgk->btgk", x_btd, self.wk[...], dt, mt, own)
        v_btgk = dense("btd,dgk->btgk", x_btd, self.wv[...], dt, mt, own)
        return self.finish_qkv(q_bthk, k_btgk, v_btgk, positions_bt)

    def output(self, o_bthk: jax.Array) -> jax.Array:
        """The output projection (B, T, H, K) -> (B, T, D)."""
        o_bthk = constrain(o_bthk, (ax.ACT_BATCH, ax.ACT_SEQ_INNER, ax.ACT_HEADS, ax.ACT_HEAD_DIM))
        y_btd = dense("bthk,hkd->btd", o_bthk, self.wo[...], self.dtype, self.matmul_dtype, self.own_backward)
        if self.use_bias:
            y_btd = y_btd + self.bo[...].astype(self.dtype)
        return y_btd

    def __call__(self, x_btd: jax.Array, packing: "Packing | None" = None) -> jax.Array:
        positions_bt = default_positions(x_btd.shape[1]) if packing is None else packing.positions_bt
        q_bthk, k_btgk, v_btgk = self.project(x_btd, positions_bt)
        # Queries keep their sequence split (context parallelism); keys and values are gathered whole.
        q_bthk = constrain(q_bthk, (ax.ACT_BATCH, ax.ACT_SEQ_INNER, ax.ACT_HEADS, ax.ACT_HEAD_DIM))
        k_btgk = constrain(k_btgk, (ax.ACT_BATCH, None, ax.ACT_KV_HEADS, ax.ACT_HEAD_DIM))
        v_btgk = constrain(v_btgk, (ax.ACT_BATCH, None, ax.ACT_KV_HEADS, ax.ACT_HEAD_DIM))
        segments_bt = None if packing is None else packing.segments_bt
        return self.output(attention(q_bthk, k_btgk, v_btgk, window=self.window, impl=self.impl,
                                     segments_bt=segments_bt))

    def decode(self, x_btd: jax.Array, positions_bt: jax.Array, cache: "LayerCache", write: "CacheWrite"
               ) -> tuple[jax.Array, "LayerCache"]:
        """Attention of T new tokens at `positions_bt` (B, T) over this layer's cache plus themselves; returns the
        output (B, T, D) and the cache with the new keys and values written where `write` says."""
        q_bthk, k_btgk, v_btgk = self.project(x_btd, positions_bt)
        k_bsgk = jnp.concatenate([cache.k, k_btgk.astype(cache.k.dtype)], axis=1)  # (B, S + T, G, K)
        v_bsgk = jnp.concatenate([cache.v, v_btgk.astype(cache.v.dtype)], axis=1)
        key_pos_bs = jnp.concatenate([write.slot_pos, positions_bt], axis=1)
        o_bthk = attention_at_positions(q_bthk, k_bsgk, v_bsgk, positions_bt, key_pos_bs, window=self.window)
        return self.output(o_bthk), LayerCache(write.apply(cache.k, k_btgk), write.apply(cache.v, v_btgk))


class MLP(nnx.Module):
    """GeLU MLP, D -> F -> D (two matrices), or SwiGLU (Shazeer 2020): down(silu(gate(x)) * up(x)), three.
    `matmuls`: its weight matmuls' (operand dtype, own backward), the block's `_matmul_setting`."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, matmuls: tuple[jnp.dtype, bool]):
        d, f = cfg.d_model, cfg.ff_size
        dt, std = jnp.dtype(cfg.param_dtype), cfg.init_std
        self.swiglu = cfg.mlp == "swiglu"
        if self.swiglu:
            self.w_gate = _param(rngs, (d, f), (ax.EMBED, ax.MLP), std, dt)
        self.w_in = _param(rngs, (d, f), (ax.EMBED, ax.MLP), std, dt)
        self.w_out = _param(rngs, (f, d), (ax.MLP, ax.EMBED), std / (2 * cfg.num_layers) ** 0.5, dt)
        if cfg.use_bias:
            if self.swiglu:
                self.b_gate = _param(rngs, (f,), (ax.MLP,), 0.0, dt)
            self.b_in = _param(rngs, (f,), (ax.MLP,), 0.0, dt)
            self.b_out = _param(rngs, (d,), (ax.NORM,), 0.0, dt)
        self.use_bias = cfg.use_bias
        self.dtype = jnp.dtype(cfg.dtype)
        self.matmul_dtype, self.own_backward = matmuls

    def column_weights(self) -> list[jax.Array]:
        """The input-side (D, F) matrices, in the order `activate` takes their products: [gate, up] or [in]."""
        return [self.w_gate[...], self.w_in[...]] if self.swiglu else [self.w_in[...]]

    def activate(self, *h_btf: jax.Array) -> jax.Array:
        """The hidden state (B, T, F) from the products x @ w of `column_weights` (biases added here; also called
        by `msjax.parallel.collective_matmul` on its own products)."""
        dt = self.dtype
        if self.swiglu:
            gate_btf, up_btf = h_btf
            if self.use_bias:
                gate_btf, up_btf = gate_btf + self.b_gate[...].astype(dt), up_btf + self.b_in[...].astype(dt)
            return jax.nn.silu(gate_btf) * up_btf
        (in_btf,) = h_btf
        if self.use_bias:
            in_btf = in_btf + self.b_in[...].astype(dt)
        return jax.nn.gelu(in_btf)  # tanh approximation: GPT-2's gelu_new

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        dt, mt, own = self.dtype, self.matmul_dtype, self.own_backward
        h_btf = self.activate(*(dense("btd,df->btf", x_btd, w, dt, mt, own) for w in self.column_weights()))
        h_btf = constrain(h_btf, (ax.ACT_BATCH, ax.ACT_SEQ_INNER, ax.ACT_MLP))
        y_btd = dense("btf,fd->btd", h_btf, self.w_out[...], dt, mt, own)
        if self.use_bias:
            y_btd = y_btd + self.b_out[...].astype(dt)
        return y_btd


# Router statistics of the MoE layers traced inside `collect_router_stats` (one dict per layer, in order).
_ROUTER_STATS: contextvars.ContextVar[list | None] = contextvars.ContextVar("router_stats", default=None)


@contextlib.contextmanager
def collect_router_stats() -> Iterator[list[dict]]:
    """Collects the router statistics of the MoE layers traced inside (`MoE.__call__`: per layer a dict of
    float32 "aux_loss", "z_loss", "dropped" scalars and "load" (E,), the fraction of assignments each expert
    got). Use it inside the function whose outputs carry them (a scan body, a checkpointed layer), so no traced
    value leaves its trace."""
    token = _ROUTER_STATS.set([])
    try:
        yield _ROUTER_STATS.get()
    finally:
        _ROUTER_STATS.reset(token)


def block_with_stats(block: "Block", x_btd: jax.Array, packing: "Packing | None" = None) -> tuple[jax.Array, dict]:
    """One layer and its router statistics: ((B, T, D) output, the MoE's float32 "aux_loss", "z_loss", "dropped"
    scalars and "load" (E,) (`collect_router_stats`), or {} for a dense layer). Call it inside the function whose
    outputs carry the statistics (a scan body, a checkpointed layer, a pipeline chunk)."""
    with collect_router_stats() as found:
        y_btd = block(x_btd, packing)
    return y_btd, (found[0] if found else {})


class MoE(nnx.Module):
    """A mixture of experts in place of the MLP (model.moe.*; the math in `msjax.ops.moe`): a float32 router over
    E experts (`router`, (D, E)), each token through its k experts, each an MLP of width `expert_ff` in model.mlp's
    form (`w_gate`, `w_in`: (E, D, F); `w_out`: (E, F, D); no biases, as Mixtral and Qwen-MoE), weighted by the
    router, dropless or with a capacity; plus `shared` (an MLP of shared_experts x expert_ff every token goes
    through, scaled per token by sigmoid(x . `shared_gate`) when set: Qwen2-MoE). The router's statistics are
    over the whole batch (B T tokens); reports its router losses and load to `collect_router_stats`. The experts'
    grouped matmuls run in the compute dtype (`model.matmul_dtype` and the weight-matmul point apply to the dense
    matmuls only). What follows the routing (and the capacity) is a declared point
    (`msjax.sharding.Parallelism.experts`: expert parallelism runs the routed and shared experts on a mesh,
    `msjax.parallel.expert`), which reads
    `column_weights()`, `activate`, `w_out`, `dtype`, `shared` (its `column_weights()`, `activate`, `w_out`) and
    `shared_gate`."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, matmuls: tuple[jnp.dtype, bool]):
        mo = cfg.moe
        d, f, e = cfg.d_model, mo.expert_ff or cfg.ff_size, mo.num_experts
        dt, std = jnp.dtype(cfg.param_dtype), cfg.init_std
        self.router = _param(rngs, (d, e), (ax.EMBED, ax.EXP), std, dt)
        self.swiglu = cfg.mlp == "swiglu"
        if self.swiglu:
            self.w_gate = _param(rngs, (e, d, f), (ax.EXP, ax.EMBED, ax.MLP), std, dt)
        self.w_in = _param(rngs, (e, d, f), (ax.EXP, ax.EMBED, ax.MLP), std, dt)
        self.w_out = _param(rngs, (e, f, d), (ax.EXP, ax.MLP, ax.EMBED), std / (2 * cfg.num_layers) ** 0.5, dt)
        self.shared = (MLP(replace(cfg, d_ff=mo.shared_experts * f, use_bias=False), rngs, matmuls)
                       if mo.shared_experts else None)
        self.shared_gate = _param(rngs, (d, 1), (ax.EMBED, None), std, dt) if mo.shared_gate else None
        self.k, self.router_kind, self.normalize = mo.experts_per_token, mo.router, mo.normalize_topk
        self.capacity_factor = mo.capacity_factor
        self.dtype = jnp.dtype(cfg.dtype)

    def column_weights(self) -> list[jax.Array]:
        """The experts' input-side (E, D, F) matrices in the compute dtype, in the order `activate` takes their
        products: [gate, up] (SwiGLU) or [in]."""
        cols = [self.w_gate[...], self.w_in[...]] if self.swiglu else [self.w_in[...]]
        return [c.astype(self.dtype) for c in cols]

    def activate(self, *h_nf: jax.Array) -> jax.Array:
        """The experts' hidden state (N, F) from the products of `column_weights`: silu(gate) * up, or gelu."""
        if self.swiglu:
            gate_nf, up_nf = h_nf
            return jax.nn.silu(gate_nf) * up_nf
        return jax.nn.gelu(h_nf[0])

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        b, t, d = x_btd.shape
        dt = self.dtype
        e, k = self.router.shape[-1], self.k
        # float32 router whatever the compute dtype: a small change in a logit can move a token to another expert.
        # Kept (B, T, .): merging a batch split over the mesh with a sequence split over it has GSPMD gather them.
        logits_bte = jnp.einsum("btd,de->bte", x_btd.astype(jnp.float32), self.router[...].astype(jnp.float32))
        weights_btk, experts_btk, probs_bte = moe_ops.route(logits_bte, k, self.router_kind, self.normalize)
        keep = moe_ops.capacity(b * t, k, e, self.capacity_factor)
        transform = applied().experts
        on_mesh = transform is not None  # routed and shared experts computed by the transform
        if on_mesh:
            y_btd, dropped = transform(self, x_btd.astype(dt), weights_btk, experts_btk, keep)
        else:
            y_td, dropped = moe_ops.expert_ffn(x_btd.reshape(b * t, d).astype(dt), weights_btk.reshape(b * t, k),
                                               experts_btk.reshape(b * t, k), self.column_weights(),
                                               self.w_out[...].astype(dt), self.activate, keep)
            y_btd = y_td.reshape(b, t, d)
        if self.shared is not None and not on_mesh:
            shared_btd = self.shared(x_btd)
            if self.shared_gate is not None:
                gate_bt1 = jax.nn.sigmoid(jnp.einsum("btd,do->bto", x_btd.astype(jnp.float32),
                                                     self.shared_gate[...].astype(jnp.float32)))
                shared_btd = (shared_btd.astype(jnp.float32) * gate_bt1).astype(dt)
            y_btd = y_btd + shared_btd
        found = _ROUTER_STATS.get()
        if found is not None:
            found.append({"aux_loss": moe_ops.load_balancing_loss(probs_bte, experts_btk),
                          "z_loss": moe_ops.router_z_loss(logits_bte), "dropped": dropped,
                          "load": moe_ops.expert_fractions(experts_btk, e)})
        return y_btd


class Block(nnx.Module):
    """One transformer layer, serial or parallel (see module docstring); its feed-forward a dense MLP, or a
    mixture of experts (`MoE`) where `model.moe` puts one (`layer`: the block's index)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, layer: int = 0):
        self.parallel = cfg.block == "parallel"
        matmuls = _matmul_setting(cfg)
        self.ln1 = Norm(cfg, rngs)
        self.attn = Attention(cfg, rngs, matmuls)
        self.ln2 = None if self.parallel else Norm(cfg, rngs)
        self.mlp = MoE(cfg, rngs, matmuls) if cfg.moe.is_moe_layer(layer) else MLP(cfg, rngs, matmuls)

    def _residual(self, x_btd: jax.Array, attend) -> tuple[jax.Array, Any]:
        """The block's residual structure around `attend`: (B, T, D) -> ((B, T, D) out, what attend returned
        beside its output (the KV cache when decoding))."""
        if self.parallel:
            h_btd = self.ln1(x_btd)
            y_btd, aux = attend(h_btd)
            return x_btd + y_btd + self.mlp(h_btd), aux
        y_btd, aux = attend(self.ln1(x_btd))
        x_btd = constrain(x_btd + y_btd, (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_EMBED))
        return x_btd + self.mlp(self.ln2(x_btd)), aux

    def __call__(self, x_btd: jax.Array, packing: "Packing | None" = None) -> jax.Array:
        x_btd = constrain(x_btd, (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_EMBED))
        run_block = applied().block  # e.g. the same math with tensor-parallel rings by hand (msjax.parallel)
        if run_block is not None:
            if packing is not None:  # the config refuses this pairing first (Config.validate)
                raise ValueError("packed sequences (segment ids) do not run through a block transform "
                                 "(mesh.tp_overlap=collective_matmul)")
            return run_block(self, x_btd)
        return self._residual(x_btd, lambda h_btd: (self.attn(h_btd, packing), None))[0]

    def decode(self, x_btd: jax.Array, positions_bt: jax.Array, cache: "LayerCache", write: "CacheWrite"
               ) -> tuple[jax.Array, "LayerCache"]:
        """The layer on T new tokens against its KV cache (`Attention.decode`); returns (B, T, D) and the cache."""
        return self._residual(x_btd, lambda h_btd: self.attn.decode(h_btd, positions_bt, cache, write))


@jax.tree_util.register_dataclass
@dataclass
class LayerCache:
    """One layer's cached keys and values, each (B, S, G, K) in the compute dtype."""

    k: jax.Array
    v: jax.Array


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    """The decoding state of every layer (`GPT.decode`).

    Attributes:
      k, v: (L, B, S, G, K) keys and values in the compute dtype (L the layers).
      pos: (B, S) int32, the position whose keys each slot holds, -1 for an empty slot. With a sliding window of
        W, S = W and slot s holds the newest position p = s (mod W) written so far: a ring.
    """

    k: jax.Array
    v: jax.Array
    pos: jax.Array

    @property
    def slots(self) -> int:
        return self.pos.shape[1]


@jax.tree_util.register_dataclass
@dataclass
class CacheWrite:
    """Where T new tokens go in an S-slot cache, the same for every layer.

    Attributes:
      slot_pos: (B, S) int32, the cache's positions before the write (what the new queries see in the cache).
      take: (B, S) int32, the new token each slot takes (when `write`).
      write: (B, S) bool, the slots that take a new token.
    """

    slot_pos: jax.Array
    take: jax.Array
    write: jax.Array

    def apply(self, cache_bsgk: jax.Array, new_btgk: jax.Array) -> jax.Array:
        taken = jax.vmap(lambda new_tgk, take_s: new_tgk[take_s])(new_btgk.astype(cache_bsgk.dtype), self.take)
        return constrain(jnp.where(self.write[:, :, None, None], taken, cache_bsgk), KV_NAMES)


def cache_write(slot_pos_bs: jax.Array, start_b: jax.Array, count_b: jax.Array, t: int) -> CacheWrite:
    """The slots that T new tokens at positions start .. start + count - 1 (per row; tokens past `count` are
    padding) fill: slot s takes the newest new position p = s (mod S), p = last - ((last - s) mod S), when there
    is one (p >= start). With S larger than every position this is slot p = position p."""
    s = slot_pos_bs.shape[1]
    last_b = start_b + count_b - 1
    p_bs = last_b[:, None] - jnp.mod(last_b[:, None] - jnp.arange(s)[None], s)
    take_bs = p_bs - start_b[:, None]
    write_bs = take_bs >= 0
    return CacheWrite(slot_pos_bs, jnp.clip(take_bs, 0, t - 1).astype(jnp.int32), write_bs)


class GPT(nnx.Module):
    """The model: token embedding (+ learned positions), L blocks, final norm, vocabulary projection.

    Args:
      cfg: model config; `cfg.vocab_size` must be set (the trainer fills it from the tokenizer).
      rngs: parameter initialisation keys.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        if cfg.vocab_size < 1:
            raise ValueError(f"model.vocab_size={cfg.vocab_size}: set it (or let the trainer take the tokenizer's)")
        self.cfg = cfg
        v, d, dt = cfg.padded_vocab(), cfg.d_model, jnp.dtype(cfg.param_dtype)
        self.wte = _vocab_param(rngs, cfg, (v, d), (ax.VOCAB, ax.EMBED), axis=0)
        if cfg.position == "learned":
            self.wpe = _param(rngs, (cfg.max_seq_len, d), (ax.POSITION, ax.EMBED), cfg.init_std, dt)

        if cfg.scan_layers:
            @nnx.split_rngs(splits=cfg.num_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: ax.LAYERS})
            def make_blocks(rngs: nnx.Rngs) -> Block:
                return Block(cfg, rngs)

            self.blocks = make_blocks(rngs)
        else:
            self.layers = nnx.List([Block(cfg, rngs, i) for i in range(cfg.num_layers)])
        self.ln_f = Norm(cfg, rngs)
        self.lm_head = None if cfg.tie_embeddings else _vocab_param(rngs, cfg, (d, v), (ax.EMBED, ax.VOCAB), axis=1)

    def __call__(self, tokens_bt: jax.Array, packing: "Packing | None" = None) -> jax.Array:
        """Logits (B, T, V) in float32 for int32 tokens (B, T) at positions 0 .. T-1, or, with `packing`, of several
        examples packed into each row (attention stays inside an example, positions restart at each: `Packing`);
        V is the padded vocabulary, and logits of the padding entries are -1e9 so they take no probability."""
        return self.forward(tokens_bt, packing)[0]

    def forward(self, tokens_bt: jax.Array, packing: "Packing | None" = None) -> tuple[jax.Array, dict]:
        """(`__call__`'s logits, the MoE layers' router statistics): "aux_loss", "z_loss", "dropped" (L_moe,)
        and "load" (L_moe, E) in float32 (`collect_router_stats`), one row per MoE layer in order; {} for a dense
        model."""
        cfg = self.cfg
        x_btd = self.embed(tokens_bt, None if packing is None else packing.positions_bt)

        def remat(f):
            if cfg.remat == "none":
                return f
            return jax.checkpoint(f, policy=REMAT_POLICIES[cfg.remat], prevent_cse=cse_barrier(cfg))

        if cfg.scan_layers:
            graphdef, stacked = nnx.split(self.blocks)
            layer = remat(lambda x, state: block_with_stats(nnx.merge(graphdef, state), x, packing))
            scan = applied().scan_layers  # e.g. layer i+1's FSDP all-gather carried ahead of layer i
            if scan is not None:  # (the config refuses it with MoE layers, whose statistics it would drop)
                x_btd, stats = scan(layer, x_btd, stacked, cfg.scan_unroll), {}
            else:
                x_btd, stats = jax.lax.scan(layer, x_btd, stacked, unroll=cfg.scan_unroll)
        else:
            per_layer = []
            for block in self.layers:
                graphdef, state = nnx.split(block)
                run = remat(lambda state, x, gd=graphdef: block_with_stats(nnx.merge(gd, state), x, packing))
                x_btd, found = run(state, x_btd)
                per_layer += [found] if found else []
            stats = jax.tree.map(lambda *a: jnp.stack(a), *per_layer) if per_layer else {}
        return self.head(x_btd), stats

    def embed(self, tokens_bt: jax.Array, positions_bt: jax.Array | None = None) -> jax.Array:
        """Token (+ learned position) embeddings (B, T, D) in the compute dtype for int32 tokens (B, T) at
        `positions_bt` (B, T) (None: 0 .. T-1): the model's input end (a pipeline's first stage runs only this
        before its layers). Raises ValueError for a sequence longer than model.max_seq_len."""
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        t = tokens_bt.shape[1]
        if t > cfg.max_seq_len:
            raise ValueError(f"sequence length {t} is longer than the model's positions "
                             f"(model.max_seq_len={cfg.max_seq_len})")
        # The lookup reads whole rows: gather the table over the vocab (and FSDP) shards first, or GSPMD falls
        # back to replicating it inside the gather ("involuntary full rematerialization").
        wte_vd = constrain(self.wte[...], (None, ax.ACT_EMBED))
        x_btd = jnp.take(wte_vd, tokens_bt, axis=0)
        if cfg.position == "learned":
            x_btd = x_btd + (self.wpe[...][:t] if positions_bt is None else jnp.take(self.wpe[...], positions_bt, 0))
        x_btd = constrain(x_btd.astype(dt), (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_EMBED))
        # where the backward pass ends: a transform may record when each device's gradient gets there
        mark = applied().backward_end
        return x_btd if mark is None else mark(x_btd)

    def head(self, x_btd: jax.Array) -> jax.Array:
        """Final norm and vocabulary projection: logits (B, T, V) float32 for the last layer's output (B, T, D),
        padding entries -1e9 (the model's output end; a pipeline's last stage runs it after its layers)."""
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        mt, own = _matmul_setting(cfg)
        x_btd = self.ln_f(x_btd)
        if self.lm_head is not None:
            logits_btv = dense("btd,dv->btv", x_btd, self.lm_head[...], dt, mt, own)
        else:
            logits_btv = dense("btd,vd->btv", x_btd, self.wte[...], dt, mt, own)
        logits_btv = constrain(logits_btv.astype(jnp.float32), (ax.ACT_BATCH, ax.ACT_SEQ_INNER, ax.ACT_VOCAB))
        if cfg.padded_vocab() > cfg.vocab_size:
            real = jnp.arange(logits_btv.shape[-1]) < cfg.vocab_size
            logits_btv = jnp.where(real, logits_btv, -1e9)
        return logits_btv

    def decode(self, tokens_bt: jax.Array, start_b: jax.Array, count_b: jax.Array, cache: KVCache
               ) -> tuple[jax.Array, KVCache]:
        """Runs T new tokens per row against the KV cache and writes them into it.

        Row b's new tokens sit at positions start_b .. start_b + T - 1; only the first count_b are real (the rest
        pad a batch of prompts of different lengths: they see no real token's keys and are never cached). Every
        real position must be later than everything already cached for its row and below model.max_seq_len
        (the caller checks: positions are traced here).

        Args:
          tokens_bt: int32 (B, T).
          start_b, count_b: int32 (B,), count_b >= 1.
          cache: from `init_cache` or the previous call.
        Returns:
          (logits (B, T, V) float32 as `__call__`, the updated cache).
        """
        positions_bt = start_b[:, None] + jnp.arange(tokens_bt.shape[1], dtype=jnp.int32)[None]
        x_btd = self.embed(tokens_bt, positions_bt)
        write = cache_write(cache.pos, start_b, count_b, tokens_bt.shape[1])
        new_pos = jnp.where(write.write, jnp.take_along_axis(positions_bt, write.take, axis=1), cache.pos)
        if self.cfg.scan_layers:
            graphdef, stacked = nnx.split(self.blocks)

            def layer(x, xs):
                state, k, v = xs
                x, lc = nnx.merge(graphdef, state).decode(x, positions_bt, LayerCache(k, v), write)
                return x, (lc.k, lc.v)

            x_btd, (k, v) = jax.lax.scan(layer, x_btd, (stacked, cache.k, cache.v), unroll=self.cfg.scan_unroll)
        else:
            ks, vs = [], []
            for i, block in enumerate(self.layers):
                x_btd, lc = block.decode(x_btd, positions_bt, LayerCache(cache.k[i], cache.v[i]), write)
                ks.append(lc.k)
                vs.append(lc.v)
            k, v = jnp.stack(ks), jnp.stack(vs)
        return self.head(x_btd), KVCache(k, v, new_pos)


def cse_barrier(cfg: ModelConfig) -> bool:
    """`jax.checkpoint`'s prevent_cse for a layer: a rolled scan already keeps XLA from merging a rematerialised
    forward with the original (they sit in different loop iterations); a Python loop or an unrolled scan puts both
    in straight-line code, where only the barrier does."""
    return not cfg.scan_layers or cfg.scan_unroll > 1


def cache_slots(cfg: ModelConfig, max_len: int) -> int:
    """S, the slots per layer of a KV cache for sequences of up to `max_len` tokens: the window W when attention
    has one (a ring), else `max_len`."""
    w = cfg.attention.window
    return max_len if w is None else min(w, max_len)


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> KVCache:
    """An empty KV cache (every slot at position -1) for `batch` rows of up to `max_len` tokens; keys and values
    (L, B, S, G, K) zeros in the compute dtype, S = `cache_slots`."""
    s = cache_slots(cfg, max_len)
    shape = (cfg.num_layers, batch, s, cfg.kv_heads, cfg.head_size)
    zeros = jnp.zeros(shape, jnp.dtype(cfg.dtype))
    names = (None, *KV_NAMES)
    return KVCache(constrain(zeros, names), constrain(zeros, names), jnp.full((batch, s), -1, jnp.int32))


def abstract_model(cfg: ModelConfig) -> tuple[nnx.GraphDef, dict, dict]:
    """(graphdef, abstract params, logical PartitionSpecs) of the model, allocating nothing.

    Params are a plain nested dict of jax.ShapeDtypeStruct (what optax and Orbax see); the specs dict has the same
    structure with one logical PartitionSpec per parameter.
    """
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: GPT(cfg, nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    return graphdef, nnx.to_pure_dict(state), nnx.to_pure_dict(nnx.get_partition_spec(state))


def block_graphdef(cfg: ModelConfig) -> nnx.GraphDef:
    """The static structure (nnx.GraphDef) of one transformer block, allocating nothing: what a pipeline stage
    merges with each layer's parameters."""
    with nnx.use_eager_sharding(False):
        block = nnx.eval_shape(lambda: Block(cfg, nnx.Rngs(0)))
    return nnx.split(block)[0]


def ends_graphdef(cfg: ModelConfig) -> tuple[nnx.GraphDef, list[str]]:
    """(GraphDef, sorted top-level parameter keys) of the model without its layers: the embedding, final norm and
    output projection (`GPT.embed`, `GPT.head`), which a pipeline runs on its first and last stage."""
    graphdef, abs_params, _ = abstract_model(replace(cfg, num_layers=0, scan_layers=False))
    return graphdef, sorted(abs_params)


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
    """Concrete float parameters as a plain nested dict (call under jit with out_shardings to create them
    sharded)."""
    with nnx.use_eager_sharding(False):
        model = GPT(cfg, nnx.Rngs(params=key))
    return nnx.to_pure_dict(nnx.state(model))


def apply(graphdef: nnx.GraphDef, params: dict, tokens_bt: jax.Array, packing: Packing | None = None) -> jax.Array:
    """Pure function of the parameters: logits (B, T, V) float32 (`GPT.__call__`). Merging happens at trace time
    only."""
    return nnx.merge(graphdef, params)(tokens_bt, packing)


def apply_with_stats(graphdef: nnx.GraphDef, params: dict, tokens_bt: jax.Array, packing: Packing | None = None
                     ) -> tuple[jax.Array, dict]:
    """`apply` and the MoE layers' router statistics (`GPT.forward`; {} for a dense model)."""
    return nnx.merge(graphdef, params).forward(tokens_bt, packing)


def apply_decode(graphdef: nnx.GraphDef, params: dict, tokens_bt: jax.Array, start_b: jax.Array,
                 count_b: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Pure function of the parameters: `GPT.decode` (logits (B, T, V) float32 and the updated cache)."""
    return nnx.merge(graphdef, params).decode(tokens_bt, start_b, count_b, cache)
