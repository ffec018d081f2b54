"""Pipeline parallelism (msjax/parallel): the interleaved-1F1B step computes what one device computes, its
activation memory does not grow with the microbatch count, its schedule is what the docs say, and bad layouts
are refused with errors naming the key.

Equivalence as tests/msjax/layouts.py says: STEPS optimizer steps on 8 fake CPU devices against one device,
losses, global gradient norms (computed outside the shard_map, as clipping and LAMB see them) and the gradient
pytree at initialisation within 1e-5 (float32). Two single-device references, shared by the session, cover
serial/parallel blocks, window/no window, AdamW/LAMB and stacked/per-layer parameters; a third is the
Llama-style model of tests/msjax/layouts.py (RoPE, RMSNorm, SwiGLU, grouped-query heads, untied head).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from msjax.config import Config, ConfigError, apply_overrides
from msjax.mesh import make_mesh
from msjax.flops import executed_matmul_flops
from msjax.parallel.pipeline import schedule_of
from msjax.parallel.schedule import Schedule, bubble_fraction, in_flight
from msjax.train_step import build_train_program
from tests.msjax.layouts import LLAMA, VOCAB, assert_same, run_layout, tiny_config

# Reference A: stacked layers, serial blocks, sliding window, AdamW. Reference B: per-layer parameters (as the CPU
# presets), parallel blocks, full causal attention, LAMB. Reference C: stacked layers split over `pipeline` with
# LAMB (its trust ratios see whole-layer norms of gradients that come back from the stages), under full remat.
# Reference D: three stages over a sequence they do not divide. Reference L: Llama-style (RoPE, RMSNorm, SwiGLU,
# grouped-query heads), stacked layers, serial blocks, sliding window, AdamW.
REFS = {
    "A": {"model.num_layers": 2, "model.scan_layers": True, "model.block": "serial", "model.attention.window": 12,
          "optimizer.name": "adamw"},
    "B": {"model.num_layers": 4, "model.scan_layers": False, "model.block": "parallel",
          "model.attention.window": None, "optimizer.name": "lamb"},
    "C": {"model.num_layers": 4, "model.scan_layers": True, "model.block": "parallel",
          "model.attention.window": None, "optimizer.name": "lamb", "model.remat": "full"},
    # three layers for three stages, whose output layers split the 32-token sequence into padded slices of 11
    "D": {"model.num_layers": 3, "model.scan_layers": True, "model.block": "parallel", "model.attention.window": 12,
          "optimizer.name": "adamw"},
    "L": {**LLAMA, "model.num_layers": 4, "model.scan_layers": True, "model.block": "serial",
          "model.attention.window": 12, "optimizer.name": "adamw"},
}

LAYOUTS = {
    "pp2": ("A", {"mesh.pipeline": 2}),
    "pp2xdp2xtp2": ("A", {"mesh.pipeline": 2, "mesh.data": 2, "mesh.tensor": 2}),
    "pp2xsp2xtp2": ("A", {"mesh.pipeline": 2, "mesh.sequence": 2, "mesh.tensor": 2}),
    "pp4": ("B", {"mesh.pipeline": 4}),
    "pp2xvpp2": ("B", {"mesh.pipeline": 2, "pipeline.virtual_stages": 2}),
    "pp2xfsdp2xtp2": ("B", {"mesh.pipeline": 2, "mesh.fsdp": 2, "mesh.tensor": 2}),  # Megatron-SP inside stages
    "pp2xdp2-accum2": ("B", {"mesh.pipeline": 2, "mesh.data": 2, "train.microbatches": 2,
                             "pipeline.microbatches": 2}),
    "stacked-lamb-pp2xvpp2xtp2": ("C", {"mesh.pipeline": 2, "pipeline.virtual_stages": 2, "mesh.tensor": 2}),
    "pp3-sequence-not-divisible": ("D", {"mesh.pipeline": 3, "pipeline.microbatches": 2}),
    "llama-pp2xvpp2": ("L", {"mesh.pipeline": 2, "pipeline.virtual_stages": 2}),
    "llama-pp2xsp2xtp2": ("L", {"mesh.pipeline": 2, "mesh.sequence": 2, "mesh.tensor": 2}),
    "llama-pp2xfsdp2xtp2": ("L", {"mesh.pipeline": 2, "mesh.fsdp": 2, "mesh.tensor": 2}),
}


def ref_config(ref: str, **overrides) -> Config:
    return tiny_config(**{**REFS[ref], **overrides})


@pytest.mark.parametrize("ref, layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_pipelined_layouts_match_single_device(layout_reference, layout_tokens, ref, layout):
    assert_same(layout_reference(**REFS[ref]), run_layout(ref_config(ref, **layout), layout_tokens))


# The schedules run from their action tables (msjax.parallel.zero_bubble), on the layouts above: pp2, pp4,
# tensor x sequence, fsdp x tensor, gpt and llama blocks, per-layer and stacked parameters, parallel blocks, a
# sliding window (A, L), three stages over a sequence they do not divide, gradient accumulation.
TABLE_LAYOUTS = {
    "zb-h1-pp2": ("A", {"mesh.pipeline": 2, "pipeline.schedule": "zb-h1"}),
    "1f1b-pp4": ("B", {"mesh.pipeline": 4, "pipeline.schedule": "1f1b"}),
    "zb-h1-pp4": ("B", {"mesh.pipeline": 4, "pipeline.schedule": "zb-h1", "pipeline.microbatches": 4}),
    "zb-h1-pp2xsp2xtp2": ("A", {"mesh.pipeline": 2, "mesh.sequence": 2, "mesh.tensor": 2,
                                "pipeline.schedule": "zb-h1"}),
    "zb-h1-pp2xfsdp2xtp2": ("B", {"mesh.pipeline": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "pipeline.schedule": "zb-h1"}),
    "zb-v-pp2": ("B", {"mesh.pipeline": 2, "pipeline.virtual_stages": 2, "pipeline.schedule": "zb-v"}),
    "zb-v-stacked-pp2xtp2": ("C", {"mesh.pipeline": 2, "pipeline.virtual_stages": 2, "mesh.tensor": 2,
                                   "pipeline.schedule": "zb-v"}),
    "zb-h1-pp3-sequence-not-divisible": ("D", {"mesh.pipeline": 3, "pipeline.microbatches": 2,
                                               "pipeline.schedule": "zb-h1"}),
    "zb-h1-pp2xdp2-accum2": ("B", {"mesh.pipeline": 2, "mesh.data": 2, "train.microbatches": 2,
                                   "pipeline.microbatches": 2, "pipeline.schedule": "zb-h1"}),
    "llama-zb-v-pp2": ("L", {"mesh.pipeline": 2, "pipeline.virtual_stages": 2, "pipeline.schedule": "zb-v"}),
    "llama-zb-h1-pp2xfsdp2xtp2": ("L", {"mesh.pipeline": 2, "mesh.fsdp": 2, "mesh.tensor": 2,
                                        "pipeline.schedule": "zb-h1"}),
}


@pytest.mark.parametrize("ref, layout", TABLE_LAYOUTS.values(), ids=TABLE_LAYOUTS.keys())
def test_table_schedules_match_single_device(layout_reference, layout_tokens, ref, layout):
    assert_same(layout_reference(**REFS[ref]), run_layout(ref_config(ref, **layout), layout_tokens))


# ---------------------------------------------------------------------------------------------------------------
# The arithmetic: each microbatch's once.

_GRAD_FLOPS: dict = {}


def grad_flops(cfg: Config) -> float:
    """Matmul FLOPs the traced gradient program of `cfg` executes (msjax.flops.executed_matmul_flops: loops by
    their trip counts, each stage's conditions with its own stage index), on the mesh's own devices."""
    if cfg not in _GRAD_FLOPS:
        n = int(np.prod(list(cfg.mesh.axis_sizes().values())))
        program = build_train_program(cfg, make_mesh(cfg.mesh, jax.devices()[:n]), vocab_size=VOCAB)
        _GRAD_FLOPS[cfg] = executed_matmul_flops(program.grad_fn, program.abstract_state["params"],
                                                 program.abstract_batch)
    return _GRAD_FLOPS[cfg]


FLOP_LAYOUTS = {**LAYOUTS, "pp2-remat_dots": ("A", {"mesh.pipeline": 2, "model.remat": "dots"}),
                "pp4-remat_full": ("B", {"mesh.pipeline": 4, "model.remat": "full"})}


@pytest.mark.parametrize("ref, layout", FLOP_LAYOUTS.values(), ids=FLOP_LAYOUTS.keys())
def test_pipelined_step_does_each_microbatchs_arithmetic_once(ref, layout):
    """The pipelined gradient's matmul FLOPs equal one device's for the same model, batch and remat within 5%,
    once the bubble's masked chunk runs are taken out by the schedule's own count: every stage runs its chunk
    in `Schedule.chunk_runs` = V M + P - 1 ticks of a flush, V M of them its own. One device's count splits
    into layers and ends (output layer, loss, embedding) by counting it at L and 2 L layers."""
    cfg = ref_config(ref, **layout)
    one = {k: v for k, v in layout.items() if not k.startswith(("mesh.", "pipeline."))}
    single = grad_flops(ref_config(ref, **one))
    ends = 2 * single - grad_flops(ref_config(ref, **one, **{"model.num_layers": 2 * REFS[ref]["model.num_layers"]}))
    sched = schedule_of(cfg)
    useful = sched.virtual_stages * sched.microbatches
    masked = (single - ends) * (sched.chunk_runs - useful) / useful
    pipelined = grad_flops(cfg)
    assert 0 < ends < single and masked >= 0
    assert abs((pipelined - masked) / single - 1) <= 0.05, (pipelined, masked, single, ends)


@pytest.mark.parametrize("ref, layout", [TABLE_LAYOUTS[k] for k in ("zb-h1-pp2", "1f1b-pp4", "zb-v-stacked-pp2xtp2")]
                         + [("A", {"mesh.pipeline": 2, "model.remat": "dots", "pipeline.schedule": "zb-h1"}),
                            ("B", {"mesh.pipeline": 4, "model.remat": "full", "pipeline.schedule": "zb-h1"})],
                         ids=["zb-h1-pp2", "1f1b-pp4", "zb-v-stacked-pp2xtp2", "zb-h1-pp2-remat_dots",
                              "zb-h1-pp4-remat_full"])
def test_table_schedules_do_one_devices_arithmetic(ref, layout):
    """Run from a table, no stage runs a masked pass and the backward's split adds nothing: the executed matmul
    FLOPs equal one device's within 1% (the B and W passes together are one backward, tests/msjax/
    test_split_backward.py)."""
    one = {k: v for k, v in layout.items() if not k.startswith(("mesh.", "pipeline."))}
    single = grad_flops(ref_config(ref, **one))
    assert grad_flops(ref_config(ref, **layout)) == pytest.approx(single, rel=0.01)


def _ancestors(body, name: str) -> set[str]:
    """Instructions of one HLO computation that `name` depends on (operands and control predecessors,
    transitively)."""
    import re

    by_name = {i.name: i for i in body.instrs}
    seen, todo = set(), [name]
    while todo:
        instr = by_name.get(todo.pop())
        if instr is None:
            continue
        preds = instr.operands + re.findall(r"%[\w.\-]+", (re.findall(r"control-predecessors=\{([^}]*)\}",
                                                                            instr.line) or [""])[0])
        for pred in preds:
            if pred in by_name and pred not in seen:
                seen.add(pred)
                todo.append(pred)
    return seen


def test_sends_do_not_wait_on_compute_of_the_same_tick():
    """Read off the compiled step (pp2 x tp2, so the slots hold tensor-parallel collectives): in the tick loop's
    body the forward send depends on the forward slot (and the embedding feeding it) but not on the backward
    slot, the output layer or the embedding gradient; the backward send not on the output layer or the
    embedding gradient. What a send depends on in the compiled program it has to wait for on any backend; the
    rest an asynchronous backend's scheduler is free to run under the transfer. (XLA:CPU's collectives are
    synchronous and its memory-driven schedule lists both sends at the end of the tick: the compiled
    dependences, not that linear order, are what the step controls.)"""
    from msjax.planner.compile_check import without_compilation_cache
    from tests.msjax import hlo_utils

    cfg = ref_config("A", **{"mesh.pipeline": 2, "mesh.tensor": 2})
    program = build_train_program(cfg, make_mesh(cfg.mesh, jax.devices()[:4]), vocab_size=VOCAB)
    with without_compilation_cache():  # a cached executable keeps the metadata of whatever compiled it first
        text = program.step_fn.lower(program.abstract_state, program.abstract_batch).compile().as_text()
    comps = hlo_utils.parse(text)
    body = next(c for c in comps.values() if sum(i.op == "collective-permute" for i in c.instrs) == 2)

    def named(scope):
        found = [i.name for i in body.instrs if f"/{scope}/" in i.line and i.op in ("conditional",
                                                                                   "collective-permute")]
        assert len(found) == 1, (scope, found)
        return found[0]

    slots = {scope: named(scope) for scope in ("tick_embedding", "tick_forward", "tick_backward",
                                               "tick_output_layer", "tick_embedding_grad")}
    fwd_send, bwd_send = named("tick_send_forward"), named("tick_send_backward")
    before_fwd, before_bwd = _ancestors(body, fwd_send), _ancestors(body, bwd_send)
    assert slots["tick_forward"] in before_fwd and slots["tick_embedding"] in before_fwd
    assert not {slots[s] for s in ("tick_backward", "tick_output_layer", "tick_embedding_grad")} & before_fwd
    assert slots["tick_backward"] in before_bwd
    assert not {slots[s] for s in ("tick_output_layer", "tick_embedding_grad")} & before_bwd


@pytest.mark.parametrize("scan_layers, remat", [(True, "none"), (False, "none"), (True, "dots"), (False, "full")])
def test_stash_holds_activations_never_parameters(scan_layers, remat):
    """bf16 compute over float32 parameters, where every cast of a weight inside the chunk would be a bf16 copy
    of it in each stash slot: no stashed residual has a parameter's shape (a layer's, a chunk's stack of them,
    or any other), and a slot's bytes are exactly linear in the microbatch (twice the sequences, twice the
    bytes: nothing in it is independent of the activations)."""
    from msjax.model import abstract_model

    cfg = ref_config("B", **{"model.scan_layers": scan_layers, "model.remat": remat, "mesh.pipeline": 2,
                             "model.dtype": "bfloat16", "model.param_dtype": "float32"})
    program = build_train_program(cfg, make_mesh(cfg.mesh, jax.devices()[:2]), vocab_size=VOCAB)
    _, params, _ = abstract_model(program.config.model)
    lc = cfg.model.num_layers // 2
    shapes = {a.shape for a in jax.tree.leaves(params)}
    shapes |= {s[1:] for s in shapes} | {(lc, *s[1:]) for s in shapes}  # unstacked and chunk-stacked layers
    entry = program.pipeline.stash_entry(2)
    assert entry and not [a.shape for a in entry if a.shape in shapes]
    nbytes = lambda leaves: sum(a.size * a.dtype.itemsize for a in leaves)  # noqa: E731
    assert nbytes(program.pipeline.stash_entry(4)) == 2 * nbytes(entry)


def _temp_bytes(cfg: Config) -> int:
    mesh = make_mesh(cfg.mesh, jax.devices()[:cfg.mesh.pipeline])
    program = build_train_program(cfg, mesh, vocab_size=VOCAB)
    compiled = program.step_fn.lower(program.abstract_state, program.abstract_batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("remat", ["none", "full"])
def test_activation_memory_is_bounded_by_stages_not_microbatches(remat):
    """1F1B's property: at M = 4P the compiled step's temp memory is within 1.25x of M = P, same microbatch, also
    without remat, where each stash slot holds a chunk's whole residual activations."""
    p, b = 2, 4
    over = {"mesh.pipeline": p, "model.d_model": 128, "model.d_ff": 512, "model.num_heads": 4, "model.remat": remat}
    small = _temp_bytes(ref_config("A", **over, **{"pipeline.microbatches": p, "train.global_batch": p * b}))
    large = _temp_bytes(ref_config("A", **over, **{"pipeline.microbatches": 4 * p,
                                                    "train.global_batch": 4 * p * b}))
    assert large <= 1.25 * small, (small, large)


