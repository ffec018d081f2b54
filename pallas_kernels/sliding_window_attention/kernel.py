"""Pallas kernels for causal sliding-window flash attention: forward, dQ and dK/dV (GPU, Triton backend), and a
TPU wrapper over jax's splash attention.

Legend: B batch, T (padded) sequence length, H query heads, Hkv key/value heads, G = H // Hkv query heads per
key/value head (GQA; G = H is MQA), K (padded) head dim, W window. Query i sees key j iff i - W < j <= i
(and, with segment ids, seg[i] == seg[j]); W = None means plain causal attention.

The GPU kernels follow FlashAttention-2 (Dao 2023, arXiv:2307.08691): the forward is Algorithm 1 (online
softmax over key tiles, one program per query tile, the output rescaled once at the end, the log-sum-exp
saved for the backward), the backward is Algorithm 2 split into two kernels so that no atomics are needed: one
program per key tile accumulates dK/dV over the query tiles that see it, one program per query tile accumulates
dQ over the key tiles it sees; both recompute P = exp(S - LSE) instead of storing it.

Block skipping: a query tile [q0, q0 + bq) only needs keys in [q0 - W + 1, q0 + bq - 1], so its key loop runs
over ceil(~(W + bq) / bk) tiles instead of all of them and the work grows as T * W, not T^2. The bounds live in
`forward_block_bounds` / `dkv_block_bounds`, plain functions of ints that the kernels call on traced program
ids and the tests call on Python ints. Tiles entirely inside the window (and before the diagonal) run without
computing the mask at all; only the two edge strips pay for it.

Everything that the masking and the loop bounds need is static (W, tile sizes, T) except the tile index, so
the loops have dynamic trip counts and no data-dependent control flow; they lower to `scf.for` on Triton and
to a while loop in interpret mode.

Hopper: these Triton kernels run there (Triton emits wgmma for sm_90). A Mosaic GPU (FA3-style, warp-specialised
TMA + wgmma) kernel is not included because it could not be verified without a GPU (jax 0.10.2, CPU jaxlib):
it lowers to the `mosaic_gpu_v2` custom call, but compiling it needs the CUDA plugin's FFI handler; the Mosaic
GPU interpreter (`InterpretGPUParams`) runs wgmma via `run_scoped` accumulators but rejects `run_state` (the
in-place `plgpu.ACC.init` accumulation a fast kernel uses); and its only purpose over this kernel is speed,
which cannot be measured here.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# Finite stand-in for -inf on masked logits (as in jax's own Pallas attention): exp2(MASK - m) underflows to an
# exact 0 and MASK - MASK is 0, never NaN. 0.7 keeps MASK - lse clear of float32 overflow.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


# ----------------------------------------------------------------------------------------------------------------
# Loop bounds (shared by the kernels, the cost estimates and the tests).
# ----------------------------------------------------------------------------------------------------------------


def _all_int(*xs) -> bool:
    return all(isinstance(x, (int, np.integer)) for x in xs)


def _max(a, b):
    return max(a, b) if _all_int(a, b) else jnp.maximum(a, b)


def _min(a, b):
    return min(a, b) if _all_int(a, b) else jnp.minimum(a, b)


def _div(a, b: int):
    """Floor division of a non-negative `a` by a positive static `b` (lax.div truncates, equal for a >= 0)."""
    return a // b if _all_int(a) else lax.div(a, jnp.int32(b))


def _cdiv(a, b: int):
    return _div(a + b - 1, b)


def forward_block_bounds(q_block, block_q: int, block_k: int, window: int | None):
    """Key-tile loop bounds for query tile `q_block` (the forward and the dQ kernels).

    Query rows are [q0, q0 + block_q) with q0 = q_block * block_q; together they see keys
    [q0 - W + 1, q0 + block_q - 1] (causal: [0, q0 + block_q - 1]).

    Returns:
      (lo, full_lo, full_hi, hi): key tiles [lo, hi) are visited, lo <= full_lo <= full_hi <= hi. Tiles in
      [full_lo, full_hi) are visible to every query row of the tile (no mask needed); the others straddle the
      diagonal or the window's trailing edge and are masked. Works on Python ints and on traced int32 scalars.
    """
    q0 = q_block * block_q
    q_end = q0 + block_q  # exclusive
    hi = _cdiv(q_end, block_k)
    if window is None:
        lo = 0
        full_lo = 0
    else:
        lo = _div(_max(q0 - window + 1, 0), block_k)
        # A key tile starting at k0 is inside every row's window iff k0 > (q_end - 1) - W.
        full_lo = _min(_max(_cdiv(_max(q_end - window, 0), block_k), lo), hi)
    # A key tile [k0, k0 + bk) is before every row's diagonal iff k0 + bk - 1 <= q0.
    full_hi = _min(_max(_div(q0 + 1, block_k), full_lo), hi)
    return lo, full_lo, full_hi, hi


def dkv_block_bounds(k_block, block_q: int, block_k: int, window: int | None, num_q_blocks: int):
    """Query-tile loop bounds for key tile `k_block` (the dK/dV kernel).

    Key rows are [k0, k0 + block_k); they are seen by queries [k0, k0 + block_k - 1 + W - 1] (causal: [k0, T)).

    Returns:
      (lo, full_lo, full_hi, hi) over query tiles, same meaning as `forward_block_bounds`.
    """
    k0 = k_block * block_k
    k_last = k0 + block_k - 1
    lo = _div(k0, block_q)
    # A query tile [q0, q0 + bq) is past every key's diagonal iff q0 >= k_last.
    full_lo = _min(_max(_cdiv(k_last, block_q), lo), num_q_blocks)
    if window is None:
        hi = num_q_blocks
        full_hi = hi
    else:
        hi = _min(_cdiv(k_last + window, block_q), num_q_blocks)
        # ... and inside every key's window iff q0 + bq - 1 < k0 + W.
        full_hi = _min(_max(_div(k0 + window, block_q), full_lo), hi)
        full_lo = _min(full_lo, hi)
    return lo, full_lo, full_hi, hi


def visited_tiles_forward(seq_len: int, block_q: int, block_k: int, window: int | None) -> int:
    """Number of (query tile, key tile) pairs the forward / dQ kernels compute for one (batch, head)."""
    total = 0
    for i in range(seq_len // block_q):
        lo, _, _, hi = forward_block_bounds(i, block_q, block_k, window)
        total += hi - lo
    return total


def visited_tiles_dkv(seq_len: int, block_q: int, block_k: int, window: int | None) -> int:
    """Number of (query tile, key tile) pairs the dK/dV kernel computes for one (batch, query head)."""
    total = 0
    num_q_blocks = seq_len // block_q
    for j in range(seq_len // block_k):
        lo, _, _, hi = dkv_block_bounds(j, block_q, block_k, window, num_q_blocks)
        total += hi - lo
    return total


def visible_pairs(seq_len: int, window: int | None) -> int:
    """Unmasked (query, key) pairs of causal sliding-window attention: sum_{i=1..T} min(i, W).

    This is the "useful work" count used for TFLOP/s (as FA2 halves the FLOPs for causal attention).
    """
    w = seq_len if window is None else min(window, seq_len)
    return w * (w + 1) // 2 + (seq_len - w) * w


# ----------------------------------------------------------------------------------------------------------------
# GPU kernels (Pallas Triton backend; also run in interpret mode on CPU).
# ----------------------------------------------------------------------------------------------------------------


def _dot(a, b, *, trans_a: bool = False, trans_b: bool = False):
    """a @ b with float32 accumulation; bf16/f16 operands hit the tensor cores, f32 ones use IEEE f32 (no TF32).

    Pallas Triton lowers a float32 dot at the default precision to TF32 (10-bit mantissa; errors of ~1e-3 on an
    H100, against 1e-5 asked of f32); HIGHEST lowers it to IEEE."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _mask(q_pos, k_pos, q_seg, k_seg, window: int | None):
    """(bq, bk) bool: causal, inside the window, same segment."""
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible = jnp.logical_and(visible, k_pos[None, :] > q_pos[:, None] - window)
    if q_seg is not None:
        visible = jnp.logical_and(visible, q_seg[:, None] == k_seg[None, :])
    return visible


