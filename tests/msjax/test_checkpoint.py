"""Checkpoints that never lose work, in one process: optimizer settings validated, non-finite steps never
applied nor checkpointed, eval_batches=0, resume config check, integrity checksums with fallback to the older
checkpoint (bit flip, 4 KiB of garbage, truncated file, missing file), metrics not duplicated, tiers.

Every test compares against an uninterrupted run of the same config (`reference`), bit for bit."""

import hashlib
import json
import logging
import math
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from msjax.checkpoint import Checkpointer, checkpoint_dir
from msjax.checkpoint.integrity import checksum_programs, checksum_state
from msjax.config import ConfigError, apply_overrides
from msjax.faults import NonFiniteLossError
from msjax.train import run


@pytest.fixture(scope="module")
def cache():
    return {}


def _leaves(state):
    return jax.tree.leaves(jax.device_get(state))


def reference(cache, tmp_path_factory, corpus, make):
    """An uninterrupted 8-step run (checkpoints 4 and 8), run once per module; returns (run_dir_root, summary)."""
    if "ref" not in cache:
        root = tmp_path_factory.mktemp("reference")
        cache["ref"] = root, run(make(root, corpus))
    return cache["ref"]


def _copy_run(src_root: Path, dst_root: Path) -> None:
    shutil.copytree(src_root / "run", dst_root / "run")


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _live_data(step_dir: Path, state) -> list[tuple[Path, int]]:
    """Every (data file, offset) of the checkpoint where the first 16 values of one saved parameter shard lie.

    Randomly initialised float32 chunks do not compress, so zstd stores them raw and their bytes appear
    verbatim. Orbax's OCDBT files can hold a chunk more than once (only one copy is read back), so damage meant
    to hit "the parameter on disk" is applied to every copy; norm scales and biases (constant) are skipped."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file()]  # OCDBT's d/ files or zarr's chunks
    contents = {f: f.read_bytes() for f in files}
    for leaf in jax.tree.leaves(state["params"]):
        for shard in leaf.addressable_shards:
            values = np.asarray(shard.data).reshape(-1)[:16]
            if values.size < 16 or len(np.unique(values)) < 16:
                continue
            needle = values.tobytes()
            hits = []
            for f, data in contents.items():
                at = data.find(needle)
                while at >= 0:
                    hits.append((f, at))
                    at = data.find(needle, at + 1)
            if hits:
                return hits
    raise AssertionError(f"no saved parameter bytes found verbatim under {step_dir}")


# ---- 7: optimizer settings, non-finite steps -----------------------------------------------------------------

@pytest.mark.parametrize("key,value", [("optimizer.lr", float("nan")), ("optimizer.lr", -1e-3),
                                       ("optimizer.warmup_steps", -1), ("optimizer.grad_clip", -1.0),
                                       ("optimizer.grad_clip", float("nan")), ("optimizer.min_lr", float("inf"))])
def test_bad_optimizer_settings_are_rejected_at_load(tmp_path, small_corpus, make_tiny_config, key, value):
    with pytest.raises(ConfigError, match=rf"{key}=.*allowed is"):
        make_tiny_config(tmp_path, small_corpus, **{key: value})


def _finite(tree) -> bool:
    return all(np.isfinite(x).all() for x in _leaves(tree) if np.issubdtype(x.dtype, np.floating))


@pytest.mark.slow
def test_nonfinite_steps_are_skipped_and_never_checkpointed(tmp_path, small_corpus, make_tiny_config):
    # lr 1e30 with no warmup: the first update is finite (Adam's step is ~lr) but the next forward pass overflows,
    # so every later loss is NaN. Before the fix those NaNs were applied and checkpointed.
    cfg = make_tiny_config(tmp_path, small_corpus, **{"optimizer.lr": 1e30, "optimizer.min_lr": 1e30,
                                                      "optimizer.warmup_steps": 0, "train.eval_every": 0})
    summary = run(cfg)
    assert _finite(summary.state)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    skipped = [r["skipped"] for r in rows if "skipped" in r]
    assert skipped[-1] >= 6 and any(not math.isfinite(r["loss"]) for r in rows if "loss" in r)
    ckpt = Checkpointer(cfg.checkpoint, checkpoint_dir(cfg.checkpoint, cfg.train.run_dir))
    from msjax.mesh import make_mesh
    from msjax.train_step import build_train_program

    program = build_train_program(cfg, make_mesh(cfg.mesh), vocab_size=summary.state["params"]["wte"].shape[0])
    step, state, _ = ckpt.restore(program.abstract_state)
    ckpt.close()
    assert step == 8 and _finite(state)


def test_nonfinite_stop_policy_ends_the_run_keeping_the_last_good_checkpoint(tmp_path, small_corpus,
                                                                             make_tiny_config):
    cfg = make_tiny_config(tmp_path, small_corpus, **{"optimizer.lr": 1e30, "optimizer.min_lr": 1e30,
                                                      "optimizer.warmup_steps": 0, "train.nonfinite": "stop",
                                                      "checkpoint.every": 1})
    with pytest.raises(NonFiniteLossError, match=r"step 2: the loss .* not finite"):
        run(cfg)
    ckpt = Checkpointer(cfg.checkpoint, checkpoint_dir(cfg.checkpoint, cfg.train.run_dir))
    assert ckpt.all_steps() == [1]
    ckpt.close()


# ---- 5: eval_batches=0 ---------------------------------------------------------------------------------------

def test_eval_batches_zero_trains_and_saves_the_last_step(tmp_path, small_corpus, make_tiny_config):
    summary = run(make_tiny_config(tmp_path, small_corpus, **{"train.eval_batches": 0, "train.steps": 4}))
    assert summary.checkpoints == [4] and summary.val_loss == []


# ---- 6: resume with another model config ---------------------------------------------------------------------

def test_resume_with_another_model_is_one_clear_error_and_touches_nothing(cache, tmp_path_factory, tmp_path,
                                                                            small_corpus, make_tiny_config):
    ref_root, _ = reference(cache, tmp_path_factory, small_corpus, make_tiny_config)
    _copy_run(ref_root, tmp_path)
    before = _tree_digest(tmp_path / "run")
    cfg = make_tiny_config(tmp_path, small_corpus, **{"model.d_model": 64, "model.num_heads": 4,
                                                      "train.steps": 12, "optimizer.lr": 5e-4,
                                                      "checkpoint.resume": True})
    with pytest.raises(ConfigError) as e:
        run(cfg)
    msg = str(e.value)
    assert "model.d_model: 32 -> 64" in msg and "model.num_heads: 2 -> 4" in msg
    assert "train.steps" not in msg.split("Keys that may")[0] and "optimizer.lr" in msg.split("Keys that may")[1]
    assert _tree_digest(tmp_path / "run") == before  # config.json, metrics, checkpoints: all as they were


# ---- 2, 3: corrupted or unreadable newest checkpoint: fall back, end bit-identical -----------------------------

def _corrupt(step_dir: Path, how: str, state) -> None:
    hits = _live_data(step_dir, state)
    for f, offset in sorted(hits, key=lambda h: -h[1]):  # from the end, so offsets stay valid when truncating
        if how == "missing":
            f.unlink(missing_ok=True)
            continue
        data = bytearray(f.read_bytes())
        if how == "bitflip":
            data[offset + 17] ^= 0x10  # one bit of one float32 of a parameter
        elif how == "garbage4k":
            data[offset:offset + 4096] = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
        elif how == "truncate":
            data = data[: offset + 32]
        f.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["bitflip", "garbage4k", "truncate", "missing"])
def test_damaged_newest_checkpoint_falls_back_and_ends_bit_identical(cache, tmp_path_factory, tmp_path,
                                                                     small_corpus, make_tiny_config, capfd, caplog,
                                                                     how):
    ref_root, ref = reference(cache, tmp_path_factory, small_corpus, make_tiny_config)
    _copy_run(ref_root, tmp_path)
    _corrupt(tmp_path / "run" / "checkpoints" / "8", how, ref.state)
    caplog.set_level(logging.INFO, logger="msjax.train")
    capfd.readouterr()
    resumed = run(make_tiny_config(tmp_path, small_corpus, **{"checkpoint.resume": True}))
    err = capfd.readouterr().err
    # the one warning, through the package's logger (a script shows it as "warning: checkpoint ...")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                and r.name.startswith("msjax.checkpoint") and r.getMessage().startswith("checkpoint")]
    assert len(warnings) == 1 and "/checkpoints/8 failed verification" in warnings[0], (warnings, err)
    assert "Traceback" not in err
    assert resumed.start_step == 4
    # data=2: restored by one replica and broadcast (msjax.checkpoint.replica), then trained on bit-identically
    assert "resumed from step 4" in caplog.text and "read by one data-parallel replica" in caplog.text
    for x, y in zip(_leaves(ref.state), _leaves(resumed.state)):
        np.testing.assert_array_equal(x, y)
    assert resumed.checkpoints == [4, 8]  # the damaged one moved aside, its step written again
    assert list((tmp_path / "run" / "checkpoints" / "rejected").iterdir())
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [(r["step"], tuple(sorted(r))) for r in rows]
    assert len(steps) == len(set(steps))  # metrics rows of steps 5..8 not duplicated by the resume


def test_single_replica_restore_is_bit_identical_to_every_replica_reading(tmp_path, small_corpus,
                                                                         make_tiny_config):
    """data=2 x fsdp=2 x tensor=2 (the tiny run's mesh): replica 0's four devices read, the broadcast fills
    replica 1; the result has the saved bits and shardings, as the normal restore (every device reads). The tree
    holds what a value-level broadcast (Orbax's SingleReplicaArrayHandler sums) would change: a -0.0 and a bool,
    and a bfloat16 leaf (widened by its sum). That training then continues bit-identically is proven by
    test_damaged_newest_checkpoint_falls_back_and_ends_bit_identical, whose resume takes this path."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from msjax.mesh import make_mesh

    cfg = make_tiny_config(tmp_path, small_corpus)
    mesh = make_mesh(cfg.mesh)
    rng = np.random.default_rng(2)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    w[3, 5] = -0.0
    saved = {"w": jax.device_put(w, NamedSharding(mesh, P("fsdp", "tensor"))),
             "h": jax.device_put(rng.standard_normal((8, 6)).astype(jnp.bfloat16), NamedSharding(mesh, P("tensor"))),
             "ok": jax.device_put(np.bool_(True), NamedSharding(mesh, P())),
             "count": jax.device_put(np.int32(-7), NamedSharding(mesh, P()))}
    ckpt = Checkpointer(cfg.checkpoint, tmp_path / "ckpt")
    ckpt.save(1, saved, {"position": 3}, force=True)
    ckpt.close()
    abstract = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding), saved)
    restored = {}
    for on in (True, False):
        ckpt = Checkpointer(apply_overrides(cfg, {"checkpoint.replica_restore": on}).checkpoint, tmp_path / "ckpt")
        step, restored[on], loader = ckpt.restore(abstract)
        assert (step, loader, ckpt.replica_restore) == (1, {"position": 3}, on)
        ckpt.close()
    for key, x in saved.items():
        bits = np.asarray(x).reshape(-1).view(np.uint8)
        for on in (True, False):
            y = restored[on][key]
            assert y.dtype == x.dtype and y.sharding == x.sharding, (key, on)
            np.testing.assert_array_equal(np.asarray(y).reshape(-1).view(np.uint8), bits, err_msg=f"{key} {on}")
    assert np.signbit(np.asarray(restored[True]["w"])[3, 5])