@pytest.mark.parametrize("p, v, m", [(2, 1, 1), (2, 1, 3), (4, 1, 8), (2, 2, 2), (4, 2, 8), (3, 3, 6)])
def test_schedule_table_is_a_valid_interleaved_1f1b(p, v, m):
    """Every (microbatch, virtual stage) runs forward and backward exactly once, in dependency order, one tick
    per hop; the backward finds its forward's stash slot and live entries never share one (an entry is live
    from its forward's tick to its backward's, both included: a tick's forward stores before its backward
    reads); the peak of live entries is `in_flight`, within the `slots` allocated; the output layer, embedding
    and embedding-gradient ticks are those of the last and first virtual stages; ticks and bubble as documented."""
    sched = Schedule(p, v, m)
    s_count = p * v
    table = sched.slot_table
    fwd, bwd = {}, {}
    for t in range(sched.ticks):
        for stage in range(p):
            for seen, which in ((fwd, sched.forward), (bwd, sched.backward)):
                on, mb, chunk, k = which(t, stage)
                if on:
                    key = (mb, chunk * p + stage)
                    assert key not in seen
                    seen[key] = (t, int(table[stage, k]))
        on, mb = sched.loss_tick(t)
        assert bool(on) == ((mb, s_count - 1) in fwd and fwd[(mb, s_count - 1)][0] == t)
        on, mb = sched.embed_tick(t)
        assert bool(on) == ((mb, 0) in fwd and fwd[(mb, 0)][0] == t)
        on, mb = sched.embed_grad_tick(t)
        assert bool(on) == ((mb, 0) in bwd and bwd[(mb, 0)][0] == t)
    assert len(fwd) == len(bwd) == m * s_count
    for (mb, s), (t, slot) in fwd.items():
        if s + 1 < s_count:
            assert fwd[(mb, s + 1)][0] == t + 1
        if s > 0:
            assert bwd[(mb, s - 1)][0] == bwd[(mb, s)][0] + 1
        assert bwd[(mb, s)][1] == slot and bwd[(mb, s)][0] > t
    assert bwd[(0, s_count - 1)][0] == fwd[(0, s_count - 1)][0] + 1  # backward starts the tick after
    assert max(t for t, _ in bwd.values()) == sched.ticks - 1
    assert max(t for t, _ in fwd.values()) == sched.forward_ticks - 1 == sched.chunk_runs - 1
    assert min(t for t, _ in bwd.values()) == sched.backward_start
    for stage in range(p):
        peak = 0
        for t in range(sched.ticks):
            live = [slot for (mb, s), (tf, slot) in fwd.items() if s % p == stage and tf <= t <= bwd[(mb, s)][0]]
            assert len(set(live)) == len(live)
            peak = max(peak, len(live))
        assert peak == in_flight(p, v, m, stage) <= sched.slots == v * p + p
        assert table[stage].max() < sched.slots
    assert sched.bubble == bubble_fraction(p, v, m) == (p - 1) / (v * m + p - 1)


