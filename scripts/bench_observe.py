"""Observability overhead: `python scripts/bench_observe.py --config=gpt_tiny [--steps=0] [--pairs=40]
[--redis=true] [--json=out.json] [--observe.window=20 ...]`: the same jitted step timed with all metrics on and
with them off; prints a table (median, IQR, paired wall and CPU overheads with distribution-free 95% intervals, the
observer's own time per step) and JSON.

Both arms run the real train step of a config on synthetic random tokens, after compilation. The observed arm
runs one `StepObserver` for the whole benchmark, exactly as the loop does in a long run (on_step_end every step
with `ctx.timings` filled in, windows with the probe and the exchange, scheduled GC, per-rank JSONL and
TensorBoard) and, with `redis=True`, the control plane's live sink (`msjax.control.metrics.RedisMetricsSink` on a
private redis-server, flushed once a second by a background thread, as `ControlPlaneHook` does, and flushed once
more inside the trial so no observed row is sent during a plain trial), with the step compiled as an observed run
compiles it (with `observe.own_compute`, each device timestamping its step from inside, `msjax.parallel.arrival`).
The plain arm runs the bare loop with the step compiled as a run with `observe.window=0` compiles it, and Python's
automatic GC on, as a run without the observer. (The observer's lag sentinel thread, started once for the whole
benchmark, runs through both arms.) Each trial is a whole number of observer periods (a multiple of
`observe.window` and `observe.gc_every` steps: every trial holds the same window ends and collections) and ends
with a device sync.

Beating the noise of a shared machine: the arms alternate in ABBA order (plain, observed, observed, plain, ...), so
that a slow drift of the machine's load hits both equally, and the overhead is estimated from *pairs*: trial i of
each arm ran next to each other, so the ratio observed_i / plain_i cancels most of the load both saw. The estimate
is the median of the pair ratios, with its distribution-free confidence interval (order statistics of the
binomial, e.g. Conover, Practical Nonparametric Statistics, 3rd ed., section 3.2: exact coverage >= the level for
any continuous distribution of independent pairs); "within 2%" is claimed only when the interval's upper end is
below 2%. The same is computed for the process's CPU time per step (all threads; less sensitive to other
processes' load than wall time), and the observer's own accounting (its main-thread time, its watcher thread's CPU
time, the probe's share of the window) is read from its window rows.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import jax
import numpy as np

from msjax import cli, runtime
from msjax.config import Config, ConfigError
from msjax.hooks import LoopControl, RunContext
from msjax.mesh import make_mesh
from msjax.observe.timing import StepObserver
from msjax.train_step import build_train_program

# An entry point: the process set-up of a run (malloc on CPU, compilation cache, XLA:CPU collective flags),
# before jax starts a backend; importing msjax itself changes nothing (msjax.runtime).
runtime.setup()


def median_ci(x: np.ndarray, level: float = 0.95) -> tuple[float, float, float]:
    """(median, low, high): the median of `x` and its distribution-free confidence interval.

    The interval is [x_(k), x_(n+1-k)] of the sorted samples with the largest k such that
    P(Binomial(n, 1/2) < k) <= (1 - level) / 2: it holds the population median with probability >= level.

    Args:
      x: (N,) independent samples.
      level: the coverage (0.95).
    Raises:
      ValueError: too few samples for an interval at `level` (N < 6 at 95%).
    """
    x = np.sort(np.asarray(x, np.float64))
    n = len(x)
    tail, cdf, k = (1.0 - level) / 2.0, 0.0, 0
    while True:  # cdf = P(B < k + 1) after the update
        cdf_next = cdf + math.comb(n, k) / 2.0 ** n
        if cdf_next > tail:
            break
        cdf, k = cdf_next, k + 1
    if k < 1:
        raise ValueError(f"{n} samples are too few for a {level:.0%} interval of the median (need >= 6 at 95%)")
    return float(np.median(x)), float(x[k - 1]), float(x[n - k])


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
        if self._thread.is_alive():
            raise TimeoutError("bench: the Redis flush thread did not stop within 10 s")


def trial_period(cfg: Config) -> int:
    """Steps in the shortest trial that holds whole observer periods: lcm of observe.window and gc_every (1 when
    both are off)."""
    o = cfg.observe
    return math.lcm(max(o.window, 1), max(o.gc_every, 1))


def overhead_benchmark(cfg: Config, steps: int = 0, pairs: int = 40, vocab_size: int | None = None,
                       redis: bool = True) -> dict[str, Any]:
    """Seconds per step with all metrics off and on, in interleaved trials (see the module docstring).

    Args:
      cfg: a validated config; its `observe` section configures the observed arm (window, GC, probe, budget).
      steps: steps per trial, a multiple of `trial_period(cfg)`; 0 for one period (100 with the defaults).
      pairs: trials per arm (>= 6, for a 95% interval); trial i of both arms form pair i.
      redis: also publish every row to a private Redis through the control plane's sink.
    Returns:
      dict with each arm's median and interquartile range of seconds per step, the wall and CPU overheads
      (median of the pair ratios - 1) with their 95% intervals, the observer's own accounting per step, every
      trial's time, and the settings.
    Raises:
      ValueError: pairs < 6, or steps not a multiple of the period.
    """
    period = trial_period(cfg)
    steps = steps or period
    if pairs < 6 or steps < 1 or steps % period:
        raise ValueError(f"pairs={pairs}, steps={steps}: allowed is pairs >= 6 and steps a multiple of {period} "
                         f"(lcm of observe.window and observe.gc_every), or 0 for {period}")
    mesh = make_mesh(cfg.mesh)
    program = build_train_program(cfg, mesh, vocab_size=vocab_size or cfg.model.vocab_size or 50304)
    # The plain arm runs the step compiled without the observer's timestamps inside it (observe.window=0: no
    # msjax.parallel.arrival marks, which observe.own_compute adds), so what they cost is part of the overhead.
    unobserved = dataclasses.replace(cfg, observe=dataclasses.replace(cfg.observe, window=0))
    plain_program = build_train_program(unobserved, mesh, vocab_size=vocab_size or cfg.model.vocab_size or 50304)
    cfg, t = program.config, program.config.train
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (t.global_batch, t.seq_len + 1))
    batch = {"inputs": jax.device_put(tokens[:, :-1].astype(np.int32), program.batch_sharding),
             "targets": jax.device_put(tokens[:, 1:].astype(np.int32), program.batch_sharding)}
    state = program.init_fn(jax.random.key(0))
    for step_fn in (program.step_fn, plain_program.step_fn):  # compile and warm up (the state layouts are equal)
        for _ in range(3):
            state, metrics = step_fn(state, batch)
    jax.block_until_ready(metrics)
    wall: dict[str, list[float]] = {"plain": [], "observed": []}
    cpu: dict[str, list[float]] = {"plain": [], "observed": []}
    gc_was_enabled = gc.isenabled()
    observed_step = 0
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        sink = store = None
        ctx = RunContext(config=cfg, run_dir=Path(tmp) / "observed", mesh=mesh, program=program, start_step=0,
                         control=LoopControl())
        if redis:
            from msjax.control.metrics import RedisMetricsSink
            from msjax.control.server import RedisServer
            from msjax.control.store import Store, connect

            server = stack.enter_context(RedisServer())
            store = Store(connect(server.url), "bench-observe")
            stack.callback(store.client.close)
            sink = RedisMetricsSink(store)
        obs = StepObserver(cfg.observe, sinks=[sink] if sink is not None else [])  # as msjax.train.build_hooks
        obs.on_start(ctx)
        stack.callback(lambda: obs.on_end(ctx, None))  # its sink's final flush
        try:
            for r in range(-1, pairs):  # pair -1 warms both arms up (first rows, files, threads) and is not kept
                for arm in (("plain", "observed") if r % 2 == 0 else ("observed", "plain")):  # ABBA
                    observed = arm == "observed"
                    if cfg.observe.gc_every:  # the observer's GC schedule, or Python's automatic GC
                        gc.disable() if observed else gc.enable()
                    flusher = _Flusher(sink) if observed and sink is not None else None
                    step_fn = program.step_fn if observed else plain_program.step_fn
                    t0, c0 = time.perf_counter(), time.process_time()
                    for _ in range(steps):
                        ctx.timings["issue_t"] = t_issue = time.perf_counter()
                        state, metrics = step_fn(state, batch)
                        ctx.timings.update(data_s=0.0, dispatch_s=time.perf_counter() - t_issue)
                        if observed:
                            observed_step += 1
                            obs.on_step_end(ctx, observed_step, metrics)
                    jax.block_until_ready(metrics)
                    if flusher is not None:
                        flusher.close()
                        sink.flush()  # what this trial published goes out inside its own time
                    if r >= 0:
                        wall[arm].append((time.perf_counter() - t0) / steps)
                        cpu[arm].append((time.process_time() - c0) / steps)
        finally:
            if gc_was_enabled:
                gc.enable()
        windows = [w for w in obs.window_rows if w["step"] > steps]  # after the warm-up pair (observed first)
        streamed = len(store.client.xrange(store.key("metrics"))) if store is not None else 0
    plain, observed = np.array(wall["plain"]), np.array(wall["observed"])
    ratio, lo, hi = median_ci(observed / plain)
    cpu_ratio, cpu_lo, cpu_hi = median_ci(np.array(cpu["observed"]) / np.array(cpu["plain"]))
    o = cfg.observe

    def q(x):
        return [float(v) for v in np.quantile(x, [0.25, 0.75])]

    def per_step(fig):  # this process's window totals, per step
        return float(np.sum([w["figures"][fig][0] for w in windows]) / (len(windows) * o.window)) if windows else 0.0

    probe_share = [w["figures"]["probe_wall_s"][0] / w["figures"]["window_s"][0] for w in windows]
    return {"config": cfg.name, "devices": mesh.devices.size, "mesh": dict(mesh.shape), "steps": steps,
            "pairs": pairs, "window": o.window, "gc_every": o.gc_every, "probe": o.probe,
            "probe_budget": o.probe_budget, "per_rank": o.per_rank, "redis": redis, "redis_rows": streamed,
            "redis_rows_expected": (pairs + 1) * steps if redis else 0,
            "plain_step_s": float(np.median(plain)), "plain_iqr_s": q(plain),
            "observed_step_s": float(np.median(observed)), "observed_iqr_s": q(observed),
            "overhead": ratio - 1.0, "overhead_ci95": [lo - 1.0, hi - 1.0], "within_2pct": bool(hi - 1.0 < 0.02),
            "cpu_overhead": cpu_ratio - 1.0, "cpu_overhead_ci95": [cpu_lo - 1.0, cpu_hi - 1.0],
            "plain_cpu_step_s": float(np.median(cpu["plain"])),
            "observer_main_s_per_step": per_step("observer_s"), "watcher_cpu_s_per_step": per_step("watcher_cpu_s"),
            "probe_wall_s_per_step": per_step("probe_wall_s"),
            "probe_share_of_window": [float(np.median(probe_share)), float(np.max(probe_share))] if windows else [],
            "probe_chains": sorted({w["probe"]["chain"] for w in windows if w.get("probe")}),
            "pair_ratios": (observed / plain).tolist(), "plain_trials_s": wall["plain"],
            "observed_trials_s": wall["observed"], "order": "ABBA",
            "spread_note": "overhead = median over pairs of observed/plain - 1; 95% CI: distribution-free order "
                           "statistics of that median"}


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
             f"{row['overhead_ci95'][1]:+.2%}]: " + ("within 2%" if row["within_2pct"] else "NOT shown within 2%"),
             f"CPU time (all threads) overhead {row['cpu_overhead']:+.2%}, 95% CI [{row['cpu_overhead_ci95'][0]:+.2%}, "
             f"{row['cpu_overhead_ci95'][1]:+.2%}] of {ms(row['plain_cpu_step_s'])} ms/step",
             f"observer's own accounting per step: main thread {row['observer_main_s_per_step'] * 1e6:.0f} us "
             f"(probe {row['probe_wall_s_per_step'] * 1e6:.0f} us), watcher thread CPU "
             f"{row['watcher_cpu_s_per_step'] * 1e6:.0f} us; probe / window wall median "
             + (f"{row['probe_share_of_window'][0]:.2%}, max {row['probe_share_of_window'][1]:.2%} "
                if row["probe_share_of_window"] else "- ")
             + f"(budget {row['probe_budget']:.2%}), chains {row['probe_chains']}"]
    if row["redis"]:
        lines.append(f"redis rows streamed {row['redis_rows']} of {row['redis_rows_expected']}")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class ObserveBenchOptions:
    """bench_observe.py's own flags.

    Attributes:
      steps: steps per trial; 0: one whole observer period, lcm(observe.window, observe.gc_every) (100 by default).
      pairs: ABBA pairs of trials (>= 6; the 95% interval needs at least 6).
      json: also write the result as JSON to this path.
      redis: stream the metrics to a Redis server started for the bench (the control plane's sink).
    """

    steps: int = 0
    pairs: int = 40
    json: str = ""
    redis: bool = True


def main(argv: list[str]) -> int:
    def body() -> int:
        cfg, (common, opts) = cli.parse(argv, ObserveBenchOptions(), prog="bench_observe.py", description=__doc__)
        cli.setup_logging(common)
        if opts.steps < 0 or opts.pairs < 6:
            raise ConfigError(f"--steps={opts.steps} / --pairs={opts.pairs}: allowed is --steps=0 or a multiple of "
                              "lcm(observe.window, observe.gc_every), and --pairs >= 6")
        if opts.json:
            cli.check_writable(opts.json, "--json")
        try:
            row = overhead_benchmark(cfg, steps=opts.steps, pairs=opts.pairs, redis=opts.redis)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        cli.print_result(format_table(row), row, opts.json)
        return 0

    return cli.main_guard(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
