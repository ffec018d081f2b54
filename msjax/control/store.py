"""Run state in Redis, through redis-py: the small, documented API the launcher, the loop and the supervisor share.

redis-py is the well-kept client (connection pool, TLS, RESP2/3, retry with backoff); we add only key names and
JSON values. Values are JSON, never pickle: any tool (redis-cli, a dashboard) can read them and nothing read from
the network is ever executed.

Keys, all under `msjax:{run_id}:` (a run id keeps concurrent runs on one Redis apart):

  restarts            int     restart count: the rendezvous generation (bumped by whoever restarts the job)
  members             hash    rank -> {"worker_id", "host", "pid", "generation", "joined_at"} (current generation)
  ckpt                hash    tier ("local", "persistent", ...) -> {"step", "path", "verified_at", ...}
  excluded            set     hosts the supervisor will not schedule on again
  events              stream  {"json": {"kind": ..., "time": ..., ...}}; trimmed to about 10,000 entries
  hb:{rank}           string  the worker's one heartbeat, with a TTL (an absent key is a dead or hung rank): {"seq",
                              "time", "pid", "host", "boot", "generation", "step", "start_step", "state", "phases"}
                              (msjax.control.hook); what the launcher, the supervisor and the liveness probe read
  reports             list    worker reports {"rank", "kind", "generation", "time", ...} (a non-finite loss), read
                              in order
  exit                hash    boot token -> reason: worker processes asked to leave at once (they print the reason
                              in one line and exit with EXIT_REQUESTED); expires an hour after the last request
  cmd                 stream  commands {"json": {"kind": "stop"|"checkpoint"|"profile", "generation", ...}}
  metrics             stream  per-step rows of every rank {"json": {"rank", "step", "step_s", "loss", ...}} (the
                              rows of `<run_dir>/ranks/rank<i>.jsonl`, msjax.observe); trimmed to about 100,000
  g{gen}:...          rendezvous keys of one generation (msjax.control.rendezvous)

Reconnection: every command retries ConnectionError/TimeoutError with exponential backoff (50 ms doubling, capped
at 2 s, `retries` times), so a Redis restart costs the caller a delay, not an exception, when it comes back in
time. A wrong URL or password is one ControlError at `connect`, never a retry loop.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any
from urllib.parse import urlparse

from msjax.control.errors import ControlError

EVENTS_MAXLEN = 10_000
# Per-step metric rows kept in Redis (all ranks together; ~300 bytes each, so ~30 MB at the cap). A live view, not
# the record: the per-rank JSONL files keep every row.
METRICS_MAXLEN = 100_000
COMMAND_KINDS = ("stop", "checkpoint", "profile")
# A worker asked to leave (`Store.request_exit`) exits with this: EX_TEMPFAIL, "try again". Non-zero, so a
# Kubernetes JobSet's failurePolicy restarts the job; the supervisor reads it as "stopped because the job is being
# restarted", never as the worker's own failure.
EXIT_REQUESTED = 75


def redact(url: str) -> str:
    """The URL with its password replaced by ***, for error messages and logs."""
    p = urlparse(url)
    if p.password:
        netloc = f"{p.username or ''}:***@{p.hostname}" + (f":{p.port}" if p.port else "")
        return p._replace(netloc=netloc).geturl()
    return url


def connect(url: str, *, password: str | None = None, ssl_ca_certs: str | None = None,
            ssl_certfile: str | None = None, ssl_keyfile: str | None = None, socket_timeout_s: float | None = 30.0,
            connect_timeout_s: float = 5.0, retries: int = 12, check: bool = True):
    """A redis-py client for `url`, checked with one PING.

    Args:
      url: `redis://[:PASSWORD@]HOST:PORT[/DB]`, or `rediss://...` for TLS.
      password: overrides the URL's password (e.g. from a Kubernetes Secret in MSJAX_REDIS_PASSWORD).
      ssl_ca_certs, ssl_certfile, ssl_keyfile: TLS files handed to redis-py (with a rediss:// URL).
      socket_timeout_s: per-command socket timeout (None: none; blocking reads set their own).
      connect_timeout_s: TCP connect timeout.
      retries: reconnect attempts per command after a ConnectionError/TimeoutError (backoff 50 ms doubling to
        2 s: 12 retries cover about 17 s of Redis being away).
      check: PING once, with no retry, so a bad URL or password fails here with one clear error.

    Returns: redis.Redis with decode_responses=True (str in, str out).
    Raises: ControlError naming the URL (password redacted): malformed URL, unreachable server, refused password.
    """
    import redis
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    parsed = urlparse(url)
    if parsed.scheme not in ("redis", "rediss") or not parsed.hostname:
        raise ControlError(f"Redis URL {redact(url)!r} is malformed: expected redis://:PASSWORD@HOST:PORT/DB "
                           "or rediss://... for TLS")
    kwargs: dict[str, Any] = dict(decode_responses=True, socket_timeout=socket_timeout_s,
                                  socket_connect_timeout=connect_timeout_s)
    if password is not None:
        kwargs["password"] = password
    if parsed.scheme == "rediss":
        kwargs.update({k: v for k, v in dict(ssl_ca_certs=ssl_ca_certs, ssl_certfile=ssl_certfile,
                                             ssl_keyfile=ssl_keyfile).items() if v})
    elif any((ssl_ca_certs, ssl_certfile, ssl_keyfile)):
        raise ControlError(f"TLS files were given for {redact(url)!r}, a plain redis:// URL: use rediss://")
    try:
        if check:
            probe = redis.Redis.from_url(url, retry=Retry(ExponentialBackoff(), 0), **kwargs)
            try:
                probe.ping()
            finally:
                probe.close()
        retry = Retry(ExponentialBackoff(cap=2.0, base=0.05), retries)
        return redis.Redis.from_url(url, retry=retry, retry_on_error=[redis.ConnectionError, redis.TimeoutError],
                                    health_check_interval=0, **kwargs)
    except redis.AuthenticationError as e:
        if password is None and not parsed.password:
            raise ControlError(f"Redis at {redact(url)} requires a password and none was given: put it in the URL "
                               "(redis://:PASSWORD@HOST:PORT/0) or MSJAX_REDIS_PASSWORD") from None
        raise ControlError(f"Redis at {redact(url)} refused the password ({e}); check the URL's password or "
                           "MSJAX_REDIS_PASSWORD") from None
    except redis.ResponseError as e:
        if "NOAUTH" in str(e) or "WRONGPASS" in str(e):
            raise ControlError(f"Redis at {redact(url)} refused the password ({e}); check the URL's password "
                               "or MSJAX_REDIS_PASSWORD") from None
        raise ControlError(f"Redis at {redact(url)} answered PING with an error: {e}") from None
    except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
        raise ControlError(f"cannot reach Redis at {redact(url)}: {e}") from None


def env_connect(**overrides):
    """`connect` from the worker environment: MSJAX_REDIS_URL, MSJAX_REDIS_PASSWORD, MSJAX_REDIS_CA_CERT,
    MSJAX_REDIS_CERT, MSJAX_REDIS_KEY. Raises ControlError when MSJAX_REDIS_URL is unset."""
    url = os.environ.get("MSJAX_REDIS_URL")
    if not url:
        raise ControlError("MSJAX_REDIS_URL is not set")
    kw = dict(password=os.environ.get("MSJAX_REDIS_PASSWORD") or None,
              ssl_ca_certs=os.environ.get("MSJAX_REDIS_CA_CERT") or None,
              ssl_certfile=os.environ.get("MSJAX_REDIS_CERT") or None,
              ssl_keyfile=os.environ.get("MSJAX_REDIS_KEY") or None)
    kw.update(overrides)
    return connect(url, **kw)


def _loads(value: str | None) -> Any:
    return None if value is None else json.loads(value)


class Store:
    """The run state of one run id on one Redis (see the module docstring for the keys).

    Args:
      client: a redis-py client with decode_responses=True (from `connect`).
      run_id: names the run; letters, digits, `-`, `_` and `.` only.

    Every method is one or two Redis round trips; none blocks longer than its `block_s`/`timeout` argument.
    Raises ValueError for a malformed run id or command; redis-py errors pass through after its retries.
    """

    def __init__(self, client, run_id: str):
        if not run_id or not all(c.isalnum() or c in "-_." for c in run_id):
            raise ValueError(f"run id {run_id!r}: allowed are letters, digits, '-', '_' and '.'")
        self.client = client
        self.run_id = run_id
        self.prefix = f"msjax:{run_id}"

    def key(self, name: str) -> str:
        return f"{self.prefix}:{name}"

    # -- restarts and members ------------------------------------------------------------------------------------
    def restart_count(self) -> int:
        """How many times the job was restarted (the current rendezvous generation); 0 for a fresh run."""
        return int(self.client.get(self.key("restarts")) or 0)

    def bump_restarts(self) -> int:
        """Starts a new rendezvous generation (call before restarting the workers); returns the new count."""
        return int(self.client.incr(self.key("restarts")))

    def members(self) -> dict[int, dict]:
        """rank -> member record of the current generation ({worker_id, host, pid, generation, joined_at})."""
        return {int(r): json.loads(v) for r, v in self.client.hgetall(self.key("members")).items()}

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def set_checkpoint(self, tier: str, step: int, path: str, **info: Any) -> None:
        """Records the newest verified checkpoint of `tier` (only if newer than the one recorded)."""
        current = self.checkpoint(tier)
        if current is not None and current["step"] >= step:
            return
        record = {"step": int(step), "path": str(path), "verified_at": time.time(), **info}
        self.client.hset(self.key("ckpt"), tier, json.dumps(record))

    def checkpoint(self, tier: str) -> dict | None:
        """The newest verified checkpoint of `tier`, or None."""
        return _loads(self.client.hget(self.key("ckpt"), tier))

    def checkpoints(self) -> dict[str, dict]:
        return {t: json.loads(v) for t, v in self.client.hgetall(self.key("ckpt")).items()}

    # -- excluded hosts ------------------------------------------------------------------------------------------
    def exclude_host(self, host: str, reason: str = "") -> None:
        """Marks `host` as not to be used again (and records an event saying why)."""
        self.client.sadd(self.key("excluded"), host)
        self.post_event("host_excluded", host=host, reason=reason)

    def excluded_hosts(self) -> set[str]:
        return set(self.client.smembers(self.key("excluded")))

    # -- events --------------------------------------------------------------------------------------------------
    def post_event(self, kind: str, **fields: Any) -> str:
        """Appends {"kind", "time", "host", "pid", **fields} to the events stream; returns the entry id."""
        record = {"kind": kind, "time": time.time(), "host": socket.gethostname(), "pid": os.getpid(), **fields}
        return self.client.xadd(self.key("events"), {"json": json.dumps(record)}, maxlen=EVENTS_MAXLEN,
                                approximate=True)

    def events(self, count: int = 100) -> list[dict]:
        """The newest `count` events, oldest first."""
        rows = self.client.xrevrange(self.key("events"), count=count)
        return [json.loads(fields["json"]) for _, fields in reversed(rows)]

    # -- per-rank metrics ----------------------------------------------------------------------------------------
    def publish_metrics(self, rows: list[dict]) -> None:
        """Appends metric rows ({"rank", "step", **values}, JSON-serialisable) to the `metrics` stream in one
        pipelined round trip, trimming it to about METRICS_MAXLEN entries (XADD MAXLEN ~)."""
        if not rows:
            return
        pipe = self.client.pipeline(transaction=False)
        for row in rows:
            pipe.xadd(self.key("metrics"), {"json": json.dumps(row)}, maxlen=METRICS_MAXLEN, approximate=True)
        pipe.execute()

    def metrics(self, after_id: str = "-", count: int | None = None) -> list[tuple[str, dict]]:
        """Metric rows after stream id `after_id` (exclusive; "-" from the start), oldest first, at most `count`.
        Returns [(id, row)]: pass the last id back to read on (a live tail)."""
        start = after_id if after_id == "-" else f"({after_id}"
        return [(i, json.loads(f["json"])) for i, f in self.client.xrange(self.key("metrics"), min=start,
                                                                          count=count)]

    def latest_metrics(self, scan: int = 10_000) -> dict[int, dict]:
        """rank -> its newest metric row among the newest `scan` rows (what a live view of every rank shows)."""
        out: dict[int, dict] = {}
        for _, f in self.client.xrevrange(self.key("metrics"), count=scan):
            row = json.loads(f["json"])
            out.setdefault(int(row["rank"]), row)
        return out

    # -- heartbeats, reports and exit requests ------------------------------------------------------------------
    def heartbeat(self, rank: int, ttl_s: float, beat: dict[str, Any], member: dict | None = None
                  ) -> tuple[bool, str | None]:
        """Sets hb:{rank} = `beat` (JSON) expiring after `ttl_s` seconds (ms precision), in one pipelined round
        trip with two reads:

          - with `member`, writes the rank's members record if it is missing (a Redis that restarted without
            persistence gets its membership back);
          - with `beat["boot"]`, reads whether that worker process was asked to leave (`request_exit`).

        Returns (the members record was missing, the exit request's reason or None)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self.key(f"hb:{rank}"), json.dumps(beat), px=max(1, int(ttl_s * 1000)))
        if member is not None:
            pipe.hsetnx(self.key("members"), rank, json.dumps(member))
        if beat.get("boot"):
            pipe.hget(self.key("exit"), beat["boot"])
        replies = pipe.execute()[1:]
        recreated = bool(replies.pop(0)) if member is not None else False
        return recreated, (replies[0] if beat.get("boot") else None)

    def heartbeats(self, ranks=None) -> dict[int, dict]:
        """rank -> newest heartbeat, for every rank whose heartbeat has not expired: of `ranks` (one MGET), or of
        every rank (None: one SCAN + one MGET)."""
        if ranks is None:
            keys = sorted(self.client.scan_iter(match=self.key("hb:*"), count=1000))
            ranks = [int(k.rsplit(":", 1)[1]) for k in keys]
        else:
            ranks = list(ranks)
            keys = [self.key(f"hb:{r}") for r in ranks]
        if not keys:
            return {}
        return {r: json.loads(v) for r, v in zip(ranks, self.client.mget(keys)) if v}

    def clear_heartbeats(self, ranks) -> None:
        """Deletes the heartbeats of `ranks` (between attempts, so old beats are not taken for new ones)."""
        keys = [self.key(f"hb:{r}") for r in ranks]
        if keys:
            self.client.delete(*keys)

    def report(self, rank: int, kind: str, generation: int, **fields: Any) -> None:
        """Appends a worker report {rank, kind, generation, time, **fields} (e.g. kind "nonfinite", step, loss).
        `generation` is the reporting process's rendezvous generation: a report that reaches Redis after its job
        was stopped is not taken for one of the restarted job's."""
        self.client.rpush(self.key("reports"), json.dumps({"rank": rank, "kind": kind, "generation": generation,
                                                           "time": time.time(), **fields}))

    def reports(self, start: int = 0) -> list[dict]:
        """Reports from index `start` on (keep the count read so far and pass it next time)."""
        return [json.loads(v) for v in self.client.lrange(self.key("reports"), start, -1)]

    def request_exit(self, boots, reason: str, ttl_s: float = 3600.0) -> None:
        """Asks the worker processes with these boot tokens (each process's own random id, in its heartbeat) to
        leave at once: each prints `reason` in one line and exits with EXIT_REQUESTED at its next heartbeat. How
        a supervisor ends the survivors of a failed job without waiting on collectives a dead peer will never
        join, and how a Kubernetes controller without API access restarts a JobSet. The request expires after
        `ttl_s` seconds, long after the processes are gone."""
        boots = [b for b in boots if b]
        if boots:
            pipe = self.client.pipeline(transaction=False)
            pipe.hset(self.key("exit"), mapping={b: reason for b in boots})
            pipe.expire(self.key("exit"), int(ttl_s))
            pipe.execute()

    # -- command channel -----------------------------------------------------------------------------------------
    def send_command(self, kind: str, **args: Any) -> str:
        """Queues a command for the running loop: "stop", "checkpoint" (now), "profile" (first_step, num_steps).

        The command is stamped with the current generation, so a restarted job does not replay an old stop.
        Returns the stream entry id. Raises ValueError for an unknown kind or a profile request without steps."""
        if kind not in COMMAND_KINDS:
            raise ValueError(f"command {kind!r}: allowed are {', '.join(COMMAND_KINDS)}")
        if kind == "profile" and not (int(args.get("num_steps", 0)) >= 1 and int(args.get("first_step", -1)) >= 0):
            raise ValueError(f"profile command needs first_step >= 0 and num_steps >= 1, got {args}")
        record = {"kind": kind, "generation": self.restart_count(), "time": time.time(), **args}
        return self.client.xadd(self.key("cmd"), {"json": json.dumps(record)}, maxlen=1000, approximate=True)

    def read_commands(self, after_id: str = "0-0", block_s: float | None = None) -> list[tuple[str, dict]]:
        """Commands after stream id `after_id` (oldest first), waiting up to `block_s` seconds for one (None: no
        wait). Returns [(id, command)]."""
        block = None if block_s is None else max(1, int(block_s * 1000))
        reply = self.client.xread({self.key("cmd"): after_id}, block=block)
        out = []
        for _key, entries in reply or []:
            for entry_id, fields in entries:
                out.append((entry_id, json.loads(fields["json"])))
        return out
