"""Per-step, per-process timing without a host sync per step, Python GC control, and the straggler exchange.

How a step is timed (every process, every step, nothing added to the training thread's critical path):

  issue_t      the loop's clock when it called the jitted step (after the batch arrived): `ctx.timings`.
  data_s       time the loop waited for the batch (`next(loader)`), measured by the loop.
  dispatch_s   host time inside the jitted step's call (enqueueing; async dispatch returns before the device runs).
  checkpoint_s time the loop was blocked in the checkpoint save that preceded this step (device->host copy).
  gc_s         time of this step's scheduled garbage collection (0 on other steps).
  done_t       when step's outputs became ready on this process's devices, read by a *watcher thread* that
               blocks on the step's metrics (`jax.block_until_ready`) while the training thread runs ahead.

From these, with done_t of the previous step:
  step_s       = done_t(s) - done_t(s-1): the device step interval (equal on every rank of a synchronous step).
  host_stall_s = max(0, issue_t(s) - done_t(s-1)): time the devices sat idle waiting for *this* process's host
                 (data, checkpoint, GC, Python). This is a rank's own host-side share: in a synchronous step the
                 other ranks wait for the rank whose host issued last, so only that rank shows the stall.
  compute_s    = done_t(s) - max(issue_t(s), done_t(s-1)): the device time of the step (compute and the time spent
                 in its collectives).
  tokens_per_s, mfu from step_s; loss, grad_norm read by the watcher once the step is done; lr from the optax
  schedule at the step (a table computed once on the CPU backend: no device work per step).

The device-side share of a rank (its compute before the step's collectives) is hidden inside one compiled program
and cannot be read from the host without splitting the step or profiling it. So at the end of each window
(`observe.window` steps, after the window's last step is done) every rank times a *collective-free probe*: a fixed
chain of matmuls on each of its own devices. A throttled GPU, a CPU shared with a noisy neighbour, a host slowed
from outside: the probe of that rank takes longer, while the others' do not, because nothing in it waits for
another rank. The window's per-rank figures (probe_s, host_stall_s, data_s, ...) are then gathered with jax's
multihost all-gather (one collective per window, not per step) and compared with the other ranks' median
(`msjax.observe.stragglers`). That window boundary is the one host sync the observer adds: one per window.

Resolution: done_t is when the watcher thread woke, so it lags by the thread's wake-up (tens of microseconds to a
few milliseconds under load); step figures are meant for windows of steps and heatmaps, not single microseconds.
The first step observed (compilation) is written but left out of window figures.
"""

from __future__ import annotations

import gc
import json
import math
import os
import queue
import socket
import threading
import time
from pathlib import Path
from typing import Any, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from msjax.flops import flops_per_token
from msjax.hardware import mesh_peak_flops
from msjax.hooks import Hook, RunContext
from msjax.observe.events import append_event
from msjax.observe.stragglers import RankPlace, StragglerDetector, mesh_places
from msjax.optim import lr_schedule

# How long the observer waits for a step's results at a window boundary before it gives up (seconds).
WAIT_TIMEOUT_S = 900.0
# Per-window figures exchanged between ranks, in this order. Seconds, means over the window's steps (probe_s: the
# median of a few timed probes).
WINDOW_FIGURES = ("step_s", "compute_s", "host_stall_s", "data_s", "checkpoint_s", "gc_s", "probe_s")
# Figures the straggler detector scores, with the floor of their denominator as a fraction of the median step
# time (host stalls are ~0 on healthy ranks: without a floor microseconds of noise would make huge ratios).
SCORED_FIGURES = {"probe_s": 0.0, "host_stall_s": 0.1}


class MetricsSink(Protocol):
    """Where live per-rank metrics go besides files, e.g. the control plane's store.

    `publish` is called from the observer's background thread once per step; it must not block for long. A sink
    with a `close()` method gets one call after the observer's last row (a final flush).
    """

    def publish(self, rank: int, step: int, values: dict[str, float]) -> None: ...


def _log(msg: str) -> None:
    if jax.process_index() == 0:
        tqdm.write(msg)


