"""Supervision under Kubernetes and SLURM, where the cluster's own controller starts and restarts the workers.

`scripts/launch.py --backend=k8s|slurm --supervise` (or `--supervisor.enabled=true`) passes the control plane's
spec (msjax.control.specs) through `supervise_spec`, which adds:

Kubernetes (JobSet): the supervisor's heartbeat in every worker (MSJAX_SUPERVISED=1, slot = the pod's job
  completion index, host = its node name); a livenessProbe (`python -m msjax.supervise.probe`) that fails when
  the worker's heartbeat has expired, so the kubelet kills a hung or stopped worker (a hang is what the JobSet
  controller cannot see by itself); an initContainer that runs the self-check diagnostics on the node's devices
  and fails the pod on a faulty one; and the restart budget as the JobSet's failurePolicy.maxRestarts (the JobSet
  controller restarts every pod, and the workers join the next rendezvous generation and resume).
SLURM (sbatch): the worker step in a loop that restarts it with `--resume` within the restart budget, with
  exponential backoff, running the diagnostics on every node before each restart and ending with a report
  naming the node to exclude when one fails.

Not done here (the local supervisor does them): re-planning onto fewer nodes (a JobSet's and an allocation's size
are fixed), excluding a node automatically (that needs node taints through the Kubernetes API, or a new
allocation), and the events.jsonl figures (the control plane's event stream carries the workers' own events).
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


def supervise_k8s(text: str, cfg: Config) -> str:
    """The JobSet manifest `text` with supervision added (see the module docstring). Raises ValueError when the
    manifest holds no JobSet."""
    head = "".join(line + "\n" for line in text.splitlines() if line.startswith("#"))
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    jobsets = [d for d in docs if d.get("kind") == "JobSet"]
    if not jobsets:
        raise ValueError("the manifest has no JobSet to supervise")
    s = cfg.supervisor
    for js in jobsets:
        js["spec"].setdefault("failurePolicy", {})["maxRestarts"] = s.restart_budget
        for rj in js["spec"]["replicatedJobs"]:
            pod = rj["template"]["spec"]["template"]["spec"]
            worker = pod["containers"][0]
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
                    "env": [{"name": "MSJAX_HOST", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
                    "resources": worker.get("resources", {})}
            pod["initContainers"] = [init] + pod.get("initContainers", [])
    return head + yaml.safe_dump_all(docs, sort_keys=False)


def supervise_slurm(text: str, cfg: Config, train_flags: list[str]) -> str:
    """The sbatch script `text` with its worker step run in a supervised restart loop (see the module docstring).
    Raises ValueError when the script has no `srun ... scripts/train.py` step."""
    lines = text.rstrip("\n").split("\n")
    idx = [i for i, line in enumerate(lines) if line.startswith("srun ") and "scripts/train.py" in line]
    if not idx:
        raise ValueError("the sbatch script has no `srun ... scripts/train.py` worker step to supervise")
    step = lines[idx[-1]]
    srun, _, _ = step.partition(" python ")
    worker = " ".join(shlex.quote(a) for a in ["python", "scripts/train.py", *train_flags])
    diag = " ".join(shlex.quote(a) for a in _diagnostics_command(cfg, "HOST")).replace("HOST", '"$(hostname)"')
    s = cfg.supervisor
    loop = [
        "# Supervised (msjax.supervise): restart the worker step with --resume within the restart budget, with",
        "# exponential backoff; run the self-checks on every node before each restart.",
        "export MSJAX_SUPERVISED=1",
        f"BUDGET={s.restart_budget}; DELAY={s.backoff_s}; MAX_DELAY={s.backoff_max_s}; RESUME=''; RESTARTS=0",
        "while true; do",
        f"  {srun} bash -c 'MSJAX_SLOT=$SLURM_PROCID MSJAX_HOST=$(hostname) exec \"$@\"' _ {worker} $RESUME "
        "&& { echo \"msjax supervise: finished after $RESTARTS restart(s)\"; exit 0; }",
        "  STATUS=$?",
        "  if [ \"$RESTARTS\" -ge \"$BUDGET\" ]; then",
        "    echo \"msjax supervise: restart budget exhausted ($BUDGET restart(s) allowed,"
        " supervisor.restart_budget); last exit status $STATUS\" >&2; exit 4",
        "  fi",
        f"  if ! srun --nodes=\"$SLURM_NNODES\" --ntasks=\"$SLURM_NNODES\" --ntasks-per-node=1 {diag}; then",
        "    echo \"msjax supervise: a node failed its self-checks (see above); resubmit with --exclude=NODE\" >&2",
        "    exit 3",
        "  fi",
        "  RESTARTS=$((RESTARTS + 1)); RESUME=--resume",
        "  echo \"msjax supervise: worker step failed (status $STATUS); restart $RESTARTS/$BUDGET in $DELAY s\"",
        "  sleep \"$DELAY\"; DELAY=$(python -c \"print(min(2 * $DELAY, $MAX_DELAY))\")",
        "done",
    ]
    return "\n".join(lines[:idx[-1]] + loop + lines[idx[-1] + 1:]) + "\n"


def supervise_spec(backend: str, text: str, cfg: Config, train_flags: list[str]) -> str:
    """`supervise_k8s` or `supervise_slurm` by `backend` ("k8s" / "slurm")."""
    return supervise_k8s(text, cfg) if backend == "k8s" else supervise_slurm(text, cfg, train_flags)
