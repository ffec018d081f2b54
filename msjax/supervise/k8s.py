"""The supervisor's Kubernetes backend: a controller that watches a JobSet's workers and restarts them through
the JobSet itself, with no Kubernetes API access (no client library, no RBAC beyond the pod's own).

The manifest (msjax.supervise.cluster.supervise_k8s) adds a Deployment NAME-supervisor running
`python -m msjax.supervise --backend=k8s --hosts=N ...` beside Redis. Then:

  start    the JobSet starts the pods (the controller starts nothing); a worker's heartbeat names its node.
  watch    the same detection as everywhere (msjax.supervise.detect): missed heartbeats (a hang, SIGSTOP, a dead
           pod), a stalled step, a non-finite loss, no heartbeat within supervisor.startup_timeout_s; and a slot
           whose heartbeat comes from a new process (the JobSet restarted the job by itself after a pod failed).
  stop     the controller puts the workers' boot tokens in Redis (HeartbeatStore.request_restart); each worker's
           heartbeat thread sees its own and exits with RESTART_EXIT_CODE at once, so its pod fails and the
           JobSet's failurePolicy (maxRestarts = supervisor.restart_budget) recreates every pod; the new workers
           resume from the newest verified checkpoint (their command carries --resume). A worker too hung to
           exit is killed by its livenessProbe (an expired heartbeat).
  diagnose the self-checks run in each pod's initContainer, on every (re)start; a node that fails is recorded
           in Redis (the control plane's excluded set) and its pod fails. The controller reports it with the
           label that keeps the JobSet off it (`kubectl label node NODE msjax.dev/excluded=true`: the pods
           require that label's absence through nodeAffinity).
Not on Kubernetes: re-planning onto fewer nodes (the JobSet's size is fixed; a spare node pool does the job of
spares), running the self-checks on demand (they run at every pod start instead), and fault injection.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

from msjax.supervise.store import HeartbeatStore
from msjax.supervise.supervisor import Worker

EXCLUDE_LABEL = "msjax.dev/excluded"


class _Pod:
    """A JobSet worker as the supervisor sees it: no exit code (the kubelet has it, not us), no pid."""

    pid = None

    @staticmethod
    def poll() -> None:
        return None


class JobSetBackend:
    """Workers started and restarted by a JobSet (see the module docstring).

    Args:
      store: the run's heartbeats (the controller reads the boot tokens there and asks for restarts there).
      poll_s: how often `stop` looks whether the workers have gone.
    """

    def __init__(self, store: HeartbeatStore, poll_s: float = 0.5):
        self.store, self.poll_s = store, poll_s

    def launch(self, attempt: int, hosts: Sequence[str], overrides: dict, resume: bool, redis_url: str,
               run_id: str) -> list[Worker]:
        """Starts nothing (the JobSet starts the pods); returns one Worker per slot, its node learnt from its
        heartbeat. Raises ValueError for overrides: a JobSet's pods all run the manifest's one command."""
        if overrides:
            raise ValueError(f"a JobSet's workers run the manifest's command; overrides {overrides} cannot reach "
                             "them (re-planning is not done on Kubernetes)")
        now = time.time()
        return [Worker(rank, host, _Pod(), now, Path("/dev/null")) for rank, host in enumerate(hosts)]

    def stop(self, workers: Sequence[Worker], grace_s: float) -> dict:
        """Asks every worker with a live heartbeat to exit (the JobSet then restarts the job) and waits up to
        `grace_s` for their heartbeats to go. Returns {"terminated": gone, "killed": still beating (their
        livenessProbe ends them)}."""
        slots = [w.rank for w in workers]
        boots = {r: hb.get("boot") for r, hb in self.store.heartbeats(slots).items() if hb.get("boot")}
        self.store.request_restart(boots.values())
        deadline = time.monotonic() + grace_s
        left = dict(boots)
        while left and time.monotonic() < deadline:
            beats = self.store.heartbeats(list(left))
            left = {r: b for r, b in left.items() if r in beats and beats[r].get("boot") == b}
            if left:
                time.sleep(self.poll_s)
        return {"terminated": len(boots) - len(left), "killed": len(left)}

    @staticmethod
    def diagnose(hosts: Sequence[str], timeout_s: float, min_flops: float, failing: Sequence[str] = ()) -> None:
        """None: the self-checks run in every pod's initContainer, not on demand."""
        return None

    @staticmethod
    def inject(worker: Worker, sig: int, pid: int | None) -> None:
        raise ValueError("fault injection is not available under --backend=k8s (use kubectl exec ... kill)")

    @staticmethod
    def exclusion_note(host: str) -> str:
        """What keeps the JobSet's pods off `host` (the manifest's nodeAffinity requires the label's absence)."""
        return f"kubectl label node {host} {EXCLUDE_LABEL}=true"
