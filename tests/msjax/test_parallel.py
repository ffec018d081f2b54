"""Parallel equivalence: the same short deterministic run on 1 device and on data x fsdp x sequence x tensor
meshes of 8 fake CPU devices gives the same losses and gradients within 1e-5 (float32); what is compared and why
is in tests/msjax/layouts.py. Every layout runs the GPT-2-style model and a Llama-style one (RoPE, RMSNorm,
SwiGLU, grouped-query heads, no biases, untied head)."""

import jax
import numpy as np
import optax
import pytest

from msjax.config import ConfigError
from msjax.mesh import make_mesh
from msjax.train_step import build_train_program
from tests.msjax.layouts import LLAMA, TOL, VOCAB, assert_same, run_layout, tiny_config


@pytest.fixture(scope="module")
def tokens(layout_tokens):
    return layout_tokens


MODELS = {"gpt": {}, "llama": LLAMA}


@pytest.fixture(scope="module")
def single(layout_reference):
    return {name: layout_reference(**overrides) for name, overrides in MODELS.items()}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mesh", [
    dict(data=2, fsdp=2, tensor=2), dict(data=8), dict(tensor=8), dict(fsdp=8), dict(data=2, sequence=2, tensor=2),
])
def test_layouts_match_single_device(single, tokens, mesh, model):
    cfg = tiny_config(**MODELS[model], **{f"mesh.{k}": v for k, v in {"data": 1, **mesh}.items()})
    assert_same(single[model], run_layout(cfg, tokens, 8))


# (fsdp_tp, the default, is the first mesh layout's rule set; GPT's zero2 is in test_overlap.py)
@pytest.mark.parametrize("model, rules", [("gpt", r) for r in ("dp", "fsdp", "tp", "fsdp_tp")]
                         + [("llama", r) for r in ("dp", "fsdp", "tp", "zero2")])
def test_rule_sets_match_single_device(single, tokens, model, rules):
    cfg = tiny_config(**MODELS[model], **{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "mesh.rules": rules})
    assert_same(single[model], run_layout(cfg, tokens, 8))


@pytest.mark.parametrize("block, mesh", [("serial", dict(data=2, sequence=2, tensor=2)),
                                         ("parallel", dict(data=2, fsdp=2, tensor=2))], ids=["serial-sp", "parallel"])
def test_llama_collective_matmul_matches_single_device(layout_reference, tokens, block, mesh):
    """The collective-matmul rings run the Llama block too (SwiGLU's gate beside the other column-parallel
    weights; RoPE at each sequence shard's own positions)."""
    blocks = {**LLAMA, "model.block": block}
    cfg = tiny_config(**blocks, **{f"mesh.{k}": v for k, v in mesh.items()}, **{"mesh.tp_overlap": "collective_matmul"})
    assert_same(layout_reference(**blocks), run_layout(cfg, tokens, 8))


def test_gradient_accumulation_matches_one_big_batch(single, tokens):
    cfg = tiny_config(**{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "train.microbatches": 2})
    got = run_layout(cfg, tokens, 8)
    np.testing.assert_allclose(got.losses, single["gpt"].losses, atol=TOL, rtol=0)
    np.testing.assert_allclose(got.norms, single["gpt"].norms, atol=TOL, rtol=0)


def test_fsdp_shards_parameters_and_optimizer_state(tokens):
    cfg = tiny_config(**{"mesh.data": 1, "mesh.fsdp": 4, "mesh.tensor": 2})
    state = run_layout(cfg, tokens, 8).state
    w_in = state["params"]["blocks"]["mlp"]["w_in"]  # (layers, embed, mlp)
    assert w_in.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    assert w_in.addressable_shards[0].data.shape == (2, 64 // 4, 128 // 2)
    # Adam's moments by name: the chain is wrapped in apply_if_finite, so their position in the state moves
    mu, nu = (optax.tree_utils.tree_get(state["opt_state"], name) for name in ("mu", "nu"))
    assert mu["blocks"]["mlp"]["w_in"].sharding.spec == w_in.sharding.spec
    assert nu["blocks"]["attn"]["wq"].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)


def test_batch_split_errors():
    cfg = tiny_config(**{"mesh.data": 8, "train.global_batch": 12})
    with pytest.raises(ConfigError, match="microbatch of 12 sequences .* does not split over data x fsdp x expert = 8"):
        build_train_program(cfg, make_mesh(cfg.mesh), VOCAB)
