"""Live per-rank metrics into the run's Redis, so the supervisor (or any tool) sees every rank while it trains.

`RedisMetricsSink` is the control plane's `msjax.observe.MetricsSink`: `ControlPlaneHook.metrics`, passed to the
step observer by `msjax.train.build_hooks` whenever the run joined a control plane (MSJAX_REDIS_URL): the
step observer publishes every per-step row it writes to `<run_dir>/ranks/rank<i>.jsonl`, and those same rows go
to the `msjax:{run_id}:metrics` stream (`Store.publish_metrics`: JSON, XADD MAXLEN ~, never pickle).

Off the step's critical path, bounded, and indifferent to Redis outages:
  - `publish` (called on the observer's watcher thread, never on the training thread) only appends to an
    in-memory deque of at most `capacity` rows: no network, no host sync.
  - `flush` (called by the control plane's own background thread once per `interval_s`, next to the heartbeat)
    sends what is buffered in one pipelined round trip and forgets it only once Redis has taken it. A failure
    raises into that thread, whose bounded reconnect backoff (msjax.control.hook) handles it; the rows stay
    buffered and go out when Redis is back.
  - When Redis is away long enough for the buffer to fill, the oldest rows are dropped (counted in `dropped`):
    memory stays bounded and training never waits; the JSONL files keep every row.
  - `close` (called by the observer after its last row) makes a final best-effort flush.

Also carries each rank's goodput ledger so far (msjax.goodput, `publish_goodput`): the newest one is kept and
written by `flush` to `msjax:{run_id}:goodput:{rank}` (a JSON string, overwritten each time: a live view; the
run's events.jsonl and goodput.json are the record), read with `live_goodput`.

Also carries the straggler exclusions of `observe.exclude_stragglers` (`exclude_host`): recorded in the run's
`excluded` set (`Store.exclude_host`) by the same background thread, so the supervisor's next restart leaves
those hosts out (msjax.supervise.supervisor).
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
from collections import deque
from typing import Any

log = logging.getLogger(__name__)

# Rows buffered while Redis is away before the oldest are dropped (~300 bytes each: ~3 MB).
DEFAULT_CAPACITY = 10_000
# Rows per pipelined round trip.
FLUSH_BATCH = 2_000


class RedisMetricsSink:
    """Buffers per-rank metric rows and writes them to the run's `metrics` stream (see the module docstring).

    Args:
      store: the run's `msjax.control.store.Store`.
      capacity: most rows kept in memory while unsent (>= 1); older ones are dropped first.
    Raises:
      ValueError: capacity < 1.
    """

    def __init__(self, store, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError(f"capacity={capacity}: must be >= 1")
        self.store = store
        self.capacity = capacity
        self.sent = 0  # rows Redis has taken
        self.dropped = 0  # rows dropped because the buffer was full (Redis away)
        self._rows: deque[tuple[int, dict]] = deque(maxlen=capacity)  # (sequence number, row)
        self._seq = itertools.count()
        self._exclusions: deque[tuple[str, str]] = deque(maxlen=1000)
        self._goodput: tuple[int, dict] | None = None  # (rank, the newest ledger), until flushed
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()  # one flusher at a time (control thread, or close at the end)

    # -- producer side (the observer's watcher thread) --------------------------------------------------------------
    def publish(self, rank: int, step: int, values: dict[str, float]) -> None:
        """Buffers one row {"rank", "step", **values}; O(1), no I/O."""
        with self._lock:
            if len(self._rows) == self.capacity:
                self.dropped += 1
            self._rows.append((next(self._seq), {"rank": int(rank), "step": int(step), **values}))

    def publish_goodput(self, rank: int, ledger: dict[str, Any]) -> None:
        """Keeps `ledger` (msjax.goodput.LoopLedger.to_dict) as this rank's newest; O(1), no I/O."""
        with self._lock:
            self._goodput = (int(rank), ledger)

    def exclude_host(self, host: str, reason: str) -> None:
        """Queues `host` for the run's excluded set (written by the next `flush`)."""
        with self._lock:
            self._exclusions.append((host, reason))

    # -- consumer side (the control plane's background thread) ------------------------------------------------------
    @property
    def pending(self) -> int:
        """Rows buffered and not yet sent."""
        return len(self._rows)

    def flush(self) -> int:
        """Sends every buffered row (and queued exclusion) to Redis; returns the number of rows sent.

        Raises redis-py's ConnectionError/TimeoutError after its own retries; unsent rows stay buffered."""
        with self._flush_lock:
            while self._exclusions:
                host, reason = self._exclusions[0]
                self.store.exclude_host(host, reason)
                with self._lock:
                    self._exclusions.popleft()
            with self._lock:
                goodput, self._goodput = self._goodput, None
            if goodput is not None:
                try:
                    self.store.client.set(self.store.key(f"goodput:{goodput[0]}"), json.dumps(goodput[1]))
                except Exception:
                    with self._lock:  # kept for the next flush unless a newer one came meanwhile
                        self._goodput = self._goodput or goodput
                    raise
            total = 0
            while True:
                with self._lock:
                    batch = list(itertools.islice(self._rows, FLUSH_BATCH))
                if not batch:
                    return total
                self.store.publish_metrics([row for _, row in batch])
                last = batch[-1][0]
                with self._lock:  # rows dropped meanwhile (buffer full) were older: pop only what was sent
                    while self._rows and self._rows[0][0] <= last:
                        self._rows.popleft()
                total += len(batch)
                self.sent += len(batch)

    def close(self) -> None:
        """A final best-effort flush at the end of the run (a Redis still away costs redis-py's retries, then a
        message; training is already over)."""
        try:
            self.flush()
        except Exception as e:
            log.warning(f"msjax.control: {self.pending} metric rows not sent to Redis at the end ({e})")
        if self.dropped:
            log.warning(f"msjax.control: {self.dropped} metric rows were dropped while Redis was away (buffer of "
                        f"{self.capacity}); the per-rank JSONL files have them")

    def stats(self) -> dict[str, Any]:
        return {"sent": self.sent, "pending": self.pending, "dropped": self.dropped}


def live_goodput(store, ranks=range(1)) -> dict[int, dict]:
    """The newest goodput ledger each of `ranks` published (rank -> msjax.goodput.LoopLedger.to_dict); ranks that
    published none are left out. Raises redis-py's errors."""
    ranks = list(ranks)
    values = store.client.mget([store.key(f"goodput:{r}") for r in ranks]) if ranks else []
    return {r: json.loads(v) for r, v in zip(ranks, values) if v is not None}
