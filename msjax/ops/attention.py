"""The attention dispatch point: every attention call in the model goes through `attention()`.

Implementations (config `model.attention.impl`):
  xla     plain JAX masked-softmax attention (`xla_attention`): O(T^2) memory, any backend. Written out rather
          than `jax.nn.dot_product_attention(implementation='xla')` because that path ran the shakespeare_char
          train step ~25% slower on CPU here (39 vs 30 ms forward+backward).
  pallas  our sliding-window flash-attention kernel (`pallas_kernels.sliding_window_attention`); on CPU it runs
          in Pallas interpret mode (for tests: correct, far too slow to train with).
  cudnn   `jax.nn.dot_product_attention(implementation='cudnn')`: cuDNN flash attention with a local window;
          NVIDIA GPUs, bfloat16/float16 only.
  auto    the implementation to use on this backend; see `resolve_impl`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from msjax.ops.context_parallel import sequence_sharded_attention
from msjax.ops.softmax import softmax
from msjax.sharding import active_rules, nested_shard_map
from msjax.sharding_rules import axes as ax
from msjax.sharding_rules import logical_to_mesh_spec

IMPLS = ("auto", "xla", "pallas", "cudnn")


def resolve_impl(impl: str, dtype=jnp.float32, backend: str | None = None, packed: bool = False) -> str:
    """The concrete implementation `auto` stands for.

    CPU: `xla` (the Pallas kernel only runs interpreted there). GPU: `cudnn` for 16-bit inputs, else `xla`
    (cuDNN takes no float32); with packed sequences (segment ids) `pallas` for 16-bit inputs, as `cudnn` here
    takes no segment ids. TPU: `pallas` (splash attention with a local mask).
    """
    if impl not in IMPLS:
        raise ValueError(f"model.attention.impl={impl!r}; allowed: {', '.join(IMPLS)}")
    if impl != "auto":
        return impl
    backend = backend or jax.default_backend()
    if backend == "gpu":
        if jnp.dtype(dtype).itemsize != 2:
            return "xla"
        return "pallas" if packed else "cudnn"
    if backend == "tpu":
        return "pallas"
    return "xla"


def attention(q_bthk: jax.Array, k_bshk: jax.Array, v_bshk: jax.Array, *, window: int | None,
              impl: str = "auto", segments_bt: jax.Array | None = None) -> jax.Array:
    """Causal self-attention with an optional sliding window, optionally inside packed segments.

    Query i attends keys j with i - window < j <= i (window None: all j <= i) and, with segment ids,
    segments[b, i] == segments[b, j] (examples packed into one row do not see each other); scaled by 1/sqrt(K).

    Args:
      q_bthk: queries (B, T, H, K).
      k_bshk, v_bshk: keys and values (B, S=T, Hkv, K), H a multiple of Hkv (grouped-query attention).
      window: sliding-window size W >= 1, or None.
      impl: one of IMPLS.
      segments_bt: int32 (B, T) segment ids, or None (one sequence per row).
    Returns:
      (B, T, H, K) in the dtype of q.
    Raises:
      ValueError: unknown impl, window < 1, or segment ids with impl `cudnn` (which takes none here).
    """
    if window is not None and window < 1:
        raise ValueError(f"attention window={window}: allowed is an integer >= 1, or None")
    impl = resolve_impl(impl, q_bthk.dtype, packed=segments_bt is not None)
    active = active_rules()
    if impl == "xla" and active is not None and active[0].shape[ax.SEQUENCE] > 1:
        # Context parallelism: keys/values gathered by hand so the backward reduce-scatters dK/dV.
        mesh, rules = active
        q_spec = logical_to_mesh_spec((ax.ACT_BATCH, ax.ACT_SEQ_INNER, ax.ACT_HEADS, None), rules)
        kv_spec = logical_to_mesh_spec((ax.ACT_BATCH, ax.ACT_SEQ_INNER, ax.ACT_KV_HEADS, None), rules)
        return sequence_sharded_attention(
            lambda q, k, v, offset, q_seg=None, k_seg=None: xla_attention(
                q, k, v, window=window, q_offset=offset, q_segments_bt=q_seg, k_segments_bs=k_seg),
            mesh, q_bthk, k_bshk, v_bshk, q_spec=q_spec, kv_spec=kv_spec, segments_bt=segments_bt)
    if impl == "pallas":
        from msjax.pallas_kernels.sliding_window_attention import sliding_window_attention

        return _per_shard(lambda q, k, v, seg=None: sliding_window_attention(q, k, v, window=window, segment_ids=seg),
                          q_bthk, k_bshk, v_bshk, segments_bt)
    if impl == "cudnn":
        if segments_bt is not None:
            raise ValueError("model.attention.impl='cudnn' takes no segment ids (packed sequences); allowed with "
                             "packing: xla, pallas, auto")
        local = None if window is None else (window - 1, 0)
        return jax.nn.dot_product_attention(q_bthk, k_bshk, v_bshk, is_causal=True, local_window_size=local,
                                            implementation="cudnn")
    return xla_attention(q_bthk, k_bshk, v_bshk, window=window, q_segments_bt=segments_bt, k_segments_bs=segments_bt)


def _per_shard(fn, q_bthk: jax.Array, k_bshk: jax.Array, v_bshk: jax.Array,
               segments_bt: jax.Array | None = None) -> jax.Array:
    """Runs a kernel `fn(q, k, v[, segments])` on each device's (batch, heads) shard under the active mesh.

    GSPMD cannot partition a `pallas_call`, so the kernel runs inside `jax.shard_map` over the batch and head
    axes (attention is independent across both). The sequence stays whole on each device: the kernel has no
    query-offset input yet, so under context parallelism (mesh.sequence > 1) queries are gathered first.
    """
    args = (q_bthk, k_bshk, v_bshk) + (() if segments_bt is None else (segments_bt,))
    active = active_rules()
    if active is None:
        return fn(*args)
    mesh, rules = active
    q_spec = logical_to_mesh_spec((ax.ACT_BATCH, None, ax.ACT_HEADS, None), rules)
    kv_spec = logical_to_mesh_spec((ax.ACT_BATCH, None, ax.ACT_KV_HEADS, None), rules)
    specs = (q_spec, kv_spec, kv_spec) + (() if segments_bt is None else
                                          (logical_to_mesh_spec((ax.ACT_BATCH, None), rules),))
    return nested_shard_map(fn, mesh, in_specs=specs, out_specs=q_spec, check_vma=False)(*args)


def local_attention(q_bthk: jax.Array, k_bshk: jax.Array, v_bshk: jax.Array, *, window: int | None,
                    impl: str = "auto", q_offset: jax.Array | int = 0) -> jax.Array:
    """`attention` for code that already holds one device's shard (inside `jax.shard_map`): no layout of its own.

    Args:
      q_bthk: this shard's queries (B, T, H, K); query t sits at position `q_offset + t` among the keys.
      k_bshk, v_bshk: keys and values (B, S, Hkv, K), S >= q_offset + T (context parallelism: all keys).
      window, impl: as `attention`.
      q_offset: int32 scalar (may be traced), the first query's position; nonzero only under context parallelism.
    Returns:
      (B, T, H, K) in the dtype of q.
    Raises:
      ValueError: a query offset with an implementation that takes none (only `xla` does).
    """
    impl = resolve_impl(impl, q_bthk.dtype)
    offset = not (isinstance(q_offset, int) and q_offset == 0)
    if offset and impl != "xla":
        raise ValueError(f"attention impl={impl!r} takes no query offset (context parallelism inside shard_map); "
                         "allowed: xla")
    if impl == "pallas":
        from msjax.pallas_kernels.sliding_window_attention import sliding_window_attention

        return sliding_window_attention(q_bthk, k_bshk, v_bshk, window=window)
    if impl == "cudnn":
        local = None if window is None else (window - 1, 0)
        return jax.nn.dot_product_attention(q_bthk, k_bshk, v_bshk, is_causal=True, local_window_size=local,
                                            implementation="cudnn")
    return xla_attention(q_bthk, k_bshk, v_bshk, window=window, q_offset=q_offset)


def xla_attention(q_bthk: jax.Array, k_bshk: jax.Array, v_bshk: jax.Array, *, window: int | None,
                  q_offset: jax.Array | int = 0, q_segments_bt: jax.Array | None = None,
                  k_segments_bs: jax.Array | None = None) -> jax.Array:
    """Masked-softmax attention in plain JAX: matmuls in the input dtype accumulating in float32, softmax in
    float32. Shapes as `attention` (S may exceed T: query t sits at key position `q_offset + t`); materialises
    (B, G, H/G, T, S) logits with grouped heads, (B, H, T, S) without. With segment ids (int32 (B, T) for the
    queries and (B, S) for the keys, both or neither) a query sees only keys of its own segment."""
    b, t, h, k = q_bthk.shape
    s, g = k_bshk.shape[1], k_bshk.shape[2]
    # Query heads grouped by the key/value head they share; without grouping (g == h) the plain 4-D products,
    # whose probabilities XLA keeps in one shape (the grouped form with a unit group axis made it copy them).
    if g != h:
        q, spec_qk, spec_pv = q_bthk.reshape(b, t, g, h // g, k), "btgrk,bsgk->bgrts", "bgrts,bsgk->btgrk"
    else:
        q, spec_qk, spec_pv = q_bthk, "bthk,bshk->bhts", "bhts,bshk->bthk"
    logits = jnp.einsum(spec_qk, q, k_bshk, preferred_element_type=jnp.float32)
    logits = logits * (1.0 / k**0.5)
    i, j = q_offset + jnp.arange(t)[:, None], jnp.arange(s)[None, :]
    visible = (j <= i) if window is None else (j <= i) & (j > i - window)  # (T, S); the diagonal always is
    if q_segments_bt is not None:  # (B, T, S), then a unit axis per head axis of the logits
        visible = visible[None] & (q_segments_bt[:, :, None] == k_segments_bs[:, None, :])
        visible = visible[:, None, None] if g != h else visible[:, None]
    weights = softmax(jnp.where(visible, logits, -jnp.inf)).astype(v_bshk.dtype)
    out = jnp.einsum(spec_pv, weights, v_bshk, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, k).astype(q_bthk.dtype)


def attention_at_positions(q_bthk: jax.Array, k_bshk: jax.Array, v_bshk: jax.Array, q_pos_bt: jax.Array,
                           k_pos_bs: jax.Array, *, window: int | None) -> jax.Array:
    """Causal attention between tokens at explicit positions, for decoding against a KV cache (msjax.generate).

    Query at position i attends a key at position j when 0 <= j <= i and, with a window, j > i - window; a key
    position of -1 marks an empty cache slot. Plain JAX like `xla_attention` (matmuls in the input dtype,
    accumulating and taking the softmax in float32); the key order does not matter.

    Args:
      q_bthk: queries (B, T, H, K).
      k_bshk, v_bshk: keys and values (B, S, G, K), H a multiple of G.
      q_pos_bt: int32 (B, T) query positions; k_pos_bs: int32 (B, S) key positions (-1: none).
      window: sliding-window size W >= 1, or None.
    Returns:
      (B, T, H, K) in the dtype of q. Every query must see at least one key (itself, in practice), or its row is
      NaN.
    """
    b, t, h, k = q_bthk.shape
    g = k_bshk.shape[2]
    q_btgrk = q_bthk.reshape(b, t, g, h // g, k)
    logits = jnp.einsum("btgrk,bsgk->bgrts", q_btgrk, k_bshk.astype(q_bthk.dtype),
                        preferred_element_type=jnp.float32) * (1.0 / k**0.5)
    i, j = q_pos_bt[:, :, None], k_pos_bs[:, None, :]
    visible = (j >= 0) & (j <= i)
    if window is not None:
        visible = visible & (j > i - window)
    weights = softmax(jnp.where(visible[:, None, None], logits, -jnp.inf)).astype(v_bshk.dtype)
    out = jnp.einsum("bgrts,bsgk->btgrk", weights, v_bshk, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, k).astype(q_bthk.dtype)
