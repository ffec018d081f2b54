"""The supervisor beside a Kubernetes JobSet, against a real Redis: the liveness probe follows the one heartbeat's
TTL, and the controller's restart request (no API access) ends exactly the worker processes it names, each with
one line and EXIT_REQUESTED, while a process it did not name beats on. The specs themselves are checked in
test_launch_specs.py; the SLURM backend runs on a real cluster in test_slurm_cluster.py."""

import os
import subprocess
import sys
import time
from pathlib import Path

from msjax.control.server import RedisServer
from msjax.control.store import EXIT_REQUESTED, Store, connect

# A worker process as far as the control plane goes: one ControlPlaneHook of rank argv[1], its loop "running".
WORKER = """
import os, sys, time
from pathlib import Path
from msjax.config import Config
from msjax.control.hook import ControlPlaneHook
from msjax.control.rendezvous import Assignment
from msjax.control.store import Store, env_connect
from msjax.control.worker import WorkerContext
from msjax.hooks import LoopControl, RunContext
rank = int(sys.argv[1])
worker = WorkerContext(Store(env_connect(), "k8s-test"), Assignment(rank, 3, "h:1", 0), "0-0", f"w{rank}",
                       f"node-{rank}")
hook = ControlPlaneHook(worker, period_s=0.1, ttl_s=5.0)
hook.on_start(RunContext(Config(), Path("/nonexistent"), None, None, 0, LoopControl()))
time.sleep(60)
"""


def _wait(what, timeout_s: float, desc: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {desc}")


def test_probe_follows_the_heartbeat_ttl():
    with RedisServer() as server:
        env = {**os.environ, "MSJAX_REDIS_URL": server.url, "MSJAX_RUN_ID": "probe-test", "MSJAX_RANK": "1"}
        store = Store(connect(server.url), "probe-test")

        def probe(**extra) -> int:
            return subprocess.run([sys.executable, "-m", "msjax.control.probe"], env={**env, **extra},
                                  capture_output=True, timeout=60).returncode

        assert probe() == 1  # no heartbeat yet
        store.heartbeat(1, 30, {"step": 3})
        assert probe() == 0
        store.heartbeat(1, 0.2, {"step": 4})
        time.sleep(0.5)
        assert probe() == 1  # expired: a hung or stopped worker
        assert probe(MSJAX_RANK="x") == 2  # the probe's own failure


def test_k8s_controller_restart_request_ends_exactly_the_workers_it_names():
    """JobSetBackend.stop (the Kubernetes controller's restart, no API): the workers it saw leave at their next
    heartbeat with EXIT_REQUESTED and one line saying why (so the JobSet's failure policy restarts the job); a
    worker process that it did not see (another rank's) keeps running."""
    from msjax.launch.k8s import JobSetBackend
    from msjax.supervise.supervisor import Worker

    with RedisServer() as server:
        store = Store(connect(server.url), "k8s-test")
        env = {**os.environ, "MSJAX_REDIS_URL": server.url}
        procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(rank)], env=env, stderr=subprocess.PIPE,
                                  text=True) for rank in (0, 1, 2)]
        try:
            _wait(lambda: len(store.heartbeats([0, 1, 2])) == 3, 120, "heartbeats of the three workers")
            assert all(hb["boot"] and hb["state"] == "running" for hb in store.heartbeats().values())
            named = [Worker(r, f"node-{r}", None, 0.0, Path("/dev/null")) for r in (0, 1)]
            assert JobSetBackend(store, poll_s=0.05).stop(named, grace_s=30) == {"terminated": 2, "killed": 0}
            for p in procs[:2]:
                assert p.wait(timeout=30) == EXIT_REQUESTED
                last = p.stderr.read().strip().splitlines()[-1]
                assert last.startswith("msjax: rank ") and "stopping: the supervisor restarts the job" in last, last
            assert procs[2].poll() is None and set(store.heartbeats()) == {2}  # not named: still beating
        finally:
            for p in procs:
                p.kill()
                p.wait()
