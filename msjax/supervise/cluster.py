"""Supervision under Kubernetes and SLURM: the supervisor as the job's controller process.

`scripts/launch.py --backend=k8s|slurm --supervise` (or `--supervisor.enabled=true`) passes the control plane's
spec (msjax.control.specs) through `supervise_spec`, which adds:

SLURM (sbatch): the batch script runs the supervisor (`python -m msjax.supervise --backend=slurm`) on the first
  node of the allocation, beside Redis, in place of the worker step; the supervisor starts the workers as an srun
  step itself and does everything it does locally: detection, ending the step (scancel), the self-checks as an
  srun step on every node, exclusion (`srun --exclude`), a spare node (`#SBATCH --nodes` = hosts +
  supervisor.spares) or re-planning onto the nodes left, restart from the newest verified checkpoint within the
  budget, events.jsonl (msjax.supervise.slurm).
Kubernetes (JobSet): a controller Job NAME-supervisor running `python -m msjax.supervise --backend=k8s`, which
  watches the workers' heartbeats and restarts the job through the JobSet's own failurePolicy (maxRestarts = the
  restart budget), with no Kubernetes API access (msjax.supervise.k8s); in every worker pod the heartbeat
  (MSJAX_SUPERVISED=1, slot = the pod's job completion index, host = its node name), `--resume`, a livenessProbe
  (`python -m msjax.supervise.probe`) that fails when the worker's heartbeat has expired (so the kubelet kills a
  hung worker even without the controller), an initContainer running the self-checks on the node's devices
  (a failing node fails the pod and is reported in Redis), and a nodeAffinity that keeps pods off nodes labelled
  excluded. docs/supervise.md says which parts of the policy apply on each backend.
"""

from __future__ import annotations

import math
import shlex

import yaml

from msjax.config import Config

PROBE = ["python", "-m", "msjax.supervise.probe"]


def _diagnostics_command(cfg: Config, host: str) -> list[str]:
    s = cfg.supervisor
    return ["python", "-m", "msjax.supervise.diagnostics", "--host", host, "--rank", "0", "--num", "1",
            "--min_flops", str(s.diag_min_matmul_flops), "--timeout", str(s.diagnose_timeout_s), "--fail_exit"]