def test_checksum_detects_a_flipped_bit_in_any_array_and_ignores_layout():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 48)).astype(np.float32)
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))
    base, _ = checksum_state({"w": x})()
    assert checksum_state({"w": sharded})()[0] == base  # same value on one device and split over 8
    # The definition, one weight per element (integrity.py's docstring), in numpy: what the row/column sums give.
    b = x.reshape(-1).view(np.uint32).astype(np.uint64)
    i = np.arange(x.size, dtype=np.uint64)
    row, col = i // x.shape[1] * x.shape[1], i % x.shape[1]
    odd = lambda v, p: (v * p % 2**32) | 1  # noqa: E731
    c1 = int((b * (2 * i + 1) % 2**32).sum() % 2**32)
    c2 = int((b * (odd(row, 2654435761) * odd(col, 2246822519) % 2**32) % 2**32).sum() % 2**32)
    assert base == {"['w']": f"{c1:08x}{c2:08x}"}
    for pos in rng.integers(0, x.size, 20):
        for bit in (0, 13, 31):
            y = x.copy().reshape(-1).view(np.uint32)
            y[pos] ^= np.uint32(1 << bit)
            assert checksum_state({"w": y.view(np.float32).reshape(x.shape)})()[0] != base


@pytest.mark.parametrize("mesh_overrides", [{"mesh.data": 1}, {"mesh.fsdp": 4, "mesh.tensor": 2, "mesh.data": 1}])
def test_checksum_programs_compiled_ahead_leave_the_save_nothing_to_compile(mesh_overrides):
    """`checksum_programs` (what CheckpointManager.prepare runs on its thread before the first step) compiles every
    program `checksum_state` then runs, for a train program's own state (as the loop creates it), on one device
    and split over 8."""
    from msjax.config import load_preset
    from msjax.mesh import make_mesh
    from msjax.train_step import build_train_program

    cfg = apply_overrides(load_preset("gpt_tiny"), {"model.num_layers": 2, "model.d_model": 32, **mesh_overrides})
    devices = jax.devices()[:math.prod(cfg.mesh.axis_sizes().values())]
    state = build_train_program(cfg, make_mesh(cfg.mesh, devices), vocab_size=256).init_fn(jax.random.key(0))
    compiles = []

    def listen(name, secs, **kw):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(secs)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        assert checksum_programs(state)() > 0
        compiles.clear()
        checksum_state(state)()
        assert compiles == []
        fresh = jax.tree.map(lambda x: x[..., :1] if x.ndim else x, state)  # other shapes: never prepared
        checksum_state(fresh)()
        assert compiles  # what the save would have waited for without it
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


