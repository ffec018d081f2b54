"""Joining JAX's multi-controller runtime (`jax.distributed`) when this process is one of several.

msjax's own launchers (msjax.launch: local processes, Kubernetes, SLURM) set MSJAX_REDIS_URL: their workers join
through Redis in O(1) round trips per worker (`msjax.control.worker.join_from_env`, called by the train command,
msjax.train.main), which initializes jax.distributed itself. Otherwise `initialize` tries, in this order:
  1. JAX_COORDINATOR_ADDRESS=host:port with JAX_NUM_PROCESSES and JAX_PROCESS_ID, set by hand or by a launcher
     msjax does not know.
  2. SLURM (`srun`) or Open MPI variables: JAX's own cluster detection reads them.
A plain single process has none of them and is left alone (and imports nothing that needs Redis).
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


# How long a process waits at the first-step barrier for the others to finish compiling (seconds).
FIRST_STEP_BARRIER_TIMEOUT_S = 1800
_barriers = 0  # barrier ids must be unique within a jax.distributed session: one per run() call


def align_first_step(step_fn, *args, timeout_s: float = FIRST_STEP_BARRIER_TIMEOUT_S) -> None:
    """With several processes: compiles `step_fn` for `args` ahead of its first call, then waits until every
    process has, so that all of them enter the step's first collectives together.

    Why: each process compiles the step on its own, and their compile times differ (tens of seconds apart on a
    loaded host). CPU collectives (gloo) set up each communicator on first use and give up when a peer is more than
    30 s late ("Gloo context initialization failed: ... GetKeyValue() timed out ... 30 s", seen with 4 local
    workers on 2 loaded cores). The wait is the coordination service's barrier (no collective, so no such limit).
    The compiled program is jax's own cache entry: the step's first call then runs it without compiling again.

    Args:
      step_fn: the jitted step.
      args: its arguments, or jax.ShapeDtypeStruct with the same shapes, dtypes and shardings.
      timeout_s: the longest wait for the other processes (seconds).
    Raises:
      jax's error naming the barrier when a process does not arrive within `timeout_s`.
    """
    global _barriers
    if jax.process_count() == 1:
        return
    step_fn.lower(*args).compile()
    _barriers += 1
    # jax has no public barrier outside collectives; its distributed client's barrier is the coordination service's.
    from msjax.compat import jax_distributed

    jax_distributed.global_state.client.wait_at_barrier(f"msjax_first_step_compiled_{_barriers}",
                                                        int(timeout_s * 1000))
