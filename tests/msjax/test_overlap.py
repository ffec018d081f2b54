"""Overlap switches change the schedule, never the math: 8 fake CPU devices against one device, and the
compiled programs show the communication pattern each switch promises (docs/overlap.md).

Equivalence as tests/msjax/layouts.py says: the loss and global gradient norm of each of STEPS optimizer steps
and the full gradient pytree at initialisation, float32, within 1e-5, against single-device references (serial
and parallel blocks) shared by the session.
"""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from msjax.config import Config, ConfigError
from msjax.mesh import make_mesh
from msjax.runtime import CPU_CONCURRENT_SCHEDULER
from msjax.train_step import build_train_program
from tests.msjax.hlo_utils import collectives, dependents, is_matmul, parse
from tests.msjax.layouts import TOL, VOCAB, assert_same, run_layout, tiny_config

@pytest.fixture(scope="module")
def tokens(layout_tokens):
    return layout_tokens


@pytest.fixture(scope="module")
def reference(layout_reference):
    """Single-device runs, one per block kind (shared with test_parallel and test_pipeline)."""
    return {block: layout_reference(**{"model.block": block}) for block in ("serial", "parallel")}


ROOT = Path(__file__).resolve().parents[2]
TP = dict(data=2, fsdp=2, tensor=2)
TP_SP = dict(data=2, sequence=2, tensor=2)


def cfg_for(block: str, mesh: dict, **overrides) -> Config:
    return tiny_config(**{"model.block": block, **{f"mesh.{k}": v for k, v in mesh.items()}, **overrides})


# ---------------------------------------------------------------------------------------------------------------
# Equivalence with one device.


@pytest.mark.parametrize("block", ["serial", "parallel"])
@pytest.mark.parametrize("mesh", [TP, TP_SP], ids=["tp", "tp_sp"])
def test_collective_matmul_matches_single_device(reference, tokens, block, mesh):
    cfg = cfg_for(block, mesh, **{"mesh.tp_overlap": "collective_matmul"})
    assert_same(reference[block], run_layout(cfg, tokens, 8))


def test_context_parallel_reduce_scatter_matches_single_device(reference, tokens):
    """The GSPMD path with the hand-written K/V all-gather (tp_overlap=none), parallel blocks (the serial
    block with this mesh is tests/msjax/test_parallel.py's data x sequence x tensor layout)."""
    assert_same(reference["parallel"], run_layout(cfg_for("parallel", TP_SP), tokens, 8))


@pytest.mark.parametrize("block,mesh,overlap,micro", [
    ("serial", dict(data=2, fsdp=4), "none", 1),
    ("parallel", dict(fsdp=2, sequence=2, tensor=2), "collective_matmul", 2),
], ids=["d2xf4", "f2xs2xt2-collective_matmul-microbatches2"])
def test_zero2_matches_single_device(reference, tokens, block, mesh, overlap, micro):
    """ZeRO-2's hand-written reduction (msjax/parallel/zero2.py) computes the plain data-parallel step's numbers.
    Besides the losses and norms, Adam's first moment after the steps is compared leaf by leaf: it is linear in
    each step's reduced gradients (mu = (1 - b1) sum_k b1^k g_k), so a gradient reduced over the wrong devices
    or divided by the wrong count shows in it even where the global norm hides it. The second layout runs the
    reduction with gradient accumulation inside and tensor, sequence and collective-matmul regions nested in it."""
    want = reference[block]  # one whole batch: accumulating microbatches must not change the math
    cfg = cfg_for(block, mesh, **{"mesh.rules": "zero2", "mesh.tp_overlap": overlap, "train.microbatches": micro})
    got = run_layout(cfg, tokens, 8)
    assert_same(want, got)
    mu_want, mu_got = (jax.device_get(optax.tree_utils.tree_get(r.state["opt_state"], "mu")) for r in (want, got))
    assert jax.tree.structure(mu_want) == jax.tree.structure(mu_got)
    for x, y in zip(jax.tree.leaves(mu_want), jax.tree.leaves(mu_got)):
        np.testing.assert_allclose(y, x, atol=TOL, rtol=0)


@pytest.mark.parametrize("mesh,tp_overlap,unroll", [(dict(fsdp=4, tensor=2), "none", 1),
                                                    (dict(fsdp=4, tensor=2), "none", 4),
                                                    (dict(fsdp=2, sequence=2, tensor=2), "collective_matmul", 1)],
                         ids=["fsdp4xtp2", "fsdp4xtp2-unrolled", "fsdp2xsp2xtp2-collective_matmul"])