# Arrays of several shapes, dtypes and shardings (mesh "d": 8 devices; "a" x "b": 4 x 2), each with the checksum
# that format 2 as first written (row sums + column sums + hashed row sums, commit 2ee3f7b) gave for it: records
# written then must still verify.
_CHECKSUM_CASES = [((64, 48), "float32", ("d",), "bab71d6cf09013e4"),
                   ((3, 5, 16), "bfloat16", (None, None, "d"), "7651eaa861865954"),  # split along the last axis
                   ((16, 8), "float32", ("a", "b"), "97a9a7e259804408"),
                   ((), "int32", (), "4fbec2f84fbec2f8"),
                   ((10,), "bool", (), "00000044b1a1b9f6"),
                   ((7, 3), "int8", (), "0000cda38e90c20b"),
                   ((8, 4, 2), "float16", (None, "a"), "06e4d2d5fed6dabb"),
                   ((40,), "float32", ("d",), "6d33d71353961b2b"),
                   ((2, 4, 8, 6), "uint32", ("b", "a", None, None), "7924dcb358dab643")]


def _checksum_case(shape, dtype, spec, seed):
    """(host array, the same placed with `spec` on the case's mesh)."""
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        x = rng.integers(0, 2, shape).astype(bool)
    elif dtype in ("int8", "int32", "uint32"):
        x = rng.integers(np.iinfo(dtype).min, np.iinfo(dtype).max, shape, dtype=dtype, endpoint=True)
    else:
        x = rng.standard_normal(shape).astype(jnp.dtype(dtype))
    auto = jax.sharding.AxisType.Auto
    mesh = (jax.make_mesh((8,), ("d",), axis_types=(auto,)) if "d" in spec
            else jax.make_mesh((4, 2), ("a", "b"), axis_types=(auto, auto)))
    return x, jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)))


