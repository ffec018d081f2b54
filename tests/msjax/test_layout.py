"""The resolved layout (msjax/layout.py): every derived fact against an independent computation, and the one
place each rule is written."""

import math
import re
from pathlib import Path

import jax
import numpy as np
import pytest

from msjax import layout as layout_mod
from msjax.config import Config, ConfigError, apply_overrides, load_preset
from msjax.flops import flops_per_token
from msjax.hardware import lookup
from msjax.planner.compile_check import compile_config
from msjax.sharding_rules import RULE_SETS, optimizer_state_rules

REPO = Path(__file__).resolve().parents[2]


def _cfg(**over) -> Config:
    return apply_overrides(load_preset("gpt_tiny"), {"model.vocab_size": 256, **over})


@pytest.mark.parametrize("seed", range(6))
def test_resolved_facts_match_their_definitions(seed):
    """Random layouts of the 8 test devices: sizes, M, V, rules, batch split, FLOPs and MFU, each computed here
    from its definition."""
    rng = np.random.default_rng(seed)
    p, t = int(rng.choice([1, 2])), int(rng.choice([1, 2]))
    f = int(rng.choice([1, 2]))
    m_cfg = int(rng.choice([0, 2, 4])) if p > 1 else 0
    over = {"mesh.pipeline": p, "mesh.tensor": t, "mesh.fsdp": f, "mesh.data": -1, "pipeline.microbatches": m_cfg,
            "train.global_batch": 16}
    lay = layout_mod.resolve(_cfg(**over))
    data = 8 // (p * t * f)
    assert dict(lay.axis_sizes) == {"pipeline": p, "data": data, "fsdp": f, "expert": 1, "sequence": 1, "tensor": t}
    assert lay.mesh.devices.size == 8 and dict(lay.mesh.shape) == dict(lay.axis_sizes)
    m = (m_cfg or p) if p > 1 else 1
    assert lay.microbatches == m == lay.batch.pipeline_microbatches
    assert lay.batch.microbatch * m * data * f == 16 and lay.batch.per_replica == 16 // (data * f)
    want_rules = dict(RULE_SETS["fsdp_tp"])
    want_state = dict(optimizer_state_rules("fsdp_tp"))
    if p > 1:
        want_rules["layers"] = want_state["layers"] = "pipeline"
    assert dict(lay.rules) == want_rules and dict(lay.state_rules) == want_state
    assert lay.padded_vocab == 256
    assert lay.step_flops == flops_per_token(lay.config.model, lay.config.train.seq_len) * 16 * lay.config.train.seq_len
    peak = lay.peak_flops
    assert peak > 0 and lay.mfu(2.0) == pytest.approx(2.0 * lay.step_flops / peak, rel=1e-15)


def test_the_planner_and_the_step_read_the_same_microbatches():
    """The compile check, the schedule and the layout take M from one rule."""
    from msjax.parallel.pipeline import schedule_of

    cfg = _cfg(**{"mesh.pipeline": 2, "mesh.data": 4, "train.global_batch": 16})
    lay = layout_mod.resolve(cfg)
    assert schedule_of(lay.config).microbatches == lay.microbatches == 2
    _, _, what = compile_config(lay.config, dict(lay.axis_sizes))
    assert f"M={lay.microbatches} microbatches" in what


def test_the_microbatch_rule_is_written_once():
    """`pipeline.microbatches or <stages>` stands in one place of the package and its scripts."""
    rule = re.compile(r"\.microbatches or ")
    found = [f"{p.relative_to(REPO)}:{i}" for p in [*(REPO / "msjax").rglob("*.py"), *(REPO / "scripts").glob("*.py")]
             for i, line in enumerate(p.read_text().splitlines(), 1) if rule.search(line)]
    assert found == ["msjax/config.py:" + found[0].split(":")[1]] and len(found) == 1, found


def test_a_plan_layout_prices_its_catalogue_device():
    hw = lookup("a100-80g")
    lay = layout_mod.plan(_cfg(**{"mesh.tensor": 2, "mesh.data": -1, "train.global_batch": 64}), 64, hw)
    assert lay.mesh is None and lay.axis_sizes["data"] == 32
    assert lay.peak == (hw.peak_flops * 64, "a100-80g x 64 devices")


@pytest.mark.parametrize("over, vocab, match", [
    ({"mesh.data": 8, "train.global_batch": 12}, 256,
     r"microbatch of 12 sequences \(train.global_batch=12 / train.microbatches=1\) does not split over data x "
     r"fsdp x expert = 8 devices"),
    ({"mesh.data": 1, "mesh.fsdp": 8, "mesh.rules": "dp"}, 256, r"mesh.fsdp=8 but rule set mesh.rules='dp'"),
    ({"model.vocab_size": 100}, 300, r"the tokenizer has 300 tokens but model.vocab_size=100"),
    ({"mesh.data": 4, "mesh.tensor": 2, "model.vocab_size": 0, "model.vocab_multiple": 1}, 257,
     r"pads the 257-token vocabulary to 257 rows, which mesh.tensor=2 does not divide"),
])
def test_a_layout_that_cannot_run_is_one_error_naming_the_key(over, vocab, match):
    with pytest.raises(ConfigError, match=match):
        layout_mod.resolve(_cfg(**over)).with_vocab(vocab)


def test_the_program_builder_keeps_building_any_rule_set_on_any_mesh():
    """`build_train_program(cfg, mesh)` resolves with strict=False: the equivalence tests' 'dp' rules on an fsdp
    mesh build (a run refuses them, above)."""
    from msjax.mesh import make_mesh
    from msjax.train_step import build_train_program

    cfg = _cfg(**{"mesh.data": 1, "mesh.fsdp": 8, "mesh.rules": "dp", "model.num_layers": 1})
    program = build_train_program(cfg, make_mesh(cfg.mesh))
    assert program.layout.axis_sizes["fsdp"] == 8 and program.layout.rules == RULE_SETS["dp"]
    assert math.prod(program.layout.axis_sizes.values()) == len(jax.devices())
