"""Cluster launch specs: a Kubernetes JobSet manifest and a SLURM sbatch script running the same train.py command.

Both start one worker process per node (MegaScale's one pod per node) with the MSJAX_* variables of
`msjax.control.worker`, and one Redis per job (password required, nothing on disk):

Kubernetes (`k8s_jobset`, multi-document YAML):
  Secret NAME-redis (the password; skipped when --redis_secret names an existing one), Deployment + Service
  NAME-redis (redis-server --requirepass from the Secret), a headless Service NAME (clusterIP None) giving every
  worker pod a stable DNS name NAME-workers-0-I.NAME (the coordinator is pod 0's: its rank is its completion
  index, MSJAX_RANK; rank 0 publishes the address through Redis), and a JobSet NAME: one ReplicatedJob
  `workers`, an Indexed Job of N pods (parallelism = completions = N, backoffLimit 0, restartPolicy Never), GPU
  (`nvidia.com/gpu`) or TPU (`google.com/tpu` + GKE node selectors) requests, and failurePolicy.maxRestarts:
  the JobSet controller restarts the whole job, every worker joins the next rendezvous generation.

SLURM (`slurm_sbatch`): #SBATCH --nodes=N --ntasks-per-node=1; Redis on the first node of the allocation
(`scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1`), its password generated at job start and passed in
the environment; then `srun` runs one train.py per node. Worker ids and ranks come from SLURM_PROCID (rank 0,
and so JAX's coordinator, is the first node of the allocation), the advertised host is each node's host name.
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:  # launch.py imports this module
    from msjax.control.launch import LaunchOptions

class _NoAliasDumper(yaml.SafeDumper):
    """Writes shared dicts out in full (no &id001 anchors): kubectl accepts anchors, people reading do worse."""

    def ignore_aliases(self, data) -> bool:
        return True


COORDINATOR_PORT = 8476
REDIS_PORT = 6379


def _worker_command(train_flags: list[str]) -> list[str]:
    return ["python", "scripts/train.py", *train_flags]


def k8s_jobset(args: LaunchOptions, run_id: str, train_flags: list[str]) -> str:
    """The manifest as YAML text (see the module docstring). Raises ValueError without --image."""
    if not args.image:
        raise ValueError("--backend=k8s needs --image (a container image holding msjax and its dependencies)")
    name, ns, n = args.name, args.namespace, args.num_processes
    secret = args.redis_secret or f"{name}-redis"
    redis_host = f"{name}-redis.{ns}.svc.cluster.local"
    labels = {"app.kubernetes.io/name": "msjax", "app.kubernetes.io/instance": name}
    docs: list[dict] = []
    if not args.redis_secret:
        import secrets

        docs.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret, "namespace": ns},
                     "type": "Opaque", "stringData": {"password": secrets.token_urlsafe(24)}})
    password_env = {"name": "REDIS_PASSWORD",
                    "valueFrom": {"secretKeyRef": {"name": secret, "key": "password"}}}
    redis_labels = {**labels, "app.kubernetes.io/component": "redis"}
    docs.append({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": f"{name}-redis", "namespace": ns},
        "spec": {"replicas": 1, "selector": {"matchLabels": redis_labels}, "template": {
            "metadata": {"labels": redis_labels},
            "spec": {"containers": [{
                "name": "redis", "image": "redis:7.2",
                "args": ["--requirepass", "$(REDIS_PASSWORD)", "--save", "", "--appendonly", "no",
                         "--maxclients", "20000", "--tcp-backlog", "4096"],
                "env": [password_env], "ports": [{"containerPort": REDIS_PORT, "name": "redis"}],
                "readinessProbe": {"tcpSocket": {"port": REDIS_PORT}, "periodSeconds": 2},
                "resources": {"requests": {"cpu": "2", "memory": "2Gi"}, "limits": {"memory": "4Gi"}}}]}}}})
    docs.append({"apiVersion": "v1", "kind": "Service", "metadata": {"name": f"{name}-redis", "namespace": ns},
                 "spec": {"selector": redis_labels, "ports": [{"name": "redis", "port": REDIS_PORT}]}})
    docs.append({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns},
                 "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                          "selector": {"jobset.sigs.k8s.io/jobset-name": name},
                          "ports": [{"name": "coordinator", "port": COORDINATOR_PORT}]}})
    resources: dict = {"requests": {"cpu": str(args.cpus_per_node), "memory": args.memory_per_node},
                       "limits": {"memory": args.memory_per_node}}
    node_selector = {}
    if args.accelerator == "gpu":
        resources["limits"]["nvidia.com/gpu"] = args.accelerators_per_node
        resources["requests"]["nvidia.com/gpu"] = args.accelerators_per_node
    elif args.accelerator == "tpu":
        resources["limits"]["google.com/tpu"] = args.accelerators_per_node
        resources["requests"]["google.com/tpu"] = args.accelerators_per_node
        node_selector = {"cloud.google.com/gke-tpu-accelerator": args.tpu_type,
                         "cloud.google.com/gke-tpu-topology": args.tpu_topology}
    env = [
        {"name": "JOB_INDEX", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
        {"name": "MSJAX_REDIS_URL", "value": f"redis://{redis_host}:{REDIS_PORT}/0"},
        {"name": "MSJAX_REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {"name": secret, "key": "password"}}},
        {"name": "MSJAX_RUN_ID", "value": run_id},
        {"name": "MSJAX_NUM_PROCESSES", "value": str(n)},
        {"name": "MSJAX_WORKER_ID", "value": "node-$(JOB_INDEX)"},
        {"name": "MSJAX_RANK", "value": "$(JOB_INDEX)"},  # pod 0 is rank 0: the coordinator the Service names
        {"name": "MSJAX_ADVERTISE_HOST", "value": f"{name}-workers-0-$(JOB_INDEX).{name}"},
        {"name": "MSJAX_COORDINATOR_PORT", "value": str(COORDINATOR_PORT)},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    pod_spec = {
        "restartPolicy": "Never", "subdomain": name, "terminationGracePeriodSeconds": 120,
        "containers": [{"name": "worker", "image": args.image, "workingDir": args.workdir,
                        "command": _worker_command(train_flags), "env": env, "resources": resources,
                        "ports": [{"containerPort": COORDINATOR_PORT, "name": "coordinator"}]}],
    }
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    docs.append({
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {
            "failurePolicy": {"maxRestarts": args.max_restarts},
            "network": {"enableDNSHostnames": True, "subdomain": name},
            "replicatedJobs": [{"name": "workers", "replicas": 1, "template": {"spec": {
                "parallelism": n, "completions": n, "backoffLimit": 0, "completionMode": "Indexed",
                "template": {"metadata": {"labels": labels}, "spec": pod_spec}}}}],
        },
    })
    head = (f"# msjax run {run_id}: {n} worker pods (one per node), Redis, headless coordinator service.\n"
            f"# kubectl apply -f THIS_FILE   (needs the JobSet controller: jobset.x-k8s.io)\n")
    return head + yaml.dump_all(docs, Dumper=_NoAliasDumper, sort_keys=False)


def slurm_sbatch(args: LaunchOptions, run_id: str, train_flags: list[str]) -> str:
    """The sbatch script as text (see the module docstring)."""
    n = args.num_processes
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name={args.name}",
             f"#SBATCH --nodes={n}",
             "#SBATCH --ntasks-per-node=1",
             f"#SBATCH --cpus-per-task={args.cpus_per_node}",
             f"#SBATCH --time={args.time_limit}",
             f"#SBATCH --output={args.name}-%j.out"]
    if args.accelerator == "gpu":
        lines.append(f"#SBATCH --gpus-per-node={args.accelerators_per_node}")
    if args.partition:
        lines.append(f"#SBATCH --partition={args.partition}")
    worker = " ".join(shlex.quote(a) for a in _worker_command(train_flags))
    lines += [
        f"# msjax run {run_id}: one worker per node; Redis on the first node of the allocation.",
        "set -euo pipefail",
        f"cd {shlex.quote(args.workdir)}",
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"REDIS_PORT={REDIS_PORT}",
        "REDIS_PASSWORD=$(python -c 'import secrets; print(secrets.token_urlsafe(24))')",
        "REDIS_SERVER=$(python -c 'from msjax.control.server import redis_server_binary; "
        "print(redis_server_binary())')",
        "# Redis lives as long as the job: started on the first node, killed on exit.",
        'srun --nodes=1 --ntasks=1 -w "$HEAD_NODE" --overlap "$REDIS_SERVER" --port "$REDIS_PORT" --bind 0.0.0.0 '
        '--requirepass "$REDIS_PASSWORD" --save "" --appendonly no --maxclients 20000 --tcp-backlog 4096 &',
        "REDIS_PID=$!",
        "trap 'kill $REDIS_PID 2>/dev/null || true' EXIT",
        'export MSJAX_REDIS_URL="redis://${HEAD_NODE}:${REDIS_PORT}/0"',
        'export MSJAX_REDIS_PASSWORD="$REDIS_PASSWORD"',
        f'export MSJAX_RUN_ID="{run_id}-${{SLURM_JOB_ID}}"',
        'export MSJAX_NUM_PROCESSES="$SLURM_NNODES"',
        f"export MSJAX_COORDINATOR_PORT={COORDINATOR_PORT}",
        "export PYTHONUNBUFFERED=1",
        "# Wait (at most 60 s) until Redis answers, so no worker starts against an absent server.",
        "for _ in $(seq 60); do",
        "  python -c 'from msjax.control.store import env_connect; env_connect()' 2>/dev/null && break",
        "  sleep 1",
        "done",
        "# One task per node: worker ids from SLURM_PROCID, each advertises its own host name. The rank is the",
        "# task's SLURM_PROCID (srun numbers tasks in node order), so rank 0 and JAX's coordinator run on the",
        "# first node of the allocation, beside Redis.",
        f'srun --nodes="$SLURM_NNODES" --ntasks="$SLURM_NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 '
        f"bash -c 'MSJAX_RANK=$SLURM_PROCID exec \"$@\"' msjax-worker {worker}",
    ]
    return "\n".join(lines) + "\n"
