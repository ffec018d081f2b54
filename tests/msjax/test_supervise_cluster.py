"""Supervision under Kubernetes and SLURM (msjax.supervise.cluster): the specs launch.py writes with --supervise,
the SLURM restart loop run by bash against a fake srun and a fake worker, and the liveness probe against a real
Redis."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import yaml

from msjax.control.server import RedisServer
from msjax.supervise.store import HeartbeatStore

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ["--config=gpt_tiny", "--train.steps=10", "--supervisor.restart_budget=2", "--supervisor.backoff_s=0.1",
         "--supervisor.heartbeat_period_s=2", "--supervisor.startup_timeout_s=90"]


def _launch(*args: str) -> str:
    proc = subprocess.run([sys.executable, "scripts/launch.py", *args, "--supervise", "--", *TRAIN], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_k8s_spec_probes_heartbeats_and_runs_diagnostics_first():
    docs = list(yaml.safe_load_all(_launch("--backend=k8s", "--num_processes=4", "--image=msjax:test")))
    (js,) = [d for d in docs if d["kind"] == "JobSet"]
    assert js["spec"]["failurePolicy"]["maxRestarts"] == 2  # the restart budget
    pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    worker = pod["containers"][0]
    env = {e["name"]: e for e in worker["env"]}
    assert env["MSJAX_SUPERVISED"]["value"] == "1" and env["MSJAX_SLOT"]["value"] == "$(JOB_INDEX)"
    probe = worker["livenessProbe"]
    assert probe["exec"]["command"] == ["python", "-m", "msjax.supervise.probe"]
    assert probe["initialDelaySeconds"] == 90 and probe["periodSeconds"] == 2 and probe["failureThreshold"] == 1
    (init,) = pod["initContainers"]
    assert init["command"][:3] == ["python", "-m", "msjax.supervise.diagnostics"] and "--fail_exit" in init["command"]
    assert init["image"] == "msjax:test"


def _fake_bin(tmp: Path, worker_failures: int, diag_ok: bool = True) -> dict:
    """A PATH with a fake `srun` (runs its command once, here) and a `python` that fakes the worker (fails its
    first `worker_failures` runs, and records its arguments) and the diagnostics, passing the rest through."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(textwrap.dedent("""\
        #!/bin/bash
        while [[ "$1" == -* ]]; do shift; done
        SLURM_PROCID=0 exec "$@"
        """))
    (bin_dir / "python").write_text(textwrap.dedent(f"""\
        #!/bin/bash
        if [[ "$2" == "scripts/train.py" || "$1" == "scripts/train.py" ]]; then
          echo "$MSJAX_SUPERVISED $MSJAX_SLOT $*" >> {tmp}/runs
          n=$(wc -l < {tmp}/runs)
          [ "$n" -gt {worker_failures} ] && exit 0 || exit 1
        fi
        if [[ "$2" == "msjax.supervise.diagnostics" ]]; then echo diag >> {tmp}/diags; exit {0 if diag_ok else 1}; fi
        exec {sys.executable} "$@"
        """))
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_NNODES": "2",
            "SLURM_JOB_NODELIST": "n1"}


def _slurm_loop(tmp: Path) -> Path:
    """The supervised sbatch script's worker loop alone (the Redis set-up needs a real allocation)."""
    text = _launch("--backend=slurm", "--num_processes=2")
    lines = text.splitlines()
    start = lines.index("export MSJAX_SUPERVISED=1")
    script = tmp / "loop.sh"
    script.write_text("#!/bin/bash\nset -uo pipefail\n" + "\n".join(lines[start:]) + "\n")
    return script


def test_slurm_loop_restarts_with_resume_then_finishes(tmp_path):
    script = _slurm_loop(tmp_path)
    proc = subprocess.run(["bash", str(script)], env=_fake_bin(tmp_path, worker_failures=2), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = (tmp_path / "runs").read_text().splitlines()
    assert len(runs) == 3 and "--resume" not in runs[0] and all("--resume" in r for r in runs[1:])
    assert all(r.startswith("1 0 ") for r in runs)  # supervised, slot from SLURM_PROCID
    assert len((tmp_path / "diags").read_text().splitlines()) == 2  # self-checks before each restart
    assert "finished after 2 restart(s)" in proc.stdout


def test_slurm_loop_budget_and_failed_diagnostics_end_with_a_report(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    proc = subprocess.run(["bash", str(_slurm_loop(tmp_path / "a"))], env=_fake_bin(tmp_path / "a", 99),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 4 and "restart budget exhausted (2 restart(s) allowed" in proc.stderr
    assert len((tmp_path / "a" / "runs").read_text().splitlines()) == 3
    proc = subprocess.run(["bash", str(_slurm_loop(tmp_path / "b"))],
                          env=_fake_bin(tmp_path / "b", 99, diag_ok=False), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 3 and "failed its self-checks" in proc.stderr


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
