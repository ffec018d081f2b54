"""Kubernetes: the JobSet manifest a job runs (`manifest`), and the supervisor's backend for it (`JobSetBackend`).

The manifest, built as data (a list of objects; `render` writes them as YAML), one worker pod per node
(MegaScale's one pod per node), each running `msjax-train <train flags> --resume` (the JobSet's failure policy
restarts pods with the same command; a first start finds no checkpoint and starts from step 0) with the MSJAX_*
variables of msjax.control.worker:
  Secret NAME-redis (the password; skipped when --redis_secret names an existing one), Deployment + Service
  NAME-redis (redis-server --requirepass from the Secret), a headless Service NAME (clusterIP None) giving every
  worker pod a stable DNS name NAME-workers-0-I.NAME (the coordinator is pod 0's: its rank is its completion
  index, MSJAX_RANK), and a JobSet NAME: one ReplicatedJob `workers`, an Indexed Job of N pods (parallelism =
  completions = N, backoffLimit 0, restartPolicy Never), GPU (`nvidia.com/gpu`) or TPU (`google.com/tpu` + GKE
  node selectors) requests, and a failure policy:
    - a worker that stopped resumably (exit 75, or 128 + SIGTERM/SIGINT: an eviction's or preemption's SIGTERM,
      after saving) fails its Job through the Job's podFailurePolicy (reason PodFailurePolicy), and the JobSet
      restarts every pod without counting it against maxRestarts (action RestartJobSetAndIgnoreMaxRestarts):
      stopped, resumable, never taken for a finished pod;
    - any other failure restarts the JobSet up to maxRestarts times (--max_restarts; with --supervise the
      restart budget, supervisor.restart_budget).

With --supervise (`manifest(..., cfg=...)`), as data in the same objects:
  - a controller Job NAME-supervisor running `msjax-supervise --backend=k8s`, which watches the workers'
    heartbeats in Redis and restarts the job through the JobSet's own failure policy, with no Kubernetes API
    access (`JobSetBackend`);
  - in every worker pod: a livenessProbe (`python -m msjax.control.probe`) that fails when the worker's heartbeat
    has expired (so the kubelet kills a hung worker even without the controller), an initContainer running the
    self-checks on the node's devices (`python -m msjax.supervise.diagnostics --fail_exit`: a failing node fails
    the pod and is reported in Redis), and a nodeAffinity that keeps pods off nodes labelled excluded.
What the controller cannot do without API access: re-plan onto fewer nodes (the JobSet's size is fixed; a spare
node pool does the job of spares), run the self-checks on demand (they run at every pod start instead), label
an excluded node itself (it prints the `kubectl label` command).

`JobSetBackend` (the supervisor's WorkerBackend):
  start    the JobSet starts the pods (the controller starts nothing); a worker's heartbeat names its node.
  stop     the controller asks the workers to leave (Store.request_exit with their boot tokens); each worker's
           heartbeat thread sees its request and exits with EXIT_REQUESTED at once, so its pod fails and the
           JobSet's failure policy recreates every pod; the new workers resume from the newest verified checkpoint.
           A worker too hung to exit is killed by its livenessProbe (an expired heartbeat).
  diagnose None: the self-checks ran in each pod's initContainer; a node that failed them is in Redis's excluded
           set, and the controller says which label keeps the JobSet off it.

Sources: the JobSet API (jobset.x-k8s.io/v1alpha2: failurePolicy.rules, onJobFailureReasons, actions), the
batch/v1 Job API (podFailurePolicy, onExitCodes), Kubernetes' core/v1 PodTemplateSpec; the test checks the pod and
Job templates against the Kubernetes API models of the `kubernetes` client it names.
"""

from __future__ import annotations

import math
import secrets
import time
from pathlib import Path
from typing import Sequence

import yaml

from msjax.config import Config
from msjax.control.store import EXIT_REQUESTED
from msjax.launch.options import LaunchOptions
from msjax.supervise.detect import STOPPED_EXITS
from msjax.supervise.diagnostics import Checks, command
from msjax.supervise.supervisor import Worker, WorkerBackend