@pytest.mark.parametrize("overrides, match", [
    ({"mesh.pipeline": 2, "model.num_layers": 3}, r"model.num_layers=3 is not divisible by mesh.pipeline x "
                                                  r"pipeline.virtual_stages = 2 x 1"),
    ({"mesh.pipeline": 2, "pipeline.virtual_stages": 2}, r"model.num_layers=2 is not divisible"),
    ({"mesh.pipeline": 2, "pipeline.microbatches": 3}, r"train.global_batch=8 is not divisible by "
                                                       r"train.microbatches x pipeline.microbatches = 1 x 3"),
    ({"mesh.pipeline": 2, "model.num_layers": 4, "pipeline.virtual_stages": 2, "pipeline.microbatches": 1},
     r"pipeline.microbatches=1 must be a multiple of mesh.pipeline=2"),
    ({"pipeline.virtual_stages": 2}, r"pipeline.virtual_stages=2 needs mesh.pipeline > 1"),
    ({"pipeline.schedule": "zb-h1"}, r"pipeline.schedule=zb-h1 needs mesh.pipeline > 1"),
    ({"mesh.pipeline": 2, "pipeline.schedule": "zb-v"}, r"pipeline.schedule=zb-v runs 2 chunk\(s\) per stage: "
                                                        r"allowed is pipeline.virtual_stages=2, got 1"),
    ({"mesh.pipeline": 2, "model.num_layers": 4, "pipeline.virtual_stages": 2, "pipeline.schedule": "zb-h1"},
     r"pipeline.schedule=zb-h1 runs 1 chunk\(s\) per stage"),
    ({"mesh.pipeline": 2, "mesh.tensor": 2, "mesh.tp_overlap": "collective_matmul", "pipeline.schedule": "1f1b"},
     r"pipeline.schedule=1f1b taps each weight matmul .* allowed: pipeline.schedule=interleaved"),
    ({"pipeline.microbatches": -1}, r"pipeline.microbatches=-1"),
])
def test_layouts_that_do_not_divide_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        ref_config("A", **overrides)


