"""Supervision under Kubernetes and SLURM (msjax.supervise.cluster): the specs launch.py writes with --supervise
(the controller in each), and against a real Redis the liveness probe and the Kubernetes controller's restart
request ending a worker process. The SLURM backend runs for real in test_supervise_e2e.py."""

import os
import subprocess
import sys
import shlex
import time
from pathlib import Path

import yaml

from msjax.control.server import RedisServer
from msjax.supervise.store import HeartbeatStore

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ["--config=gpt_tiny", "--train.steps=10", "--supervisor.restart_budget=2", "--supervisor.backoff_s=0.1",
         "--supervisor.heartbeat_period_s=2", "--supervisor.startup_timeout_s=90"]


def _launch(*args: str) -> str:
    own, _, extra = " ".join(args).partition(" -- ")
    proc = subprocess.run([sys.executable, "scripts/launch.py", *own.split(), "--supervise", "--", *TRAIN,
                           *extra.split()], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_k8s_spec_has_the_controller_probes_heartbeats_and_runs_diagnostics_first():
    docs = list(yaml.safe_load_all(_launch("--backend=k8s", "--num_processes=4", "--image=msjax:test",
                                           "--run_id=run-9")))
    (js,) = [d for d in docs if d["kind"] == "JobSet"]
    assert js["spec"]["failurePolicy"]["maxRestarts"] == 2  # the restart budget
    pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    worker = pod["containers"][0]
    assert worker["command"][-1] == "--resume"  # a restarted pod resumes from the newest verified checkpoint
    env = {e["name"]: e for e in worker["env"]}
    assert env["MSJAX_SUPERVISED"]["value"] == "1" and env["MSJAX_SLOT"]["value"] == "$(JOB_INDEX)"
    probe = worker["livenessProbe"]
    assert probe["exec"]["command"] == ["python", "-m", "msjax.supervise.probe"]
    assert probe["initialDelaySeconds"] == 90 and probe["periodSeconds"] == 2 and probe["failureThreshold"] == 1
    (init,) = pod["initContainers"]
    assert init["command"][:3] == ["python", "-m", "msjax.supervise.diagnostics"] and "--fail_exit" in init["command"]
    assert init["image"] == "msjax:test"
    assert {"MSJAX_REDIS_URL", "MSJAX_REDIS_PASSWORD", "MSJAX_RUN_ID"} <= {e["name"] for e in init["env"]}
    (term,) = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": "msjax.dev/excluded", "operator": "DoesNotExist"} in term["matchExpressions"]
    # the controller: the supervisor as a one-pod Job beside the JobSet, on the same Redis and run id
    (job,) = [d for d in docs if d["kind"] == "Job"]
    spec = job["spec"]["template"]["spec"]
    (ctl,) = spec["containers"]
    assert job["metadata"]["name"] == "msjax-supervisor" and spec["restartPolicy"] == "Never"
    assert ctl["command"][:6] == ["python", "-m", "msjax.supervise", "--backend=k8s", "--hosts=4", "--run_id=run-9"]
    assert ctl["command"][6:] == TRAIN and ctl["image"] == "msjax:test"
    ctl_env = {e["name"]: e for e in ctl["env"]}
    assert ctl_env["MSJAX_REDIS_URL"] == env["MSJAX_REDIS_URL"] and ctl_env["MSJAX_RUN_ID"]["value"] == "run-9"
    assert ctl_env["MSJAX_REDIS_PASSWORD"] == env["MSJAX_REDIS_PASSWORD"]


def test_slurm_spec_runs_the_supervisor_as_the_controller(tmp_path):
    script = _launch("--backend=slurm", "--num_processes=2", "--", "--supervisor.spares=1")
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    lines = script.splitlines()
    assert "#SBATCH --nodes=3" in lines  # 2 hosts + 1 spare
    assert not [x for x in lines if "scripts/train.py" in x]  # the supervisor starts the worker step itself
    (ctl,) = [x for x in lines if "msjax.supervise" in x and not x.startswith("#")]
    words = shlex.split(ctl)
    assert words[:5] == ["python", "-m", "msjax.supervise", "--backend=slurm", "--nodes=$NODES"]
    assert words[5:7] == ["--hosts=2", "--run_id=$MSJAX_RUN_ID"] and words[7:] == [*TRAIN, "--supervisor.spares=1"]
    # after Redis is up and its variables are exported
    assert lines.index(ctl) > lines.index('export MSJAX_REDIS_URL="redis://${HEAD_NODE}:${REDIS_PORT}/0"')
    assert 'NODES=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd, -)' in lines


def test_probe_follows_the_heartbeat_ttl():
    with RedisServer() as server:
        env = {**os.environ, "MSJAX_REDIS_URL": server.url, "MSJAX_RUN_ID": "probe-test", "MSJAX_SLOT": "1"}
        from msjax.control.store import connect

        store = HeartbeatStore(connect(server.url), "probe-test")

        def probe() -> int:
            return subprocess.run([sys.executable, "-m", "msjax.supervise.probe"], cwd=ROOT, env=env,
                                  capture_output=True, timeout=60).returncode

        assert probe() == 1  # no heartbeat yet
        store.beat(1, {"step": 3}, ttl_s=30)
        assert probe() == 0
        store.beat(1, {"step": 4}, ttl_s=0.2)
        time.sleep(0.5)
        assert probe() == 1  # expired: a hung or stopped worker
        assert subprocess.run([sys.executable, "-m", "msjax.supervise.probe"], cwd=ROOT,
                              env={**env, "MSJAX_SLOT": "x"}, capture_output=True, timeout=60).returncode == 2


def test_k8s_controller_restart_request_ends_exactly_the_workers_it_names():
    """JobSetBackend.stop (the Kubernetes controller's restart, no API): the workers it saw exit with
    RESTART_EXIT_CODE at their next heartbeat (so the JobSet's failurePolicy restarts the job); a worker process
    that started after it looked (a new boot token in another slot) keeps running."""
    from msjax.supervise.k8s import JobSetBackend
    from msjax.supervise.store import RESTART_EXIT_CODE
    from msjax.supervise.supervisor import Worker

    code = ("import os, sys, time; from msjax.supervise.heartbeat import HeartbeatHook; "
            "from msjax.supervise.store import HeartbeatStore; "
            "h = HeartbeatHook(HeartbeatStore.from_url(os.environ['MSJAX_REDIS_URL'], 'k8s-test'), "
            "int(sys.argv[1]), 'node-' + sys.argv[1], 0.1, 5.0); h.start(0); time.sleep(60)")
    with RedisServer() as server:
        from msjax.control.store import connect

        store = HeartbeatStore(connect(server.url), "k8s-test")
        env = {**os.environ, "MSJAX_REDIS_URL": server.url}
        procs = [subprocess.Popen([sys.executable, "-c", code, str(slot)], cwd=ROOT, env=env) for slot in (0, 1)]
        try:
            deadline = time.monotonic() + 60
            while len(store.heartbeats([0, 1])) < 2:
                assert time.monotonic() < deadline, "no heartbeats from the two workers within 60 s"
                time.sleep(0.1)
            assert all(hb["boot"] for hb in store.heartbeats([0, 1]).values())
            result = JobSetBackend(store, poll_s=0.05).stop([Worker(0, "node-0", None, 0.0, Path("/dev/null"))],
                                                            grace_s=30)
            assert result == {"terminated": 1, "killed": 0}
            assert procs[0].wait(timeout=30) == RESTART_EXIT_CODE
            assert procs[1].poll() is None  # not named: still beating
        finally:
            for p in procs:
                p.kill()
                p.wait()
