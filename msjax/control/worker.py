"""A worker's side of the control plane: join the run through Redis, start `jax.distributed`, hand the loop a hook.

The launcher (local, Kubernetes or SLURM; `msjax.launch`) sets, per worker:

  MSJAX_REDIS_URL          redis://:PASSWORD@HOST:PORT/DB (rediss:// for TLS)        required
  MSJAX_REDIS_PASSWORD     overrides the URL's password (e.g. from a Kubernetes Secret) optional
  MSJAX_REDIS_CA_CERT, MSJAX_REDIS_CERT, MSJAX_REDIS_KEY: TLS files for redis-py        optional
  MSJAX_RUN_ID             the run's id (keys live under msjax:{run_id})               required
  MSJAX_NUM_PROCESSES      world size; 1 (the default) skips the rendezvous and jax.distributed
  MSJAX_WORKER_ID          stable identity across restarts (default: host name + a launcher's task index)
  MSJAX_ADVERTISE_HOST     the host name or address other workers reach this one on (default: host name)
  MSJAX_COORDINATOR_PORT   port for JAX's coordinator if this worker becomes rank 0 (default: a free port)
  MSJAX_RANK               this worker's rank, fixed by the launcher (its own worker index, SLURM_PROCID, a Job's
                           completion index), so that the launcher's, the supervisor's, the control plane's and
                           `jax.process_index()`'s numbering is one; unset: ranks by arrival order. Rank 0 hosts
                           JAX's coordinator.
  MSJAX_HOST               the name of the host this worker runs on, as the launcher knows it (a SLURM node, a
                           supervisor's host slot; default: the machine's host name)
  MSJAX_RDZV_TIMEOUT_S     how long the rendezvous waits for every worker (default 300)

The train command (msjax.train.main) calls `join_from_env()` when MSJAX_REDIS_URL is set and hands
`ControlPlaneHook(worker, ...)` (msjax.control.hook) to the loop.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from dataclasses import dataclass

from msjax.control.errors import ControlError
from msjax.control.rendezvous import Assignment

log = logging.getLogger(__name__)


@dataclass
class WorkerContext:
    """This process's membership of a run.

    Attributes:
      store: the run's msjax.control.store.Store.
      assignment: what the rendezvous gave it (rank, world size, coordinator, generation).
      commands_after: the command stream id current when it joined: older commands are not for it.
      worker_id: its stable identity across restarts.
      host: the host it runs on, as the launcher names it (MSJAX_HOST).
    """

    store: object
    assignment: Assignment
    commands_after: str
    worker_id: str = ""
    host: str = ""


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ControlError(f"{name}={raw!r}: must be an integer") from None


def _default_worker_id() -> str:
    for var in ("JOB_COMPLETION_INDEX", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        if os.environ.get(var):
            return f"{socket.gethostname()}/{var.lower()}={os.environ[var]}"
    return socket.gethostname()


def join_from_env() -> WorkerContext:
    """Connects to MSJAX_REDIS_URL, joins the rendezvous, and calls `jax.distributed.initialize` (world size > 1).

    Prints one line `msjax.control: rank R of N ...`.
    Returns the WorkerContext.
    Raises ControlError for a missing variable or unreachable Redis, RendezvousError for a late/duplicate worker,
    a world-size mismatch or a timeout."""
    from msjax.control import phases
    from msjax.control.rendezvous import rendezvous
    from msjax.control.server import free_port
    from msjax.control.store import Store, env_connect

    run_id = os.environ.get("MSJAX_RUN_ID")
    if not run_id:
        raise ControlError("MSJAX_REDIS_URL is set but MSJAX_RUN_ID is not: the launcher sets both")
    world = _env_int("MSJAX_NUM_PROCESSES", 1)
    if world < 1:
        raise ControlError(f"MSJAX_NUM_PROCESSES={world}: must be >= 1")
    timeout_s = float(_env_int("MSJAX_RDZV_TIMEOUT_S", 300))
    worker_id = os.environ.get("MSJAX_WORKER_ID") or _default_worker_id()
    host = os.environ.get("MSJAX_ADVERTISE_HOST") or socket.gethostname()
    port = _env_int("MSJAX_COORDINATOR_PORT", 0) or free_port("")
    store = Store(env_connect(), run_id)
    last = store.client.xrevrange(store.key("cmd"), count=1)
    commands_after = last[0][0] if last else "0-0"
    member = {"host": socket.gethostname(), "pid": os.getpid()}
    if world == 1:
        assignment = Assignment(rank=0, world_size=1, coordinator=f"{host}:{port}",
                                generation=store.restart_count())
        store.client.hset(store.key("members"), 0, json.dumps({"worker_id": worker_id, **member}))
    else:
        requested = _env_int("MSJAX_RANK", 0) if os.environ.get("MSJAX_RANK") else None
        assignment = rendezvous(store.client, run_id, worker_id, world, f"{host}:{port}", member, timeout_s,
                                requested_rank=requested)
    phases.mark("rendezvous")
    log.info(f"msjax.control: rank {assignment.rank} of {assignment.world_size} (worker {worker_id}, pid "
             f"{os.getpid()}, run {run_id}, generation {assignment.generation}, coordinator {assignment.coordinator}"
             f"{', re-admitted' if assignment.rejoined else ''})")
    store.post_event("joined", rank=assignment.rank, worker_id=worker_id, generation=assignment.generation)
    if world > 1:
        import jax

        jax.distributed.initialize(coordinator_address=assignment.coordinator, num_processes=world,
                                   process_id=assignment.rank, initialization_timeout=int(timeout_s))
        phases.mark("distributed")
    return WorkerContext(store=store, assignment=assignment, commands_after=commands_after, worker_id=worker_id,
                         host=os.environ.get("MSJAX_HOST") or socket.gethostname())