class ComputeProbe:
    """A fixed, collective-free computation timed on each of this process's devices.

    Args:
      devices: the devices to probe (this process's devices of the mesh).
      size: matrix side n of the (n, n) float32 matmuls.
      chain: number of dependent matmuls (each 2 n^3 FLOPs).
      repeats: timed runs; the median is reported.
    """

    def __init__(self, devices: Sequence[jax.Device], size: int = 256, chain: int = 8, repeats: int = 3):
        self.repeats = repeats

        def body(x):
            return jax.lax.fori_loop(0, chain, lambda i, a: jnp.tanh(a @ x), x)

        self._fn = jax.jit(body)
        rng = np.random.default_rng(0)
        host = (rng.standard_normal((size, size)) / math.sqrt(size)).astype(np.float32)
        self._inputs = [jax.device_put(host, d) for d in devices]
        jax.block_until_ready([self._fn(x) for x in self._inputs])  # compile now, not inside a timed window

    def __call__(self) -> float:
        """Median wall seconds for all probed devices to finish one probe (devices run concurrently)."""
        times = []
        for _ in range(self.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready([self._fn(x) for x in self._inputs])
            times.append(time.perf_counter() - t0)
        return float(np.median(times))


class StepObserver(Hook):
    """The loop hook of `msjax.observe`: per-rank step metrics, GC control and straggler detection.

    Writes (every process): `<run_dir>/ranks/rank<i>.jsonl` (one row per step, see the module docstring),
    `<run_dir>/ranks/rank<i>.meta.json` (process, host, pid, mesh coordinates) and TensorBoard scalars under
    `<run_dir>/tb/rank<i>`. Process 0 also writes `<run_dir>/ranks/windows.jsonl` (per-window figures and scores
    of every rank) and straggler events to `<run_dir>/events.jsonl`.

    Args:
      cfg: the run's `ObserveConfig` (`config.observe`).
      sinks: extra `MetricsSink`s; a control plane may also put one in `ctx.extra["metrics_sink"]`.
    """

    def __init__(self, cfg: Any, sinks: Sequence[MetricsSink] = ()):
        self.cfg = cfg
        self.sinks = list(sinks)
        self.stragglers: list[dict[str, Any]] = []  # events raised, for callers and tests
        self.window_rows: list[dict[str, Any]] = []
        self._queue: queue.Queue = queue.Queue()
        self._cv = threading.Condition()
        self._rows: list[dict[str, Any]] = []  # rows of the current window (watcher -> main thread)
        self._done_step = -1
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        floors = {k: v for k, v in SCORED_FIGURES.items() if cfg.probe or k != "probe_s"}
        self._detector = StragglerDetector(floors, cfg.threshold, cfg.persist)

    # ---- set-up and tear-down -----------------------------------------------------------------------------------

    def on_start(self, ctx: RunContext) -> None:
        cfg, t = ctx.config, ctx.config.train
        self.rank, self.nproc = jax.process_index(), jax.process_count()
        self.run_dir = Path(ctx.run_dir)
        self.tokens_per_step = t.global_batch * t.seq_len
        self.step_flops = flops_per_token(cfg.model, t.seq_len) * self.tokens_per_step
        self.peak, _ = mesh_peak_flops(ctx.mesh.devices.flat)
        with jax.default_device(jax.local_devices(backend="cpu")[0]):  # no work on the accelerators
            sched = lr_schedule(cfg.optimizer, t.steps)
            self._lr = np.asarray(jax.vmap(sched)(jnp.arange(t.steps)))  # lr of step s is entry s - 1
        hosts = self._gather_hosts()
        self.places: dict[int, RankPlace] = mesh_places(ctx.mesh.devices, hosts=hosts)
        ranks = self.run_dir / "ranks"
        ranks.mkdir(parents=True, exist_ok=True)
        devs = ctx.mesh.devices
        coords = [list(map(int, i)) for i in np.ndindex(devs.shape) if devs[i].process_index == self.rank]
        (ranks / f"rank{self.rank}.meta.json").write_text(json.dumps(
            {**self.places[self.rank].to_dict(), "device_coords": coords, "pid": os.getpid(),
             "process_count": self.nproc,
             "mesh": dict(ctx.mesh.shape), "peak_flops": self.peak}, indent=1))
        if self.cfg.per_rank:
            from tensorboardX import SummaryWriter  # as msjax.metrics: a TensorBoard writer without TensorFlow

            # Block-buffered, flushed at window ends and at the end: a line write per step is measurable on CPU.
            self._jsonl = open(ranks / f"rank{self.rank}.jsonl", "a")
            self._tb = SummaryWriter(str(self.run_dir / "tb" / f"rank{self.rank}"))
        self._tb_every = max(1, t.log_every)  # TensorBoard at the loop's log cadence (per-step rows are in JSONL)
        self._extra = ctx.extra  # a control plane may put its sink there in its own on_start, after ours
        local = [d for d in ctx.mesh.devices.flat if d.process_index == self.rank]
        self._probe = ComputeProbe(local) if self.cfg.window and self.cfg.probe else None
        self._gc_was_enabled = gc.isenabled()
        if self.cfg.gc_every:
            gc.collect()
            gc.disable()
        self._thread = threading.Thread(target=self._watch, name=f"msjax-observe-rank{self.rank}", daemon=True)
        self._thread.start()

    def _gather_hosts(self) -> dict[int, str]:
        # Under the supervisor a worker's host is the supervisor's name for it (MSJAX_HOST), the name its excluded
        # hosts use; elsewhere the machine's host name.
        name = os.environ.get("MSJAX_HOST") or socket.gethostname()
        if self.nproc == 1:
            return {0: name}
        from jax.experimental import multihost_utils

        buf = np.zeros(64, np.uint8)
        raw = name.encode()[:64]
        buf[:len(raw)] = np.frombuffer(raw, np.uint8)
        every = np.asarray(multihost_utils.process_allgather(buf))  # (P, 64)
        return {p: bytes(row).rstrip(b"\0").decode(errors="replace") for p, row in enumerate(every)}

    def on_end(self, ctx: RunContext, error: BaseException | None) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=60.0)
            if self._thread.is_alive():
                _log("observe: the metrics thread did not finish within 60 s after the loop ended; leaving it")
        for sink in self._all_sinks():
            close = getattr(sink, "close", None)
            if close is not None:
                close()
        if self.cfg.per_rank and hasattr(self, "_jsonl"):
            self._jsonl.close()
            self._tb.close()
        if self.cfg.gc_every and self._gc_was_enabled:
            gc.enable()

    # ---- every step ---------------------------------------------------------------------------------------------

    def on_step_end(self, ctx: RunContext, step: int, metrics: dict[str, Any]) -> None:
        if self._error is not None:
            raise RuntimeError(f"observe: the metrics thread failed: {self._error!r}") from self._error
        now = time.perf_counter()
        tm = ctx.timings
        gc_s = 0.0
        if self.cfg.gc_every and step % self.cfg.gc_every == 0:
            t0 = time.perf_counter()
            gc.collect(1)  # generations 0 and 1, as torchtitan; the old generation is collected by gc.collect() rarely
            gc_s = time.perf_counter() - t0
        host = {"data_s": tm.get("data_s", 0.0), "dispatch_s": tm.get("dispatch_s", 0.0),
                "checkpoint_s": tm.get("checkpoint_s", 0.0), "gc_s": gc_s}
        issue_t = tm.get("issue_t", now)
        self._queue.put((step, metrics, issue_t, host))
        if self.cfg.window and step % self.cfg.window == 0:
            self._window_end(ctx, step)

    def _watch(self) -> None:
        """Background thread: waits for each step's results in order and writes its row."""
        prev_done: float | None = None
        first = True
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    return
                step, metrics, issue_t, host = item
                jax.block_until_ready(metrics)
                done = time.perf_counter()
                values = {k: float(v) for k, v in metrics.items()}
                if prev_done is None:
                    step_s, stall, compute = done - issue_t, 0.0, done - issue_t
                else:
                    step_s = done - prev_done
                    stall = max(0.0, issue_t - prev_done)
                    compute = done - max(issue_t, prev_done)
                prev_done = done
                row = {"step": step, "time": time.time(), "step_s": step_s, "compute_s": compute,
                       "host_stall_s": stall, **host,
                       "tokens_per_s": self.tokens_per_step / step_s if step_s > 0 else 0.0,
                       "mfu": self.step_flops / step_s / self.peak if step_s > 0 else 0.0,
                       "lr": float(self._lr[min(step, len(self._lr)) - 1]), **values}
                if first:
                    row["compile"] = True
                self._emit(step, row)
                if first and self.cfg.per_rank:
                    self._jsonl.flush()  # the first row says "compiled and running" to whoever tails the file
                with self._cv:
                    if not first:
                        self._rows.append(row)
                    first = False
                    self._done_step = step
                    self._cv.notify_all()
        except BaseException as e:  # surfaced on the training thread at its next step
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def _emit(self, step: int, row: dict[str, Any]) -> None:
        if self.cfg.per_rank:
            self._jsonl.write(json.dumps(row) + "\n")
            if step % self._tb_every == 0:
                for k, v in row.items():
                    if k not in ("step", "time", "compile"):
                        self._tb.add_scalar(k, v, step)
        values = {k: v for k, v in row.items() if k != "step"}
        for sink in self._all_sinks():
            sink.publish(self.rank, step, values)

    def _all_sinks(self) -> list[MetricsSink]:
        extra_sink = getattr(self, "_extra", {}).get("metrics_sink")
        return self.sinks + ([extra_sink] if extra_sink is not None else [])

    # ---- every window -------------------------------------------------------------------------------------------

    def _window_end(self, ctx: RunContext, step: int) -> None:
        with self._cv:
            ok = self._cv.wait_for(lambda: self._done_step >= step or self._error is not None, WAIT_TIMEOUT_S)
            if not ok:
                raise TimeoutError(f"observe: step {step}'s results were not ready on process {self.rank} within "
                                   f"{WAIT_TIMEOUT_S:.0f} s (window end)")
            if self._error is not None:
                raise RuntimeError(f"observe: the metrics thread failed: {self._error!r}") from self._error
            rows, self._rows = self._rows, []
            if self.cfg.per_rank:
                self._jsonl.flush()
        figures = {k: float(np.mean([r[k] for r in rows])) if rows else 0.0 for k in WINDOW_FIGURES if k != "probe_s"}
        figures["probe_s"] = self._probe() if self._probe is not None else 0.0
        mine = np.array([figures[k] for k in WINDOW_FIGURES], np.float32)
        if self.nproc > 1:
            from jax.experimental import multihost_utils

            every = np.asarray(multihost_utils.process_allgather(mine))  # (P, F): the window's one collective
        else:
            every = mine[None]
        if not rows:  # a window holding only the compilation step: nothing to compare
            return
        self._compare(ctx, step, every)

    def _compare(self, ctx: RunContext, step: int, every: np.ndarray) -> None:
        per_fig = {k: every[:, i] for i, k in enumerate(WINDOW_FIGURES)}
        verdict = self._detector.update(per_fig, step_s=float(np.median(per_fig["step_s"])))
        row = {"step": step, "time": time.time(), "figures": {k: v.tolist() for k, v in per_fig.items()},
               "scores": {k: v.tolist() for k, v in verdict.scores.items()}, "stragglers": verdict.stragglers}
        self.window_rows.append(row)
        if self.rank == 0:
            with open(self.run_dir / "ranks" / "windows.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
        for r in verdict.new:
            place = self.places[r]
            why = {k: round(float(v[r]), 3) for k, v in verdict.scores.items()}
            _log(f"observe: straggler at step {step}: {place.describe()}; slowdown vs the other ranks' median "
                 f"{why} (threshold {self.cfg.threshold} for {self.cfg.persist} windows)")
            details = {"step": step, **place.to_dict(), "scores": why,
                       "figures": {k: float(v[r]) for k, v in per_fig.items()}, "threshold": self.cfg.threshold,
                       "persist": self.cfg.persist, "window": self.cfg.window}
            self.stragglers.append(details)
            if self.rank == 0:
                append_event(self.run_dir, "straggler", **details)
                self._exclude(place, step, why)
        for r in verdict.recovered:
            _log(f"observe: {self.places[r].describe()} is no longer a straggler at step {step}")
            if self.rank == 0:
                append_event(self.run_dir, "straggler_recovered", step=step, process=r)

    def _exclude(self, place: RankPlace, step: int, why: dict[str, float]) -> None:
        """With `observe.exclude_stragglers`, hands the straggler's host to the control plane (its background
        thread records it in the run's excluded hosts; the supervisor leaves it out at the next restart)."""
        exclude = self._extra.get("exclude_host")
        if not self.cfg.exclude_stragglers or not place.host:
            return
        if exclude is None:
            _log(f"observe: exclude_stragglers is on but the run has no control plane: {place.host} is not excluded")
            return
        exclude(place.host, f"straggler: process {place.process} at step {step}, slowdown {why} (threshold "
                            f"{self.cfg.threshold} for {self.cfg.persist} windows)")
        _log(f"observe: host {place.host} recorded for exclusion at the next restart (observe.exclude_stragglers)")
        append_event(self.run_dir, "straggler_excluded", step=step, process=place.process, host=place.host)
