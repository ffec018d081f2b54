"""Joining JAX's multi-controller runtime (`jax.distributed`) when this process is one of several.

Three ways in, tried in this order:
  1. MSJAX_REDIS_URL set (msjax's own launcher, `scripts/launch.py`, for local processes, Kubernetes or SLURM):
     rendezvous through Redis in O(1) round trips per worker (`msjax.control.worker`), then initialize.
  2. JAX_COORDINATOR_ADDRESS=host:port with JAX_NUM_PROCESSES and JAX_PROCESS_ID, set by hand or by a launcher
     msjax does not know.
  3. SLURM (`srun`) or Open MPI variables: JAX's own cluster detection reads them.
A plain single process has none of them and is left alone (and imports nothing that needs Redis).
"""

from __future__ import annotations

import os

import jax

_LAUNCHER_SIZE_VARS = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")


def initialize() -> bool:
    """Calls `jax.distributed.initialize` when a multi-process launch is detected; returns whether it did.

    A plain single process (no launcher variables) is left alone, so the same entry point serves a laptop and a
    cluster. Raises ValueError when JAX_COORDINATOR_ADDRESS is set without JAX_NUM_PROCESSES/JAX_PROCESS_ID;
    msjax.control.ControlError / RendezvousError when the Redis rendezvous fails (unreachable, refused password,
    late or duplicate worker, timeout).
    """
    if jax.distributed.is_initialized():
        return True
    if os.environ.get("MSJAX_REDIS_URL"):
        from msjax.control.worker import join_from_env

        return join_from_env().assignment.world_size > 1
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        try:
            n, i = int(os.environ["JAX_NUM_PROCESSES"]), int(os.environ["JAX_PROCESS_ID"])
        except (KeyError, ValueError) as e:
            raise ValueError("JAX_COORDINATOR_ADDRESS is set: JAX_NUM_PROCESSES and JAX_PROCESS_ID must be "
                             f"integers too ({e})") from e
        jax.distributed.initialize(num_processes=n, process_id=i)
        return True
    if any(int(os.environ.get(v, "1")) > 1 for v in _LAUNCHER_SIZE_VARS):
        jax.distributed.initialize()  # JAX reads SLURM / Open MPI's environment itself
        return True
    return False