def _three_loops(bounds, body, carry, always_mask: bool):
    """Runs body(idx, carry, masked) over [lo, hi): masked edges, unmasked interior (FA2 causal trick)."""
    lo, full_lo, full_hi, hi = bounds
    if always_mask:  # segment ids can hide any pair: no tile is known to be fully visible
        return lax.fori_loop(lo, hi, functools.partial(body, masked=True), carry)
    carry = lax.fori_loop(lo, full_lo, functools.partial(body, masked=True), carry)
    carry = lax.fori_loop(full_lo, full_hi, functools.partial(body, masked=False), carry)
    return lax.fori_loop(full_hi, hi, functools.partial(body, masked=True), carry)


def _fwd_kernel(*refs, sm_scale, window, block_q, block_k, has_segments):
    """FA2 Algorithm 1 for one (query tile, batch, head). Refs: q (bq,K), k/v (T,K), [seg (T,)], o (bq,K), lse (bq,)."""
    if has_segments:
        q_ref, k_ref, v_ref, seg_ref, o_ref, lse_ref = refs
    else:
        q_ref, k_ref, v_ref, o_ref, lse_ref = refs
        seg_ref = None
    q_block = pl.program_id(0)
    q0 = q_block * block_q
    q = q_ref[...]
    q_pos = q0 + jnp.arange(block_q)
    q_seg = seg_ref[pl.ds(q0, block_q)] if has_segments else None
    # Work in base 2: exp(x) = exp2(x * log2(e)); folding log2(e) into the softmax scale costs nothing.
    scale2 = sm_scale * LOG2E

    def body(kb, carry, *, masked):
        acc, m_prev, l_prev = carry
        k0 = kb * block_k
        k = k_ref[pl.ds(k0, block_k), :]
        v = v_ref[pl.ds(k0, block_k), :]
        s = _dot(q, k, trans_b=True) * scale2  # (bq, bk), log2 units
        if masked:
            k_seg = seg_ref[pl.ds(k0, block_k)] if has_segments else None
            s = jnp.where(_mask(q_pos, k0 + jnp.arange(block_k), q_seg, k_seg, window), s, MASK_VALUE)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        alpha = jnp.exp2(m_prev - m_next)  # rescales what was accumulated under the old max
        p = jnp.exp2(s - m_next[:, None])
        l_next = alpha * l_prev + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v)
        return acc, m_next, l_next

    acc = jnp.zeros((block_q, q_ref.shape[-1]), jnp.float32)
    m = jnp.full((block_q,), -jnp.inf, jnp.float32)
    l = jnp.zeros((block_q,), jnp.float32)
    bounds = forward_block_bounds(q_block, block_q, block_k, window)
    acc, m, l = _three_loops(bounds, body, (acc, m, l), always_mask=has_segments)
    # Every row sees at least itself (j = i), so l >= 1 after its diagonal tile: no division by zero.
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = (m + jnp.log2(l)) * LN2  # natural-log LSE