def test_fsdp_prefetch_matches_single_device(reference, tokens, mesh, tp_overlap, unroll):
    """fsdp x tp: the layer loop runs manual over `fsdp` with our own all-gather, and the layer's sharding
    constraints inside it drop `fsdp` (msjax.sharding.region_spec). With context parallelism and collective
    matmul (shard_maps of their own in the layer) the gather ahead is GSPMD's (fsdp_prefetch's docstring). The
    prefetched loop takes `model.scan_unroll` as the plain scan does."""
    cfg = cfg_for("parallel", mesh, **{"mesh.fsdp_prefetch": True, "mesh.tp_overlap": tp_overlap,
                                       "model.scan_unroll": unroll})
    assert_same(reference["parallel"], run_layout(cfg, tokens, 8))


@pytest.mark.parametrize("overlap", [{"mesh.tp_overlap": "collective_matmul", "mesh.data": 2},
                                     {"mesh.fsdp_prefetch": True, "mesh.fsdp": 2}],
                         ids=["collective_matmul", "prefetch"])
def test_overlap_inside_pipeline_stages_matches_single_device(reference, tokens, overlap):
    """pp2 x (dp2 or fsdp2) x tp2: the overlap code runs nested in the pipeline's shard_map (msjax.sharding
    .nested_shard_map leaves `pipeline` to the enclosing region) and still computes what one device computes."""
    cfg = tiny_config(**{"model.block": "parallel", "mesh.pipeline": 2, "mesh.tensor": 2, **overlap})
    assert_same(reference["parallel"], run_layout(cfg, tokens, 8))


@pytest.mark.parametrize("mesh", [TP, TP_SP], ids=["tp", "tp_sp"])
def test_xla_mode_is_the_same_program_as_none_here(mesh):
    """`xla` differs from `none` only in XLA flags set before the backend starts; in this process (flags fixed)
    it must lower to exactly the program `none` lowers to, whose equivalence test_parallel.py proves."""
    texts = []
    for mode in ("none", "xla"):
        program = _program(cfg_for("parallel", mesh, **{"mesh.tp_overlap": mode}))
        texts.append(program.step_fn.lower(program.abstract_state, program.abstract_batch).as_text())
    assert texts[0] == texts[1]


# ---------------------------------------------------------------------------------------------------------------
# What the compiled (or lowered) programs show.


def _program(cfg: Config, devices: int = 8):
    return build_train_program(cfg, make_mesh(cfg.mesh, jax.devices()[:devices]), vocab_size=VOCAB)


def _lowered_ops(program, fn: str = "eval_fn") -> list[str]:
    """StableHLO ops in program order: 'P' collective_permute, 'D' dot_general, 'G' all_gather, 'S'
    reduce_scatter, 'R' all_reduce."""
    params = program.abstract_state["params"]
    text = getattr(program, fn).lower(params, program.abstract_batch).as_text()
    codes = {"collective_permute": "P", "dot_general": "D", "all_gather": "G", "reduce_scatter": "S",
             "all_reduce": "R"}
    return [codes[m] for m in re.findall(r"stablehlo\.(" + "|".join(codes) + r")\b", text)]


@pytest.mark.parametrize("block,rings", [("parallel", 2), ("serial", 4)])
def test_collective_matmul_rings_per_layer(block, rings):
    """tensor=4, scanned layers (the layer body is lowered once): the forward has, per layer, `rings` rings of
    tp - 1 bidirectional steps (2 collective-permutes each) and no whole all-gather or reduce-scatter. Parallel
    blocks: ONE all-gather ring and ONE reduce-scatter ring for attention and MLP together (MegaScale Fig. 3);
    serial: one of each per branch. The backward is decomposed as well: as many permutes again."""
    tp = 4
    program = _program(cfg_for(block, dict(data=2, tensor=tp), **{"mesh.tp_overlap": "collective_matmul"}))
    fwd = "".join(_lowered_ops(program))
    assert fwd.count("P") == rings * (tp - 1) * 2
    assert "G" not in fwd and "S" not in fwd
    # Interleaved in program order: each step's two permutes are followed by partial matmuls before the next
    # step's permutes (not all the permutes before or after the dots).
    runs = re.findall(r"P+", fwd[fwd.index("P"):fwd.rindex("P") + 1])
    assert runs == ["PP"] * (rings * (tp - 1))
    assert all(re.fullmatch(r"D+", gap) for gap in re.split(r"P+", fwd[fwd.index("P"):fwd.rindex("P") + 1])[1:-1])
    grad = "".join(_lowered_ops(program, "grad_fn"))
    assert grad.count("P") == 2 * fwd.count("P")
    assert "G" not in grad and "S" not in grad


