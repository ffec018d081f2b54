"""bench.py --plain_jax's yardstick: nanoGPT's block in plain JAX is the same model size as msjax's and trains."""

import math

import jax
import numpy as np
import pytest

from msjax.config import apply_overrides, load_preset
from tests.scripts.loader import load_script

plain_jax_comparison = load_script("bench").plain_jax_comparison
plain_train_step = load_script("bench_reference").plain_train_step


@pytest.mark.slow
@pytest.mark.parametrize("use_bias, params", [(False, 804_992), (True, 810_752)])
def test_plain_step_is_msjax_sized_starts_at_log_v_and_learns(use_bias, params):
    cfg = apply_overrides(load_preset("shakespeare_char"), {"model.vocab_size": 65, "model.use_bias": use_bias})
    row = plain_jax_comparison(cfg, steps=2, repeats=2)
    assert row["plain_params"] == row["msjax_params"] == params, row  # the same parameters, shape for shape
    assert row["msjax_step_s"] > 0 and row["plain_step_s"] > 0 and len(row["msjax_s"]) == 2
    step, state, batch = plain_train_step(cfg, cfg.model.padded_vocab())
    losses = []
    for _ in range(30):  # one random batch, memorised
        state, loss = step(state, batch)
        losses.append(float(loss))
    v = cfg.model.padded_vocab()
    assert abs(losses[0] - math.log(v)) < 0.05, (losses[0], math.log(v))  # small init: near-uniform logits
    assert losses[-1] < losses[0] - 0.5 and np.all(np.isfinite(losses)), losses
    assert jax.tree.leaves(state[0])[0].dtype == np.float32


def test_a_model_the_reference_does_not_reproduce_is_refused():
    cfg = apply_overrides(load_preset("shakespeare_char"), {"model.vocab_size": 65, "model.block": "parallel",
                                                            "model.tie_embeddings": False})
    with pytest.raises(ValueError, match="differs in model.block, model.tie_embeddings"):
        plain_train_step(cfg, cfg.model.padded_vocab())
    llama = apply_overrides(load_preset("llama_tiny"), {"model.vocab_size": 65})
    with pytest.raises(ValueError, match="differs in model.num_kv_heads, model.tie_embeddings, model.position, "
                                         "model.norm, model.mlp"):
        plain_train_step(llama, llama.model.padded_vocab())