def _dq_kernel(*refs, sm_scale, window, block_q, block_k, has_segments):
    """dQ for one (query tile, batch, head): FA2 Algorithm 2 lines 11-21 restricted to dQ.

    Refs: q/do (bq,K), k/v (T,K), lse/delta (bq,), [seg (T,)], dq (bq,K).
    """
    if has_segments:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, seg_ref, dq_ref = refs
    else:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref = refs
        seg_ref = None
    q_block = pl.program_id(0)
    q0 = q_block * block_q
    q = q_ref[...]
    do = do_ref[...]
    lse2 = lse_ref[...] * LOG2E
    delta = delta_ref[...]
    q_pos = q0 + jnp.arange(block_q)
    q_seg = seg_ref[pl.ds(q0, block_q)] if has_segments else None
    scale2 = sm_scale * LOG2E

    def body(kb, dq, *, masked):
        k0 = kb * block_k
        k = k_ref[pl.ds(k0, block_k), :]
        v = v_ref[pl.ds(k0, block_k), :]
        s = _dot(q, k, trans_b=True) * scale2
        if masked:
            k_seg = seg_ref[pl.ds(k0, block_k)] if has_segments else None
            s = jnp.where(_mask(q_pos, k0 + jnp.arange(block_k), q_seg, k_seg, window), s, MASK_VALUE)
        p = jnp.exp2(s - lse2[:, None])  # P recomputed from the saved LSE, masked entries are exactly 0
        dp = _dot(do, v, trans_b=True)
        ds = p * (dp - delta[:, None])  # dS = P o (dP - rowsum(dO o O)), FA2 eq. in Algorithm 2 line 16
        return dq + _dot(ds.astype(k.dtype), k)

    dq = jnp.zeros((block_q, q_ref.shape[-1]), jnp.float32)
    bounds = forward_block_bounds(q_block, block_q, block_k, window)
    dq = _three_loops(bounds, body, dq, always_mask=has_segments)
    dq_ref[...] = (dq * sm_scale).astype(dq_ref.dtype)


