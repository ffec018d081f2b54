"""Autoregressive sampling for the end-of-run sample (no KV cache: tiny models, a few hundred tokens)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from msjax.model import apply


def generate(graphdef, params: dict, prompt: list[int], num_tokens: int, context: int, temperature: float,
             key: jax.Array) -> list[int]:
    """Samples `num_tokens` tokens after `prompt`.

    Each step runs the model on the last `context` tokens (padded on the right to a fixed (1, context) shape, so
    one compiled function serves every step; causality makes the padding invisible) and samples from
    softmax(logits / temperature) at the last real position; temperature 0 takes the argmax.

    Returns:
      The generated token ids (without the prompt).
    """
    if not prompt:
        raise ValueError("generate: the prompt needs at least one token")

    @jax.jit
    def next_token(params, buf_1t, pos, key):
        logits_v = apply(graphdef, params, buf_1t)[0, pos]
        if temperature <= 0:
            return jnp.argmax(logits_v)
        return jax.random.categorical(key, logits_v / temperature)

    ids = list(prompt)
    for i in range(num_tokens):
        window = ids[-context:]
        buf = np.zeros((1, context), np.int32)
        buf[0, : len(window)] = window
        ids.append(int(next_token(params, buf, len(window) - 1, jax.random.fold_in(key, i))))
    return ids[len(prompt):]