def _kv_grad_collective_bytes(program, b: int, t: int, g: int, k: int, sp: int) -> tuple[float, int]:
    """Bytes per device that the compiled gradient program moves in collectives carrying dK/dV-shaped arrays
    ({B, S, G, K} whole or split over `sequence`), by the ring cost model (all-reduce 2 (n-1)/n of the buffer,
    reduce-scatter (n-1)/n of its input, Patarasuk & Yuan 2009), and how many such collectives there were."""
    comps = parse(program.grad_fn.lower(program.abstract_state["params"], program.abstract_batch).compile()
                  .as_text())
    whole, split = sorted((b, t, g, k)), sorted((b, t // sp, g, k))
    moved, found = 0.0, 0
    for c in collectives(comps):
        if c.op not in ("all-reduce", "reduce-scatter"):
            continue
        for dt, dims in c.shapes:
            n = c.group_size()
            size = 4 * math.prod(dims)
            if c.op == "all-reduce" and sorted(dims) == whole:
                moved, found = moved + 2 * size * (n - 1) / n, found + 1
            elif c.op == "reduce-scatter" and sorted(dims) == split:
                moved, found = moved + size * (n - 1), found + 1  # result is 1/n of the input
    return moved, found


@pytest.mark.parametrize("mode", ["none", "collective_matmul"])
def test_context_parallel_moves_no_more_dkdv_bytes_than_a_reduce_scatter(mode):
    """mesh data 2 x sequence 2 x tensor 2, one layer: dK and dV (each B/2 x T x G/2 x K float32 per device before
    the reduction) cost at most two reduce-scatters over `sequence`, not two all-reduces."""
    sp, b, t, g, k = 2, 4, 32, 4, 8
    program = _program(cfg_for("serial", TP_SP, **{"mesh.tp_overlap": mode, "model.num_layers": 1}))
    moved, found = _kv_grad_collective_bytes(program, b, t, g, k, sp)
    reduce_scatter = 4 * b * t * g * k * (sp - 1) / sp
    assert found >= 2
    assert moved <= 2 * reduce_scatter


def test_zero2_gathers_each_parameter_once_per_step():
    """fsdp=8, zero2: parameters replicated, optimizer state split over fsdp; the compiled step all-gathers each
    parameter that has an `embed` axis exactly once (after the update) and never inside the layer loops."""
    program = _program(cfg_for("serial", dict(fsdp=8), **{"mesh.rules": "zero2"}))
    state = program.abstract_state
    w_in = state["params"]["blocks"]["mlp"]["w_in"]
    assert "fsdp" not in str(w_in.sharding.spec)
    mu = optax.tree_utils.tree_get(state["opt_state"], "mu")  # Adam's first moment, wherever the chain keeps it
    assert mu["blocks"]["mlp"]["w_in"].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    comps = parse(program.step_fn.lower(state, program.abstract_batch).compile().as_text())
    gathers = collectives(comps, "all-gather")
    sharded = [m.shape for m in jax.tree.leaves(mu) if "fsdp" in str(m.sharding.spec)]
    assert len(sharded) == 8  # wte, wpe, wq, wk, wv, wo, w_in, w_out
    assert all(i in comps["ENTRY"].instrs for i in gathers)  # none in a while body (forward/backward scan)
    assert sorted(sorted(i.shapes[0][1]) for i in gathers) == sorted(sorted(s) for s in sharded)


def _ring_bytes(instr) -> float:
    """Bytes one device sends in collective `instr` on a ring of its group (Patarasuk & Yuan 2009): all-reduce
    2 (n-1)/n of the buffer, reduce-scatter (n-1)/n of its input (n times its result)."""
    n = instr.group_size()
    if instr.op == "reduce-scatter":
        return instr.bytes * (n - 1)
    return 2 * instr.bytes * (n - 1) / n


def test_zero2_reduce_scatters_each_gradient_over_fsdp():
    """data 2 x fsdp 4, zero2, compiled step: every gradient that the optimizer state splits over fsdp is reduced
    by ONE reduce-scatter over its 4 fsdp devices (result: this device's 1/4 of the whole gradient) followed by
    an all-reduce of that quarter over the 2 `data` devices, and no collective carries a whole such gradient
    (GSPMD left to itself all-reduces each layer's whole gradient over all 8 devices inside the backward loop
    and slices it). The bytes per device, read off the program, are the ZeRO-2 figure: (f-1)/f of the sharded
    gradients, plus 2 (d-1)/d of a quarter of them, plus an all-reduce of the small unsharded ones (norms); an
    all-reduce of everything would move 2 (n-1)/n. The same reduce-scatters are in the StableHLO lowered for
    GPU and TPU: they are written in the program, not left to one backend's pass."""
    data, fsdp = 2, 4
    program = _program(cfg_for("serial", dict(data=data, fsdp=fsdp), **{"mesh.rules": "zero2"}))
    state = program.abstract_state
    mu = optax.tree_utils.tree_get(state["opt_state"], "mu")  # laid out as the reduced gradients are
    sharded, whole = [], []  # (whole shape, shard shape) of the gradients split over fsdp; shapes of the others
    for m in jax.tree.leaves(mu):
        spec = tuple(m.sharding.spec) + (None,) * (len(m.shape) - len(m.sharding.spec))
        if "fsdp" in spec:
            sharded.append((m.shape, tuple(d // fsdp if s == "fsdp" else d for d, s in zip(m.shape, spec))))
        else:
            whole.append(m.shape)
    assert len(sharded) == 8  # wte, wpe, wq, wk, wv, wo, w_in, w_out
    comps = parse(program.step_fn.lower(state, program.abstract_batch).compile().as_text())

    scatters = collectives(comps, "reduce-scatter")
    assert sorted(i.shapes[0][1] for i in scatters) == sorted(shard for _, shard in sharded)
    assert all(i.group_size() == fsdp for i in scatters)
    reductions = [i for i in collectives(comps, "all-reduce") if any(dims for _, dims in i.shapes)]
    carried = [dims for i in reductions for _, dims in i.shapes]
    # whole gradients, stacked (L, ...) or one layer's slice of them (what the backward loop would reduce)
    per_layer = {full[1:] for full, _ in sharded if len(full) > 2} | {full for full, _ in sharded}
    assert not per_layer & set(carried), "a whole ZeRO-2 gradient is all-reduced"
    quarters = [i for i in reductions if {dims for _, dims in i.shapes} <= {shard for _, shard in sharded}]
    assert sorted(dims for i in quarters for _, dims in i.shapes) == sorted(shard for _, shard in sharded)
    assert all(i.group_size() == data for i in quarters)
    rest = [i for i in reductions if i not in quarters]
    assert sorted(dims for i in rest for _, dims in i.shapes if dims) == sorted(s for s in whole if s)
    assert all(i.group_size() == data * fsdp for i in rest)

    n = data * fsdp
    sharded_bytes = 4 * sum(math.prod(full) for full, _ in sharded)
    whole_bytes = 4 * sum(math.prod(s) for s in whole)
    moved = sum(_ring_bytes(i) for i in scatters + reductions)
    expected = (sharded_bytes * (fsdp - 1) / fsdp + 2 * sharded_bytes / fsdp * (data - 1) / data
                + 2 * whole_bytes * (n - 1) / n)
    assert moved == pytest.approx(expected, rel=1e-3, abs=64)  # + the loss and norm scalars
    assert moved < 0.6 * 2 * (sharded_bytes + whole_bytes) * (n - 1) / n

    traced = program.step_fn.trace(state, program.abstract_batch)
    for platform in ("cuda", "tpu"):
        text = traced.lower(lowering_platforms=(platform,)).as_text()
        assert text.count("stablehlo.reduce_scatter") == len(sharded), platform


# The prefetch tests read the loop body's order as a scheduler that seeks concurrency leaves it: XLA:CPU's
# concurrency-optimised scheduler, which `import msjax` turns off in processes with several CPU devices (a
# collective-order deadlock when such programs run: msjax/runtime.py, `order_cpu_collectives`); without it
# XLA:CPU keeps the body in program order. The flag is process-wide (a per-compile `compiler_options` override
# did not change the schedule), so the programs are compiled, never run, in one subprocess that sets it. What
# the order shows is the freedom prefetch gives a scheduler (the gathers feed no matmul of the body), the freedom
# GPU's latency-hiding scheduler uses.
_CONCURRENT_HLO = f"""
import json, os
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --{CPU_CONCURRENT_SCHEDULER}=true"
import tests.conftest
from tests.msjax.test_overlap import _program, cfg_for
out = {{}}
for prefetch in (True, False):
    program = _program(cfg_for("serial", dict(fsdp=8), **{{"mesh.fsdp_prefetch": prefetch, "model.num_layers": 3}}))
    args = (program.abstract_state["params"], program.abstract_batch)
    out[str(prefetch)] = {{fn: getattr(program, fn).lower(*args).compile().as_text() for fn in ("eval_fn", "grad_fn")}}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def concurrent_prefetch_hlo() -> dict:
    """{str(prefetch): {"eval_fn"|"grad_fn": compiled HLO text}} for fsdp=8, 3 scanned layers, compiled with
    XLA:CPU's concurrency-optimised scheduler on (see above)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", _CONCURRENT_HLO], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _loop_bodies(comps):
    return [comps[c] for i in comps["ENTRY"].instrs if i.op == "while" for c in i.calls if "body" in c
            or comps[c].instrs and comps[c].instrs[-1].op == "tuple"]


@pytest.mark.parametrize("prefetch", [True, False])
def test_fsdp_prefetch_gathers_the_next_layer_before_this_layers_matmuls(concurrent_prefetch_hlo, prefetch):
    """fsdp=8, 3 scanned layers, forward program. With prefetch the layer loop's body issues its parameter
    all-gathers before its first matmul and none of its matmuls reads them (they are the next layer's, carried
    to the next iteration); without it the body's matmuls consume the all-gathers of the same iteration."""
    comps = parse(concurrent_prefetch_hlo[str(prefetch)]["eval_fn"])
    bodies = [c for c in comps.values() if any(i.op == "all-gather" for i in c.instrs)
              and any(is_matmul(i, comps) for i in c.instrs) and c is not comps["ENTRY"]]
    assert len(bodies) == 1
    body = bodies[0]
    order = {i.name: n for n, i in enumerate(body.instrs)}
    gathers = [i.name for i in body.instrs if i.op == "all-gather"]
    matmuls = [i.name for i in body.instrs if is_matmul(i, comps)]
    assert len(gathers) == 6  # wq, wk, wv, wo, w_in, w_out
    uses_gathered = dependents(body, set(gathers))
    if prefetch:
        assert max(order[g] for g in gathers) < min(order[m] for m in matmuls)
        assert not uses_gathered & set(matmuls)
    else:
        assert uses_gathered & set(matmuls)


@pytest.mark.parametrize("prefetch", [True, False])
def test_fsdp_prefetch_reduce_scatters_each_layers_gradients_in_the_backward_loop(concurrent_prefetch_hlo, prefetch):
    """fsdp=8, 3 scanned layers, gradient program. With prefetch the backward layer loop reduce-scatters (over
    all 8 devices) the six weight gradients that the previous iteration produced (the transpose of the forward's
    carried all-gather), ahead of this iteration's matmuls and feeding none of them: the reduction of one layer's
    gradients overlaps the next layer's backward. Without it GSPMD leaves XLA:CPU an all-reduce of the whole
    gradients in the loop (and no reduce-scatter anywhere in it)."""
    comps = parse(concurrent_prefetch_hlo[str(prefetch)]["grad_fn"])
    loops = [c for c in comps.values() if c is not comps["ENTRY"]
             and sum(is_matmul(i, comps) for i in c.instrs) >= 12  # the backward body: 2 x the forward's dots
             and any(i.op in ("reduce-scatter", "all-reduce") for i in c.instrs)]
    assert len(loops) == 1
    body = loops[0]
    order = {i.name: n for n, i in enumerate(body.instrs)}
    scatters = [i for i in body.instrs if i.op == "reduce-scatter"]
    matmuls = [i.name for i in body.instrs if is_matmul(i, comps)]
    if prefetch:
        assert len(scatters) == 6  # wq, wk, wv, wo, w_in, w_out
        assert all(i.group_size() == 8 for i in scatters)
        assert max(order[i.name] for i in scatters) < min(order[m] for m in matmuls)
        assert not dependents(body, {i.name for i in scatters}) & set(matmuls)
    else:
        assert not scatters
        reduced = [dims for i in body.instrs if i.op == "all-reduce" for _, dims in i.shapes]
        # w_in's and w_out's gradients whole, not 1/8 of them (w_out's in either orientation: on XLA:CPU the
        # backward may compute it transposed, msjax.ops.matmul)
        assert sum(math.prod(dims) == 64 * 128 for dims in reduced) >= 2, reduced


def test_overlap_config_errors():
    with pytest.raises(ConfigError, match="mesh.tp_overlap=collective_matmul decomposes Megatron-SP, which "
                                          "mesh.rules='fsdp' does not use"):
        tiny_config(**{"mesh.tp_overlap": "collective_matmul", "mesh.rules": "fsdp"})
    with pytest.raises(ConfigError, match="mesh.tp_overlap='ring': allowed is one of 'none', 'xla'"):
        tiny_config(**{"mesh.tp_overlap": "ring"})
    with pytest.raises(ConfigError, match="model.attention.impl='pallas' takes no query offset"):
        tiny_config(**{"mesh.tp_overlap": "collective_matmul", "mesh.sequence": 2, "model.attention.impl": "pallas"})


# ---------------------------------------------------------------------------------------------------------------
# XLA flag presets.


def test_xla_flag_presets_parse_and_merge():
    """Every preset flag is known to the installed jaxlib (an unknown one aborts XLA at start-up: checked in a
    fresh process), the windowed einsum comes only with tp_overlap=xla, and flags already set win."""
    from msjax.parallel import xla_flags

    gpu = xla_flags.preset("gpu", "xla")
    assert gpu["xla_gpu_threshold_for_windowed_einsum_mib"] == "0"
    assert "xla_gpu_threshold_for_windowed_einsum_mib" not in xla_flags.preset("gpu", "collective_matmul")
    assert xla_flags.preset("cpu", "xla") == {}
    merged = xla_flags.merged("--xla_gpu_enable_latency_hiding_scheduler=false", gpu)
    assert "--xla_gpu_enable_latency_hiding_scheduler=false" in merged
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in merged
    env = {**os.environ, "XLA_FLAGS": xla_flags.merged("", gpu), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; print(float(jnp.ones(3).sum()))"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "3.0", proc.stderr[-2000:]
    with pytest.raises(RuntimeError, match="backend is already initialised"):
        xla_flags.apply("xla", backend="gpu")
    with pytest.raises(ValueError, match="backend='npu'"):
        xla_flags.preset("npu")


# ---------------------------------------------------------------------------------------------------------------
# Hybrid mesh.


def test_hybrid_mesh_keeps_tensor_and_sequence_inside_a_host():
    """4 hosts x 4 devices (stand-in device objects: only `id` and `process_index` are read when the grid is
    built), mesh data 4 x sequence 2 x tensor 2: every (sequence, tensor) block lies on one host and `data`
    runs across hosts."""
    from dataclasses import dataclass

    from jax.experimental import mesh_utils

    from msjax.mesh import hybrid_shapes

    @dataclass(frozen=True)
    class FakeDevice:
        id: int
        process_index: int
        platform: str = "cpu"
        device_kind: str = "fake"
        slice_index: int = 0

    devices = [FakeDevice(i, i // 4) for i in range(16)]
    sizes = dict(pipeline=1, data=4, fsdp=1, expert=1, sequence=2, tensor=2)
    per_host, across = hybrid_shapes(sizes, hosts=4)
    assert (per_host, across) == ([1, 1, 1, 1, 2, 2], [1, 4, 1, 1, 1, 1])
    grid = mesh_utils.create_hybrid_device_mesh(per_host, across, devices, process_is_granule=True)
    hosts = np.vectorize(lambda d: d.process_index)(grid).reshape(4, 4)  # (data, sequence x tensor)
    assert all(len(set(row)) == 1 for row in hosts) and sorted(hosts[:, 0]) == [0, 1, 2, 3]
    assert hybrid_shapes(dict(pipeline=8, data=4, fsdp=1, expert=1, sequence=1, tensor=8), 32) == \
        ([1, 1, 1, 1, 1, 8], [8, 4, 1, 1, 1, 1])
    with pytest.raises(ConfigError, match="cannot span 2 hosts with expert, sequence and tensor inside each host"):
        hybrid_shapes(dict(pipeline=1, data=1, fsdp=1, expert=1, sequence=2, tensor=4), 2)
