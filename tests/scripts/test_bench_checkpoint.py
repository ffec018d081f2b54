"""The checkpoint benchmark's several-hosts mode (scripts/bench_checkpoint.py --processes): two jax processes, each
with its local tier on a tmpfs of its own, through moto's S3 server. Its rows are checked for what they count
(who uploaded and who downloaded how many bytes), never for a speed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="private tmpfs per process: unshare --mount needs root (CI runs as root)")
def test_two_hosts_upload_their_shares_and_download_only_what_they_read(tmp_path):
    """A 6 MiB state on a (data 2, fsdp 2) mesh. Sharded over all 4 devices: each host uploads and downloads about
    half. Replicated over data: the hosts share the upload; every replica reading downloads it all on each host;
    single-replica restore has host 1 download no array (metadata only, a few KiB)."""
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "scripts/bench_checkpoint.py", "--processes=2", "--devices=4", "--remote=moto",
         "--gib=0.006", "--saves=2", "--restores=1", f"--json={out}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert not result["shared_disk"] and len(result["hosts"]) == 2
    size = result["sharded"]["state_bytes"]
    assert 6 << 20 <= size < 7 << 20
    sharded, replicated = result["sharded"], result["replicated"]
    # The stored checkpoint is the state in zarr chunks (compressed a little: random float32) plus metadata; the
    # whole of it is what a host of the replicated layout downloads when every replica reads.
    whole = replicated["downloaded_every_replica_bytes"][0]
    assert 0.8 * size < whole < 1.05 * size and replicated["downloaded_every_replica_bytes"][1] == whole
    for key in ("uploaded_bytes", "downloaded_every_replica_bytes", "downloaded_single_replica_bytes"):
        assert all(0.4 * whole < b < 0.6 * whole for b in sharded[key]), (key, sharded[key], whole)
    # Eight arrays, each one chunk per fsdp half and held by both replicas: the 16 chunks split by hash, each
    # uploaded once.
    assert all(b > 0 for b in replicated["uploaded_bytes"]), replicated
    assert abs(sum(replicated["uploaded_bytes"]) - whole) < 0.01 * whole, (replicated, whole)
    host0, host1 = replicated["downloaded_single_replica_bytes"]
    assert host0 == whole and host1 < 64 << 10, replicated
    assert "blocked s" in done.stdout and "replicated" in done.stdout
