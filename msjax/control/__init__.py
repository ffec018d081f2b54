"""The control plane, transport only: a real Redis server, the run state kept in it, rendezvous, the command channel,
the one worker heartbeat. It decides nothing: launching (msjax.launch) and supervision (msjax.supervise) sit on
top of it and use it; it imports neither.

MegaScale (Jiang et al., NSDI'24, sec. 4.1) cut job start-up at 2,048 GPUs from 1,047 s to under 5 s by replacing
torch's TCPStore with Redis and removing O(n^2) barriers. This package owns that part of msjax:

  server.py      `RedisServer`: starts a private, password-protected redis-server on loopback and always stops it.
  store.py       `Store`: run state under keys namespaced by run id (members, newest checkpoint per tier,
                 restart count, excluded hosts, events, the heartbeats with a TTL, worker reports, exit requests,
                 the command stream), through redis-py with bounded reconnect backoff. `connect(url)` is the one
                 way in.
  rendezvous.py  the rendezvous protocol, written once as a generator of Redis commands (sans-IO) and executed
                 by redis-py (real workers) or by the start-up benchmark's minimal asyncio client
                 (`scripts/bench_init.py`, thousands of simulated workers): O(1) round trips per worker.
  worker.py      what a worker process does: rendezvous from MSJAX_* variables, then `jax.distributed.initialize`.
  hook.py        `ControlPlaneHook`: the loop's side (the one heartbeat, exit requests, reports, the command
                 channel -> LoopControl).
  metrics.py     per-rank metric rows into a Redis stream.
  phases.py      start-up phase marks a worker's heartbeat carries.
  probe.py       `python -m msjax.control.probe`: a Kubernetes liveness probe reading the heartbeat.

A single-process run without MSJAX_REDIS_URL imports nothing from here that needs Redis and runs unchanged.
"""

from msjax.control.errors import ControlError, RendezvousError

__all__ = ["ControlError", "RendezvousError"]
