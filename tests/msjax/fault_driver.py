"""A training run in its own process, for the fault tests (signals, kill -9, a directory made read-only).

python tests/msjax/fault_driver.py TMP CORPUS OVERRIDES_JSON OUT_JSON [--lock-after-checkpoint=N] [--slow-stop=S]

Runs `msjax.train.run` on the tiny config of conftest.py with the given overrides, printing "step S" after every
step (flushed, so the parent can time its signal), and writes {"digest": sha256 of every state leaf's bytes,
"summary": ...} to OUT_JSON when the run returns. `--lock-after-checkpoint=N`: once checkpoint N is complete,
makes the checkpoint directory immutable (`chattr +i`; root ignores chmod), so the next write fails, and from
then on each step takes 0.5 s longer (a real model's step), so how many steps the failure takes to surface is
measurable. `--slow-stop=S`: once a stop was requested (a signal), the next step end or checkpoint takes S seconds
longer, as a real model's would, so a second signal surely lands while the run is still stopping (the tiny model
stops, saves and restores its signal handlers within a fraction of a second). When `run` raises CheckpointError
the driver prints "error: ..." (stderr) and "threads left: [names]" (stdout: the non-daemon threads started during
the run that are still alive) and returns 1 through a normal interpreter exit, which waits for every non-daemon
thread.
"""

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

from msjax import runtime  # noqa: E402

runtime.setup()  # a run's process set-up, before jax starts (8 CPU devices: the collective-safe flags)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from conftest import tiny_run_config  # noqa: E402

from msjax.checkpoint import CheckpointError  # noqa: E402
from msjax.hooks import Hook  # noqa: E402
from msjax.train import run, summary_json  # noqa: E402


def digest(state) -> str:
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(jax.device_get(state)):
        h.update(np.ascontiguousarray(leaf).tobytes())
    return h.hexdigest()


class Progress(Hook):
    def __init__(self, lock_after: int | None, slow_stop: float):
        self.lock_after = lock_after
        self.slow_stop = slow_stop
        self.locked = False

    def _stop_slowly(self, ctx):
        # A stop requested before this point reaches on_step_end or on_checkpoint before the loop ends (the stop's
        # step always saves), so one of the two calls it in time.
        if self.slow_stop and ctx.control.stop_reason is not None:
            time.sleep(self.slow_stop)
            self.slow_stop = 0.0

    def on_checkpoint(self, ctx, step):
        print(f"checkpoint {step} started", flush=True)  # stage 1 done, stage 2 (the write) in flight
        self._stop_slowly(ctx)

    def on_step_end(self, ctx, step, metrics):
        print(f"step {step}", flush=True)
        self._stop_slowly(ctx)
        if self.locked:
            time.sleep(0.5)  # steps of a real model's length, so "within a step or two" is measurable
        if self.lock_after is not None and step > self.lock_after:
            ckpt_dir = ctx.run_dir / "checkpoints"
            deadline = time.time() + 120
            while not (ckpt_dir / str(self.lock_after)).is_dir() and time.time() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)  # the integrity record follows the commit within a poll
            subprocess.run(["chattr", "+i", str(ckpt_dir)], check=True)
            print(f"locked {ckpt_dir}", flush=True)
            self.lock_after, self.locked = None, True


def main() -> int:
    tmp, corpus, overrides, out = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3]), Path(sys.argv[4])
    lock = [int(a.split("=")[1]) for a in sys.argv[5:] if a.startswith("--lock-after-checkpoint=")]
    slow_stop = [float(a.split("=")[1]) for a in sys.argv[5:] if a.startswith("--slow-stop=")]
    cfg = tiny_run_config(tmp, corpus, **overrides)
    before = set(threading.enumerate())
    try:
        summary = run(cfg, hooks=[Progress(lock[0] if lock else None, slow_stop[0] if slow_stop else 0.0)])
    except CheckpointError as e:  # as scripts/train.py reports it; then a normal interpreter exit
        print(f"error: {e}", file=sys.stderr)
        left = [t.name for t in threading.enumerate() if t not in before and t.is_alive() and not t.daemon]
        print(f"threads left: {json.dumps(left)}", flush=True)
        return 1
    out.write_text(json.dumps({"digest": digest(summary.state),
                               "summary": {k: v for k, v in summary_json(summary).items() if k != "sample"}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
