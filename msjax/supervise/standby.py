"""Warm standby workers: interpreters that have already imported jax and the training stack, so that a restart
skips the process start and the imports (ByteRobust's warm standbys, at the process level).

A restart's start-up on the shared 2-core machine spent 4.6-10 s from the process's start to the end of
scripts/train.py's imports (bench_recovery's `imports` phase; `python -X importtime -c "import msjax.train"`
alone takes 3.7 s there). The local backend starts one standby per host once an attempt has taken its first step
(so that the imports do not compete with the attempt's own start-up), and hands a restarted worker to a standby.

    python -m msjax.supervise.standby
      imports jax, msjax.train and the rest of scripts/train.py's imports; then reads one JSON line on stdin:
      {"argv": [train.py flags], "env": {the worker's whole environment}, "log": path}; sends its output to
      `log`, replaces its environment with `env`, and runs scripts/train.py as __main__ with `argv`. End of input
      (nobody needs it any more) ends it with status 0.

The environment a standby is started with must agree with the worker's on what is read at import: JAX_* settings
(jax reads them when imported) and MSJAX_MALLOPT / the compilation cache settings (msjax.runtime); XLA_FLAGS and
every MSJAX_* variable of the control plane are read later and may differ.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

TRAIN_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train.py"


def main() -> int:
    import jax  # noqa: F401
    import orbax.checkpoint  # noqa: F401
    import tqdm.contrib.logging  # noqa: F401

    import msjax.cli  # noqa: F401
    import msjax.control.worker  # noqa: F401
    import msjax.supervise.heartbeat  # noqa: F401
    import msjax.train  # noqa: F401

    print("msjax standby: ready", flush=True)
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    job = json.loads(line)
    fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(job["env"])
    sys.argv = [str(TRAIN_SCRIPT), *job["argv"]]
    runpy.run_path(str(TRAIN_SCRIPT), run_name="__main__")  # ends with sys.exit(status)
    return 0


if __name__ == "__main__":
    sys.exit(main())
