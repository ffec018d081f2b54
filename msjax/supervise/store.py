"""Where the supervisor's heartbeats, reports and events travel: the control plane's Redis (msjax.control).

Keys, under the run's namespace next to the control plane's own (`msjax.control.store`):

  msjax:{run}:sup:hb:{slot}   the newest heartbeat, JSON {seq, step, start_step, time, pid, host, state}, expiring
                              after the TTL; `slot` is the worker's place in the supervisor's host list, which
                              stays fixed across restarts (the rendezvous rank need not).
  msjax:{run}:sup:reports     a list of worker reports, JSON {rank, kind, step, ...} (e.g. a non-finite loss).
  msjax:{run}:sup:restart     a set of worker boot tokens (each worker process's own random id, in its heartbeat)
                              the supervisor wants gone: a listed worker exits with RESTART_EXIT_CODE at its next
                              heartbeat (how a Kubernetes controller without the API restarts a JobSet).

The supervisor's events go to the control plane's event stream (`Store.post_event`), excluded hosts to its
`excluded` set, restarts to its restart count (the rendezvous generation).

Why separate heartbeat keys from the control-plane hook's `hb:{rank}`: the supervisor needs, beside the step, the
step the worker resumed from and whether its loop is over (a worker past its loop sits in jax.distributed's
shutdown barrier without stepping), with its own period and TTL (`supervisor.*`); one SET per period is cheap.
"""

from __future__ import annotations

import json
import time

# A worker asked to restart exits with this (EX_TEMPFAIL): non-zero, so a JobSet's failurePolicy restarts the job.
RESTART_EXIT_CODE = 75


def _key(run_id: str, *parts: str | int) -> str:
    return ":".join(["msjax", run_id, "sup", *map(str, parts)])


class HeartbeatStore:
    """Heartbeats and reports of one run in Redis.

    Args:
      client: a redis-py client with decode_responses=True (`msjax.control.store.connect`).
      run_id: the run's namespace.
    """

    def __init__(self, client, run_id: str):
        self.client, self.run_id = client, run_id

    @classmethod
    def from_url(cls, url: str, run_id: str, timeout_s: float = 5.0) -> "HeartbeatStore":
        """Connects through the control plane's `connect` (password handling, bounded retries).

        Raises msjax.control.ControlError for a malformed URL, an unreachable server or a refused password."""
        import os

        from msjax.control.store import connect

        # MSJAX_REDIS_PASSWORD: the cluster specs pass the password apart from the URL (a Secret, a job variable)
        return cls(connect(url, password=os.environ.get("MSJAX_REDIS_PASSWORD") or None, socket_timeout_s=timeout_s,
                           retries=3), run_id)

    # Worker side ------------------------------------------------------------------------------------------------
    def beat(self, slot: int, payload: dict, ttl_s: float) -> None:
        """Sets the slot's heartbeat to `payload` (JSON-serialisable), expiring after `ttl_s` seconds."""
        self.client.set(_key(self.run_id, "hb", slot), json.dumps(payload), px=max(1, int(ttl_s * 1000)))

    def report(self, slot: int, kind: str, **fields) -> None:
        """Appends a report {rank: slot, kind, time, **fields} to the run's report list."""
        self.client.rpush(_key(self.run_id, "reports"),
                          json.dumps({"rank": slot, "kind": kind, "time": time.time(), **fields}))

    def restart_requested(self, boot: str) -> bool:
        """Whether the supervisor asked the worker process `boot` to exit (`request_restart`)."""
        return bool(self.client.sismember(_key(self.run_id, "restart"), boot))

    # Supervisor side --------------------------------------------------------------------------------------------
    def request_restart(self, boots, ttl_s: float = 3600.0) -> None:
        """Asks the worker processes with these boot tokens to exit with RESTART_EXIT_CODE (the set expires after
        `ttl_s`, long after they are gone)."""
        boots = [b for b in boots if b]
        if boots:
            key = _key(self.run_id, "restart")
            self.client.sadd(key, *boots)
            self.client.expire(key, int(ttl_s))

    def heartbeats(self, slots) -> dict[int, dict]:
        """{slot: newest heartbeat} for the slots whose heartbeat has not expired (one MGET)."""
        slots = list(slots)
        if not slots:
            return {}
        values = self.client.mget([_key(self.run_id, "hb", r) for r in slots])
        return {r: json.loads(v) for r, v in zip(slots, values) if v is not None}

    def reports(self, start: int = 0) -> list[dict]:
        """Reports from index `start` on (keep the count you have read and pass it next time)."""
        return [json.loads(v) for v in self.client.lrange(_key(self.run_id, "reports"), start, -1)]

    def clear_heartbeats(self, slots) -> None:
        """Deletes the heartbeats of `slots` (between attempts, so old beats are not taken for new ones)."""
        slots = list(slots)
        if slots:
            self.client.delete(*[_key(self.run_id, "hb", r) for r in slots])

    def close(self) -> None:
        self.client.close()
