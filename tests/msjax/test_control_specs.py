"""launch.py --backend=k8s / slurm: the JobSet manifest parses and has every required object and field; the sbatch
script passes `bash -n`; both run exactly the train.py command line given after `--`."""

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
FLAGS = ["--config=gpt_tiny", "--train.steps=300", "--mesh.data=2", "--mesh.tensor=2", "--data.paths=my corpus/",
         "--resume"]


def _launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/launch.py", *args, "--", *FLAGS], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def _by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


@pytest.mark.parametrize("accelerator,resource", [("gpu", "nvidia.com/gpu"), ("tpu", "google.com/tpu")])
def test_k8s_jobset_manifest(tmp_path, accelerator, resource):
    out = tmp_path / "job.yaml"
    proc = _launch("--backend=k8s", "--num_processes=16", "--image=registry.example/msjax:1", "--name=gpt",
                   f"--accelerator={accelerator}", "--accelerators_per_node=4", "--max_restarts=5",
                   "--run_id=run-7", f"--output={out}")
    assert proc.returncode == 0, proc.stderr
    kinds = _by_kind(list(yaml.safe_load_all(out.read_text())))
    assert sorted(kinds) == ["Deployment", "JobSet", "Secret", "Service"]
    secret = kinds["Secret"][0]
    assert secret["metadata"]["name"] == "gpt-redis" and len(secret["stringData"]["password"]) >= 24

    redis = kinds["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]
    assert redis["args"][:2] == ["--requirepass", "$(REDIS_PASSWORD)"]
    assert {"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {"name": "gpt-redis", "key": "password"}}} \
        in redis["env"]
    services = {s["metadata"]["name"]: s["spec"] for s in kinds["Service"]}
    assert services["gpt-redis"]["ports"][0]["port"] == 6379
    assert services["gpt"]["clusterIP"] == "None"  # headless: stable DNS names for the coordinator
    assert services["gpt"]["selector"] == {"jobset.sigs.k8s.io/jobset-name": "gpt"}

    jobset = kinds["JobSet"][0]
    assert jobset["apiVersion"].startswith("jobset.x-k8s.io/")
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] == 5
    (rjob,) = jobset["spec"]["replicatedJobs"]
    job = rjob["template"]["spec"]
    assert (job["parallelism"], job["completions"], job["completionMode"]) == (16, 16, "Indexed")
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["subdomain"] == "gpt"
    (worker,) = pod["containers"]
    assert worker["command"] == ["python", "scripts/train.py", *FLAGS]
    env = {e["name"]: e for e in worker["env"]}
    assert env["MSJAX_REDIS_URL"]["value"] == "redis://gpt-redis.default.svc.cluster.local:6379/0"
    assert env["MSJAX_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "gpt-redis", "key": "password"}
    assert env["MSJAX_NUM_PROCESSES"]["value"] == "16" and env["MSJAX_RUN_ID"]["value"] == "run-7"
    assert env["MSJAX_ADVERTISE_HOST"]["value"] == "gpt-workers-0-$(JOB_INDEX).gpt"
    assert env["MSJAX_RANK"]["value"] == "$(JOB_INDEX)"  # pod 0 is rank 0, the coordinator
    names = [e["name"] for e in worker["env"]]
    assert names.index("JOB_INDEX") < names.index("MSJAX_ADVERTISE_HOST")  # $(VAR) needs VAR defined first
    assert names.index("JOB_INDEX") < names.index("MSJAX_RANK")
    assert worker["resources"]["limits"][resource] == 4
    if accelerator == "tpu":
        assert "cloud.google.com/gke-tpu-accelerator" in pod["nodeSelector"]


def test_k8s_needs_an_image():
    proc = _launch("--backend=k8s", "--num_processes=2")
    assert proc.returncode == 2 and proc.stderr.startswith("error: --backend=k8s needs --image")


def test_slurm_sbatch_script(tmp_path):
    proc = _launch("--backend=slurm", "--num_processes=8", "--partition=a100", "--accelerators_per_node=8")
    assert proc.returncode == 0, proc.stderr
    script = proc.stdout
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    for directive in ("--nodes=8", "--ntasks-per-node=1", "--gpus-per-node=8", "--partition=a100"):
        assert f"#SBATCH {directive}" in lines
    assert 'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in lines
    redis_line = next(line for line in lines if "$REDIS_SERVER" in line and line.startswith("srun"))
    assert '-w "$HEAD_NODE"' in redis_line and '--requirepass "$REDIS_PASSWORD"' in redis_line
    assert 'export MSJAX_REDIS_URL="redis://${HEAD_NODE}:${REDIS_PORT}/0"' in lines
    (worker_line,) = [line for line in lines if "scripts/train.py" in line]
    words = shlex.split(worker_line)
    assert words[0] == "srun" and "--ntasks-per-node=1" in words
    i = words.index("python")
    assert words[i:] == ["python", "scripts/train.py", *FLAGS]
    # Between srun's options and the command, the wrapper that fixes each task's rank to its SLURM_PROCID (so
    # rank 0, JAX's coordinator, is the allocation's first node): run it as srun would, with `env` as command.
    wrapper = words[words.index("bash"):i]
    ran = subprocess.run([*wrapper, "env"], capture_output=True, text=True,
                         env={"SLURM_PROCID": "3", "PATH": "/bin:/usr/bin"})
    assert ran.returncode == 0 and "MSJAX_RANK=3" in ran.stdout.splitlines(), ran
