"""Overhead of observability on the step loop: the same jitted step timed with all metrics on and with them off.

Both arms run the real train step of a config on synthetic random tokens, after compilation. The observed arm
runs `StepObserver` exactly as the loop does (its on_start, on_step_end every step with `ctx.timings` filled in,
windows with the probe and the exchange, scheduled GC, per-rank JSONL and TensorBoard, on_end) and, with
`redis=True`, the control plane's live sink (`msjax.control.metrics.RedisMetricsSink` on a private redis-server,
flushed once a second by a background thread, as `ControlPlaneHook` does); the plain arm runs the bare loop.
Each trial ends with a device sync.

Beating the noise of a shared machine: the arms alternate in ABBA order (plain, observed, observed, plain, ...), so
that a slow drift of the machine's load hits both equally, and the overhead is estimated from *pairs*: trial i of
each arm ran next to each other, so the ratio observed_i / plain_i cancels most of the load both saw. The estimate
is the median of the pair ratios, with a 95% bootstrap confidence interval of that median (resampling pairs,
Efron & Tibshirani 1993, percentile method); "within 2%" is claimed only when the interval's upper end is below 2%.
"""

from __future__ import annotations

import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import jax
import numpy as np

from msjax.config import Config
from msjax.hooks import LoopControl, RunContext
from msjax.mesh import make_mesh
from msjax.observe.timing import StepObserver
from msjax.train_step import build_train_program

BOOTSTRAP_RESAMPLES = 5000


def median_ci(x: np.ndarray, level: float = 0.95, resamples: int = BOOTSTRAP_RESAMPLES,
              seed: int = 0) -> tuple[float, float, float]:
    """(median, low, high): the median of `x` and its percentile-bootstrap confidence interval.

    Args:
      x: (N,) samples, N >= 1.
      level: the interval's coverage (0.95: the 2.5th and 97.5th percentiles of the resampled medians).
    """
    x = np.asarray(x, np.float64)
    rng = np.random.default_rng(seed)
    meds = np.median(x[rng.integers(0, len(x), (resamples, len(x)))], axis=1)
    lo, hi = np.quantile(meds, [(1 - level) / 2, (1 + level) / 2])
    return float(np.median(x)), float(lo), float(hi)


class _Flusher:
    """Flushes a sink every `interval_s` on a thread, as ControlPlaneHook's thread does."""

    def __init__(self, sink, interval_s: float = 1.0):
        self.sink, self.interval_s = sink, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-redis-flush", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sink.flush()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


