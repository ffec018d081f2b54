"""Public API: causal sliding-window flash attention with a custom VJP (GPU: Pallas Triton; TPU: splash).

Legend: B batch, T sequence length, H query heads, Hkv key/value heads, K head dim, W window.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from . import kernel as _kernel
from .block_sizes import MIN_BLOCK, TPU_BLOCK_MULTIPLE, BlockSizes
from .block_sizes import default_block_sizes
from .reference import check_inputs, sliding_window_attention_reference

BACKENDS = ("gpu", "cuda", "rocm", "cpu", "tpu", "xla")


@dataclass(frozen=True)
class _Static:
    """Everything the kernels specialise on (hashable: a jit static argument and a custom_vjp nondiff arg)."""

    window: int | None
    sm_scale: float
    block_q: int
    block_k: int
    block_q_dkv: int
    block_k_dkv: int
    block_q_dq: int
    block_k_dq: int
    num_warps: int | None
    num_stages: int
    interpret: bool


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, segment_ids, cfg: _Static):
    out, _ = _flash_fwd(q, k, v, segment_ids, cfg)
    return out


def _flash_fwd(q, k, v, segment_ids, cfg: _Static):
    out, lse = _kernel.flash_forward(
        q, k, v, segment_ids, window=cfg.window, sm_scale=cfg.sm_scale, block_q=cfg.block_q, block_k=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, interpret=cfg.interpret,
    )
    return out, (q, k, v, segment_ids, out, lse)


def _flash_bwd(cfg: _Static, residuals, do):
    q, k, v, segment_ids, out, lse = residuals
    dq, dk, dv = _kernel.flash_backward(
        q, k, v, segment_ids, out, lse, do, window=cfg.window, sm_scale=cfg.sm_scale,
        block_q_dq=cfg.block_q_dq, block_k_dq=cfg.block_k_dq, block_q_dkv=cfg.block_q_dkv,
        block_k_dkv=cfg.block_k_dkv, num_warps=cfg.num_warps, num_stages=cfg.num_stages, interpret=cfg.interpret,
    )
    return dq, dk, dv, None  # segment ids are integers: no cotangent


_flash.defvjp(_flash_fwd, _flash_bwd)


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _pad_axis(x, axis: int, size: int):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def _effective_blocks(sizes: BlockSizes, seq_len: int, smallest: int) -> BlockSizes:
    """Shrinks tiles larger than the (power-of-two rounded) sequence, so short sequences are not over-padded."""
    cap = max(smallest, _next_power_of_two(seq_len))
    return BlockSizes(
        block_q=min(sizes.block_q, cap), block_k=min(sizes.block_k, cap),
        block_q_dkv=min(sizes.block_q_dkv, cap), block_k_dkv=min(sizes.block_k_dkv, cap),
        block_q_dq=min(sizes.block_q_dq, cap), block_k_dq=min(sizes.block_k_dq, cap),
        num_warps=sizes.num_warps, num_stages=sizes.num_stages,
    )


def _max_block(sizes: BlockSizes) -> int:
    return max(sizes.block_q, sizes.block_k, sizes.block_q_dkv, sizes.block_k_dkv, sizes.block_q_dq, sizes.block_k_dq)


@functools.partial(jax.jit, static_argnames=("cfg", "kind"))
def _attention_padded(q, k, v, segment_ids, *, cfg: _Static, kind: str):
    """Pads T (and K on GPU) to the kernel's tiling, runs it, slices the result back. Differentiable: the
    padding and slicing are plain JAX, so padded query rows get a zero cotangent and add nothing to dK/dV."""
    batch, seq_len, num_heads, head_dim = q.shape
    sizes = BlockSizes(
        cfg.block_q, cfg.block_k, cfg.block_q_dkv, cfg.block_k_dkv, cfg.block_q_dq, cfg.block_k_dq,
        cfg.num_warps, cfg.num_stages,
    )
    padded_len = _round_up(seq_len, _max_block(sizes))
    # Padded keys j >= T are only ever visible to padded queries (causality), so no extra mask is needed.
    q_p, k_p, v_p = (_pad_axis(x, 1, padded_len) for x in (q, k, v))
    seg_p = None if segment_ids is None else _pad_axis(segment_ids.astype(jnp.int32), 1, padded_len)
    if kind == "tpu":
        out = _kernel.splash_attention(
            q_p, k_p, v_p, seg_p, window=cfg.window, sm_scale=cfg.sm_scale, block_sizes=sizes,
            interpret=cfg.interpret,
        )
    else:
        # Triton tensors have power-of-two shapes and tl.dot needs K >= 16: zero columns change no logit.
        padded_dim = max(MIN_BLOCK, _next_power_of_two(head_dim))
        q_p, k_p, v_p = (_pad_axis(x, 3, padded_dim) for x in (q_p, k_p, v_p))
        out = _flash(q_p, k_p, v_p, seg_p, cfg)
    return out[:, :seq_len, :, :head_dim]


def sliding_window_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    window: int | None = None,
    segment_ids: jax.Array | None = None,
    sm_scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    backend: str | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Causal sliding-window attention, FlashAttention-2 style, differentiable (custom VJP with Pallas backward).

    Query i attends key j iff i - W < j <= i (W tokens, itself included) and, with segment ids,
    segment_ids[b, i] == segment_ids[b, j] (packed documents do not see each other). The forward is
    FlashAttention-2 Algorithm 1, the backward Algorithm 2 (Dao 2023, arXiv:2307.08691), with key/query tiles
    outside the window skipped, so work grows as T * W instead of T^2. Softmax statistics and accumulators are
    float32 whatever the input dtype.

    Args:
      q: (B, T, H, K) float32, bfloat16 or float16.
      k, v: (B, T, Hkv, K), same dtype as q, H % Hkv == 0 (GQA; Hkv = 1 is MQA).
      window: W >= 1, or None for plain causal attention. W >= T is the same function as None.
      segment_ids: (B, T) integer array or None.
      sm_scale: logit scale; default 1 / sqrt(K).
      block_sizes: tile sizes; default `default_block_sizes()` for the first device's kind. On TPU every block
        must be a multiple of 128.
      backend: "gpu" / "cuda" / "rocm" (Pallas Triton kernels, Ampere and Hopper), "cpu" (the same kernels in
        Pallas interpret mode), "tpu" (jax's splash attention with a LocalMask), "xla" (the plain-JAX reference:
        O(T^2) memory). Default: `jax.default_backend()`.
      interpret: run the Pallas kernels in interpret mode; default True when `backend` or jax's default backend
        is "cpu".

    Returns:
      (B, T, H, K) in q.dtype.

    Raises:
      ValueError: window < 1 (or not an int); q/k/v not 4-D, k and v shapes differ, batch or length differ,
        head dims differ, H % Hkv != 0, dtypes differ; segment_ids not (B, T) integers; unknown backend;
        on TPU, block sizes that are not multiples of 128.
    """
    check_inputs(q, k, v, window, segment_ids)
    if backend is None:
        backend = jax.default_backend()
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    seq_len, head_dim = q.shape[1], q.shape[3]
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    if backend == "xla":
        return sliding_window_attention_reference(q, k, v, window=window, segment_ids=segment_ids, sm_scale=sm_scale)
    if window is not None and window >= seq_len:
        window = None  # the window covers every causal key: skip the window mask entirely
    if interpret is None:
        interpret = backend == "cpu" or jax.default_backend() == "cpu"
    if block_sizes is None:
        block_sizes = default_block_sizes()
    kind = "tpu" if backend == "tpu" else "gpu"
    if kind == "tpu":
        block_sizes.validate_for_tpu()
    sizes = _effective_blocks(block_sizes, seq_len, TPU_BLOCK_MULTIPLE if kind == "tpu" else MIN_BLOCK)
    cfg = _Static(
        window=None if window is None else int(window), sm_scale=float(sm_scale),
        block_q=sizes.block_q, block_k=sizes.block_k, block_q_dkv=sizes.block_q_dkv,
        block_k_dkv=sizes.block_k_dkv, block_q_dq=sizes.block_q_dq, block_k_dq=sizes.block_k_dq,
        num_warps=sizes.num_warps, num_stages=sizes.num_stages, interpret=bool(interpret),
    )
    return _attention_padded(q, k, v, segment_ids, cfg=cfg, kind=kind)
