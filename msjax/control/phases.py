"""Start-up phase timestamps of a worker process, for the supervisor's recovery breakdown (where a restart's time
goes: process start, imports, rendezvous, jax.distributed, data and program, restore, the first step's compile).

`mark(name)` records the wall time (time.time(), seconds) of the first call per name; the worker's heartbeat
sends `marks()` (msjax.control.hook) and the supervisor writes them once per worker and attempt as a
`worker_phases` event. Marks, in order:
  process_start   the process's start (psutil: the kernel's process creation time)
  imports         the train command has imported jax and the stack (msjax.train.main)
  rendezvous      the Redis rendezvous gave this worker its rank (msjax.control.worker)
  distributed     jax.distributed is initialised (msjax.control.worker, msjax.train.main)
  prepared        data prepared, mesh and train program built (msjax.train.run)
  restored        state restored from the newest verified checkpoint, or initialised (msjax.train.run)
  first_step      the first step has been dispatched, i.e. compiled (ControlPlaneHook.on_step_end)
Costs one dict write per mark; nothing when nobody reads them.
"""

from __future__ import annotations

import time

_MARKS: dict[str, float] = {}


def mark(name: str) -> None:
    """Records now (time.time()) under `name`, unless `name` is already marked."""
    _MARKS.setdefault(name, time.time())


def marks() -> dict[str, float]:
    """{name: unix seconds} of the marks so far, with `process_start` added."""
    if "process_start" not in _MARKS:
        try:
            import psutil

            _MARKS["process_start"] = psutil.Process().create_time()
        except Exception:  # noqa: BLE001 - a missing figure, not a failure
            pass
    return dict(_MARKS)
