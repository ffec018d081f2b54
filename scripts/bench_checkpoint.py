"""Checkpoint benchmark: how long the loop is blocked per checkpoint, restore speed per tier, integrity cost.

python scripts/bench_checkpoint.py [--gib=1.0] [--saves=3] [--restores=3] [--devices=8] [--dir=/tmp/...]
                                   [--local_dir=/dev/shm/...] [--json PATH]

For a train-state-like pytree of `--gib` GiB of float32 arrays sharded over `--devices` CPU devices:
  blocked_s       the time `Checkpointer.save` blocks the loop (stage 1: device -> host copy, checksum dispatch),
                  two tiers (local `--local_dir` then persistent `--dir`), mean over saves after the first;
  sync_save_s     a synchronous Orbax save of the same state to the persistent tier (what the loop would wait
                  for without the two stages); the target is blocked_s <= 10% of it;
  background_s    how long the write, record and copy go on after `save` returned;
  restore_*_s     a verified restore from the local tier and from the persistent tier (the persistent files were
                  just written, so they may come from the page cache: an upper bound on its speed), median of
                  `--restores`; restore_*_unverified_s the same restore without the checksum comparison
                  (`Checkpointer.restore(verify=False)`), interleaved with the verified ones; *_cpu_s: process
                  CPU seconds (all threads) of the same restores, less disturbed by other jobs than wall time;
  verify_cost_*   the cost of integrity checking: the extra time of a verified restore over an unverified one,
                  as a fraction of the unverified one (verify_cost_cpu_*: the same in CPU seconds); the target is
                  under 20%. It can come out slightly negative: the noise of the medians.
  verify_in_restore_*_s  the checksum pass timed inside the verified restores (Checkpointer.last_restore_timing),
                  and verify_fraction_of_restore_* its share of the restore; verify_s: the same pass alone, on the
                  saved state.
  blocked_*_s     where the blocked time goes (Checkpointer.last_save_timing): waiting for the previous save,
                  dispatching the checksums, Orbax's save call (stage 1).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from msjax import cli
from msjax.config import ConfigError


@dataclasses.dataclass(frozen=True)
class CheckpointBenchOptions:
    """bench_checkpoint.py's flags (`--local-dir`, the old spelling of `--local_dir`, is accepted too).

    Attributes:
      gib: size of the train-state-like pytree, in GiB of float32.
      saves: checkpoints to time (>= 2; the first is reported apart).
      restores: restores timed per tier, verified and not (medians).
      devices: fake CPU devices the state is sharded over.
      dir: the persistent tier's directory; empty: a fresh one under /tmp, removed at the end.
      local_dir: the local tier's directory; empty: a fresh one under /dev/shm. Removed at the end either way.
      json: also write the results as JSON to this path.
    """

    gib: float = 1.0
    saves: int = 3
    restores: int = 3
    devices: int = 8
    dir: str = ""
    local_dir: str = ""
    json: str = ""


def main(argv: list[str]) -> int:
    def body() -> int:
        common, args = cli.parse_options(argv, CheckpointBenchOptions(), prog="bench_checkpoint.py",
                                         description=__doc__)
        cli.setup_logging(common)
        for flag, value, ok, allowed in (("--gib", args.gib, args.gib > 0, "> 0"),
                                         ("--saves", args.saves, args.saves >= 2, ">= 2"),
                                         ("--restores", args.restores, args.restores >= 1, ">= 1"),
                                         ("--devices", args.devices, args.devices >= 1, ">= 1")):
            if not ok:
                raise ConfigError(f"{flag}={value}: allowed is {allowed}")
        if args.json:
            cli.check_writable(args.json, "--json")
        return run(args)

    return cli.main_guard(body)


def run(args: CheckpointBenchOptions) -> int:
    """The benchmark (see the module docstring): prints the table, writes --json; returns the exit status."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.devices}").strip()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from msjax.checkpoint import Checkpointer
    from msjax.checkpoint.integrity import checksum_state
    from msjax.config import CheckpointConfig

    persistent = Path(args.dir or tempfile.mkdtemp(prefix="msjax-bench-ckpt-", dir="/tmp"))
    local = Path(args.local_dir or tempfile.mkdtemp(prefix="msjax-bench-ckpt-", dir="/dev/shm"))
    sync_dir = Path(tempfile.mkdtemp(prefix="msjax-bench-sync-", dir=str(persistent.parent)))
    mesh = jax.make_mesh((len(jax.devices()),), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, P("d"))
    n_arrays, cols = 8, 8192
    rows = max(len(jax.devices()), int(args.gib * 2**30 / 4 / n_arrays / cols) // len(jax.devices())
               * len(jax.devices()))
    make = jax.jit(lambda k: {f"w{i}": jax.random.normal(jax.random.fold_in(k, i), (rows, cols), jnp.float32)
                              for i in range(n_arrays)}, out_shardings=sharding)
    step_fn = jax.jit(lambda s: {"params": jax.tree.map(lambda x: x * 1.0001 + 1e-4, s["params"]),
                                 "step": s["step"] + 1}, donate_argnums=0)
    state = {"params": make(jax.random.key(0)),
             "step": jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(mesh, P()))}
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    results: dict = {"state_bytes": nbytes, "devices": len(jax.devices()), "persistent_dir": str(persistent),
                     "local_dir": str(local)}
    try:
        # Two tiers, asynchronous: what the loop pays per checkpoint.
        ckpt = Checkpointer(CheckpointConfig(every=1, keep=2, local_keep=1), persistent, local)
        blocked, background, parts = [], [], []
        for i in range(1, args.saves + 1):
            state = step_fn(state)
            jax.block_until_ready(state)  # the step's own compute is not the checkpoint's cost
            t0 = time.perf_counter()
            ckpt.save(i, state, {"step": i}, force=True)
            t1 = time.perf_counter()
            ckpt.wait()
            blocked.append(t1 - t0)
            background.append(time.perf_counter() - t1)
            parts.append(ckpt.last_save_timing)
        ckpt.close()
        results.update(blocked_first_s=blocked[0], blocked_s=float(np.mean(blocked[1:])),
                       background_s=float(np.mean(background[1:])))
        for key in parts[-1]:  # where the blocked time goes (Checkpointer.last_save_timing)
            results[f"blocked_{key}"] = float(np.mean([p[key] for p in parts[1:]]))

        # The same state saved synchronously (Orbax, no async), persistent tier only.
        sync = Checkpointer(CheckpointConfig(every=1, keep=1, async_save=False), sync_dir)
        times = []
        for i in range(1, 3):
            t0 = time.perf_counter()
            sync.save(i, state, {"step": i}, force=True)
            sync.wait()
            times.append(time.perf_counter() - t0)
        sync.close()
        results["sync_save_s"] = times[-1]
        results["blocked_fraction_of_sync"] = results["blocked_s"] / results["sync_save_s"]

        # Restores: local tier (newest there), then persistent only; each verified and unverified, interleaved
        # (V U / U V alternately per round) so both see the same load and page cache.
        def timed_restore(tier: str, verify: bool) -> tuple[float, float, float]:
            """(wall s, process CPU s, verification s inside it) of one restore, until the arrays are ready."""
            c = (Checkpointer(CheckpointConfig(keep=2, local_keep=1), persistent, local) if tier == "local"
                 else Checkpointer(CheckpointConfig(keep=2), persistent))
            t0, c0 = time.perf_counter(), time.process_time()
            _, restored, _ = c.restore(abstract, verify=verify)
            jax.block_until_ready(restored)
            out = time.perf_counter() - t0, time.process_time() - c0, c.last_restore_timing["verify_s"]
            c.close()
            return out

        # The verification kernels (one per shard shape and device) compiled outside the timings, as the save's
        # were by the first save: a resumed process compiles them once, like every program it runs.
        checksum_state(state, check_finite=False)()
        timed_restore("local", False)  # and Orbax's first restore in this process (its set-up), untimed
        runs: dict[tuple[str, bool], list[tuple[float, float, float]]] = {}
        for r in range(args.restores):
            for tier in ("local", "persistent"):
                for verify in ((True, False) if r % 2 == 0 else (False, True)):
                    runs.setdefault((tier, verify), []).append(timed_restore(tier, verify))
        for tier in ("local", "persistent"):
            med = {v: np.median(np.array(runs[tier, v]), axis=0) for v in (True, False)}
            results[f"restore_{tier}_s"], results[f"restore_{tier}_cpu_s"] = float(med[True][0]), float(med[True][1])
            results[f"restore_{tier}_unverified_s"] = float(med[False][0])
            results[f"restore_{tier}_unverified_cpu_s"] = float(med[False][1])
            results[f"verify_in_restore_{tier}_s"] = float(med[True][2])
            # The cost of integrity checking: what a verified restore takes beyond an unverified one, as a
            # fraction of the unverified restore (wall, and process CPU, the figure load disturbs least).
            results[f"verify_cost_{tier}"] = (results[f"restore_{tier}_s"] / results[f"restore_{tier}_unverified_s"]
                                              - 1)
            results[f"verify_cost_cpu_{tier}"] = (results[f"restore_{tier}_cpu_s"]
                                                  / results[f"restore_{tier}_unverified_cpu_s"] - 1)
            results[f"verify_fraction_of_restore_{tier}"] = (results[f"verify_in_restore_{tier}_s"]
                                                            / results[f"restore_{tier}_s"])
        t0 = time.perf_counter()
        checksum_state(state, check_finite=False)()  # compiled already by the restores
        results["verify_s"] = time.perf_counter() - t0
    finally:
        for d in (local, sync_dir) + (() if args.dir else (persistent,)):
            shutil.rmtree(d, ignore_errors=True)

    print(f"checkpoint benchmark: {nbytes / 2**30:.2f} GiB state over {len(jax.devices())} CPU devices, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'quantity':<40} {'value':>10}")
    for key in ("blocked_first_s", "blocked_s", *(k for k in results if k.startswith("blocked_") and
                                                   k.endswith("_s") and k not in ("blocked_first_s", "blocked_s")),
                "background_s", "sync_save_s", "blocked_fraction_of_sync",
                *(f"{k}_{tier}{suffix}" for tier in ("local", "persistent") for k, suffix in (
                    ("restore", "_s"), ("restore", "_unverified_s"), ("restore", "_cpu_s"),
                    ("restore", "_unverified_cpu_s"), ("verify_in_restore", "_s"), ("verify_cost", ""),
                    ("verify_cost_cpu", ""), ("verify_fraction_of_restore", ""))),
                "verify_s"):
        print(f"{key:<40} {results[key]:>10.3f}")
    results["load_average_1min"] = os.getloadavg()[0]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