def test_pipeline_microbatch_that_does_not_split_over_data_is_refused():
    cfg = ref_config("A", **{"mesh.pipeline": 2, "mesh.data": 4, "pipeline.microbatches": 4})
    with pytest.raises(ConfigError, match=r"microbatch of 2 sequences .* pipeline.microbatches=4\) does not split "
                                          r"over data x fsdp x expert = 4"):
        build_train_program(cfg, make_mesh(cfg.mesh), VOCAB)


# ---------------------------------------------------------------------------------------------------------------
# Through the loop and the command line.

ROOT = Path(__file__).resolve().parents[2]


def _env(devices: int, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", PYTHONUNBUFFERED="1", **extra)
    return env


def _train_cli(tmp: Path, devices: int, *flags: str) -> tuple[dict, list[dict], str]:
    proc = subprocess.run([sys.executable, "scripts/train.py", "--config=shakespeare_char", "--train.steps=6",
                           "--train.log_every=1", "--train.eval_every=6", "--train.eval_batches=2",
                           "--train.sample_tokens=0", "--train.progress=false", f"--train.run_dir={tmp / 'run'}",
                           f"--data.cache_dir={tmp / 'cache'}", *flags], cwd=ROOT, env=_env(devices),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    return summary, rows, proc.stdout + proc.stderr


@pytest.mark.slow
def test_cli_pipelined_shakespeare_logs_the_losses_of_one_device(tmp_path):
    one, one_rows, _ = _train_cli(tmp_path / "one", 1, "--mesh.data=1")
    pp, pp_rows, log = _train_cli(tmp_path / "pp", 8, "--mesh.pipeline=2", "--mesh.data=2", "--mesh.tensor=2")
    assert "pipeline: interleaved 1F1B, P=2 stages x V=1 chunks, M=2 microbatches | bubble (P-1)/(VM+P-1) = " \
           f"{1 / 3:.1%} | 2 chunk-microbatches in flight on stage 0 (stash of 4 slots)" in log
    losses = [(r["step"], r["loss"]) for r in one_rows if "loss" in r]
    assert len(losses) == 5 and [s for s, _ in losses] == [s for s, _ in ((r["step"], 0) for r in pp_rows
                                                                          if "loss" in r)]
    np.testing.assert_allclose([r["loss"] for r in pp_rows if "loss" in r], [l for _, l in losses], atol=1e-4,
                               rtol=0)
    assert abs(one["val_loss"][-1][1] - pp["val_loss"][-1][1]) < 1e-4


def test_gpt175b_is_refused_before_any_data_or_directory(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/train.py", "--config=gpt175b",
                           f"--train.run_dir={tmp_path / 'run'}", f"--data.cache_dir={tmp_path / 'cache'}"],
                          cwd=ROOT, env=_env(1), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr
    assert err.startswith("error: gpt175b: mesh pipeline=8 x data=-1 x fsdp=1 x expert=1 x sequence=1 x tensor=8 "
                          "needs a multiple of 64 devices; 1 present"), err
    for part in ("parameters", "gradients", "optimizer state", "activations", "total", "limit per device",
                 "host RAM", "no override"):
        assert part in err, (part, err)
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def test_layout_over_memory_names_parts_limit_and_overrides_that_fit():
    from msjax.planner.preflight import check_layout

    # 4 layers, 8 devices, 64-sequence microbatches; the planner's estimates per device (msjax.planner.memory:
    # float32, materialised attention): remat none 7.64 GiB, dots 3.25, dots_no_batch 2.44, full 1.14
    cfg = apply_overrides(Config(name="probe"), {
        "model.num_layers": 4, "model.d_model": 256, "model.num_heads": 4, "model.max_seq_len": 256,
        "model.vocab_size": 1000, "train.seq_len": 256, "train.global_batch": 512, "mesh.data": 4,
        "mesh.pipeline": 2}).validate()

    class Small:  # a device with 1.5 GiB: the limit is taken from the allocator's own figure
        platform, device_kind, process_index = "gpu", "probe", 0

        def memory_stats(self):
            return {"bytes_limit": 1.5 * 2**30}

    with pytest.raises(ConfigError) as err:
        check_layout(cfg, [Small()] * 8, remat_fixed=True)
    msg = str(err.value)
    assert msg.startswith("probe does not fit"), msg
    assert "limit per device: 1.50 GiB (probe allocator limit) - does not fit" in msg
    for part in ("parameters", "gradients", "optimizer state", "activations", "total"):
        assert part in msg
    assert "overrides that would fit on the 8 device(s) present: --model.remat=full" in msg
    fixed = apply_overrides(cfg, {"model.remat": "full"}).validate()
    assert check_layout(fixed, [Small()] * 8).memory.total <= 1.5 * 2**30

    # Left free (a preset's policy), remat is raised to the cheapest policy that fits: full, since the dots
    # policies' saved matmul outputs do not fit either.
    checked = check_layout(cfg, [Small()] * 8)
    assert checked.config.model.remat == "full" and checked.memory.total <= 1.5 * 2**30
    assert checked.config == fixed and "full is the cheapest policy that fits" in checked.note, checked.note
    for remat in ("dots", "dots_no_batch"):
        over = check_layout(apply_overrides(cfg, {"model.remat": remat}), [Small()] * 8, remat_fixed=False)
        assert over.config.model.remat == "full"


@pytest.mark.slow
def test_resume_mid_pipelined_run_is_bit_identical(tmp_path, small_corpus, make_tiny_config):
    from msjax.train import run

    layout = {"mesh.pipeline": 2, "mesh.fsdp": 1, "train.sample_tokens": 0}
    straight = run(make_tiny_config(tmp_path / "a", small_corpus, **layout))
    run(make_tiny_config(tmp_path / "b", small_corpus, **layout, **{"train.steps": 4}))
    resumed = run(make_tiny_config(tmp_path / "b", small_corpus, **layout, **{"checkpoint.resume": True}))
    assert resumed.start_step == 4
    for x, y in zip(jax.tree.leaves(jax.device_get(straight.state)),
                    jax.tree.leaves(jax.device_get(resumed.state))):
        np.testing.assert_array_equal(x, y)  # params, optimizer state, step and RNG, bit for bit
    assert straight.val_loss[-1] == resumed.val_loss[-1]


# Two processes x 4 devices training pp2 x dp2 x tp2 and ending with the parameters of 1 process x 8 devices:
# tests/msjax/test_multiprocess.py (one multi-process run serves the pipeline and the data-loading checks).