COORDINATOR_PORT = 8476
REDIS_PORT = 6379
EXCLUDE_LABEL = "msjax.dev/excluded"
PROBE = ["python", "-m", "msjax.control.probe"]
_REDIS_ENV = ("MSJAX_REDIS_URL", "MSJAX_REDIS_PASSWORD", "MSJAX_RUN_ID")


class _NoAliasDumper(yaml.SafeDumper):
    """Writes shared dicts out in full (no &id001 anchors): kubectl accepts anchors, people reading do worse."""

    def ignore_aliases(self, data) -> bool:
        return True


def render(docs: Sequence[dict], run_id: str) -> str:
    """The manifest as multi-document YAML, with a comment saying how to apply it."""
    head = (f"# msjax run {run_id}: {docs[-1]['metadata']['name']} and its workers (one pod per node), Redis, a "
            "headless coordinator service.\n# kubectl apply -f THIS_FILE   (needs the JobSet controller: "
            "jobset.x-k8s.io)\n")
    return head + yaml.dump_all(list(docs), Dumper=_NoAliasDumper, sort_keys=False)


def manifest(opts: LaunchOptions, run_id: str, train_flags: Sequence[str], cfg: Config | None = None) -> list[dict]:
    """The objects of the job (see the module docstring); `cfg` given: supervised, with its controller.

    Raises ValueError without --image."""
    if not opts.image:
        raise ValueError("--backend=k8s needs --image (a container image holding msjax and its dependencies)")
    name, ns, n = opts.name, opts.namespace, opts.num_processes
    secret = opts.redis_secret or f"{name}-redis"
    labels = {"app.kubernetes.io/name": "msjax", "app.kubernetes.io/instance": name}
    docs: list[dict] = []
    if not opts.redis_secret:
        docs.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret, "namespace": ns},
                     "type": "Opaque", "stringData": {"password": secrets.token_urlsafe(24)}})
    redis_labels = {**labels, "app.kubernetes.io/component": "redis"}
    docs.append({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": f"{name}-redis", "namespace": ns},
        "spec": {"replicas": 1, "selector": {"matchLabels": redis_labels}, "template": {
            "metadata": {"labels": redis_labels},
            "spec": {"containers": [{
                "name": "redis", "image": "redis:7.2",
                "args": ["--requirepass", "$(REDIS_PASSWORD)", "--save", "", "--appendonly", "no",
                         "--maxclients", "20000", "--tcp-backlog", "4096"],
                "env": [{"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {"name": secret, "key": "password"}}}],
                "ports": [{"containerPort": REDIS_PORT, "name": "redis"}],
                "readinessProbe": {"tcpSocket": {"port": REDIS_PORT}, "periodSeconds": 2},
                "resources": {"requests": {"cpu": "2", "memory": "2Gi"}, "limits": {"memory": "4Gi"}}}]}}}})
    docs.append({"apiVersion": "v1", "kind": "Service", "metadata": {"name": f"{name}-redis", "namespace": ns},
                 "spec": {"selector": redis_labels, "ports": [{"name": "redis", "port": REDIS_PORT}]}})
    docs.append({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns},
                 "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                          "selector": {"jobset.sigs.k8s.io/jobset-name": name},
                          "ports": [{"name": "coordinator", "port": COORDINATOR_PORT}]}})
    env = _worker_env(opts, run_id, secret)
    worker = {"name": "worker", "image": opts.image, "command": ["msjax-train", *train_flags, "--resume"],
              "env": env, "resources": _resources(opts),
              "ports": [{"containerPort": COORDINATOR_PORT, "name": "coordinator"}]}
    if opts.workdir:
        worker["workingDir"] = opts.workdir
    pod: dict = {"restartPolicy": "Never", "subdomain": name, "terminationGracePeriodSeconds": 120,
                 "containers": [worker]}
    if opts.accelerator == "tpu":
        pod["nodeSelector"] = {"cloud.google.com/gke-tpu-accelerator": opts.tpu_type,
                               "cloud.google.com/gke-tpu-topology": opts.tpu_topology}
    max_restarts = opts.max_restarts
    if cfg is not None:
        _supervise_pod(pod, worker, cfg)
        max_restarts = cfg.supervisor.restart_budget
    job_spec = {
        "parallelism": n, "completions": n, "backoffLimit": 0, "completionMode": "Indexed",
        # stopped, resumable: fail the Job with reason PodFailurePolicy (the JobSet rule below) at once
        "podFailurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": {
            "containerName": "worker", "operator": "In", "values": [EXIT_REQUESTED, *STOPPED_EXITS]}}]},
        "template": {"metadata": {"labels": labels}, "spec": pod}}
    docs.append({
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {
            "failurePolicy": {"maxRestarts": max_restarts, "rules": [{
                "name": "stopped_resumable", "action": "RestartJobSetAndIgnoreMaxRestarts",
                "onJobFailureReasons": ["PodFailurePolicy"]}]},
            "network": {"enableDNSHostnames": True, "subdomain": name},
            "replicatedJobs": [{"name": "workers", "replicas": 1, "template": {"spec": job_spec}}],
        },
    })
    if cfg is not None:
        docs.insert(len(docs) - 1, _controller_job(name, ns, labels, worker, env, n, run_id, opts, train_flags))
    return docs


