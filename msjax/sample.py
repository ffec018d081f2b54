"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus) sampling.

The filters are applied in the order Hugging Face `transformers` applies its logits warpers (temperature, then
top-k, then top-p), so the same settings mean the same distribution:
  temperature T: logits / T (T <= 0 means greedy: the argmax, the other settings unused);
  top-k k: only the k most likely tokens keep their logits (0: all);
  top-p p: only the smallest set of most likely tokens whose probabilities add up to at least p (Holtzman et al.
    2020, "The Curious Case of Neural Text Degeneration", sec. 3.1; 1.0: all). The most likely token is always
    kept.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """Raises ValueError naming the setting that is out of range (the flags' names: --temperature, --top_k,
    --top_p)."""
    if not (temperature == temperature and temperature < float("inf")):
        raise ValueError(f"--temperature={temperature}: allowed is a finite number (0 or less: greedy)")
    if top_k < 0:
        raise ValueError(f"--top_k={top_k}: allowed is an integer >= 0 (0: no top-k filter)")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"--top_p={top_p}: allowed is 0 < top_p <= 1 (1: no nucleus filter)")


def filter_logits(logits_bv: jax.Array, temperature: float, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """The logits (B, V) float32 after temperature, top-k and top-p (module docstring); filtered-out entries are
    -inf. Ties at a cut-off are all kept."""
    logits_bv = logits_bv.astype(jnp.float32) / temperature
    if 0 < top_k < logits_bv.shape[-1]:
        kth_b1 = jax.lax.top_k(logits_bv, top_k)[0][:, -1:]
        logits_bv = jnp.where(logits_bv < kth_b1, -jnp.inf, logits_bv)
    if top_p < 1.0:
        sorted_bv = jnp.sort(logits_bv, axis=-1)[:, ::-1]  # descending
        probs_bv = jax.nn.softmax(sorted_bv, axis=-1)
        before_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv  # probability of the more likely tokens
        kept_bv = before_bv < top_p  # the first token is always kept (nothing before it)
        cutoff_b1 = jnp.min(jnp.where(kept_bv, sorted_bv, jnp.inf), axis=-1, keepdims=True)
        logits_bv = jnp.where(logits_bv < cutoff_b1, -jnp.inf, logits_bv)
    return logits_bv


def sample_logits(logits_bv: jax.Array, key: jax.Array, temperature: float, top_k: int = 0, top_p: float = 1.0
                  ) -> jax.Array:
    """One token per row: int32 (B,) from logits (B, V). temperature <= 0: the argmax (greedy); otherwise a draw
    from softmax(filter_logits(...)) with `key`. The settings are Python values (static under jit)."""
    if temperature <= 0:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    filtered = filter_logits(logits_bv, temperature, top_k, top_p)
    return jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)
