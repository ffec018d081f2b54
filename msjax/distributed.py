"""Joining JAX's multi-controller runtime (`jax.distributed`) when this process is one of several.

msjax does not launch processes itself: SLURM (`srun`), Kubernetes (JobSet / indexed Jobs) or Open MPI start
one process per host, and JAX's own cluster detection reads their environment. For launchers it does not know
(or a local multi-process test), set JAX_COORDINATOR_ADDRESS=host:port, JAX_NUM_PROCESSES and JAX_PROCESS_ID.
"""

from __future__ import annotations

import os

import jax

_LAUNCHER_SIZE_VARS = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")


def initialize() -> bool:
    """Calls `jax.distributed.initialize` when a multi-process launch is detected; returns whether it did.

    A plain single process (no launcher variables) is left alone, so the same entry point serves a laptop and a
    cluster. Raises ValueError when JAX_COORDINATOR_ADDRESS is set without JAX_NUM_PROCESSES/JAX_PROCESS_ID.
    """
    if jax.distributed.is_initialized():
        return True
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
