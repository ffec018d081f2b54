"""Rendezvous through Redis in O(1) round trips per worker, written once and run by any client.

The protocol (one definition, `join_protocol`) is a generator that yields Redis commands and receives their replies
(the "sans-IO" style): `rendezvous()` runs it with redis-py for real workers, and `scripts/bench_init.py` runs
the very same generator with a minimal asyncio client for thousands of simulated workers.

Per worker, after connecting (and AUTH):
  1. One EVAL of `JOIN_SCRIPT` (atomic in Redis): read the generation (restart count), INCR the arrival count of
     that generation, so rank = count - 1 (or the rank the launcher fixed, below); record the member; rank 0's
     proposed address becomes the coordinator;
     the last arriver (count == world size) XADDs one entry {coordinator, world_size, generation} to the
     generation's `done` stream.
  2. One XREAD BLOCK on that stream from id 0: it returns at once if the entry is there, else when the last worker
     adds it: one entry wakes every waiter (BLPOP would wake one).
Then `jax.distributed.initialize(coordinator, world_size, rank)`. No all-pairs key exchange and no barrier beyond
JAX's own: Redis serves O(n) commands in all, against the O(n) polls per round (O(n^2) in all) of a counter
barrier (MegaScale sec. 4.1; PyTorch issue 124982).

Ranks by arrival or fixed by the launcher. A launcher that numbers its tasks (SLURM's SLURM_PROCID, in node order
of the allocation; a Kubernetes Indexed Job's completion index) may pass that number as the rank
(`requested_rank`, env MSJAX_RANK): rank 0, and so JAX's coordinator, is then the first node of the allocation (or
pod 0, which the headless Service names), as `jax.distributed`'s own SLURM detection does, and a worker's rank is
the same in every generation. A generation is either all fixed or all by arrival (the first arriver decides).

Outcomes for a worker that does not fit (each a RendezvousError naming run, generation and worker):
  - late: the generation already has `world_size` members and this worker id is not one of them. A job that is
    restarted must start a new generation (`Store.bump_restarts()`), which every worker then joins afresh.
  - duplicate: this worker id already joined the generation and the generation is complete. JAX cannot re-admit
    one process into a running coordination service, so the job must restart (new generation).
  - re-admission: this worker id already joined but the generation is still forming (it crashed and came back
    before the others arrived): it gets its old rank again and the count is not incremented.
  - world size mismatch: a worker expects a different world size than the first arriver recorded.
  - timeout: the blocking wait ended before the last member arrived; the message says how many had arrived.
  - fixed ranks: a requested rank outside [0, world size), one another worker already holds, or a generation
    mixing requested and arrival-order ranks.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable, Generator

from msjax.control.errors import RendezvousError

# KEYS[1] = run prefix ("msjax:RUN"); ARGV = worker_id, world_size, proposed coordinator address, member JSON,
# requested rank (-1: by arrival). Sub-keys are built from the prefix inside the script: fine on one Redis (not on
# Redis Cluster, which needs every key in KEYS).
JOIN_SCRIPT = """
local p = KEYS[1]
local gen = tonumber(redis.call('GET', p .. ':restarts') or '0')
local g = p .. ':g' .. gen
local world = tonumber(ARGV[2])
local want = tonumber(ARGV[5])
local mode = (want >= 0) and 'fixed' or 'arrival'
local recorded = tonumber(redis.call('GET', g .. ':world') or '0')
if recorded == 0 then
  redis.call('SET', g .. ':world', world)
  redis.call('SET', g .. ':mode', mode)
elseif recorded ~= world then
  return {'mismatch', gen, -1, recorded}
elseif redis.call('GET', g .. ':mode') ~= mode then
  return {'mixed', gen, want, 0}
end
local count = tonumber(redis.call('GET', g .. ':count') or '0')
local known = redis.call('HGET', g .. ':ids', ARGV[1])
local rank
if known then
  if count >= world then return {'duplicate', gen, tonumber(known), count} end
  rank = tonumber(known)
  if want >= 0 and want ~= rank then return {'taken', gen, want, rank} end
else
  if count >= world then return {'late', gen, -1, count} end
  if want >= world then return {'out_of_range', gen, want, world} end
  if want >= 0 then
    local holder = redis.call('HGET', g .. ':ranks', want)
    if holder then return {'taken', gen, want, -1, holder} end
    rank = want
  end
  count = redis.call('INCR', g .. ':count')
  if want < 0 then rank = count - 1 end
  redis.call('HSET', g .. ':ids', ARGV[1], rank)
  redis.call('HSET', g .. ':ranks', rank, ARGV[1])
end
if rank == 0 then redis.call('SET', g .. ':coord', ARGV[3]) end
redis.call('HSET', p .. ':members', rank, ARGV[4])
if count == world and not known then
  redis.call('XADD', g .. ':done', '*', 'coordinator', redis.call('GET', g .. ':coord'), 'world_size', world,
             'generation', gen)
