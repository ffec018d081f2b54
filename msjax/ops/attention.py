"""The attention dispatch point: every attention call in the model goes through `attention()`.

Implementations (config `model.attention.impl`):
  xla     `jax.nn.dot_product_attention(implementation='xla')`: plain JAX, exact, O(T^2) memory; any backend.
  pallas  our sliding-window flash-attention kernel (`pallas_kernels.sliding_window_attention`); on CPU it runs
          in Pallas interpret mode (for tests: correct, far too slow to train with).
  cudnn   `jax.nn.dot_product_attention(implementation='cudnn')`: cuDNN flash attention with a local window;
          NVIDIA GPUs, bfloat16/float16 only.
  auto    the implementation to use on this backend; see `resolve_impl`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLS = ("auto", "xla", "pallas", "cudnn")


def resolve_impl(impl: str, dtype=jnp.float32, backend: str | None = None) -> str:
    """The concrete implementation `auto` stands for.

    CPU: `xla` (the Pallas kernel only runs interpreted there). GPU: `cudnn` for 16-bit inputs, else `xla`
    (cuDNN takes no float32). TPU: `pallas` (splash attention with a local mask).
    """
    if impl not in IMPLS:
        raise ValueError(f"model.attention.impl={impl!r}; allowed: {', '.join(IMPLS)}")
    if impl != "auto":
        return impl
    backend = backend or jax.default_backend()
    if backend == "gpu":
        return "cudnn" if jnp.dtype(dtype).itemsize == 2 else "xla"
    if backend == "tpu":
        return "pallas"
    return "xla"


def attention(q_bthk: jax.Array, k_bshk: jax.Array, v_bshk: jax.Array, *, window: int | None,
              impl: str = "auto") -> jax.Array:
    """Causal self-attention with an optional sliding window.

    Query i attends keys j with i - window < j <= i (window None: all j <= i), scaled by 1/sqrt(K).

    Args:
      q_bthk: queries (B, T, H, K).
      k_bshk, v_bshk: keys and values (B, S=T, Hkv, K), H a multiple of Hkv (grouped-query attention).
      window: sliding-window size W >= 1, or None.
      impl: one of IMPLS.
    Returns:
      (B, T, H, K) in the dtype of q.
    Raises:
      ValueError: unknown impl, or window < 1.
    """
    if window is not None and window < 1:
        raise ValueError(f"attention window={window}: allowed is an integer >= 1, or None")
    impl = resolve_impl(impl, q_bthk.dtype)
    if impl == "pallas":
        from pallas_kernels.sliding_window_attention import sliding_window_attention

        return sliding_window_attention(q_bthk, k_bshk, v_bshk, window=window)
    local = None if window is None else (window - 1, 0)
    return jax.nn.dot_product_attention(q_bthk, k_bshk, v_bshk, is_causal=True, local_window_size=local,
                                        implementation=impl)
