"""Overhead of observability on the step loop: the same jitted step timed with and without the observer's hooks.

Both arms run the real train step of a config on synthetic random tokens, after compilation, in alternating
repeats (A B A B ...) so that both see the same machine load. The observed arm runs `StepObserver` exactly as the
loop does (its on_start, on_step_end every step with `ctx.timings` filled in, windows with the probe and the
exchange, scheduled GC, on_end); the plain arm runs the bare loop. Each repeat ends with a device sync.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from msjax.config import Config
from msjax.hooks import LoopControl, RunContext
from msjax.mesh import make_mesh
from msjax.observe.timing import StepObserver
from msjax.train_step import build_train_program


def overhead_benchmark(cfg: Config, steps: int = 100, repeats: int = 5, vocab_size: int | None = None
                       ) -> dict[str, Any]:
    """Median seconds per step with observability off and on.

    Args:
      cfg: a validated config; its `observe` section configures the observed arm (window, GC, probe).
      steps: steps per timed repeat (should span several `observe.window`s).
      repeats: timed repeats per arm, interleaved.
    Returns:
      dict with plain_step_s, observed_step_s (medians), overhead (observed / plain - 1), each arm's repeat
      times, and the settings.
    """
    mesh = make_mesh(cfg.mesh)
    program = build_train_program(cfg, mesh, vocab_size=vocab_size or cfg.model.vocab_size or 50304)
    cfg, t = program.config, program.config.train
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (t.global_batch, t.seq_len + 1))
    batch = {"inputs": jax.device_put(tokens[:, :-1].astype(np.int32), program.batch_sharding),
             "targets": jax.device_put(tokens[:, 1:].astype(np.int32), program.batch_sharding)}
    state = program.init_fn(jax.random.key(0))
    for _ in range(3):  # compile and warm up
        state, metrics = program.step_fn(state, batch)
    jax.block_until_ready(metrics)
    times: dict[str, list[float]] = {"plain": [], "observed": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            for arm in ("plain", "observed"):
                ctx = RunContext(config=cfg, run_dir=Path(tmp) / f"{arm}{r}", mesh=mesh, program=program,
                                 start_step=0, control=LoopControl())
                obs = StepObserver(cfg.observe) if arm == "observed" else None
                if obs:
                    obs.on_start(ctx)
                t0 = time.perf_counter()
                for step in range(1, steps + 1):
                    ctx.timings["issue_t"] = t_issue = time.perf_counter()
                    state, metrics = program.step_fn(state, batch)
                    ctx.timings.update(data_s=0.0, dispatch_s=time.perf_counter() - t_issue)
                    if obs:
                        obs.on_step_end(ctx, step, metrics)
                jax.block_until_ready(metrics)
                times[arm].append((time.perf_counter() - t0) / steps)
                if obs:
                    obs.on_end(ctx, None)
    plain, observed = statistics.median(times["plain"]), statistics.median(times["observed"])
    o = cfg.observe
    return {"config": cfg.name, "devices": mesh.devices.size, "mesh": dict(mesh.shape), "steps": steps,
            "repeats": repeats, "window": o.window, "gc_every": o.gc_every, "probe": o.probe,
            "plain_step_s": plain, "observed_step_s": observed, "overhead": observed / plain - 1.0,
            "plain_repeats_s": times["plain"], "observed_repeats_s": times["observed"]}


def format_table(row: dict[str, Any]) -> str:
    cols = [("config", "{}"), ("devices", "{}"), ("steps", "{}"), ("repeats", "{}"), ("window", "{}"),
            ("plain_step_s", "{:.4f}"), ("observed_step_s", "{:.4f}"), ("overhead", "{:+.2%}")]
    cells = [[c for c, _ in cols], [f.format(row[c]) for c, f in cols]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cols))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in cells)
