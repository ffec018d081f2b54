"""Which chunk files of a per-host checkpoint a process writes, uploads and reads (msjax.checkpoint.shards), held
against brute force and against the files Orbax really writes (8 fake CPU devices)."""

import dataclasses
import itertools
import json

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from msjax.checkpoint import Checkpointer
from msjax.checkpoint import shards
from msjax.config import CheckpointConfig


def _brute_force(index, shape, chunks) -> list[str]:
    """Every chunk of the grid whose box intersects the block `index`, by testing each one."""
    if not shape:
        return ["0"]
    grid = [range(-(-n // c)) for n, c in zip(shape, chunks)]
    block = [sl.indices(n)[:2] for sl, n in zip(index, shape)]
    out = []
    for pos in itertools.product(*grid):
        if all(p * c < stop and start < (p + 1) * c for p, c, (start, stop) in zip(pos, chunks, block)):
            out.append(".".join(map(str, pos)))
    return out


def test_chunk_keys_equal_brute_force_for_random_blocks_and_chunk_shapes():
    rng = np.random.default_rng(0)
    for _ in range(400):
        ndim = int(rng.integers(0, 4))
        shape = tuple(int(n) for n in rng.integers(1, 13, ndim))
        chunks = tuple(int(rng.integers(1, n + 1)) for n in shape)
        index = []
        for n in shape:  # a non-empty block inside the array
            a = int(rng.integers(0, n))
            index.append(slice(a, int(rng.integers(a + 1, n + 1))))
        index = tuple(index)
        assert shards.chunk_keys(index, shape, chunks) == _brute_force(index, shape, chunks), (shape, chunks, index)


def _mesh():
    return jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3)


def _state(mesh):
    rng = np.random.default_rng(1)
    layout = {"w": ((8, 6), P("fsdp", "tensor")), "b": ((16,), P(("data", "fsdp"))), "e": ((5, 4), P()),
              "opt": {"mu": ((8, 6), P("fsdp", "tensor"))}, "n": ((), P())}

    def make(spec):
        shape, pspec = spec
        x = rng.normal(size=shape).astype(np.float32)
        return jax.make_array_from_callback(shape, NamedSharding(mesh, pspec), lambda i: x[i])

    return jax.tree.map(make, layout, is_leaf=lambda v: isinstance(v, tuple) and isinstance(v[1], P))


def test_a_per_host_save_writes_every_chunk_each_owned_by_one_shard_and_reads_what_a_new_layout_needs(tmp_path):
    """One process with a local tier writes every addressable shard (replicas included) as zarr chunks; the
    replica-0 shards own every chunk exactly once (what the processes upload between them is the checkpoint, with
    nothing twice); the chunks another sharding reads are those its blocks overlap."""
    mesh = _mesh()
    state = _state(mesh)
    cfg = CheckpointConfig(every=0, async_save=False, timeout_s=60)
    ckpt = Checkpointer(cfg, tmp_path / "persistent", tmp_path / "local")
    ckpt.save(3, state, {"pos": 3}, force=True)
    ckpt.close()
    step_dir = tmp_path / "local" / "process-0" / "3"
    rels = shards.relative_files(step_dir)
    arrays = shards.array_dirs_of(rels)
    assert arrays == {"state/w", "state/b", "state/e", "state/opt.mu", "state/n"}
    written = {r for r in rels if shards.is_chunk(r, arrays)}
    index = shards.shard_indices(state)
    owned = shards.owned_chunks(step_dir, index)
    assert owned == written
    expected = {"state/w": 4, "state/b": 4, "state/e": 1, "state/opt.mu": 4, "state/n": 1}
    assert {d: sum(r.startswith(d + "/") for r in written) for d in arrays} == expected
    chunks = json.loads((step_dir / "state" / "w" / ".zarray").read_text())["chunks"]
    assert chunks == [4, 3]  # a shard's shape: fsdp splits rows in 2, tensor columns in 2
    # Restored onto devices 0..3 of a (data=2, fsdp=2) mesh with w split by rows only: w's four chunks, b's two
    # halves of 16 over fsdp = all four of b's quarters, and e's and n's one.
    other = jax.make_mesh((2, 2), ("data", "fsdp"), devices=jax.devices()[:4],
                          axis_types=(jax.sharding.AxisType.Auto,) * 2)
    abstract = {"w": jax.ShapeDtypeStruct((8, 6), np.float32, sharding=NamedSharding(other, P("fsdp", None))),
                "b": jax.ShapeDtypeStruct((16,), np.float32, sharding=NamedSharding(other, P("fsdp")))}
    assert shards.needed_chunks(step_dir, shards.shard_indices(abstract)) == {
        "state/w/0.0", "state/w/0.1", "state/w/1.0", "state/w/1.1", "state/b/0", "state/b/1", "state/b/2",
        "state/b/3"}
    # The persistent tier holds exactly these files, the record last; the restore reads it back exactly.
    assert sorted(shards.relative_files(tmp_path / "persistent" / "3")) == rels
    _, back, loader = Checkpointer(cfg, tmp_path / "persistent", tmp_path / "fresh").restore(
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state))
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert loader == {"pos": 3}


@pytest.mark.parametrize("spec", [P(), P("data"), P(("data", "fsdp", "tensor"))])
def test_each_block_once_with_its_replica_ids_and_the_replicas_share_its_upload(spec, tmp_path):
    """Of the 8 devices' shards (one process: it holds every replica), shard_indices gives one entry per distinct
    block with every replica id 0..R-1 and R = 8 / blocks. Split over R processes (each keeping one replica id),
    the owners of a block's chunks cover every chunk exactly once."""
    mesh = _mesh()
    x = jax.device_put(np.arange(16, dtype=np.float32), NamedSharding(mesh, spec))
    index = shards.shard_indices({"x": x})
    blocks = {tuple(sl.indices(16)[:2] for sl in s.index) for s in index}
    r = 8 // len(blocks)
    assert len(index) == len(blocks) and all(s.replica_ids == tuple(range(r)) and s.replicas == r for s in index)
    ckpt = Checkpointer(CheckpointConfig(every=0, async_save=False, timeout_s=60), tmp_path / "p", tmp_path / "l")
    ckpt.save(1, {"x": x}, {}, force=True)
    ckpt.close()
    step_dir = tmp_path / "l" / "process-0" / "1"
    every = shards.needed_chunks(step_dir, index)
    parts = [shards.owned_chunks(step_dir, [dataclasses.replace(s, replica_ids=(k,)) for s in index])
             for k in range(r)]
    assert sorted(c for part in parts for c in part) == sorted(every)  # each chunk once, none left out


def test_a_failed_upload_is_one_write_error_and_leaves_no_persistent_record(tmp_path):
    """The persistent directory becomes unwritable (chattr +i: root writes through chmod) after the checkpointer
    opened: the save's copy fails with one CheckpointWriteError naming the tier and the OS error, the local part
    stays complete (its record), and the persistent tier holds no record of the step."""
    import subprocess

    from msjax.checkpoint import CheckpointWriteError, latest_verified
    from msjax.checkpoint.integrity import RECORD_NAME

    state = _state(_mesh())
    cfg = CheckpointConfig(every=0, async_save=False, timeout_s=60)
    persistent = tmp_path / "persistent"
    ckpt = Checkpointer(cfg, persistent, tmp_path / "local")
    if subprocess.run(["chattr", "+i", str(persistent)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not supported on this file system")
    try:
        ckpt.save(5, state, {"pos": 5}, force=True)
        with pytest.raises(CheckpointWriteError, match=r"step 5 could not be copied to the persistent tier .*"
                                                       r"persistent/5: process 0: PermissionError"):
            ckpt.wait()
    finally:
        subprocess.run(["chattr", "-i", str(persistent)], check=True)
        ckpt.close()
    assert (tmp_path / "local" / "process-0" / "5" / RECORD_NAME).is_file()
    assert not (persistent / "5").exists() and latest_verified(persistent) is None