end
if known then return {'rejoined', gen, rank, count} end
return {'joined', gen, rank, count}
"""


@dataclass(frozen=True)
class Assignment:
    """What a worker got from the rendezvous.

    rank: its process id in [0, world_size). world_size: number of processes. coordinator: "host:port" of rank
    0's JAX coordination service. generation: the restart count the rendezvous belongs to. rejoined: it was
    re-admitted with its old rank.
    """

    rank: int
    world_size: int
    coordinator: str
    generation: int
    rejoined: bool = False


Command = tuple  # the arguments of one Redis command, e.g. ("XREAD", "BLOCK", 1000, "STREAMS", key, "0-0")


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, (bytes, bytearray)) else str(x)


def _entry_fields(reply: Any) -> dict[str, str]:
    """The field dict of the first entry of an XREAD reply, raw RESP ([[key, [[id, [k, v, ...]]]]]) or as redis-py
    parses it ([[key, [(id, {k: v})]]]); empty when the reply is nil (the wait timed out)."""
    if not reply:
        return {}
    entries = reply[0][1]
    fields = entries[0][1]
    if isinstance(fields, dict):
        return {_text(k): _text(v) for k, v in fields.items()}
    return {_text(fields[i]): _text(fields[i + 1]) for i in range(0, len(fields), 2)}


def join_protocol(run_id: str, worker_id: str, world_size: int, address: str, member: dict | None = None,
                  timeout_s: float = 300.0, requested_rank: int | None = None
                  ) -> Generator[Command, Any, Assignment]:
    """The rendezvous of one worker, as a generator of Redis commands: send it each command's reply.

    Args:
      run_id: the run (keys live under msjax:{run_id}).
      worker_id: stable identity of this worker across restarts (host name, pod or task index).
      world_size: number of processes expected.
      address: "host:port" this worker would serve the JAX coordinator on if it becomes rank 0.
      member: extra JSON fields recorded in the members hash (host, pid, ...).
      timeout_s: how long the one blocking wait lasts.
      requested_rank: the rank the launcher fixed for this worker (its task index), or None for arrival order.

    Returns (as the generator's value): an Assignment.
    Raises: RendezvousError for a late or duplicate worker, a world-size mismatch, a timeout, or a requested rank
      that is out of range, held by another worker, or mixed with arrival-order workers in one generation.
    """
    if world_size < 1:
        raise RendezvousError(f"world size {world_size}: must be >= 1")
    if requested_rank is not None and requested_rank < 0:
        raise RendezvousError(f"worker {worker_id!r}: requested rank {requested_rank} must be >= 0")
    prefix = f"msjax:{run_id}"
    record = json.dumps({"worker_id": worker_id, "address": address, "joined_at": time.time(), **(member or {})})
    want = -1 if requested_rank is None else requested_rank
    status, gen, rank, count, *holder = (yield ("EVAL", JOIN_SCRIPT, 1, prefix, worker_id, world_size, address,
                                                record, want))
    status, gen, rank, count = _text(status), int(gen), int(rank), int(count)
    where = f"run {run_id!r} generation {gen}"
    if status == "out_of_range":
        raise RendezvousError(f"worker {worker_id!r} requested rank {rank}, outside [0, {count}) for {where}")
    if status == "taken":
        other = f"worker {_text(holder[0])!r}" if holder else f"this worker's rank {count}"
        raise RendezvousError(f"worker {worker_id!r} requested rank {rank} in {where}, already held by {other}: "
                              "each launcher task index (MSJAX_RANK) must be unique and stable")
    if status == "mixed":
        how = f"requested rank {want}" if want >= 0 else "joined by arrival order"
        raise RendezvousError(f"worker {worker_id!r} {how}, but {where} was started the other way: either every "
                              "worker sets MSJAX_RANK or none does")
    if status == "mismatch":
        raise RendezvousError(f"worker {worker_id!r} expects {world_size} processes but {where} was started with "
                              f"{count}: every worker must be given the same world size")
    if status == "late":
        raise RendezvousError(f"worker {worker_id!r} arrived late: {where} is already complete with {count} of "
                              f"{world_size} members. A restarted job must start a new generation "
                              "(Store.bump_restarts) so that every worker joins afresh")
    if status == "duplicate":
        raise RendezvousError(f"worker {worker_id!r} already joined {where} as rank {rank} and the generation is "
                              "complete: a restarted worker cannot rejoin a running JAX job; restart the job "
                              "(Store.bump_restarts) so that every worker joins a new generation")
    done_key = f"{prefix}:g{gen}:done"
    reply = yield ("XREAD", "BLOCK", max(1, int(timeout_s * 1000)), "STREAMS", done_key, "0-0")
    fields = _entry_fields(reply)
    if not fields:
        arrived = yield ("GET", f"{prefix}:g{gen}:count")
        raise RendezvousError(f"worker {worker_id!r} (rank {rank}) timed out after {timeout_s:g} s waiting for "
                              f"all {world_size} members of {where}: {int(arrived or 0)} had arrived")
    return Assignment(rank=rank, world_size=int(fields["world_size"]), coordinator=fields["coordinator"],
                      generation=gen, rejoined=status == "rejoined")


def run_protocol(gen: Generator[Command, Any, Any], execute: Callable[..., Any]) -> Any:
    """Drives a protocol generator with a synchronous `execute(*command) -> reply`; returns its value."""
    reply = None
    try:
        while True:
            reply = execute(*gen.send(reply))
    except StopIteration as stop:
        return stop.value


def rendezvous(client, run_id: str, worker_id: str, world_size: int, address: str, member: dict | None = None,
               timeout_s: float = 300.0, requested_rank: int | None = None) -> Assignment:
    """Joins the run through a redis-py client (see `join_protocol` for arguments, result and errors).

    The blocking XREAD needs a socket timeout longer than the wait, so the command runs on a connection whose
    timeout is `timeout_s + 10` s."""
    import redis

    kwargs = dict(client.connection_pool.connection_kwargs)
    kwargs["socket_timeout"] = timeout_s + 10.0
    waiter = redis.Redis(connection_pool=redis.ConnectionPool(connection_class=client.connection_pool.connection_class,
                                                              max_connections=1, **kwargs))
    try:
        # execute_command applies redis-py's reply parsing (XREAD -> dicts); _entry_fields accepts both forms.
        return run_protocol(join_protocol(run_id, worker_id, world_size, address, member, timeout_s,
                                          requested_rank), waiter.execute_command)
    finally:
        waiter.close()
