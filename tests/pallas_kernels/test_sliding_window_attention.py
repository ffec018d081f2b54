"""Sliding-window flash attention: kernels vs. the float32 reference, loop-bound skipping, errors, lowering.

Tolerances (max |kernel - reference| / max(1, max |reference|), the reference computed in float32 from the same
inputs upcast): float32 1e-5, bfloat16 2e-2. Measured on CPU interpret mode: about 5e-7 (f32) and 5e-3 (bf16,
which rounds P, dS and the outputs to bfloat16), so both keep a margin of 4x or more. They are not to be loosened
to make a test pass.

Coverage is a sampled product, not the full cartesian one (interpret mode costs ~1-2 s per case): each test
below crosses two or three factors in full and cycles the others, so every value of every factor appears:
  sequence length 5, 64, 80, 96, 100, 129, 200 (most not tile multiples) | window 1, one tile, between tiles, >= T,
  None | tiles (16..64, q/k unequal) | head dim 16, 32, 64, 128 | (H, Hkv) (2, 2), (4, 2), (4, 1) MQA, (8, 2) |
  float32, bfloat16 | no segments, packed random segments.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from msjax.pallas_kernels.sliding_window_attention import (
    BlockSizes,
    default_block_sizes,
    sliding_window_attention,
    sliding_window_attention_reference,
)
from msjax.pallas_kernels.sliding_window_attention import kernel as swa_kernel

TOLERANCE = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2}
SMALL = BlockSizes(block_q=32, block_k=16, block_q_dkv=16, block_k_dkv=32, block_q_dq=32, block_k_dq=16)


def _inputs(seed, batch, seq_len, heads, kv_heads, head_dim, dtype, packed_segments):
    keys = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(keys[0], (batch, seq_len, heads, head_dim), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (batch, seq_len, kv_heads, head_dim), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (batch, seq_len, kv_heads, head_dim), jnp.float32).astype(dtype)
    cotangent = jax.random.normal(keys[3], (batch, seq_len, heads, head_dim), jnp.float32)
    segment_ids = None
    if packed_segments:
        # Packed documents: random boundaries, ids increasing along the sequence (1 to ~5 documents per row).
        starts = jax.random.bernoulli(keys[4], 4.0 / seq_len, (batch, seq_len)).at[:, 0].set(True)
        segment_ids = jnp.cumsum(starts.astype(jnp.int32), axis=1)
    return q, k, v, cotangent, segment_ids


def _assert_close(actual, expected, tol, what):
    actual = np.asarray(jnp.asarray(actual, jnp.float32))
    expected = np.asarray(jnp.asarray(expected, jnp.float32))
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert np.all(np.isfinite(actual)), f"{what}: non-finite values"
    err = float(np.max(np.abs(actual - expected)))
    # Relative to the largest reference entry, floored at 1 so that an exactly-zero reference (dK with W = 1:
    # a one-key softmax has zero gradient) is compared absolutely instead of demanding bit-exact zeros.
    scale = max(1.0, float(np.max(np.abs(expected))))
    assert err <= tol * scale, f"{what}: max abs error {err:.3g} > {tol:g} * max(1, max |ref|) {scale:.3g}"


def _window_value(kind, seq_len, block_k):
    return {
        "one": 1,
        "one_tile": block_k,
        "between_tiles": block_k + block_k // 2 + 1,
        "at_least_T": seq_len + 3,
        "none": None,
    }[kind]


WINDOW_KINDS = ("one", "one_tile", "between_tiles", "at_least_T", "none")
HEAD_GROUPS = ((2, 2), (4, 2), (4, 1), (8, 2))


class TestSlidingWindowAttentionInterpret:
    """Pallas Triton-backend kernels run in interpret mode on CPU (the GPU twin below runs them compiled)."""

    INTERPRET = True

    def _check(self, *, seq_len, window, block_sizes=SMALL, head_dim=32, heads=4, kv_heads=2,
               dtype=jnp.float32, packed_segments=False, batch=1, seed=0):
        q, k, v, cotangent, segment_ids = _inputs(
            seed, batch, seq_len, heads, kv_heads, head_dim, dtype, packed_segments
        )

        def kernel_fn(q, k, v):
            return sliding_window_attention(
                q, k, v, window=window, segment_ids=segment_ids, block_sizes=block_sizes, backend="gpu",
                interpret=self.INTERPRET,
            )

        def reference_fn(q, k, v):
            return sliding_window_attention_reference(q, k, v, window=window, segment_ids=segment_ids)

        def out_and_grads(fn):
            # One jit per function: forward output (as aux) and the gradients of <out, cotangent> together.
            def loss(q, k, v):
                out = fn(q, k, v)
                return jnp.sum(out.astype(jnp.float32) * cotangent), out

            return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))

        tol = TOLERANCE[jnp.dtype(dtype)]
        (_, out), grads = out_and_grads(kernel_fn)(q, k, v)
        (_, ref_out), ref_grads = out_and_grads(reference_fn)(*(x.astype(jnp.float32) for x in (q, k, v)))
        assert out.dtype == q.dtype and out.shape == q.shape
        _assert_close(out, ref_out, tol, "out")
        for name, g, rg, x in zip("qkv", grads, ref_grads, (q, k, v)):
            assert g.dtype == x.dtype and g.shape == x.shape
            _assert_close(g, rg, tol, f"d{name}")

    # Windows x sequence lengths, in full; GQA layout and segments cycle.
    @pytest.mark.parametrize(
        "case", list(enumerate(itertools.product((64, 100, 200), WINDOW_KINDS))), ids=lambda c: f"T{c[1][0]}-{c[1][1]}"
    )
    def test_windows_and_lengths(self, case):
        i, (seq_len, window_kind) = case
        heads, kv_heads = HEAD_GROUPS[i % len(HEAD_GROUPS)]
        self._check(
            seq_len=seq_len, window=_window_value(window_kind, seq_len, SMALL.block_k), heads=heads,
            kv_heads=kv_heads, packed_segments=bool(i % 2), seed=i,
        )

    # Dtypes x head dims, in full; the window sits between tiles and the length is not a tile multiple.
    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
    @pytest.mark.parametrize("head_dim", [16, 64, 128])
    def test_dtypes_and_head_dims(self, dtype, head_dim):
        self._check(seq_len=100, window=40, head_dim=head_dim, dtype=dtype, packed_segments=head_dim == 64, batch=2)

    # GQA / MQA layouts x segment layouts, in full.
    @pytest.mark.parametrize("packed_segments", [False, True], ids=["nosegments", "packed"])
    @pytest.mark.parametrize("heads_kv", HEAD_GROUPS, ids=lambda hk: f"H{hk[0]}-Hkv{hk[1]}")
    def test_head_groups_and_segments(self, heads_kv, packed_segments):
        heads, kv_heads = heads_kv
        self._check(seq_len=96, window=33, heads=heads, kv_heads=kv_heads, packed_segments=packed_segments,
                    batch=2, seed=heads * 10 + kv_heads, dtype=jnp.bfloat16 if heads == 8 else jnp.float32)

    # Tile shapes x windows relative to them.
    @pytest.mark.parametrize(
        "block_sizes",
        [
            BlockSizes(16, 16, 16, 16, 16, 16),
            BlockSizes(64, 16, 32, 64, 16, 32),
            BlockSizes(16, 64, 64, 16, 64, 64),
            BlockSizes(64, 64, 64, 64, 64, 64),
        ],
        ids=["16", "q64k16", "q16k64", "64"],
    )
    @pytest.mark.parametrize("window_kind", ["one_tile", "between_tiles"])
    def test_block_sizes(self, block_sizes, window_kind):
        self._check(seq_len=129, window=_window_value(window_kind, 129, block_sizes.block_k),
                    block_sizes=block_sizes, packed_segments=window_kind == "one_tile", head_dim=16)

    def test_sequence_shorter_than_a_tile(self):
        self._check(seq_len=5, window=2, heads=2, kv_heads=1, packed_segments=True, batch=2)

    def test_default_block_sizes_and_scale(self):
        # No block_sizes: the device table entry (64-row tiles on CPU); a non-default sm_scale.
        q, k, v, _, _ = _inputs(3, 1, 80, 2, 1, 32, jnp.float32, False)
        out = sliding_window_attention(q, k, v, window=20, sm_scale=0.3, backend="gpu", interpret=self.INTERPRET)
        _assert_close(out, sliding_window_attention_reference(q, k, v, window=20, sm_scale=0.3), 1e-5, "out")


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU: runs the Triton kernels compiled")
class TestSlidingWindowAttentionGPU(TestSlidingWindowAttentionInterpret):
    INTERPRET = False


class TestSplashInterpret:
    """TPU path (jax splash attention + LocalMask) in interpret mode; tiles are multiples of 128."""

    INTERPRET = True

    @pytest.mark.parametrize(
        "window, heads_kv, packed_segments",
        [(50, (4, 4), True), (128, (4, 2), False), (None, (4, 1), True), (300, (2, 2), False)],
    )
    def test_matches_reference(self, window, heads_kv, packed_segments):
        heads, kv_heads = heads_kv
        q, k, v, cotangent, segment_ids = _inputs(7, 1, 200, heads, kv_heads, 64, jnp.float32, packed_segments)
        sizes = BlockSizes(*(128,) * 6)

        def kernel_fn(q, k, v):
            return sliding_window_attention(q, k, v, window=window, segment_ids=segment_ids, block_sizes=sizes,
                                            backend="tpu", interpret=self.INTERPRET)

        def reference_fn(q, k, v):
            return sliding_window_attention_reference(q, k, v, window=window, segment_ids=segment_ids)

        _assert_close(jax.jit(kernel_fn)(q, k, v), reference_fn(q, k, v), 1e-5, "out")
        grads = jax.jit(jax.grad(lambda *a: jnp.sum(kernel_fn(*a) * cotangent), argnums=(0, 1, 2)))(q, k, v)
        ref_grads = jax.grad(lambda *a: jnp.sum(reference_fn(*a) * cotangent), argnums=(0, 1, 2))(q, k, v)
        for name, g, rg in zip("qkv", grads, ref_grads):
            _assert_close(g, rg, 1e-5, f"d{name}")

    def test_rejects_tiles_not_multiple_of_128(self):
        q, k, v, _, _ = _inputs(0, 1, 128, 2, 2, 64, jnp.float32, False)
        with pytest.raises(ValueError, match="block_q=64.*multiples of 128"):
            sliding_window_attention(q, k, v, window=8, block_sizes=BlockSizes(64, 128, 128, 128, 128, 128),
                                     backend="tpu", interpret=True)


@pytest.mark.skipif(jax.default_backend() != "tpu", reason="needs a TPU: runs splash attention compiled")
class TestSplashTPU(TestSplashInterpret):
    INTERPRET = False


# ---------------------------------------------------------------------------------------------------------------
# Loop bounds: the tiles the kernels visit are exactly the tiles that hold a visible (query, key) pair.
# ---------------------------------------------------------------------------------------------------------------


def _tile_visibility(seq_len, window, block_q, block_k):
    """(nq, nk) any-visible and all-visible flags per tile, by brute force over the dense mask."""
    i = np.arange(seq_len)[:, None]
    j = np.arange(seq_len)[None, :]
    visible = j <= i
    if window is not None:
        visible &= j > i - window
    tiles = visible.reshape(seq_len // block_q, block_q, seq_len // block_k, block_k)
    return tiles.any(axis=(1, 3)), tiles.all(axis=(1, 3))


@pytest.mark.parametrize("window", [1, 7, 16, 40, 64, 100, 255, None])
@pytest.mark.parametrize("block_q, block_k", [(16, 16), (32, 16), (16, 64), (64, 32)])
def test_forward_bounds_are_tight(window, block_q, block_k):
    seq_len = 256
    any_visible, all_visible = _tile_visibility(seq_len, window, block_q, block_k)
    for qb in range(seq_len // block_q):
        lo, full_lo, full_hi, hi = swa_kernel.forward_block_bounds(qb, block_q, block_k, window)
        assert lo <= full_lo <= full_hi <= hi
        assert list(range(lo, hi)) == list(np.flatnonzero(any_visible[qb])), (qb, lo, hi)
        assert list(range(full_lo, full_hi)) == list(np.flatnonzero(all_visible[qb])), (qb, full_lo, full_hi)


@pytest.mark.parametrize("window", [1, 7, 16, 40, 64, 100, 255, None])
@pytest.mark.parametrize("block_q, block_k", [(16, 16), (32, 16), (16, 64), (64, 32)])
def test_dkv_bounds_are_tight(window, block_q, block_k):
    seq_len = 256
    any_visible, all_visible = _tile_visibility(seq_len, window, block_q, block_k)
    num_q_blocks = seq_len // block_q
    for kb in range(seq_len // block_k):
        lo, full_lo, full_hi, hi = swa_kernel.dkv_block_bounds(kb, block_q, block_k, window, num_q_blocks)
        assert lo <= full_lo <= full_hi <= hi
        assert list(range(lo, hi)) == list(np.flatnonzero(any_visible[:, kb])), (kb, lo, hi)
        assert list(range(full_lo, full_hi)) == list(np.flatnonzero(all_visible[:, kb])), (kb, full_lo, full_hi)


def test_visited_tiles_grow_as_t_times_w():
    """The kernels' loop bounds visit ~T * W / (bq * bk) tiles, not the causal T^2 / (2 * bq * bk)."""
    block_q = block_k = 64
    window = 512
    for seq_len in (4096, 8192, 32768):
        visited = swa_kernel.visited_tiles_forward(seq_len, block_q, block_k, window)
        # Each query tile needs keys [q0 - W + 1, q0 + bq - 1]: ceil((W + bq - 1) / bk) tiles, +1 if unaligned.
        per_tile = math.ceil((window + block_q - 1) / block_k)
        assert visited <= (seq_len // block_q) * (per_tile + 1)
        # With aligned tiles the count is exact: W / bk + 1 per query tile, fewer at the start.
        first_rows = window // block_k
        expected = (seq_len // block_q) * (window // block_k + 1) - first_rows * (first_rows + 1) // 2
        assert visited == expected, (seq_len, visited, expected)
        causal = swa_kernel.visited_tiles_forward(seq_len, block_q, block_k, None)
        assert causal == (seq_len // block_q) * (seq_len // block_q + 1) // 2
        assert swa_kernel.visited_tiles_dkv(seq_len, block_q, block_k, window) == visited
    # Past the first W tokens the work is linear in T: each extra query tile costs W / bk + 1 key tiles.
    v8, v16 = (swa_kernel.visited_tiles_forward(t, 64, 64, window) for t in (8192, 16384))
    assert v16 - v8 == (16384 - 8192) // block_q * (window // block_k + 1)


def test_kernel_reads_its_bounds_from_the_helper(monkeypatch):
    """Dropping the first visited key tile in the helper must change the kernel output (so the kernel really
    loops over the helper's bounds, and the test above constrains it); restoring it restores agreement."""
    seq_len, window = 112, 40  # a length no other test compiles, so no cached executable is reused
    q, k, v, _, _ = _inputs(5, 1, seq_len, 2, 2, 16, jnp.float32, False)
    sizes = BlockSizes(*(16,) * 6)
    reference = sliding_window_attention_reference(q, k, v, window=window)
    real_bounds = swa_kernel.forward_block_bounds

    def too_narrow(q_block, block_q, block_k, window):
        lo, full_lo, full_hi, hi = real_bounds(q_block, block_q, block_k, window)
        narrow = lo + 1
        return narrow, swa_kernel._max(full_lo, narrow), swa_kernel._max(full_hi, narrow), swa_kernel._max(hi, narrow)

    monkeypatch.setattr(swa_kernel, "forward_block_bounds", too_narrow)
    broken = sliding_window_attention(q, k, v, window=window, block_sizes=sizes, backend="gpu", interpret=True)
    # (Rows whose only keys sat in the dropped tile even come out NaN: l = 0.)
    assert not np.allclose(np.asarray(broken), np.asarray(reference), atol=1e-2)
    monkeypatch.setattr(swa_kernel, "forward_block_bounds", real_bounds)
    # Another block_k_dq, so that the jit cache cannot hand back the executable traced with the broken bounds.
    fixed = sliding_window_attention(q, k, v, window=window, block_sizes=sizes.replace(block_k_dq=32),
                                     backend="gpu", interpret=True)
    _assert_close(fixed, reference, 1e-5, "out")


def test_cost_estimate_is_window_aware():
    seq_len, window, head_dim = 256, 32, 16
    q, k, v, _, _ = _inputs(0, 1, seq_len, 2, 2, head_dim, jnp.float32, False)
    sizes = BlockSizes(*(32,) * 6)
    fn = lambda q, k, v: sliding_window_attention(q, k, v, window=window, block_sizes=sizes, backend="gpu",
                                                  interpret=True)
    text = str(jax.make_jaxpr(fn)(q, k, v))
    tiles = swa_kernel.visited_tiles_forward(seq_len, 32, 32, window) * 2  # x heads
    assert f"flops={4 * tiles * 32 * 32 * head_dim}" in text
    assert tiles < (seq_len // 32) ** 2  # fewer than the causal-without-skipping count


# ---------------------------------------------------------------------------------------------------------------
# Errors, defaults, the reference itself, lowering for the real backends.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [0, -3, 2.5, True])
def test_rejects_bad_window(window):
    q, k, v, _, _ = _inputs(0, 1, 32, 2, 2, 16, jnp.float32, False)
    with pytest.raises(ValueError, match="window"):
        sliding_window_attention(q, k, v, window=window)
    with pytest.raises(ValueError, match="window"):
        sliding_window_attention_reference(q, k, v, window=window)


def test_rejects_bad_shapes():
    q = jnp.ones((1, 32, 4, 16))
    with pytest.raises(ValueError, match="head dims differ"):
        sliding_window_attention(q, jnp.ones((1, 32, 2, 32)), jnp.ones((1, 32, 2, 32)))
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        sliding_window_attention(q, jnp.ones((1, 32, 3, 16)), jnp.ones((1, 32, 3, 16)))
    with pytest.raises(ValueError, match="same shape"):
        sliding_window_attention(q, jnp.ones((1, 32, 2, 16)), jnp.ones((1, 32, 1, 16)))
    with pytest.raises(ValueError, match="4-D"):
        sliding_window_attention(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="sequence length must match"):
        sliding_window_attention(q, jnp.ones((1, 16, 2, 16)), jnp.ones((1, 16, 2, 16)))
    with pytest.raises(ValueError, match="segment_ids"):
        sliding_window_attention(q, q, q, segment_ids=jnp.ones((1, 31), jnp.int32))
    with pytest.raises(ValueError, match="backend"):
        sliding_window_attention(q, q, q, backend="metal")


@pytest.mark.parametrize(
    "field, value, allowed",
    [("block_q", 0, "powers of two"), ("block_k", 24, "powers of two"), ("block_q_dkv", 8, ">= 16"),
     ("block_k_dq", 32.0, "must be an int"), ("block_q_dq", True, "must be an int"),
     ("num_warps", 3, "power of two in"), ("num_stages", 0, ">= 1")],
)
def test_block_sizes_validation(field, value, allowed):
    with pytest.raises(ValueError, match=f"BlockSizes.{field}") as excinfo:
        BlockSizes(**{field: value})
    assert allowed in str(excinfo.value)


def test_block_sizes_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        BlockSizes().block_q = 32  # type: ignore[misc]
    assert BlockSizes().replace(block_q=128).block_q == 128


def test_default_table():
    assert default_block_sizes("NVIDIA H100 80GB HBM3").block_q == 128
    assert default_block_sizes("NVIDIA A100-SXM4-80GB") == default_block_sizes("NVIDIA H200")
    assert default_block_sizes("TPU v5 lite").block_q % 128 == 0
    assert default_block_sizes("cpu") == default_block_sizes("some future chip")  # 64-row fallback
    default_block_sizes("TPU v4").validate_for_tpu()


@pytest.mark.parametrize("window, heads_kv, packed", [(None, (4, 2), False), (9, (4, 4), False), (9, (4, 1), True)])
def test_reference_matches_jax_dot_product_attention(window, heads_kv, packed):
    """The reference against jax.nn.dot_product_attention (XLA), an independent implementation of the mask."""
    q, k, v, _, segment_ids = _inputs(1, 2, 50, *heads_kv, 16, jnp.float32, packed)
    ours = sliding_window_attention_reference(q, k, v, window=window, segment_ids=segment_ids)
    mask = None
    if segment_ids is not None:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # (B, 1, T, S)
    theirs = jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=True, implementation="xla",
        local_window_size=None if window is None else (window - 1, 0),
    )
    _assert_close(ours, theirs, 1e-5, "reference")


def test_xla_backend_is_the_reference():
    q, k, v, _, _ = _inputs(2, 1, 40, 2, 1, 16, jnp.bfloat16, False)
    out = sliding_window_attention(q, k, v, window=5, backend="xla")
    np.testing.assert_array_equal(out, sliding_window_attention_reference(q, k, v, window=5))


@pytest.mark.parametrize("platform, backend, target", [("cuda", "gpu", "__gpu$xla.gpu.triton"),
                                                       ("tpu", "tpu", "tpu_custom_call")])
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, dtype",
    [(8, 2, 128, jnp.bfloat16), (4, 1, 64, jnp.float16), (2, 2, 16, jnp.float32)],
    ids=["gqa-k128-bf16", "mqa-k64-f16", "mha-k16-f32"],
)
def test_lowers_for_hardware(platform, backend, target, heads, kv_heads, head_dim, dtype):
    """Forward + backward lower to the real backend (Triton IR / Mosaic TPU) without the device: catches ops and
    shapes that interpret mode accepts but the compilers reject. (Compiling the IR to a binary needs the device.)"""
    q = jax.ShapeDtypeStruct((2, 1000, heads, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((2, 1000, kv_heads, head_dim), dtype)
    seg = jax.ShapeDtypeStruct((2, 1000), jnp.int32)
    if backend == "tpu":
        sizes = BlockSizes(*(128,) * 6)
    elif head_dim == 16:
        sizes = BlockSizes(*(16,) * 6)
    else:
        sizes = default_block_sizes("NVIDIA H100")

    def loss(q, k, v, segment_ids):
        out = sliding_window_attention(q, k, v, window=300, segment_ids=segment_ids, block_sizes=sizes,
                                       backend=backend, interpret=False)
        return jnp.sum(out.astype(jnp.float32))

    for segment_ids in (None, seg):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv, segment_ids)
        text = lowered.lower(lowering_platforms=(platform,)).as_text()
        assert text.count(target) == 3  # the forward, dQ and dK/dV kernels