def _dkv_kernel(*refs, sm_scale, window, block_q, block_k, has_segments, group, num_q_blocks):
    """dK, dV for one (key tile, batch, kv head), summed over the G query heads that share it (GQA).

    Refs: q/do (T,G,K), k/v (bk,K), lse/delta (G,T), [seg (T,)], dk/dv (bk,K).
    """
    if has_segments:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, seg_ref, dk_ref, dv_ref = refs
    else:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref = refs
        seg_ref = None
    k_block = pl.program_id(0)
    k0 = k_block * block_k
    k = k_ref[...]
    v = v_ref[...]
    k_pos = k0 + jnp.arange(block_k)
    k_seg = seg_ref[pl.ds(k0, block_k)] if has_segments else None
    scale2 = sm_scale * LOG2E
    bounds = dkv_block_bounds(k_block, block_q, block_k, window, num_q_blocks)

    def head_body(g, carry):
        def body(qb, carry, *, masked):
            dk, dv = carry
            q0 = qb * block_q
            q = q_ref[pl.ds(q0, block_q), g, :]
            do = do_ref[pl.ds(q0, block_q), g, :]
            lse2 = lse_ref[g, pl.ds(q0, block_q)] * LOG2E
            delta = delta_ref[g, pl.ds(q0, block_q)]
            s = _dot(q, k, trans_b=True) * scale2  # (bq, bk)
            if masked:
                q_seg = seg_ref[pl.ds(q0, block_q)] if has_segments else None
                s = jnp.where(_mask(q0 + jnp.arange(block_q), k_pos, q_seg, k_seg, window), s, MASK_VALUE)
            p = jnp.exp2(s - lse2[:, None])
            dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)  # P^T dO
            dp = _dot(do, v, trans_b=True)
            ds = p * (dp - delta[:, None])
            dk = dk + _dot(ds.astype(q.dtype), q, trans_a=True)  # dS^T Q
            return dk, dv

        return _three_loops(bounds, body, carry, always_mask=has_segments)

    zeros = jnp.zeros((block_k, k_ref.shape[-1]), jnp.float32)
    if group == 1:
        dk, dv = head_body(0, (zeros, zeros))
    else:
        dk, dv = lax.fori_loop(0, group, head_body, (zeros, zeros))
    dk_ref[...] = (dk * sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _compiler_params(num_warps: int | None, num_stages: int, head_dim: int):
    if num_warps is None:
        num_warps = 4 if head_dim <= 64 else 8  # jax's Pallas attention heuristic
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def flash_forward(q, k, v, segment_ids, *, window, sm_scale, block_q, block_k, num_warps, num_stages, interpret):
    """Forward kernel launch on padded inputs.

    Args:
      q: (B, T, H, K); k, v: (B, T, Hkv, K), same dtype; T a multiple of block_q and block_k, K a power of two
        >= 16 (ops.py pads). segment_ids: (B, T) int32 or None.
      window: W >= 1 or None. sm_scale: softmax scale. block_q, block_k: tile sizes. num_warps, num_stages:
        Triton launch parameters. interpret: run in Pallas interpret mode (CPU).

    Returns:
      out (B, T, H, K) in q.dtype and lse (B, H, T) float32, natural log, per query row.
    """
    batch, seq_len, num_heads, head_dim = q.shape
    group = num_heads // k.shape[2]
    has_segments = segment_ids is not None
    kernel = functools.partial(
        _fwd_kernel, sm_scale=sm_scale, window=window, block_q=block_q, block_k=block_k, has_segments=has_segments
    )
    in_specs = [
        pl.BlockSpec((None, block_q, None, head_dim), lambda i, b, h: (b, i, h, 0)),
        pl.BlockSpec((None, seq_len, None, head_dim), lambda i, b, h: (b, 0, lax.div(h, group), 0)),
        pl.BlockSpec((None, seq_len, None, head_dim), lambda i, b, h: (b, 0, lax.div(h, group), 0)),
    ]
    args = [q, k, v]
    if has_segments:
        in_specs.append(pl.BlockSpec((None, seq_len), lambda i, b, h: (b, 0)))
        args.append(segment_ids)
    tiles = visited_tiles_forward(seq_len, block_q, block_k, window) * batch * num_heads
    pairs = tiles * block_q * block_k
    itemsize = q.dtype.itemsize
    cost = pl.CostEstimate(
        flops=4 * pairs * head_dim,  # QK^T and PV
        transcendentals=pairs,  # one exp2 per visited logit
        # q and o once, k and v once per visited tile, lse once
        bytes_accessed=2 * q.size * itemsize + tiles * 2 * block_k * head_dim * itemsize
        + batch * num_heads * seq_len * 4,
    )
    return pl.pallas_call(
        kernel,
        grid=(seq_len // block_q, batch, num_heads),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, block_q, None, head_dim), lambda i, b, h: (b, i, h, 0)),
            pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((batch, num_heads, seq_len), jnp.float32),
        ],
        compiler_params=_compiler_params(num_warps, num_stages, head_dim),
        cost_estimate=cost,
        interpret=interpret,
        name="sliding_window_attention_fwd",
    )(*args)


def flash_backward(q, k, v, segment_ids, out, lse, do, *, window, sm_scale, block_q_dq, block_k_dq, block_q_dkv,
                   block_k_dkv, num_warps, num_stages, interpret):
    """Backward kernel launches on padded inputs (same layout contract as `flash_forward`).

    Args:
      q, k, v, segment_ids: as for `flash_forward`. out: (B, T, H, K) forward output. lse: (B, H, T) float32.
      do: (B, T, H, K) cotangent of out.

    Returns:
      dq (B, T, H, K) in q.dtype, dk and dv (B, T, Hkv, K) in k.dtype / v.dtype.
    """
    batch, seq_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    has_segments = segment_ids is not None
    itemsize = q.dtype.itemsize
    compiler_params = _compiler_params(num_warps, num_stages, head_dim)
    # delta_i = rowsum(dO_i o O_i) (FA2 Algorithm 2 line 4). A separate Pallas kernel would buy nothing: XLA
    # fuses this multiply-reduce into one pass over O and dO.
    delta = jnp.einsum("bthk,bthk->bht", out.astype(jnp.float32), do.astype(jnp.float32))  # (B, H, T)

    # dQ: grid over query tiles.
    dq_tiles = visited_tiles_forward(seq_len, block_q_dq, block_k_dq, window) * batch * num_heads
    dq_pairs = dq_tiles * block_q_dq * block_k_dq
    in_specs = [
        pl.BlockSpec((None, block_q_dq, None, head_dim), lambda i, b, h: (b, i, h, 0)),  # q
        pl.BlockSpec((None, seq_len, None, head_dim), lambda i, b, h: (b, 0, lax.div(h, group), 0)),  # k
        pl.BlockSpec((None, seq_len, None, head_dim), lambda i, b, h: (b, 0, lax.div(h, group), 0)),  # v
        pl.BlockSpec((None, block_q_dq, None, head_dim), lambda i, b, h: (b, i, h, 0)),  # do
        pl.BlockSpec((None, None, block_q_dq), lambda i, b, h: (b, h, i)),  # lse
        pl.BlockSpec((None, None, block_q_dq), lambda i, b, h: (b, h, i)),  # delta
    ]
    args = [q, k, v, do, lse, delta]
    if has_segments:
        in_specs.append(pl.BlockSpec((None, seq_len), lambda i, b, h: (b, 0)))
        args.append(segment_ids)
    dq = pl.pallas_call(
        functools.partial(
            _dq_kernel, sm_scale=sm_scale, window=window, block_q=block_q_dq, block_k=block_k_dq,
            has_segments=has_segments,
        ),
        grid=(seq_len // block_q_dq, batch, num_heads),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, block_q_dq, None, head_dim), lambda i, b, h: (b, i, h, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=compiler_params,
        cost_estimate=pl.CostEstimate(
            flops=6 * dq_pairs * head_dim,  # QK^T, dO V^T, dS K
            transcendentals=dq_pairs,
            bytes_accessed=3 * q.size * itemsize + dq_tiles * 2 * block_k_dq * head_dim * itemsize
            + 2 * batch * num_heads * seq_len * 4,
        ),
        interpret=interpret,
        name="sliding_window_attention_bwd_dq",
    )(*args)

    # dK, dV: grid over key tiles and kv heads; the G query heads of a kv head are summed inside the program.
    num_q_blocks = seq_len // block_q_dkv
    dkv_tiles = visited_tiles_dkv(seq_len, block_q_dkv, block_k_dkv, window) * batch * num_heads
    dkv_pairs = dkv_tiles * block_q_dkv * block_k_dkv
    in_specs = [
        pl.BlockSpec((None, seq_len, group, head_dim), lambda j, b, g: (b, 0, g, 0)),  # q, heads of kv head g
        pl.BlockSpec((None, block_k_dkv, None, head_dim), lambda j, b, g: (b, j, g, 0)),  # k
        pl.BlockSpec((None, block_k_dkv, None, head_dim), lambda j, b, g: (b, j, g, 0)),  # v
        pl.BlockSpec((None, seq_len, group, head_dim), lambda j, b, g: (b, 0, g, 0)),  # do
        pl.BlockSpec((None, group, seq_len), lambda j, b, g: (b, g, 0)),  # lse
        pl.BlockSpec((None, group, seq_len), lambda j, b, g: (b, g, 0)),  # delta
    ]
    args = [q, k, v, do, lse, delta]
    if has_segments:
        in_specs.append(pl.BlockSpec((None, seq_len), lambda j, b, g: (b, 0)))
        args.append(segment_ids)
    kv_spec = pl.BlockSpec((None, block_k_dkv, None, head_dim), lambda j, b, g: (b, j, g, 0))
    dk, dv = pl.pallas_call(
        functools.partial(
            _dkv_kernel, sm_scale=sm_scale, window=window, block_q=block_q_dkv, block_k=block_k_dkv,
            has_segments=has_segments, group=group, num_q_blocks=num_q_blocks,
        ),
        grid=(seq_len // block_k_dkv, batch, num_kv_heads),
        in_specs=in_specs,
        out_specs=[kv_spec, kv_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=compiler_params,
        cost_estimate=pl.CostEstimate(
            flops=8 * dkv_pairs * head_dim,  # QK^T, P^T dO, dO V^T, dS^T Q
            transcendentals=dkv_pairs,
            bytes_accessed=4 * k.size * itemsize + dkv_tiles * 2 * block_q_dkv * head_dim * itemsize
            + 2 * dkv_tiles * block_q_dkv * 4,
        ),
        interpret=interpret,
        name="sliding_window_attention_bwd_dkv",
    )(*args)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------------------------
# TPU: jax's splash attention with a local (sliding-window) mask.
# ----------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _splash_kernel(seq_len: int, window: int | None, heads: int, is_mqa: bool, block_q: int, block_k: int,
                   block_q_dkv: int, block_k_dkv: int, block_q_dq: int, block_k_dq: int, interpret: bool):
    # Imported here so that GPU/CPU users never import the TPU (Mosaic) lowering stack.
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    shape = (seq_len, seq_len)
    if window is None:
        mask = splash.CausalMask(shape)
    else:
        # window_size = (left, right): W - 1 keys before the query, none after it.
        mask = splash.LocalMask(shape, window_size=(window - 1, 0), offset=0)
    sizes = splash.BlockSizes(
        block_q=block_q, block_kv=block_k, block_kv_compute=block_k,
        block_q_dkv=block_q_dkv, block_kv_dkv=block_k_dkv, block_kv_dkv_compute=block_k_dkv,
        block_q_dq=block_q_dq, block_kv_dq=block_k_dq,
    )
    make = splash.make_splash_mqa_single_device if is_mqa else splash.make_splash_mha_single_device
    # The kernel holds the mask metadata as jax arrays; building it eagerly (even when first called under jit)
    # keeps tracers out of this cache.
    with jax.ensure_compile_time_eval():
        kernel = make(splash.MultiHeadMask([mask] * heads), block_sizes=sizes, interpret=interpret)
    return kernel, splash.SegmentIds


def splash_attention(q, k, v, segment_ids, *, window, sm_scale, block_sizes, interpret):
    """Sliding-window attention on TPU through jax's splash attention (its own fwd/bwd kernels and custom_vjp).

    Splash is the tuned TPU tool for exactly this mask: `LocalMask(window_size=(W - 1, 0))` is processed into
    per-tile "fully masked / partially masked / fully visible" metadata ahead of time, so masked tiles are
    skipped on TPU (the same T * W scaling as the GPU kernels here) and only edge tiles evaluate the mask.
    Writing a second Mosaic TPU kernel would duplicate it, slower.

    Args:
      q: (B, T, H, K); k, v: (B, T, Hkv, K); T a multiple of every block size (ops.py pads). segment_ids: (B, T)
        int32 or None. window: W or None. sm_scale: softmax scale (splash does not scale; q is pre-scaled).
      block_sizes: a BlockSizes whose blocks are multiples of 128. interpret: run in interpret mode (CPU).

    Returns:
      (B, T, H, K) in q.dtype.
    """
    batch, seq_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    bs = block_sizes
    q_bhtk = jnp.swapaxes(q * jnp.asarray(sm_scale, q.dtype), 1, 2)  # (B, H, T, K)
    k_bhtk = jnp.swapaxes(k, 1, 2)  # (B, Hkv, T, K)
    v_bhtk = jnp.swapaxes(v, 1, 2)
    is_mqa = group > 1
    kernel, segment_ids_cls = _splash_kernel(
        seq_len, window, group if is_mqa else num_heads, is_mqa, bs.block_q, bs.block_k, bs.block_q_dkv,
        bs.block_k_dkv, bs.block_q_dq, bs.block_k_dq, bool(interpret),
    )

    def one_sequence(q_htk, k_htk, v_htk, seg_t):
        seg = None if seg_t is None else segment_ids_cls(q=seg_t, kv=seg_t)
        if not is_mqa:
            return kernel(q_htk, k_htk, v_htk, segment_ids=seg)
        # GQA: one MQA call per kv head, over the G query heads that share it.
        q_hgtk = q_htk.reshape(num_kv_heads, group, seq_len, head_dim)
        out = jax.vmap(lambda qg, kg, vg: kernel(qg, kg, vg, segment_ids=seg))(q_hgtk, k_htk, v_htk)
        return out.reshape(num_heads, seq_len, head_dim)

    if segment_ids is None:
        out = jax.vmap(lambda a, b, c: one_sequence(a, b, c, None))(q_bhtk, k_bhtk, v_bhtk)
    else:
        out = jax.vmap(one_sequence)(q_bhtk, k_bhtk, v_bhtk, segment_ids)
    return jnp.swapaxes(out, 1, 2).astype(q.dtype)  # (B, T, H, K)
