"""Peer replicas of the local tier (checkpoint.local_replicas): a lost host's local part survives on a peer.

Real processes, real HTTP between them, and real private disks: each process of the job runs in a mount namespace
of its own with a fresh tmpfs at the local tier's path, so what one host wrote is invisible to the other except
through the peer transfer under test.
"""

import threading
from pathlib import Path

import pytest

from msjax.checkpoint import peers
from msjax.checkpoint.integrity import RECORD_NAME
from msjax.config import CheckpointConfig, ConfigError, apply_overrides, load_preset
from tests.msjax.processes import TWO_HOST_STATE, two_processes

_LOSE_A_HOST = r"""
import hashlib, json, os, shutil, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
from pathlib import Path
import jax, numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
from msjax.checkpoint import Checkpointer, NoWholeCheckpointError
from msjax.config import CheckpointConfig
pid, port, local, persistent = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
async_save = sys.argv[5] == "async"
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid, initialization_timeout=120)
""" + TWO_HOST_STATE + r"""
out = {}
for replicas in (1, 0):
    cfg = CheckpointConfig(every=0, async_save=async_save, timeout_s=60, local_keep=2, local_replicas=replicas)
    tier, bucket = local / f"tier{replicas}", persistent / f"r{replicas}"
    ckpt = Checkpointer(cfg, bucket, tier)
    for step in (2, 4):
        ckpt.save(step, state(step), {"pos": step}, force=True)
    ckpt.wait()
    ckpt.close()
    other = 1 - pid
    held = tier / "replicas" / f"process-{other}"
    copies = sorted(os.listdir(held)) if held.is_dir() else []
    def digests(d):  # {file relative to the step: sha256 of its bytes}
        return {p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(d.rglob("*")) if p.is_file()}
    own = {s: digests(tier / f"process-{pid}" / s) for s in ("2", "4")}
    held_files = {s: digests(held / s) for s in copies}
    # The host of process 1 dies: its local disk is gone (a new, empty one), and the persistent tier has only
    # step 2 (step 4's upload had not finished).
    multihost_utils.sync_global_devices(f"saved {replicas}")
    if pid == 1:
        shutil.rmtree(tier)
        tier.mkdir()
    elif pid == 0:
        shutil.rmtree(bucket / "4")
    multihost_utils.sync_global_devices(f"host lost {replicas}")
    r = Checkpointer(cfg, bucket, tier)
    step, got, loader = r.restore(abstract)
    exact = all(np.array_equal(np.asarray(s.data), (step * full[k])[s.index] if full[k].ndim else step * full[k])
                for k in got for s in got[k].addressable_shards)
    restored = {"step": step, "exact": exact, "pos": loader["pos"], "download": r.last_download}
    # The job goes on: the next checkpoint is replicated again, to the new host too.
    r.save(6, state(6), {"pos": 6}, force=True)
    r.wait()
    r.close()
    out[replicas] = {"copies": copies, "own": own, "held": held_files, "replica": ckpt.last_replica, **restored,
                     "after": sorted(os.listdir(held)) if held.is_dir() else []}
    if replicas == 0:  # host 1 lost again, and the persistent tier too: nothing whole is left, nothing damaged
        multihost_utils.sync_global_devices("lose all")
        if pid == 1:
            shutil.rmtree(tier)
            tier.mkdir()
        elif pid == 0:
            shutil.rmtree(bucket)
        multihost_utils.sync_global_devices("lost all")
        c = Checkpointer(cfg, bucket, tier)
        try:
            c.restore(abstract)
            out["nothing_whole"] = "restored"
        except NoWholeCheckpointError as e:
            left = sorted(d for d in os.listdir(tier / f"process-{pid}") if d.isdigit())
            # The run starts afresh: its first checkpoint is saved again on every host.
            c.save(6, state(6), {"pos": 6}, force=True)
            c.wait()
            again = sorted(d for d in os.listdir(tier / f"process-{pid}") if d.isdigit())
            out["nothing_whole"] = [str(e), left, again]
        c.close()
print(json.dumps(out), flush=True)
jax.distributed.shutdown()
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_lost_hosts_newest_local_step_survives_on_its_peer_and_restores_bit_identically(tmp_path, mode):
    """Two processes on two "hosts" with private local disks save steps 2 and 4. With `local_replicas=1` each
    host also holds the other's local part (the same files), copied over HTTP. Then host 1 is lost (its disk
    emptied) while the persistent tier holds only step 2: with peer replicas the job resumes from step 4, process
    1 copying what it reads from process 0's replica of its part, bit for bit; without, from step 2. Both jobs then
    checkpoint again, and with replicas the new host holds its peer's part again. Then, without replicas, host 1
    is lost once more along with the persistent tier: no step is whole anywhere, and the restore says so. Saved
    synchronously and asynchronously (Orbax's background threads on each host, writing each its own directory)."""
    local = tmp_path / "local"
    local.mkdir()
    outs = two_processes(_LOSE_A_HOST, [str(local), str(tmp_path / "persistent"), mode], timeout=300,
                         private_tmpfs=local)
    assert not any(local.iterdir())  # every local write went to the processes' own tmpfs
    for pid, out in enumerate(outs):
        with_peers, without = out["1"], out["0"]
        assert with_peers["copies"] == ["2", "4"], with_peers
        # What a host holds of its peer's part is that part, file for file and byte for byte.
        assert with_peers["held"] == outs[1 - pid]["1"]["own"] and len(with_peers["held"]["4"]) > 5, with_peers
        assert with_peers["replica"]["step"] == 4 and with_peers["replica"]["bytes"] > 0, with_peers
        assert with_peers["step"] == 4 and with_peers["pos"] == 4 and with_peers["exact"], with_peers
        # local_keep=2 copies; the new host holds its peer's part from the first checkpoint after the restore.
        assert with_peers["after"] == (["4", "6"] if pid == 0 else ["6"]), with_peers
        assert without["copies"] == [] and without["after"] == [] and without["replica"] == {}, without
        assert without["step"] == 2 and without["exact"], without
    # Process 0 read its own tier; process 1, on the new host, copied the 5 chunks it reads from its peer (its own
    # part, held there as a replica), not from the persistent tier.
    assert outs[0]["1"]["download"] == {"chunks": 0, "bytes": 0, "seconds": 0.0}, outs[0]
    assert outs[1]["1"]["download"]["source"] == "peers" and outs[1]["1"]["download"]["chunks"] == 5, outs[1]
    # Without peer replicas and without a persistent step, host 0's parts are all that is left: not a checkpoint.
    # The restore says so (a NoWholeCheckpointError, which the loop takes as "start from step 0") and deletes them,
    # so that the steps can be saved again.
    for out in outs:
        message, left, again = out["nothing_whole"]
        assert "step 6: in the local tier of some processes only" in message and left == [], out["nothing_whole"]
        assert again == ["6"], out["nothing_whole"]


def _inventory(step: int, writer: int, digest: str, files: list[str], writers: int = 2) -> dict:
    return {"step": step, "writer": writer, "dir": f"process-{writer}/{step}", "digest": digest,
            "writers": writers, "files": files}


def test_a_step_is_held_by_the_job_only_when_every_writers_part_of_one_version_survives():
    """`PeerSet.from_inventories`: step 6 has both parts (on different hosts) and is a step of the job; step 8 lost
    writer 1's part; step 4's two parts are of different versions (digests: another timeline). Every file of a
    held step maps to each host holding it."""
    inventories = {
        0: [_inventory(6, 0, "a", ["x/0", RECORD_NAME]), _inventory(8, 0, "c", ["x/0", RECORD_NAME]),
            _inventory(4, 0, "d", ["x/0", RECORD_NAME])],
        1: [_inventory(6, 1, "a", ["x/1", RECORD_NAME]), _inventory(4, 1, "e", ["x/1", RECORD_NAME]),
            {**_inventory(6, 0, "a", ["x/0", RECORD_NAME]), "dir": "replicas/process-0/6"}],
    }
    got = peers.PeerSet.from_inventories(0, {}, Path("/nonexistent"), 1.0, inventories)
    assert sorted(got.steps) == [6]
    assert got.files(6) == sorted(["x/0", "x/1", RECORD_NAME])
    assert got.steps[6]["x/0"] == [(0, "process-0/6/x/0"), (1, "replicas/process-0/6/x/0")]
    assert got.steps[6]["x/1"] == [(1, "process-1/6/x/1")]


def test_replica_sources_wrap_around_and_never_include_the_process_itself():
    assert peers.sources(0, 4, 1) == [3] and peers.sources(2, 4, 2) == [1, 0]
    assert peers.sources(1, 2, 5) == [0]  # at most the others
    assert peers.sources(0, 1, 1) == []
    for count, replicas in ((2, 1), (4, 1), (4, 2), (5, 3)):  # who copies whom, seen from either end
        assert all(w in peers.sources(h, count, replicas)
                   for w in range(count) for h in peers.holders(w, count, replicas))
        assert sorted(len(peers.holders(w, count, replicas)) for w in range(count)) == [replicas] * count


def test_the_peer_server_serves_only_its_tier_and_only_to_the_token(tmp_path):
    """A real server and client: the file arrives whole with the token; without it (or with another), a path
    outside the tier, or a missing file, nothing is served and the client raises OSError."""
    root = tmp_path / "tier"
    (root / "process-0" / "2").mkdir(parents=True)
    data = bytes(range(256)) * 4099  # not a multiple of the client's read size
    (root / "process-0" / "2" / "a").write_bytes(data)
    (tmp_path / "secret").write_text("outside")
    server = peers.PeerServer(root, "127.0.0.1", timeout_s=10)
    try:
        got = peers.fetch(server.address, server.token, [("process-0/2/a", tmp_path / "out" / "a")], 10)
        assert got == len(data) and (tmp_path / "out" / "a").read_bytes() == data
        for token, rel in [("wrong", "process-0/2/a"), ("", "process-0/2/a"), (server.token, "../secret"),
                           (server.token, "process-0/2/missing")]:
            with pytest.raises(OSError):
                peers.fetch(server.address, token, [(rel, tmp_path / "no")], 10)
        assert not (tmp_path / "no").exists()
    finally:
        server.close()
    assert not [t for t in threading.enumerate() if t.name == "msjax-peer-server"]


def test_local_replicas_need_a_local_tier_and_are_not_negative():
    for overrides, ok in [({"checkpoint.local_replicas": -1, "checkpoint.local_dir": "/tmp/x"}, False),
                          ({"checkpoint.local_replicas": 1}, False),
                          ({"checkpoint.local_replicas": 1, "checkpoint.local_dir": "/tmp/x"}, True),
                          ({"checkpoint.local_replicas": 1, "checkpoint.dir": "s3://b/run"}, True)]:
        if ok:
            apply_overrides(load_preset("gpt_tiny"), overrides).validate()
        else:
            with pytest.raises(ConfigError, match="checkpoint.local_replicas"):
                apply_overrides(load_preset("gpt_tiny"), overrides).validate()
    assert CheckpointConfig().local_replicas == 0
