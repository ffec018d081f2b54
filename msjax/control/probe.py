"""Liveness probe of a worker (Kubernetes `livenessProbe.exec`): `python -m msjax.control.probe` exits 0 while this
worker's heartbeat is alive in Redis, 1 once it has expired (a hung or stopped worker; its TTL is
`supervisor.heartbeat_timeout_s`), 2 when the probe itself cannot run (no Redis, bad environment).

Reads the worker's own environment: MSJAX_REDIS_URL (+ MSJAX_REDIS_PASSWORD), MSJAX_RUN_ID, MSJAX_RANK.
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    try:
        from msjax.control.store import Store, env_connect

        rank = int(os.environ["MSJAX_RANK"])
        beats = Store(env_connect(), os.environ["MSJAX_RUN_ID"]).heartbeats([rank])
    except Exception as e:  # noqa: BLE001 - the probe's own failure is reported as such
        print(f"msjax probe: cannot check the heartbeat: {e!r}", file=sys.stderr)
        return 2
    if rank not in beats:
        print(f"msjax probe: rank {rank} has no live heartbeat (expired: hung, stopped or dead)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