def _worker_env(opts: LaunchOptions, run_id: str, secret: str) -> list[dict]:
    name, ns = opts.name, opts.namespace
    env = [
        {"name": "JOB_INDEX", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
        {"name": "MSJAX_REDIS_URL", "value": f"redis://{name}-redis.{ns}.svc.cluster.local:{REDIS_PORT}/0"},
        {"name": "MSJAX_REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {"name": secret, "key": "password"}}},
        {"name": "MSJAX_RUN_ID", "value": run_id},
        {"name": "MSJAX_NUM_PROCESSES", "value": str(opts.num_processes)},
        {"name": "MSJAX_WORKER_ID", "value": "node-$(JOB_INDEX)"},
        {"name": "MSJAX_RANK", "value": "$(JOB_INDEX)"},  # pod 0 is rank 0: the coordinator the Service names
        {"name": "MSJAX_HOST", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "MSJAX_ADVERTISE_HOST", "value": f"{name}-workers-0-$(JOB_INDEX).{name}"},
        {"name": "MSJAX_COORDINATOR_PORT", "value": str(COORDINATOR_PORT)},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    if opts.accelerator == "none":
        env.append({"name": "XLA_FLAGS",
                    "value": f"--xla_force_host_platform_device_count={opts.devices_per_process}"})
    return env


def _resources(opts: LaunchOptions) -> dict:
    resources: dict = {"requests": {"cpu": str(opts.cpus_per_process), "memory": opts.memory_per_process},
                       "limits": {"memory": opts.memory_per_process}}
    device = {"gpu": "nvidia.com/gpu", "tpu": "google.com/tpu"}.get(opts.accelerator)
    if device:
        # a quantity is a string in the API's schema (the API server also parses a bare number)
        resources["limits"][device] = resources["requests"][device] = str(opts.devices_per_process)
    return resources


def _supervise_pod(pod: dict, worker: dict, cfg: Config) -> None:
    """A worker pod under the supervisor: the liveness probe, the self-checks as an initContainer, and the node
    affinity that keeps it off excluded nodes."""
    s = cfg.supervisor
    worker["livenessProbe"] = {
        "exec": {"command": PROBE},
        # no verdict before a worker could have sent its first heartbeat
        "initialDelaySeconds": int(math.ceil(s.startup_timeout_s)),
        "periodSeconds": max(1, int(math.ceil(s.heartbeat_period_s))),
        "timeoutSeconds": 10, "failureThreshold": 1,
    }
    checks = Checks(s.diagnose_timeout_s, s.diag_min_matmul_flops, s.health_check)
    init = {"name": "diagnostics", "image": worker["image"],
            "command": command(checks, "$(MSJAX_HOST)", 0, 1, python="python", fail_exit=True),
            # a failing node is reported to the controller through Redis
            "env": [e for e in worker["env"] if e["name"] in ("MSJAX_HOST", *_REDIS_ENV)],
            "resources": worker["resources"]}
    if "workingDir" in worker:
        init["workingDir"] = worker["workingDir"]
    pod["initContainers"] = [init]
    # Excluded nodes carry EXCLUDE_LABEL (the controller says which); pods require its absence.
    pod["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": EXCLUDE_LABEL, "operator": "DoesNotExist"}]}]}}}


