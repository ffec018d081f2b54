"""Planner on a mixture of experts: the expert-parallel all-to-alls in the inventory, the load-imbalance
assumption, the `expert` axis in `--search`, bad input, the presets' plans, the per-device memory against the
compiled expert-parallel step (fake CPU devices) and the pipelined step's stash. (The step's FLOPs against the
traced program's: tests/msjax/test_planner.py, with the dense blocks.)"""

import dataclasses

import pytest

from msjax.config import Config, ConfigError, apply_overrides, load_preset
from msjax.planner import PlanError, PlanOptions, compile_check, make_plan, plan_text, search
from msjax.planner import moe, timing
from msjax.planner.layout import make_layout, mesh_sizes
from msjax.planner.plan import get_hardware


@pytest.mark.parametrize("preset, total, active", [("mixtral_8x7b", 46_702_792_704, 12_879_925_248),
                                                   ("qwen3_30b_a3b", 30_532_122_624, 3_353_032_704)])
def test_moe_presets_are_planned_with_their_published_counts(preset, total, active):
    """A plan of each MoE preset (no refusal) carries its published total and active parameters (Mixtral 8x7B
    46.7B / 12.9B, Qwen3-30B-A3B 30.5B / 3.3B), prints both, and says MFU counts active-parameter FLOPs."""
    plan = make_plan(load_preset(preset), PlanOptions(devices=64, hardware="h100"))
    assert (plan.total_params, plan.active_params) == (total, active)
    text = plan_text(plan)
    assert f"{active / 1e9:.1f}B active per token" in text and "active parameters" in text


def _layout(overrides: dict, devices: int, hardware: str = "h100", **opts):
    cfg = apply_overrides(load_preset("mixtral_8x7b"), overrides).validate()
    o = PlanOptions(devices=devices, hardware=hardware, **opts)
    hw = get_hardware(o)
    sizes = mesh_sizes(cfg, devices)
    return cfg, make_layout(cfg, o, hw, sizes, 1, 1, 0, overrides.get("model.remat", "none")), hw


@pytest.mark.parametrize("remat, runs", [("none", 1), ("full", 2), ("dots", 2)])
def test_the_expert_parallel_all_to_alls_are_in_the_inventory(remat, runs):
    """Per MoE layer and microbatch, each forward run of the dispatch (twice under remat: the grouped path keeps
    nothing a dots policy saves) sends the (ep, N, D) token buffer out and back, and the backward twice again:
    ep x N x D x 2 bytes a call (bf16; N = b T k, ep times the assignments, as built), over `expert`, on NVLink;
    the expert ids (ep, N) int32 once per forward run. Without expert parallelism there are none."""
    from msjax.planner import comm
    from msjax.planner.memory import stage_params

    cfg, lay, hw = _layout({"mesh.expert": 8, "mesh.tensor": 1, "model.remat": remat}, 64)
    colls = {c.name: c for c in comm.inventory(cfg, lay, hw, stage_params(cfg, lay.vocab, lay.axis_sizes()))}
    tokens, ids = colls["EP all-to-all (tokens)"], colls["EP all-to-all (expert ids)"]
    n = lay.microbatch_size * cfg.train.seq_len * 2  # top-2
    assert tokens.tensor_bytes == 8 * n * 4096 * 2 and ids.tensor_bytes == 8 * n * 4
    assert tokens.calls == 32 * lay.microbatches * (2 * runs + 2) and ids.calls == 32 * lay.microbatches * runs
    assert tokens.op == "all-to-all" and tokens.axes == ("expert",) and tokens.link.kind == "intra"
    assert tokens.volume_per_call == 7 / 8 * tokens.tensor_bytes
    cfg1, lay1, hw1 = _layout({"mesh.expert": 1, "mesh.tensor": 1}, 64)
    assert not [c for c in comm.inventory(cfg1, lay1, hw1, stage_params(cfg1, lay1.vocab, lay1.axis_sizes()))
                if c.group == "EP"]


