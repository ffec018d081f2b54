"""The control plane: a real Redis server, the run state kept in it, rendezvous, the command channel, launch specs.

MegaScale (Jiang et al., NSDI'24, sec. 4.1) cut job start-up at 2,048 GPUs from 1,047 s to under 5 s by replacing
torch's TCPStore with Redis and removing O(n^2) barriers. This package owns that part of msjax:

  server.py      `RedisServer`: starts a private, password-protected redis-server on loopback and always stops it.
  store.py       `Store`: run state under keys namespaced by run id (members, newest checkpoint per tier,
                 restart count, excluded hosts, events, heartbeats with a TTL, the command stream), through
                 redis-py with bounded reconnect backoff. `connect(url)` is the one way in.
  rendezvous.py  the rendezvous protocol, written once as a generator of Redis commands (sans-IO) and executed
                 by redis-py (real workers) or by the start-up benchmark's minimal asyncio client
                 (`scripts/bench_init.py`, thousands of simulated workers): O(1) round trips per worker.
  worker.py      what a worker process does: rendezvous from MSJAX_* variables, then `jax.distributed.initialize`.
  hook.py        `ControlPlaneHook`: the loop's side (heartbeats, command channel -> LoopControl).
  launch.py      `scripts/launch.py`: a private Redis + N local worker processes, or a cluster spec (specs.py).
  specs.py       launch specs: a Kubernetes JobSet manifest and a SLURM sbatch script, one pod/task per node.

A single-process run without MSJAX_REDIS_URL imports nothing from here that needs Redis and runs unchanged.
"""

from msjax.control.errors import ControlError, RendezvousError

__all__ = ["ControlError", "RendezvousError"]