def overhead_benchmark(cfg: Config, steps: int = 200, pairs: int = 10, vocab_size: int | None = None,
                       redis: bool = True) -> dict[str, Any]:
    """Seconds per step with all metrics off and on, in interleaved trials (see the module docstring).

    Args:
      cfg: a validated config; its `observe` section configures the observed arm (window, GC, probe).
      steps: steps per trial (should span several `observe.window`s).
      pairs: trials per arm (>= 2); trial i of both arms form pair i.
      redis: also publish every row to a private Redis through the control plane's sink.
    Returns:
      dict with each arm's median and interquartile range of seconds per step, the overhead (median of the pair
      ratios - 1) with its 95% confidence interval, every trial's time, and the settings.
    Raises:
      ValueError: pairs < 2 or steps < 1.
    """
    if pairs < 2 or steps < 1:
        raise ValueError(f"pairs={pairs}, steps={steps}: allowed is pairs >= 2, steps >= 1")
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
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        store = None
        if redis:
            from msjax.control.server import RedisServer
            from msjax.control.store import Store, connect

            server = stack.enter_context(RedisServer())
            store = Store(connect(server.url), "bench-observe")
            stack.callback(store.client.close)
        for r in range(pairs):
            for arm in (("plain", "observed") if r % 2 == 0 else ("observed", "plain")):  # ABBA
                ctx = RunContext(config=cfg, run_dir=Path(tmp) / f"{arm}{r}", mesh=mesh, program=program,
                                 start_step=0, control=LoopControl())
                obs = flusher = None
                if arm == "observed":
                    obs = StepObserver(cfg.observe)
                    obs.on_start(ctx)
                    if store is not None:
                        from msjax.control.metrics import RedisMetricsSink

                        sink = RedisMetricsSink(store)
                        ctx.extra["metrics_sink"] = sink
                        flusher = _Flusher(sink)
                t0 = time.perf_counter()
                for step in range(1, steps + 1):
                    ctx.timings["issue_t"] = t_issue = time.perf_counter()
                    state, metrics = program.step_fn(state, batch)
                    ctx.timings.update(data_s=0.0, dispatch_s=time.perf_counter() - t_issue)
                    if obs:
                        obs.on_step_end(ctx, step, metrics)
                jax.block_until_ready(metrics)
                times[arm].append((time.perf_counter() - t0) / steps)
                if flusher is not None:
                    flusher.close()
                if obs:
                    obs.on_end(ctx, None)  # the sink's final flush
        streamed = len(store.client.xrange(store.key("metrics"))) if store is not None else 0
    plain, observed = np.array(times["plain"]), np.array(times["observed"])
    ratio, lo, hi = median_ci(observed / plain)
    o = cfg.observe

    def q(x):
        return [float(v) for v in np.quantile(x, [0.25, 0.75])]

    return {"config": cfg.name, "devices": mesh.devices.size, "mesh": dict(mesh.shape), "steps": steps,
            "pairs": pairs, "window": o.window, "gc_every": o.gc_every, "probe": o.probe, "per_rank": o.per_rank,
            "redis": redis, "redis_rows": streamed, "redis_rows_expected": pairs * steps if redis else 0,
            "plain_step_s": float(np.median(plain)), "plain_iqr_s": q(plain),
            "observed_step_s": float(np.median(observed)), "observed_iqr_s": q(observed),
            "overhead": ratio - 1.0, "overhead_ci95": [lo - 1.0, hi - 1.0],
            "within_2pct": bool(hi - 1.0 < 0.02),
            "pair_ratios": (observed / plain).tolist(), "plain_trials_s": times["plain"],
            "observed_trials_s": times["observed"], "order": "ABBA",
            "spread_note": "overhead = median over pairs of observed/plain - 1; CI: percentile bootstrap of "
                           f"that median ({BOOTSTRAP_RESAMPLES} resamples)"}


def format_table(row: dict[str, Any]) -> str:
    """Both arms side by side (median and IQR in ms per step) and the paired overhead with its 95% CI."""
    ms = lambda v: f"{v * 1e3:.2f}"  # noqa: E731
    lines = [f"{row['config']}: {row['devices']} devices, {row['pairs']} pairs x {row['steps']} steps (ABBA), "
             f"window {row['window']}, gc_every {row['gc_every']}, probe {row['probe']}, redis {row['redis']}",
             f"{'arm':>9}  {'median ms/step':>14}  {'IQR ms/step':>15}",
             f"{'plain':>9}  {ms(row['plain_step_s']):>14}  "
             f"{ms(row['plain_iqr_s'][0]) + '-' + ms(row['plain_iqr_s'][1]):>15}",
             f"{'observed':>9}  {ms(row['observed_step_s']):>14}  "
             f"{ms(row['observed_iqr_s'][0]) + '-' + ms(row['observed_iqr_s'][1]):>15}",
             f"overhead (median of pair ratios) {row['overhead']:+.2%}, 95% CI [{row['overhead_ci95'][0]:+.2%}, "
             f"{row['overhead_ci95'][1]:+.2%}]: " + ("within 2%" if row["within_2pct"] else "NOT shown within 2%")]
    if row["redis"]:
        lines.append(f"redis rows streamed {row['redis_rows']} of {row['redis_rows_expected']}")
    return "\n".join(lines)