def supervise_k8s(text: str, cfg: Config, train_flags: list[str] | None = None) -> str:
    """The JobSet manifest `text` with supervision added (see the module docstring): the controller Job, and in
    every worker pod the heartbeat, the liveness probe, the diagnostics initContainer, `--resume`, and the node
    affinity that keeps pods off excluded nodes. Raises ValueError when the manifest holds no JobSet."""
    from msjax.supervise.k8s import EXCLUDE_LABEL

    head = "".join(line + "\n" for line in text.splitlines() if line.startswith("#"))
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    jobsets = [d for d in docs if d.get("kind") == "JobSet"]
    if not jobsets:
        raise ValueError("the manifest has no JobSet to supervise")
    s = cfg.supervisor
    controllers = []
    for js in jobsets:
        js["spec"].setdefault("failurePolicy", {})["maxRestarts"] = s.restart_budget
        num_workers = 0
        for rj in js["spec"]["replicatedJobs"]:
            num_workers += rj.get("replicas", 1) * rj["template"]["spec"].get("parallelism", 1)
            pod = rj["template"]["spec"]["template"]["spec"]
            worker = pod["containers"][0]
            if "--resume" not in worker["command"]:  # the JobSet restarts pods with the manifest's command
                worker["command"] = worker["command"] + ["--resume"]
            redis_env = [e for e in worker.get("env", []) if e["name"] in _REDIS_ENV]
            worker["env"] = worker.get("env", []) + [
                {"name": "MSJAX_SUPERVISED", "value": "1"},
                {"name": "MSJAX_SLOT", "value": "$(JOB_INDEX)"},
                {"name": "MSJAX_HOST", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            ]
            worker["livenessProbe"] = {
                "exec": {"command": PROBE},
                # no verdict before a worker could have sent its first heartbeat
                "initialDelaySeconds": int(math.ceil(s.startup_timeout_s)),
                "periodSeconds": max(1, int(math.ceil(s.heartbeat_period_s))),
                "timeoutSeconds": 10, "failureThreshold": 1,
            }
            init = {"name": "diagnostics", "image": worker["image"], "workingDir": worker.get("workingDir"),
                    "command": _diagnostics_command(cfg, "$(MSJAX_HOST)"),
                    "env": [{"name": "MSJAX_HOST", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                            *redis_env],  # a failing node is reported to the controller through Redis
                    "resources": worker.get("resources", {})}
            pod["initContainers"] = [init] + pod.get("initContainers", [])
            # Excluded nodes carry EXCLUDE_LABEL (the controller says which); pods require its absence.
            terms = (pod.setdefault("affinity", {}).setdefault("nodeAffinity", {})
                     .setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
                     .setdefault("nodeSelectorTerms", [{}]))
            for term in terms:
                term.setdefault("matchExpressions", []).append({"key": EXCLUDE_LABEL, "operator": "DoesNotExist"})
        controllers.append(_controller_job(js, worker, redis_env, num_workers, train_flags or []))
    return head + yaml.safe_dump_all(docs + controllers, sort_keys=False)


_REDIS_ENV = ("MSJAX_REDIS_URL", "MSJAX_REDIS_PASSWORD", "MSJAX_RUN_ID", "MSJAX_REDIS_CA_CERT", "MSJAX_REDIS_CERT",
              "MSJAX_REDIS_KEY")


def _controller_job(js: dict, worker: dict, redis_env: list[dict], num_workers: int, train_flags: list[str]) -> dict:
    """The supervisor as a one-pod batch Job beside the JobSet (msjax.supervise.k8s). A Job, not a Deployment:
    the controller ends when the run does (0 finished, 4 budget spent), and a Deployment would start it again. Not
    restarted if it crashes (backoffLimit 0): the JobSet, its failurePolicy and the liveness probes go on healing
    crashes and hangs without it."""
    name, ns = js["metadata"]["name"], js["metadata"].get("namespace", "default")
    run_id = next((e["value"] for e in redis_env if e["name"] == "MSJAX_RUN_ID"), "")
    labels = {**js["metadata"].get("labels", {}), "app.kubernetes.io/component": "supervisor"}
    return {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"{name}-supervisor", "namespace": ns,
                                                              "labels": labels},
        "spec": {"backoffLimit": 0, "template": {"metadata": {"labels": dict(labels)}, "spec": {
            "restartPolicy": "Never",
            "containers": [{
                "name": "supervisor", "image": worker["image"], "workingDir": worker.get("workingDir"),
                "command": ["python", "-m", "msjax.supervise", "--backend=k8s", f"--hosts={num_workers}",
                            f"--run_id={run_id}", *train_flags],
                "env": [*redis_env, {"name": "PYTHONUNBUFFERED", "value": "1"}],
                "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "4Gi"}},
            }]}}},
    }


def supervise_slurm(text: str, cfg: Config, train_flags: list[str]) -> str:
    """The sbatch script `text` with its worker step handed to the supervisor (see the module docstring): the
    allocation grows by `supervisor.spares` nodes, and the `srun ... scripts/train.py` line becomes the supervisor
    (`python -m msjax.supervise --backend=slurm`), run by the batch script on the first node beside Redis; the
    supervisor starts the workers as an srun step itself (msjax.supervise.slurm). Its exit status is the job's.
    Raises ValueError when the script has no `srun ... scripts/train.py` step."""
    lines = text.rstrip("\n").split("\n")
    idx = [i for i, line in enumerate(lines) if line.startswith("srun ") and "scripts/train.py" in line]
    if not idx:
        raise ValueError("the sbatch script has no `srun ... scripts/train.py` worker step to supervise")
    s = cfg.supervisor
    nodes = [i for i, line in enumerate(lines) if line.startswith("#SBATCH --nodes=")]
    hosts = int(lines[nodes[0]].split("=", 1)[1]) if nodes else 1
    if nodes and s.spares:
        lines[nodes[0]] = f"#SBATCH --nodes={hosts + s.spares}"
    flags = " ".join(shlex.quote(a) for a in train_flags)
    controller = [
        "# The supervisor (msjax.supervise) is this job's controller, here on the first node beside Redis: it starts",
        "# the workers as an srun step (one task per node), watches their heartbeats in Redis, and on a failure",
        "# ends the step (scancel), runs the self-checks as an srun step on every node, excludes the nodes that",
        "# fail (--exclude), re-plans onto the nodes left (or takes a spare) and restarts from the newest verified",
        f"# checkpoint within the restart budget ({s.restart_budget}). Exit status: 0 finished, 3 no node or layout",
        "# left, 4 restart budget exhausted.",
        'NODES=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd, -)',
        f'python -m msjax.supervise --backend=slurm --nodes="$NODES" --hosts={hosts} --run_id="$MSJAX_RUN_ID" '
        + flags,
    ]
    head = lines[:idx[-1]]
    if head and head[-1].startswith("# One task per node"):  # the replaced step's comment
        head = head[:-1]
    return "\n".join(head + controller + lines[idx[-1] + 1:]) + "\n"


def supervise_spec(backend: str, text: str, cfg: Config, train_flags: list[str]) -> str:
    """`supervise_k8s` or `supervise_slurm` by `backend` ("k8s" / "slurm")."""
    return supervise_k8s(text, cfg, train_flags) if backend == "k8s" else supervise_slurm(text, cfg, train_flags)
