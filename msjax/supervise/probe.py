"""Liveness probe of a supervised worker (Kubernetes `livenessProbe.exec`): exit 0 while this worker's
supervisor heartbeat is alive in Redis, 1 once it has expired (a hung or stopped worker; its TTL is
`supervisor.heartbeat_timeout_s`), 2 when the probe itself cannot run (no Redis, bad environment).

Reads the worker's own environment: MSJAX_REDIS_URL (+ MSJAX_REDIS_PASSWORD), MSJAX_RUN_ID, MSJAX_SLOT.
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    try:
        from msjax.control.store import env_connect
        from msjax.supervise.store import HeartbeatStore

        slot = int(os.environ["MSJAX_SLOT"])
        store = HeartbeatStore(env_connect(), os.environ["MSJAX_RUN_ID"])
        beats = store.heartbeats([slot])
    except Exception as e:  # noqa: BLE001 - the probe's own failure is reported as such
        print(f"msjax probe: cannot check the heartbeat: {e!r}", file=sys.stderr)
        return 2
    if slot not in beats:
        print(f"msjax probe: slot {slot} has no live heartbeat (expired: hung, stopped or dead)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