def _checksum_definition(x: np.ndarray) -> str:
    """integrity.py's docstring in numpy, one weight per element: c1 = sum b_i (2i + 1),
    c2 = sum b_i h1(base_r) h2(g_c), modulo 2^32, as 16 hex digits."""
    flat = x.reshape(-1)
    b = (flat.astype(np.uint32) if x.dtype == np.bool_ else flat.view(f"u{x.dtype.itemsize}")).astype(np.uint64)
    i = np.arange(flat.size, dtype=np.uint64)
    width = x.shape[-1] if x.ndim else 1
    row, col = i // width * width, i % width
    odd = lambda v, p: (v * p % 2**32) | 1  # noqa: E731
    c1 = int((b * (2 * i + 1) % 2**32).sum() % 2**32)
    c2 = int((b * (odd(row, 2654435761) * odd(col, 2246822519) % 2**32) % 2**32).sum() % 2**32)
    return f"{c1:08x}{c2:08x}"


@pytest.mark.parametrize("case", range(len(_CHECKSUM_CASES)),
                         ids=[f"{c[1]}{list(c[0])}{c[2]}" for c in _CHECKSUM_CASES])
def test_checksum_is_the_documented_definition_on_every_shape_dtype_and_sharding(case):
    shape, dtype, spec, recorded = _CHECKSUM_CASES[case]
    x, placed = _checksum_case(shape, dtype, spec, case)
    for check_finite in (True, False):
        sums, finite = checksum_state({"x": placed}, check_finite=check_finite)()
        assert sums == {"['x']": _checksum_definition(x)} and finite
    assert sums["['x']"] == recorded  # the value records written before the one-pass reduction hold


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_checksum_finds_one_nonfinite_value_in_any_shard(dtype, bad):
    rng = np.random.default_rng(3)
    mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a", "b"))
    x = rng.standard_normal((32, 24)).astype(jnp.dtype(dtype))
    ok = {"x": jax.device_put(x, sharding), "flag": jnp.bool_(True)}
    assert checksum_state(ok)()[1]
    for pos in rng.integers(0, x.size, 4):
        y = x.copy().reshape(-1)
        y[pos] = bad
        y = y.reshape(x.shape)
        state = {"x": jax.device_put(y, sharding), "flag": jnp.bool_(True)}
        sums, finite = checksum_state(state)()
        assert not finite and checksum_state(state, check_finite=False)()[1]
        assert sums["['x']"] == _checksum_definition(y)


