"""Pipeline parallelism (msjax/parallel): the interleaved-1F1B step computes what one device computes, its
activation memory does not grow with the microbatch count, its schedule is what the docs say, and bad layouts
are refused with errors naming the key.

Equivalence follows tests/msjax/test_parallel.py: STEPS optimizer steps on 8 fake CPU devices against one device,
losses, global gradient norms (computed outside the shard_map, as clipping and LAMB see them) and the gradient
pytree at initialisation within 1e-5 (float32). Two single-device references, shared at module scope, cover
serial/parallel blocks, window/no window, AdamW/LAMB and stacked/per-layer parameters.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from msjax.config import Config, ConfigError, apply_overrides
from msjax.mesh import make_mesh
from msjax.parallel.schedule import Schedule, bubble_fraction, in_flight
from msjax.train_step import build_train_program

TOL = 1e-5
STEPS = 3
VOCAB = 100

# Reference A: stacked layers, serial blocks, sliding window, AdamW. Reference B: per-layer parameters (as the CPU
# presets), parallel blocks, full causal attention, LAMB.
REFS = {
    "A": {"model.num_layers": 2, "model.scan_layers": True, "model.block": "serial", "model.attention.window": 12,
          "optimizer.name": "adamw"},
    "B": {"model.num_layers": 4, "model.scan_layers": False, "model.block": "parallel",
          "model.attention.window": None, "optimizer.name": "lamb"},
}


def tiny_config(ref: str, **overrides) -> Config:
    base = {"model.d_model": 64, "model.num_heads": 8, "model.d_ff": 128, "model.max_seq_len": 32,
            "train.seq_len": 32, "train.global_batch": 8, "train.steps": 10, "optimizer.warmup_steps": 2,
            "mesh.data": 1}
    return apply_overrides(Config(), {**base, **REFS[ref], **overrides}).validate()


def run_layout(cfg: Config, tokens: np.ndarray):
    sizes = cfg.mesh.axis_sizes()
    mesh = make_mesh(cfg.mesh, jax.devices()[:int(np.prod(list(sizes.values())))])
    program = build_train_program(cfg, mesh, vocab_size=VOCAB)
    state = program.init_fn(jax.random.key(0))
    batch = {"inputs": jax.device_put(tokens[:, :-1], program.batch_sharding),
             "targets": jax.device_put(tokens[:, 1:], program.batch_sharding)}
    _, grads = program.grad_fn(state["params"], batch)
    losses, norms = [], []
    for _ in range(STEPS):
        state, metrics = program.step_fn(state, batch)
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    return np.array(losses), np.array(norms), jax.device_get(grads)


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, VOCAB, (8, 33)).astype(np.int32)


@pytest.fixture(scope="module")
def single(tokens):
    cache = {}

    def get(ref):
        if ref not in cache:
            cache[ref] = run_layout(tiny_config(ref), tokens)
        return cache[ref]

    return get


@pytest.mark.parametrize("ref, layout", [
    ("A", {"mesh.pipeline": 2}),
    ("A", {"mesh.pipeline": 2, "mesh.data": 2, "mesh.tensor": 2}),
    ("A", {"mesh.pipeline": 2, "mesh.sequence": 2, "mesh.tensor": 2}),
    ("B", {"mesh.pipeline": 4}),
    ("B", {"mesh.pipeline": 2, "pipeline.virtual_stages": 2}),
    ("B", {"mesh.pipeline": 2, "mesh.fsdp": 2, "mesh.tensor": 2}),  # Megatron-SP: act_seq split over tensor
    ("B", {"mesh.pipeline": 2, "mesh.data": 2, "train.microbatches": 2, "pipeline.microbatches": 2}),
], ids=["pp2", "pp2xdp2xtp2", "pp2xsp2xtp2", "pp4", "pp2xvpp2", "pp2xfsdp2xtp2", "pp2xdp2-accum2"])
def test_pipelined_layouts_match_single_device(single, tokens, ref, layout):
    want = single(ref)
    got = run_layout(tiny_config(ref, **layout), tokens)
    np.testing.assert_allclose(got[0], want[0], atol=TOL, rtol=0)  # losses of each step
    np.testing.assert_allclose(got[1], want[1], atol=TOL, rtol=0)  # whole-model gradient norms
    assert jax.tree.structure(got[2]) == jax.tree.structure(want[2])
    for x, y in zip(jax.tree.leaves(want[2]), jax.tree.leaves(got[2])):
        np.testing.assert_allclose(y, x, atol=TOL, rtol=0)
    assert want[0][-1] < want[0][0]  # the reference really trains


def _temp_bytes(cfg: Config) -> int:
    mesh = make_mesh(cfg.mesh, jax.devices()[:cfg.mesh.pipeline])
    program = build_train_program(cfg, mesh, vocab_size=VOCAB)
    compiled = program.step_fn.lower(program.abstract_state, program.abstract_batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_activation_memory_is_bounded_by_stages_not_microbatches():
    """1F1B's property: at M = 4P the compiled step's temp memory is within 1.25x of M = P, same microbatch."""
    p, b = 2, 4
    over = {"mesh.pipeline": p, "model.d_model": 128, "model.d_ff": 512, "model.num_heads": 4}
    small = _temp_bytes(tiny_config("A", **over, **{"pipeline.microbatches": p, "train.global_batch": p * b}))
    large = _temp_bytes(tiny_config("A", **over, **{"pipeline.microbatches": 4 * p,
                                                    "train.global_batch": 4 * p * b}))
    assert large <= 1.25 * small, (small, large)


@pytest.mark.parametrize("p, v, m", [(2, 1, 1), (2, 1, 3), (4, 1, 8), (2, 2, 2), (4, 2, 8), (3, 3, 6)])
def test_schedule_table_is_a_valid_interleaved_1f1b(p, v, m):
    """Every (microbatch, virtual stage) runs forward and backward exactly once, in dependency order, one tick
    per hop; stash slots never collide; the peak of live stash entries is `in_flight`; ticks and bubble as
    documented."""
    sched = Schedule(p, v, m)
    s_count = p * v
    fwd, bwd = {}, {}
    for t in range(sched.ticks):
        for stage in range(p):
            for table, which in ((fwd, sched.forward), (bwd, sched.backward)):
                on, mb, chunk, slot = which(t, stage)
                if on:
                    key = (mb, chunk * p + stage)
                    assert key not in table
                    table[key] = (t, slot)
    assert len(fwd) == len(bwd) == m * s_count
    for (mb, s), (t, slot) in fwd.items():
        if s + 1 < s_count:
            assert fwd[(mb, s + 1)][0] == t + 1
        if s > 0:
            assert bwd[(mb, s - 1)][0] == bwd[(mb, s)][0] + 1
        assert bwd[(mb, s)] [1] == slot and bwd[(mb, s)][0] > t
    assert bwd[(0, s_count - 1)][0] == fwd[(0, s_count - 1)][0] + 1  # backward starts the tick after
    assert max(t for t, _ in bwd.values()) == sched.ticks - 1
    assert max(t for t, _ in fwd.values()) == sched.forward_ticks - 1
    assert min(t for t, _ in bwd.values()) == sched.backward_start
    for stage in range(p):
        peak = 0
        for t in range(sched.ticks):
            live = [slot for (mb, s), (tf, slot) in fwd.items() if s % p == stage and tf <= t <= bwd[(mb, s)][0]]
            assert len(set(live)) == len(live)
            peak = max(peak, len(live))
        assert peak == in_flight(p, v, m, stage)
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
    ({"pipeline.microbatches": -1}, r"pipeline.microbatches=-1"),
])
def test_layouts_that_do_not_divide_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config("A", **overrides)


def test_pipeline_microbatch_that_does_not_split_over_data_is_refused():
    cfg = tiny_config("A", **{"mesh.pipeline": 2, "mesh.data": 4, "pipeline.microbatches": 4})
    with pytest.raises(ConfigError, match=r"microbatch of 2 sequences .* pipeline.microbatches=4\) does not split "
                                          r"over data x fsdp = 4"):
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


def test_cli_pipelined_shakespeare_logs_the_losses_of_one_device(tmp_path):
    one, one_rows, _ = _train_cli(tmp_path / "one", 1, "--mesh.data=1")
    pp, pp_rows, log = _train_cli(tmp_path / "pp", 8, "--mesh.pipeline=2", "--mesh.data=2", "--mesh.tensor=2")
    assert "pipeline: interleaved 1F1B, P=2 stages x V=1 chunks, M=2 microbatches | bubble (P-1)/(VM+P-1) = " \
           f"{1 / 3:.1%} | 2 chunk inputs in flight on stage 0" in log
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
    assert err.startswith("error: gpt175b: mesh pipeline=8 x data=-1 x fsdp=1 x sequence=1 x tensor=8 needs a "
                          "multiple of 64 devices; 1 present"), err
    for part in ("parameters", "gradients", "optimizer state", "activations", "total", "limit per device",
                 "host RAM", "no override"):
        assert part in err, (part, err)
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def test_layout_over_memory_names_parts_limit_and_overrides_that_fit():
    from msjax.planner.preflight import check_layout

    # 4 layers, 8 devices, 64-sequence microbatches: ~1.97 GiB per device without remat, ~1.22 GiB with full remat
    # (msjax.planner.memory: what the compiled step holds, float32, materialised attention)
    cfg = apply_overrides(Config(name="probe"), {
        "model.num_layers": 4, "model.d_model": 256, "model.num_heads": 4, "model.max_seq_len": 256,
        "model.vocab_size": 1000, "train.seq_len": 256, "train.global_batch": 512, "mesh.data": 4,
        "mesh.pipeline": 2}).validate()

    class Small:  # a device with 1.5 GiB: the limit is taken from the allocator's own figure
        platform, device_kind, process_index = "gpu", "probe", 0

        def memory_stats(self):
            return {"bytes_limit": 1.5 * 2**30}

    with pytest.raises(ConfigError) as err:
        check_layout(cfg, [Small()] * 8)
    msg = str(err.value)
    assert msg.startswith("probe does not fit"), msg
    assert "limit per device: 1.50 GiB (probe allocator limit) - does not fit" in msg
    for part in ("parameters", "gradients", "optimizer state", "activations", "total"):
        assert part in msg
    assert "overrides that would fit on the 8 device(s) present: --model.remat=full" in msg
    fixed = apply_overrides(cfg, {"model.remat": "full"}).validate()
    assert check_layout(fixed, [Small()] * 8).total <= 1.5 * 2**30


def test_resume_mid_pipelined_run_is_bit_identical(tmp_path, small_corpus, make_tiny_config):
    from msjax.train import run

    layout = {"mesh.pipeline": 2, "mesh.fsdp": 1, "train.sample_tokens": 0}
    straight = run(make_tiny_config(tmp_path / "a", small_corpus, **layout))
    run(make_tiny_config(tmp_path / "b", small_corpus, **layout, **{"train.steps": 4}))
    resumed = run(make_tiny_config(tmp_path / "b", small_corpus, **layout, **{"checkpoint.resume": True}))
    assert resumed["start_step"] == 4
    for x, y in zip(jax.tree.leaves(jax.device_get(straight["state"])),
                    jax.tree.leaves(jax.device_get(resumed["state"]))):
        np.testing.assert_array_equal(x, y)  # params, optimizer state, step and RNG, bit for bit
    assert straight["val_loss"][-1] == resumed["val_loss"][-1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mp_flags(tmp: Path, corpus: Path) -> list[str]:
    return ["--config=gpt_tiny", "--model.num_layers=2", "--model.d_model=32", "--model.num_heads=2",
            "--model.max_seq_len=32", f"--data.paths={corpus}", "--data.tokenizer=char", "--data.val_fraction=0.2",
            f"--data.cache_dir={tmp / 'cache'}", "--train.seq_len=32", "--train.global_batch=8", "--train.steps=4",
            "--train.eval_every=4", "--train.eval_batches=2", "--train.sample_tokens=0",
            f"--train.run_dir={tmp / 'run'}", "--train.progress=false", "--optimizer.decay_steps=4",
            "--optimizer.warmup_steps=2", "--checkpoint.every=4", "--mesh.pipeline=2", "--mesh.data=2",
            "--mesh.tensor=2"]


def _final_params(tmp: Path, corpus: Path) -> list[np.ndarray]:
    """The parameters of the run's last checkpoint, restored onto one device."""
    from msjax.checkpoint import Checkpointer
    from msjax.config import parse_args
    from msjax.data.tokenizer import load_tokenizer

    cfg, _ = parse_args(_mp_flags(tmp, corpus) + ["--mesh.pipeline=1", "--mesh.data=1", "--mesh.tensor=1"])
    vocab = load_tokenizer(str(tmp / "run" / "tokenizer.json")).vocab_size
    program = build_train_program(cfg, make_mesh(cfg.mesh, jax.devices()[:1]), vocab_size=vocab)
    ckpt = Checkpointer(cfg.checkpoint, tmp / "run" / "checkpoints")
    try:
        _, state, _ = ckpt.restore(program.abstract_state)
    finally:
        ckpt.close()
    return jax.tree.leaves(jax.device_get(state["params"]))


def test_two_processes_pipelined_end_with_the_parameters_of_one(tmp_path, small_corpus):
    one = subprocess.run([sys.executable, "scripts/train.py", *_mp_flags(tmp_path / "one", small_corpus)],
                         cwd=ROOT, env=_env(8), capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "scripts/train.py", *_mp_flags(tmp_path / "two", small_corpus)],
                              cwd=ROOT, env=_env(4, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                                                 JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        for p in procs:
            _, err = p.communicate(timeout=600)
            assert p.returncode == 0, err[-3000:]
    finally:
        for p in procs:
            p.kill()
    for x, y in zip(_final_params(tmp_path / "one", small_corpus), _final_params(tmp_path / "two", small_corpus)):
        np.testing.assert_allclose(y, x, atol=TOL, rtol=0)
