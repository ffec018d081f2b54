"""Rule sets: the mapping itself, and golden shardings (parameter -> PartitionSpec per preset and rule set).

Regenerate the golden file after an intended layout change with `MSJAX_UPDATE_GOLDEN=1 python -m pytest
tests/sharding_rules` and review its diff like code.
"""

import dataclasses
import json
import os
from pathlib import Path

import jax
import pytest
from jax.sharding import PartitionSpec as P

from msjax.config import load_preset
from msjax.model import abstract_model
from msjax.sharding_rules import RULE_SETS, logical_to_mesh_spec
from msjax.sharding_rules import axes as ax

GOLDEN = Path(__file__).with_name("golden_shardings.json")
PRESETS = ("gpt_tiny", "gpt175b", "llama_tiny", "llama3_8b")


def _specs(preset: str, rules: str) -> dict[str, str]:
    model_cfg = load_preset(preset).model
    model_cfg = dataclasses.replace(model_cfg, vocab_size=model_cfg.vocab_size or 4096)
    _, _, logical = abstract_model(model_cfg)
    flat = jax.tree_util.tree_flatten_with_path(logical, is_leaf=lambda x: isinstance(x, P))[0]
    return {jax.tree_util.keystr(path): str(logical_to_mesh_spec(tuple(spec), RULE_SETS[rules]))
            for path, spec in flat}


def test_golden_shardings():
    got = {f"{preset}/{rules}": _specs(preset, rules) for preset in PRESETS for rules in sorted(RULE_SETS)}
    if os.environ.get("MSJAX_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = json.loads(GOLDEN.read_text())
    assert got == want


def test_megatron_layout():
    r = RULE_SETS["fsdp_tp"]
    # Column-parallel in, row-parallel out; FSDP on the model dimension of every weight.
    assert logical_to_mesh_spec((ax.EMBED, ax.MLP), r) == P("fsdp", "tensor")
    assert logical_to_mesh_spec((ax.MLP, ax.EMBED), r) == P("tensor", "fsdp")
    assert logical_to_mesh_spec((ax.EMBED, ax.HEADS, ax.HEAD_DIM), r) == P("fsdp", "tensor", None)
    # Residual stream: sequence split over sequence and tensor (Megatron-SP); inside TP regions over sequence.
    # The batch over every data-parallel axis, `expert` included (expert-data parallelism).
    assert logical_to_mesh_spec((ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_EMBED), r) == P(("data", "fsdp", "expert"),
                                                                                  ("sequence", "tensor"), None)
    assert logical_to_mesh_spec((ax.ACT_BATCH, ax.ACT_SEQ_INNER, ax.ACT_HEADS, ax.ACT_HEAD_DIM), r) == P(
        ("data", "fsdp", "expert"), "sequence", "tensor", None)
    # Experts over `expert`, their width over `tensor` (expert tensor parallelism), their model dim over `fsdp`.
    assert logical_to_mesh_spec((ax.EXP, ax.EMBED, ax.MLP), r) == P("expert", "fsdp", "tensor")
    assert logical_to_mesh_spec((ax.VOCAB, ax.EMBED), RULE_SETS["dp"]) == P(None, None)


def test_a_mesh_axis_is_used_once_per_array():
    rules = {"a": ("data", "tensor"), "b": "tensor", "c": "data"}
    assert logical_to_mesh_spec(("a", "b", "c"), rules) == P(("data", "tensor"), None, None)


def test_every_logical_name_has_a_rule_in_every_set():
    names = {v for k, v in vars(ax).items() if k.isupper() and k not in ("MESH_AXES", "BATCH_AXES")
             and v not in ax.MESH_AXES}
    for rules in RULE_SETS.values():
        assert names <= set(rules)
    with pytest.raises(KeyError, match="logical axis 'nope' has no rule; known:"):
        logical_to_mesh_spec(("nope",), RULE_SETS["dp"])