# ---- tiers ---------------------------------------------------------------------------------------------------

def test_local_tier_restores_first_and_persistent_tier_backs_it_up(tmp_path, small_corpus, make_tiny_config,
                                                                  caplog):
    local = tmp_path / "local"
    cfg = make_tiny_config(tmp_path, small_corpus, **{"checkpoint.local_dir": str(local), "checkpoint.keep": 2,
                                                      "checkpoint.local_keep": 1})
    straight = run(cfg)
    persistent = tmp_path / "run" / "checkpoints"
    mine = local / "process-0"  # each process writes its own part of the local tier
    assert sorted(p.name for p in mine.iterdir() if p.name.isdigit()) == ["8"]
    assert sorted(p.name for p in persistent.iterdir() if p.name.isdigit()) == ["4", "8"]
    # The local copy of 8 is damaged: the persistent copy of the same step is restored, nothing retrained.
    _corrupt(mine / "8", "bitflip", straight.state)
    resumed = run(apply_overrides(cfg, {"checkpoint.resume": True}))
    assert resumed.start_step == 8 and "process-0/8 failed verification" in caplog.text
    for x, y in zip(_leaves(straight.state), _leaves(resumed.state)):
        np.testing.assert_array_equal(x, y)


def test_between_persistent_steps_checkpoints_stay_in_the_local_tier_and_restore_from_it(tmp_path, small_corpus,
                                                                                          make_tiny_config):
    """checkpoint.every=2, persistent_every=4: steps 2 and 6 stay local, 4 and 8 go on to the persistent tier.
    With step 8 lost from both tiers, the resume reads the local-only step 6 (newer than the persistent 4) and
    ends bit-identical to the straight run."""
    local = tmp_path / "local"
    cfg = make_tiny_config(tmp_path, small_corpus, **{"checkpoint.local_dir": str(local), "checkpoint.keep": 5,
                                                      "checkpoint.local_keep": 2, "checkpoint.every": 2,
                                                      "checkpoint.persistent_every": 4})
    straight = run(cfg)
    persistent, mine = tmp_path / "run" / "checkpoints", local / "process-0"
    assert sorted(int(p.name) for p in persistent.iterdir() if p.name.isdigit()) == [4, 8]
    assert sorted(int(p.name) for p in mine.iterdir() if p.name.isdigit()) == [6, 8]
    shutil.rmtree(mine / "8")
    shutil.rmtree(persistent / "8")
    resumed = run(apply_overrides(cfg, {"checkpoint.resume": True}))
    assert resumed.start_step == 6
    for x, y in zip(_leaves(straight.state), _leaves(resumed.state)):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(ConfigError, match="checkpoint.persistent_every=3"):
        apply_overrides(cfg, {"checkpoint.persistent_every": 3}).validate()


