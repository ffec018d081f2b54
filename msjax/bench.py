"""Step-time benchmark of a config on whatever devices exist: tokens/s, step time and MFU, as a table and JSON.

Synthetic random tokens (the data pipeline is benchmarked separately and runs off the critical path); the state
is created sharded and the jitted step is timed after compilation, with a device sync around each timed window.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import numpy as np

from msjax.config import Config
from msjax.flops import flops_per_token
from msjax.hardware import mesh_peak_flops
from msjax.mesh import make_mesh
from msjax.train_step import build_train_program


def benchmark(cfg: Config, steps: int = 20, warmup: int = 3, repeats: int = 3, vocab_size: int | None = None
              ) -> dict[str, Any]:
    """Times `steps` train steps `repeats` times after `warmup` steps.

    Args:
      cfg: a validated config (model.vocab_size 0 takes `vocab_size`, default 50304).
    Returns:
      dict with compile_s, step_s (median seconds per step), tokens_per_s, mfu (model FLOPs over
      `hardware.mesh_peak_flops`: datasheet peak x devices, or on CPU the measured host rate), peak label,
      devices and mesh.
    """
    mesh = make_mesh(cfg.mesh)
    program = build_train_program(cfg, mesh, vocab_size=vocab_size or cfg.model.vocab_size or 50304)
    cfg, t = program.config, program.config.train
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.model.vocab_size, (t.global_batch, t.seq_len + 1)).astype(np.int32)
    batch = {"inputs": jax.device_put(tokens[:, :-1], program.batch_sharding),
             "targets": jax.device_put(tokens[:, 1:], program.batch_sharding)}
    t0 = time.perf_counter()
    state = program.init_fn(jax.random.key(0))
    compiled = program.step_fn.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    for _ in range(warmup):
        state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        times.append((time.perf_counter() - t0) / steps)
    step_s = statistics.median(times)
    peak, label = mesh_peak_flops(mesh.devices.flat)
    tokens_per_step = t.global_batch * t.seq_len
    flops = flops_per_token(cfg.model, t.seq_len) * tokens_per_step
    return {
        "config": cfg.name, "devices": mesh.devices.size, "device_kind": jax.devices()[0].device_kind,
        "mesh": dict(mesh.shape), "global_batch": t.global_batch, "seq_len": t.seq_len,
        "params": program.param_count, "compile_s": compile_s, "step_s": step_s,
        "tokens_per_s": tokens_per_step / step_s, "model_flops_per_step": flops,
        "mfu": flops / step_s / peak, "peak_flops": peak, "peak_label": label,
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    cols = [("config", "{}"), ("devices", "{}"), ("params", "{:,}"), ("global_batch", "{}"), ("seq_len", "{}"),
            ("compile_s", "{:.2f}"), ("step_s", "{:.4f}"), ("tokens_per_s", "{:,.0f}"), ("mfu", "{:.1%}")]
    cells = [[c for c, _ in cols]] + [[f.format(r[c]) for c, f in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells)