def test_load_imbalance_scales_only_the_expert_parallel_grouped_matmuls():
    """`moe_imbalance` multiplies the routed experts' grouped-matmul time on the busiest device with expert
    parallelism (not the router, shared experts or attention, nor the FLOPs executed), and changes nothing
    without it; a value below 1 is a PlanError naming the option."""
    rates = timing.Rates(1.0, 1.0, 1e30)  # one FLOP per second: times are FLOPs
    cfg, lay, _ = _layout({"mesh.expert": 8, "mesh.tensor": 1}, 64, moe_imbalance=1.5)
    balanced = dataclasses.replace(lay, moe_imbalance=1.0)
    hot, even = timing.layer_times(cfg, lay, rates), timing.layer_times(cfg, balanced, rates)
    mg = moe.moe_gemm_flops(cfg, lay)
    assert hot.gemm["lin1"] - even.gemm["lin1"] == pytest.approx(0.5 * mg["lin1"], rel=1e-12)
    assert hot.gemm["lin2"] - even.gemm["lin2"] == pytest.approx(0.5 * mg["lin2"], rel=1e-12)
    assert hot.gemm["qkv"] == even.gemm["qkv"] and hot.hw_flops == even.hw_flops
    cfg1, lay1, _ = _layout({"mesh.expert": 1, "mesh.tensor": 8}, 64, moe_imbalance=1.5)
    assert timing.layer_times(cfg1, lay1, rates) == timing.layer_times(
        cfg1, dataclasses.replace(lay1, moe_imbalance=1.0), rates)
    with pytest.raises(PlanError, match=r"--moe_imbalance=0.9: allowed is a finite number >= 1"):
        make_plan(load_preset("moe_tiny"), PlanOptions(devices=8, moe_imbalance=0.9))


def test_search_considers_the_expert_axis_for_mixtures_of_experts_only():
    """`--search` tries expert > 1 for a mixture of experts, only sizes that divide its experts and keep expert x
    sequence x tensor inside a node (8 H100s); a dense model's candidates keep expert = 1."""
    cfg = apply_overrides(load_preset("moe_tiny"), {"model.vocab_size": 4096, "train.global_batch": 32})
    result = search(cfg, PlanOptions(devices=16, hardware="h100"), workers=1)
    experts = {dict(zip(("pipeline", "data", "fsdp", "expert", "sequence", "tensor"), c.sizes))["expert"]
               for c in result.ranked}
    assert experts == {1, 2, 4, 8}, experts
    for c in result.ranked:  # (tensor and sequence alone may cross nodes: the planner prices that, as for dense)
        _, _, _, ep, s, t = c.sizes
        assert ep == 1 or 8 % (ep * s * t) == 0
    assert any("does not fit a node of 8" in c.reason for c in result.rejected)
    assert all(c.sizes[3] in (1, 2, 4, 8) for c in result.ranked + result.rejected)
    dense = apply_overrides(load_preset("llama_tiny"), {"model.vocab_size": 4096, "train.global_batch": 32})
    assert {c.sizes[3] for c in search(dense, PlanOptions(devices=16, hardware="h100"), workers=1).ranked} == {1}


def test_bad_expert_layouts_are_refused_with_the_key(capsys):
    """An expert axis that does not divide the experts is the config's error, which plan.py reports as its usual
    one-line error with exit status 2; a layout the planner makes up is refused as a PlanError naming the key."""
    from msjax.planner.cli import main

    assert main(["--config=mixtral_8x7b", "--devices=64", "--hardware=h100", "--mesh.expert=3",
                 "--mesh.tensor=1"]) == 2
    assert "mesh.expert=3" in capsys.readouterr().err
    cfg = load_preset("mixtral_8x7b")
    o = PlanOptions(devices=64, hardware="h100")
    sizes = {"pipeline": 1, "data": 1, "fsdp": 4, "expert": 8, "sequence": 1, "tensor": 2}
    with pytest.raises(PlanError, match=r"mesh.expert=8 x mesh.sequence=1 x mesh.tensor=2 = 16 devices does not "
                                        r"fit a node of 8"):
        make_layout(cfg, o, get_hardware(o), sizes, 1, 1, 0, "full")
    with pytest.raises(PlanError, match=r"mesh.expert=2: an expert-parallel axis needs a mixture-of-experts"):
        make_layout(load_preset("llama3_8b"), o, get_hardware(o), {**sizes, "expert": 2, "tensor": 4}, 1, 1, 0,
                    "full")
    with pytest.raises(ConfigError, match=r"mesh.expert=3"):
        apply_overrides(cfg, {"mesh.expert": 3, "mesh.tensor": 1}).validate()


# The memory check: moe_tiny's blocks, wider (d_model 256, 8 heads over 4, expert width 384), batch 16, no remat.
# The MoE layer's counts (`msjax.planner.moe`: MOE_SAVED_ROWS, MOE_SAVED_HIDDEN and the rest) were read off the
# compiled step's buffer assignment on FIT_CASES; the layouts below were not used to fit anything. The pipelined
# one prices its stash with `moe.moe_stash_bytes` (the residual pytrees, checked below) and nothing fitted on it.
MOE_MEMORY = {"model.vocab_size": 4096, "model.d_model": 256, "model.num_heads": 8, "model.num_kv_heads": 4,
              "model.moe.expert_ff": 384, "train.global_batch": 16}