# ---- several processes ---------------------------------------------------------------------------------------

_TWO_PROCESS_RESTORE = """
import os, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
from pathlib import Path
import jax, numpy as np
from jax.experimental import multihost_utils
from msjax.checkpoint import Checkpointer
from msjax.checkpoint.integrity import RECORD_NAME
from msjax.config import CheckpointConfig
pid, port, directory = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid, initialization_timeout=120)
mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
w = np.random.default_rng(0).normal(size=(8, 16)).astype(np.float32)
state = lambda k: {"w": jax.make_array_from_process_local_data(spec, k * w[pid * 4:(pid + 1) * 4])}
cfg = CheckpointConfig(every=0, async_save=False, timeout_s=60)
ckpt = Checkpointer(cfg, directory)
for step in (2, 4):
    ckpt.save(step, state(step), {"pos": step}, force=True)
ckpt.wait()
ckpt.close()
multihost_utils.sync_global_devices("saved")
if pid == 0:  # step 4's write "was interrupted": its record never landed
    (directory / "4" / RECORD_NAME).unlink()
multihost_utils.sync_global_devices("record removed")
abstract = {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=spec)}
restorer = Checkpointer(cfg, directory)  # Orbax's manager synchronises the processes here
if pid == 1:  # arrives late at restore: without an agreement process 0 deletes step 4 before this one lists
    time.sleep(3)
step, restored, loader = restorer.restore(abstract)
error = np.abs(np.asarray(multihost_utils.process_allgather(restored["w"], tiled=True)) - 2 * w).max()
print(step, loader["pos"], float(error), "|".join(restorer.skipped).replace(" ", "_"), flush=True)
jax.distributed.shutdown()
"""


@pytest.mark.slow
def test_processes_agree_on_which_checkpoint_to_restore(tmp_path):
    """2 processes restore while the newest checkpoint is an interrupted write, process 1 arriving 3 s late:
    both walk the same candidates (each passed over step 4 as interrupted; before the restore's barrier, process 1
    listed after process 0 had deleted it and met process 0's next collective with a different one, which in a
    supervised restart failed both), both restore step 2, equal to what was saved, and step 4 is gone."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    repo = Path(__file__).resolve().parents[2]
    procs = [subprocess.Popen([sys.executable, "-c", _TWO_PROCESS_RESTORE, str(i), str(port), str(tmp_path / "ck")],
                              cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=90)  # 8 s here; without the agreement it hangs
            assert p.returncode == 0, err[-3000:]
            outs.append(out.strip().splitlines()[-1].split())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [o[:2] for o in outs] == [["2", "2"], ["2", "2"]], outs
    assert all(float(o[2]) == 0.0 for o in outs), outs
    assert [o[3] for o in outs] == [f"{tmp_path / 'ck' / '4'}:_interrupted_write"] * 2, outs
    assert sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.isdigit()) == ["2"]