def _controller_job(name: str, ns: str, labels: dict, worker: dict, env: list[dict], num_workers: int,
                    run_id: str, opts: LaunchOptions, train_flags: Sequence[str]) -> dict:
    """The supervisor as a one-pod batch Job beside the JobSet. A Job, not a Deployment: the controller ends when
    the run does (0 finished, 4 budget spent), and a Deployment would start it again. Not restarted if it crashes
    (backoffLimit 0): the JobSet, its failure policy and the liveness probes go on healing crashes and hangs
    without it."""
    labels = {**labels, "app.kubernetes.io/component": "supervisor"}
    container = {
        "name": "supervisor", "image": worker["image"],
        "command": ["msjax-supervise", "--backend=k8s", f"--num_processes={num_workers}", f"--run_id={run_id}",
                    *opts.flags("devices_per_process", "accelerator", "device_kind"), "--", *train_flags],
        "env": [*[e for e in env if e["name"] in _REDIS_ENV], {"name": "PYTHONUNBUFFERED", "value": "1"}],
        "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "4Gi"}},
    }
    if "workingDir" in worker:
        container["workingDir"] = worker["workingDir"]
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": f"{name}-supervisor", "namespace": ns, "labels": labels},
            "spec": {"backoffLimit": 0, "template": {"metadata": {"labels": dict(labels)}, "spec": {
                "restartPolicy": "Never", "containers": [container]}}}}


# -- the supervisor's backend ------------------------------------------------------------------------------------

class _Pod:
    """A JobSet worker as the supervisor sees it: no exit code (the kubelet has it, not us), no pid."""

    pid = None

    @staticmethod
    def poll() -> None:
        return None


class JobSetBackend(WorkerBackend):
    """Workers started and restarted by a JobSet (see the module docstring).

    Args:
      store: the run's msjax.control.store.Store (heartbeats and boot tokens are read there, exit requests
        written there).
      poll_s: how often `stop` looks whether the workers have gone.
    """

    def __init__(self, store, poll_s: float = 0.5):
        self.store, self.poll_s = store, poll_s

    def launch(self, attempt: int, hosts: Sequence[str], overrides: dict, resume: bool, redis_url: str,
               run_id: str) -> list[Worker]:
        """Starts nothing (the JobSet starts the pods); returns one Worker per rank, its node learnt from its
        heartbeat. Raises ValueError for overrides: a JobSet's pods all run the manifest's one command."""
        if overrides:
            raise ValueError(f"a JobSet's workers run the manifest's command; overrides {overrides} cannot reach "
                             "them (re-planning is not done on Kubernetes)")
        now = time.time()
        return [Worker(rank, host, _Pod(), now, Path("/dev/null")) for rank, host in enumerate(hosts)]

    def stop(self, workers: Sequence[Worker], grace_s: float) -> dict:
        """Asks every worker with a live heartbeat to leave (the JobSet then restarts the job) and waits up to
        `grace_s` for their heartbeats to go. Returns {"terminated": gone, "killed": still beating (their
        livenessProbe ends them)}."""
        ranks = [w.rank for w in workers]
        boots = {r: hb.get("boot") for r, hb in self.store.heartbeats(ranks).items() if hb.get("boot")}
        self.store.request_exit(boots.values(), "the supervisor restarts the job through the JobSet")
        deadline = time.monotonic() + grace_s
        left = dict(boots)
        while left and time.monotonic() < deadline:
            beats = self.store.heartbeats(list(left))
            left = {r: b for r, b in left.items() if r in beats and beats[r].get("boot") == b}
            if left:
                time.sleep(self.poll_s)
        return {"terminated": len(boots) - len(left), "killed": len(left)}

    @staticmethod
    def diagnose(hosts: Sequence[str], checks: Checks) -> None:
        """None: the self-checks run in every pod's initContainer, not on demand."""
        return None

    @staticmethod
    def exclusion_note(host: str) -> str:
        """What keeps the JobSet's pods off `host` (the manifest's nodeAffinity requires the label's absence)."""
        return f"kubectl label node {host} {EXCLUDE_LABEL}=true"