FIT_CASES = [{"mesh.data": 1, "mesh.expert": 2, "mesh.fsdp": 2, "mesh.tensor": 2},
             {"mesh.data": 1, "mesh.expert": 8}, {"mesh.data": 8}]
HELD_OUT = [{"mesh.data": 1, "mesh.expert": 4, "mesh.fsdp": 2},
            {"mesh.data": 1, "mesh.expert": 2, "mesh.sequence": 2, "mesh.tensor": 2},
            {"mesh.data": 2, "mesh.expert": 2, "mesh.pipeline": 2}]


@pytest.mark.parametrize("mesh", HELD_OUT, ids=["ep4-fsdp2", "ep2-sp2-tp2", "pp2-ep2-dp2"])
def test_planner_memory_of_an_expert_parallel_step_within_10_percent_of_the_compiled_one(mesh):
    """The planner's per-device total for the step as it runs (preflight's estimate: the MoE layer's saved
    tensors, the dispatch's buffers, the grouped matmuls' intermediates as XLA:CPU's dense fallback for ragged_dot
    keeps them, FSDP gathering each device's own experts) is within 10% of XLA's argument + temp + output - alias
    bytes of the same compiled step (the comparison tests/msjax/test_planner_compile.py makes for dense layouts),
    on layouts no constant was fitted on; the state part within 1% first."""
    cfg = apply_overrides(load_preset("moe_tiny"), {**MOE_MEMORY, **mesh})
    check = compile_check(cfg, cfg.mesh.axis_sizes())
    assert check["agree"], check
    est, bound = check["estimate"], check["xla_peak_bound_bytes"]
    assert abs(est["total"] / bound - 1) <= 0.10, (est, bound, check["what"])


# A pipelined MoE stage's stash (one MoE layer per chunk): 6 experts of width 40, D 48, k = 3 unless said.
STASH = {"model.d_model": 48, "model.num_heads": 4, "model.num_kv_heads": 2, "model.d_ff": 80,
         "model.max_seq_len": 16, "train.seq_len": 16, "train.global_batch": 12, "mesh.data": 1,
         "model.vocab_size": 100, "mesh.pipeline": 2, "model.scan_layers": False, "model.dtype": "bfloat16",
         "model.position": "rope", "model.norm": "rmsnorm", "model.mlp": "swiglu", "model.use_bias": False,
         "model.tie_embeddings": False, "model.num_layers": 2, "model.moe.num_experts": 6,
         "model.moe.expert_ff": 40, "model.moe.experts_per_token": 3}


@pytest.mark.parametrize("over", [{"mesh.expert": 1}, {"mesh.expert": 3},
                                  {"mesh.expert": 2, "model.mlp": "gelu", "model.moe.experts_per_token": 2},
                                  {"mesh.expert": 1, "model.moe.shared_experts": 1, "model.moe.shared_gate": True},
                                  {"mesh.expert": 2, "model.moe.shared_experts": 1, "model.moe.shared_gate": True}],
                         ids=["ep1", "ep3", "ep2-gelu-k2", "ep1-shared-gate", "ep2-shared-gate"])
def test_moe_stash_bytes_are_the_pipelined_steps_residuals(over):
    """The planner's stash slot of a MoE layer (`memory.stash_layer_bytes` with `moe.moe_stash_bytes`) against
    what the pipelined step's forward saves for its backward (`PipelinedGrads.stash_entry`, traced as the step is,
    with the expert dispatch), per device, under no remat, dots and full remat: to the byte without expert
    parallelism; with it within 0.5%, the per-device bytes read as the residuals' global bytes over `expert` (the
    router's (E,) counts and scalars, whole on every device, are counted 1 / ep times that way)."""
    import jax

    from msjax.mesh import make_mesh
    from msjax.planner import memory as mem
    from msjax.planner.preflight import cpu_hardware
    from msjax.train_step import build_train_program

    for remat in ("none", "dots", "full"):
        cfg = apply_overrides(Config(), {**STASH, **over, "model.remat": remat}).validate()
        ep, b = cfg.mesh.expert, 2
        program = build_train_program(cfg, make_mesh(cfg.mesh, jax.devices()[:2 * ep]))
        stash = sum(a.size * a.dtype.itemsize for a in program.pipeline.stash_entry(b * ep)) / ep
        lay = make_layout(cfg, PlanOptions(devices=2 * ep), cpu_hardware(1e12), {**cfg.mesh.axis_sizes(), "data": 1},
                          1, b, 0, remat)
        got = mem.stash_layer_bytes(cfg, lay, False) + mem.stash_entry_invariant_bytes(cfg, lay, False)
        if ep == 1:
            assert got == stash, (remat, got, stash)
        else:
            assert abs(got / stash - 1) <= 0.005, (remat, got, stash)
