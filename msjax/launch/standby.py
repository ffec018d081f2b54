"""Warm standby workers: interpreters that have already imported jax and the training stack, so that a restart
skips the process start and the imports (ByteRobust's warm standbys, at the process level).

A restart's start-up on a shared 2-core machine spends seconds from the process's start to the end of the train
command's imports (bench_recovery's `imports` phase). The local backend (msjax.launch.local.LocalBackend) starts
one standby per host once an attempt has taken its first step (so that the imports do not compete with the
attempt's own start-up), and hands a restarted worker to a standby.

    python -m msjax.launch.standby
      imports jax and the train command (msjax.train); then reads one JSON line on stdin:
      {"argv": [train flags], "env": {the worker's whole environment}}; replaces its environment with `env` and
      runs `msjax.train.main(argv)`, its output on the standby's own stdout (which its launcher reads). End of
      input (nobody needs it any more) ends it with status 0.

The environment a standby is started with must agree with the worker's on what is read at import: JAX_* settings
(jax reads them when imported) and the compilation cache settings (msjax.runtime); XLA_FLAGS and every MSJAX_*
variable of the control plane are read later and may differ.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> int:
    import jax  # noqa: F401
    import orbax.checkpoint  # noqa: F401
    import tqdm.contrib.logging  # noqa: F401

    import msjax.control.hook  # noqa: F401
    import msjax.control.worker  # noqa: F401
    import msjax.train

    line = sys.stdin.readline()
    if not line.strip():
        return 0
    job = json.loads(line)
    os.environ.clear()
    os.environ.update(job["env"])
    sys.argv = ["msjax-train", *job["argv"]]
    return msjax.train.main(job["argv"])


if __name__ == "__main__":
    sys.exit(main())
