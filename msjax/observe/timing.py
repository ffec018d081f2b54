"""Per-step, per-process timing without a host sync per step, Python GC control, and the straggler exchange.

How a step is timed (every process, every step, nothing added to the training thread's critical path):

  issue_t      the loop's clock when it called the jitted step (after the batch arrived): `ctx.timings`.
  data_s       time the loop waited for the batch (`next(loader)`), measured by the loop.
  dispatch_s   host time inside the jitted step's call (enqueueing; async dispatch returns before the device runs).
  checkpoint_s time the loop was blocked in the checkpoint save that preceded this step (device->host copy).
  gc_s         time of this step's scheduled garbage collection (0 on other steps).
  start_t, arrive_t  with `observe.own_compute`, timestamps each of this process's devices takes from inside the
               compiled step (`msjax.parallel.arrival`): when the step begins on it, and when its backward pass has
               carried the gradient back to the model's input (with gradient accumulation, its last microbatch's).
  lag_s        wall time by which this process's host lagged: a sentinel thread sleeping in ticks of LAG_TICK_S
               adds up how late it wakes (`LagSentinel`), late by whatever kept the process from running although
               it was ready to: stopped (SIGSTOP, a debugger), throttled (a CPU quota), descheduled (a noisy
               neighbour, a hypervisor's steal time), or its interpreter busy. A lagging process holds up every
               collective of the steps it is in, wherever in the step the lag falls.
  done_t       when step's outputs became ready on this process's devices, read by a *watcher thread* that
               blocks on the step's metrics (`jax.block_until_ready`) while the training thread runs ahead.

From these, with done_t of the previous step:
  step_s       = done_t(s) - done_t(s-1): the device step interval (equal on every rank of a synchronous step).
  host_stall_s = max(0, issue_t(s) - done_t(s-1)): time the devices sat idle waiting for *this* process's host
                 (data, checkpoint, GC, Python). This is a rank's own host-side share: in a synchronous step the
                 other ranks wait for the rank whose host issued last, so only that rank shows the stall.
  data idle    = max(0, issue_t(s) - max(issue_t(s) - data_s, done_t(s-1))): the part of the batch wait the
                 devices sat idle for (before done_t(s-1) they still ran queued steps); added up with data_s in the
                 run's `RunContext.data_wait`, for the goodput ledger's data_wait bucket.
  compute_s    = done_t(s) - max(issue_t(s), done_t(s-1)): the device time of the step (compute and the time spent
                 in its collectives).
  own_compute_s = max(arrive_t(s)) - min(start_t(s)) over the process's devices: the rank's own compute, the
                 forward pass and the backward's chain of activation gradients on its devices (MegaScale's per-rank
                 compute time, which it takes from CUDA events). A slow device, a slow host or a pause during it
                 makes it longer than the others'; the others' wait for this rank lies after it, in the collectives.
  host_lag_s   = lag_s accumulated between done_t(s-1) and done_t(s).
  tokens_per_s, mfu from step_s; loss, grad_norm read by the watcher once the step is done; lr of the step from
  the run's table of the optimizer's schedule (`TrainProgram.learning_rates`).

At the end of each window (`observe.window` steps, after the window's last step is done) the window's per-rank
figures (own_compute_s, host_lag_s, host_stall_s, ...) are gathered with jax's multihost all-gather (one
collective per window, not per step) and compared with the other ranks' median (`msjax.observe.stragglers`): those
three, the rank's own compute and host time in its steps, decide who is a straggler (own_compute_s only where it is
timed, `observe.own_compute`). Except that where processes share a host's CPUs as their devices (several
CPU-backend processes on one machine), own_compute_s is only reported: there each process's compute time follows
how the OS shares the cores among them, not its own speed. That window boundary is the one host sync the
observer adds.

A second signal, reported and scored but never flagging a rank by itself: a *collective-free probe* timed by every
rank at each window end, a chain of matmuls on each of its own devices (`ComputeProbe`), reported as seconds per
matmul. Its cost is budgeted: the matrix size is calibrated once at start (the same on every rank), and at every
window end the chain is sized so the probe takes at most `observe.probe_budget` (default 0.5%) of the window's wall
time. It shows a device that is slow throughout; a rank that stalls now and then can pass a short probe untouched,
which is why the steps' own figures decide.

With `train.steps_per_execution` K > 1 one call of the compiled program runs up to K steps and the loop sees only
the step it ends at: a row then stands for the steps its call ran, its step number the last of them, its times the
call's divided by its steps (per-step averages), its loss and gradient norm the last step's.

Resolution: done_t is when the watcher thread woke, so it lags by the thread's wake-up (tens of microseconds to a
few milliseconds under load); step figures are meant for windows of steps and heatmaps, not single microseconds.
The first step observed (compilation) is written but left out of window figures.
"""

from __future__ import annotations

import fcntl
import gc
import json
import logging
import math
import os
import queue
import socket
import tempfile
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from msjax.hooks import DataWait, Hook, RunContext
from msjax.events import append_event
from msjax.observe.stragglers import RankPlace, StragglerDetector, mesh_places
from msjax.parallel.arrival import ARRIVALS

log = logging.getLogger(__name__)

# How long the observer waits for a step's results at a window boundary before it gives up (seconds).
WAIT_TIMEOUT_S = 900.0
# Per-window figures exchanged between ranks, in this order. Seconds; means over the window's steps except:
# step_median_s (the median step: a checkpoint, an eval or the previous window's probe do not move it), probe_s
# (seconds per matmul of the window-end probe), probe_wall_s (that probe's wall time), window_s (main-thread wall
# time from the end of the previous window's probe to the end of this window's probe), observer_s (main-thread
# time inside the observer's on_step_end over the window, probe and exchange included, the wait for the window's
# last step to finish on the device excluded: that is queued work, not the observer's) and watcher_cpu_s (CPU time
# of the observer's watcher thread over the window): window totals. own_compute_s is the mean over the window's steps that
# carried arrival marks (0 when none did: a pipelined step marks nothing).
WINDOW_FIGURES = ("step_s", "step_median_s", "compute_s", "own_compute_s", "host_lag_s", "host_stall_s",
                  "data_s", "checkpoint_s", "gc_s", "probe_s", "probe_wall_s", "window_s", "observer_s",
                  "watcher_cpu_s")
# Per-rank TensorBoard scalars: the figures that differ between ranks. Run-wide values (loss, grad norm, lr,
# tokens/s, MFU) are the same on every rank and already in the loop's own TensorBoard at the same steps; the JSONL
# rows and the live sink carry everything (each TensorBoard scalar costs tens of microseconds of CPU).
TB_FIGURES = ("step_s", "compute_s", "own_compute_s", "host_lag_s", "host_stall_s", "data_s", "dispatch_s",
              "checkpoint_s", "gc_s")
# The probe's candidate matrix sides, and the most seconds one matmul (all local devices at once) may take at the
# size chosen (ComputeProbe.calibrate): 0.2 ms is ~100x a jit dispatch, and a 0.5% budget of a 1 s window still
# holds over 20 matmuls.
PROBE_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)
PROBE_MATMUL_S = 2e-4
PROBE_MAX_CHAIN = 1 << 16
# A budget is spent as several short calls (median taken) rather than one long one: calls of ~4 ms fit in an OS
# scheduler slice on a healthy host even under load, while a rank throttled throughout is slow in every call
# (a CFS quota of 1 ms per 10 ms stretches a 4 ms call to ~40 ms). Longer calls are preempted on healthy ranks
# too, which blurs the throttled rank's score.
PROBE_CALL_S = 4e-3
PROBE_MAX_REPEATS = 25
# Per window the probe's cost model follows the measured probe time (median over ranks), by at most this factor
# either way: a load burst during one probe does not swing the next probe's size by more.
PROBE_RESCALE_LIMIT = 2.0
# Processes on one host (a local multi-process run) time their window-end probes one at a time, under a host-wide
# file lock: run together they compete for the same cores, and whichever the OS serves last looks slow (healthy
# workers of an unslowed 4-process run on 2 cores were flagged that way). One process per host, the usual
# multi-host layout, never takes the lock. The most seconds a probe waits for its turn before it runs anyway:
PROBE_LOCK_TIMEOUT_S = 60.0
# Figures that decide who is a straggler, with the floor of their denominator as a fraction of the median step
# time: host stalls and lags are ~0 on healthy ranks (without a floor microseconds of noise, or a sentinel's
# timer slack, would make huge ratios); a rank's own compute is a large part of a compute-bound step, and its floor
# keeps a step made almost entirely of communication from flagging a rank for a few milliseconds of it.
SCORED_FIGURES = {"own_compute_s": 0.05, "host_lag_s": 0.1, "host_stall_s": 0.1}
# Scored and reported, never flagging a rank on their own (the module docstring: the probe is a second signal).
ADVISORY_FIGURES = {"probe_s": 0.0}
# The lag sentinel's sleep: 100 wake-ups a second cost ~0.3% of one core, and a pause shorter than a tick still
# shows (the tick it falls in ends late by it).
LAG_TICK_S = 0.01


class LagSentinel:
    """A daemon thread that sleeps in ticks of `tick_s` and adds up how late it wakes (see the module docstring,
    lag_s). `start()`, `stop()`, `lag_s` (the total so far, seconds; read from any thread). A healthy process's
    total is a small share of the wall time (timer slack, wake-up latency under load); a stopped or throttled
    one's is most of it."""

    def __init__(self, tick_s: float = LAG_TICK_S):
        self.tick_s = tick_s
        self.lag_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="msjax-lag-sentinel", daemon=True)

    def _run(self) -> None:
        # time.sleep, not Event.wait(timeout): half the CPU per tick (~0.3% of a core at 100 ticks a second,
        # against ~0.65%); stop() then waits up to one tick.
        while not self._stop.is_set():
            t0 = time.monotonic()
            time.sleep(self.tick_s)
            self.lag_s += max(0.0, time.monotonic() - t0 - self.tick_s)  # only this thread writes it

    def start(self) -> "LagSentinel":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10.0)


class MetricsSink(Protocol):
    """Where live per-rank metrics go besides files, e.g. the control plane's store.

    `publish` is called from the observer's background thread once per step; it must not block for long. A sink
    with a `close()` method gets one call after the observer's last row (a final flush).
    """

    def publish(self, rank: int, step: int, values: dict[str, float]) -> None: ...


def _log(msg: str) -> None:
    if jax.process_index() == 0:
        log.info(msg)


@contextmanager
def host_probe_turn(timeout_s: float = PROBE_LOCK_TIMEOUT_S):
    """Holds this host's probe lock (an exclusive `flock` on a file in the temporary directory) for the block, so
    that processes sharing the host's cores time their probes one after another. Waits at most `timeout_s` seconds,
    polling every millisecond; then it logs and runs the block without the lock rather than stall training. A lock
    file that cannot be opened (a read-only temporary directory) runs the block without it too."""
    path = Path(tempfile.gettempdir()) / f"msjax-probe-{os.getuid()}.lock"
    try:
        f = open(path, "a")
    except OSError as e:
        log.warning(f"observe: cannot open the host's probe lock {path} ({e.strerror}); probing without it")
        yield
        return
    with f:
        deadline = time.monotonic() + timeout_s
        locked = False
        while not locked:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    log.warning(f"observe: process {jax.process_index()} waited {timeout_s:.0f} s for the host's "
                                f"probe lock {path}; probing without it")
                    break
                time.sleep(1e-3)
        try:
            yield
        finally:
            if locked:
                fcntl.flock(f, fcntl.LOCK_UN)


@dataclass(frozen=True)
class ProbeCost:
    """Cost model of one probe call on this process's devices: wall seconds = overhead_s + chain * matmul_s.

    Attributes:
      size: matrix side n of the (n, n) float32 matmuls.
      overhead_s: seconds of a call with no matmul (dispatch to every local device and the wait for them).
      matmul_s: seconds per (n, n) @ (n, n) matmul + tanh, all local devices running concurrently.
    """

    size: int
    overhead_s: float
    matmul_s: float

    def predict(self, chain: int) -> float:
        """Predicted wall seconds of a probe of `chain` matmuls."""
        return self.overhead_s + chain * self.matmul_s

    def chain_for(self, budget_s: float, max_chain: int = PROBE_MAX_CHAIN) -> int:
        """The longest chain (>= 1, <= max_chain) predicted to take at most `budget_s` seconds; 1 when even one
        matmul is predicted over the budget (the caller reports that as over budget)."""
        room = (budget_s - self.overhead_s) / max(self.matmul_s, 1e-12)
        return int(min(max_chain, max(1, math.floor(room))))

    def scaled(self, factor: float) -> "ProbeCost":
        """The same model with both times multiplied by `factor` (the machine got faster or slower)."""
        return ProbeCost(self.size, self.overhead_s * factor, self.matmul_s * factor)


class ComputeProbe:
    """A collective-free chain of matmuls timed on every device of this process, sized to a time budget.

    One call runs `chain` dependent (n, n) float32 matmuls (`a = tanh(a @ x)`, 2 n^3 FLOPs each) on every local
    device at once and waits for all of them; a probe is `repeats` calls, and its figure is *seconds per matmul*
    (median call wall / chain), so windows whose chains differ compare (the per-call dispatch is amortised over the
    chain: at chains of a few matmuls it weighs more). The chain length is a traced argument (a while loop):
    changing it compiles nothing.

    Why several short calls and a median when the budget allows (`plan`), 1 call otherwise: a healthy rank
    preempted once by the OS loses one call, which the median drops (a single call would show it whole, as a
    one-window spike); a rank slowed throughout (a throttled GPU, a CPU cgroup quota) is slow in every call. A
    throttle that works in slices (CFS: 1 ms of CPU per 10 ms) shows in every call only when a call outlasts its
    quota slice: a probe of a few matmuls can slip through between pauses. The budget grows with the window's wall
    time, so once a straggler slows the run its probe gets longer.

    Args:
      devices: the devices to probe (this process's devices of the mesh).
      sizes: candidate matrix sides for `calibrate`, ascending.
    """

    def __init__(self, devices: Sequence[jax.Device], sizes: Sequence[int] = PROBE_SIZES):
        self._devices = list(devices)
        self._sizes = tuple(sorted(sizes))

        def body(x, chain):
            return jax.lax.fori_loop(0, chain, lambda i, a: jnp.tanh(a @ x), x)

        self._fn = jax.jit(body)
        self._inputs: dict[int, list[jax.Array]] = {}
        self._chain_args: dict[int, list[jax.Array]] = {}
        self.cost: ProbeCost | None = None
        self.chain = 1
        self.repeats = 1

    def _args(self, size: int, chain: int) -> tuple[list[jax.Array], list[jax.Array]]:
        if size not in self._inputs:
            host = (np.random.default_rng(size).standard_normal((size, size)) / math.sqrt(size)).astype(np.float32)
            self._inputs[size] = [jax.device_put(host, d) for d in self._devices]
            zero = [jax.device_put(np.int32(0), d) for d in self._devices]
            jax.block_until_ready([self._fn(x, c) for x, c in zip(self._inputs[size], zero)])  # compile now
        if chain not in self._chain_args:  # the loop bound lives on each device: a call transfers nothing
            self._chain_args[chain] = [jax.device_put(np.int32(chain), d) for d in self._devices]
        return self._inputs[size], self._chain_args[chain]

    def time_call(self, size: int, chain: int) -> float:
        """Wall seconds of one probe call of `chain` (n=size) matmuls on every local device (compiled first)."""
        xs, cs = self._args(size, chain)
        t0 = time.perf_counter()
        jax.block_until_ready([self._fn(x, c) for x, c in zip(xs, cs)])
        return time.perf_counter() - t0

    def measure(self, size: int, samples: int = 5, chain: int = 16) -> ProbeCost:
        """Fits the cost model at `size`: the median of `samples` calls with no matmul (overhead) and with
        `chain` matmuls (overhead + chain x matmul)."""
        empty = float(np.median([self.time_call(size, 0) for _ in range(samples)]))
        full = float(np.median([self.time_call(size, chain) for _ in range(samples)]))
        return ProbeCost(size, empty, max((full - empty) / chain, 1e-9))

    def calibrate(self, matmul_target_s: float = PROBE_MATMUL_S) -> ProbeCost:
        """The cost at the largest candidate size whose matmul takes at most `matmul_target_s` (the smallest
        candidate when none does): work per matmul well above dispatch noise, yet fine steps of chain length.
        Sets `self.cost`. Takes a few compilations (one per size tried) and about a second on a CPU."""
        best = None
        for size in self._sizes:
            cost = self.measure(size)
            if best is not None and cost.matmul_s > matmul_target_s:
                break
            best = cost
            if cost.matmul_s > matmul_target_s:
                break
        self.cost = best
        return best

    def plan(self, budget_s: float, call_s: float = PROBE_CALL_S, max_repeats: int = PROBE_MAX_REPEATS) -> bool:
        """Sets repeats and chain for a probe of at most `budget_s` seconds: calls of about `call_s` each,
        between 3 and `max_repeats` of them (longer calls beyond that), or 1 call when 3 calls of one matmul do
        not fit; the chain is the longest predicted to fit. False when even one call of one matmul is predicted
        over the budget (the probe then runs 1 x 1). Needs `self.cost`."""
        if 3 * self.cost.predict(1) <= budget_s:
            self.repeats = int(min(max_repeats, max(3, budget_s // call_s)))
        else:
            self.repeats = 1
        self.chain = self.cost.chain_for(budget_s / self.repeats)
        return self.cost.predict(1) <= budget_s

    def rescale(self, measured_s: float, limit: float = PROBE_RESCALE_LIMIT) -> float:
        """Follows the machine's speed: multiplies the cost model by measured / predicted wall time of a probe of
        the current plan (`measured_s`: the probe's whole wall time), clamped to [1/limit, limit] (one probe hit by
        a burst of load moves the model by at most that). Returns the factor applied."""
        predicted = self.repeats * self.cost.predict(self.chain)
        factor = min(limit, max(1.0 / limit, measured_s / max(predicted, 1e-12)))
        self.cost = self.cost.scaled(factor)
        return factor

    def __call__(self) -> tuple[float, float]:
        """(seconds per matmul, wall seconds): the median call's wall / chain, and the whole probe's wall time
        (`self.repeats` calls of `self.chain` matmuls at `self.cost.size`)."""
        walls = [self.time_call(self.cost.size, self.chain) for _ in range(self.repeats)]
        return float(np.median(walls)) / self.chain, float(np.sum(walls))


class StepObserver(Hook):
    """The loop hook of `msjax.observe`: per-rank step metrics, GC control and straggler detection.

    Writes (every process): `<run_dir>/ranks/rank<i>.jsonl` (one row per step, see the module docstring),
    `<run_dir>/ranks/rank<i>.meta.json` (process, host, pid, mesh coordinates) and TensorBoard scalars under
    `<run_dir>/tb/rank<i>`. Process 0 also writes `<run_dir>/ranks/windows.jsonl` (per-window figures and scores
    of every rank) and straggler events to `<run_dir>/events.jsonl`.

    Args:
      cfg: the run's `ObserveConfig` (`config.observe`).
      sinks: `MetricsSink`s that get every row (the control plane's live sink among them, when the run has one);
        closed (when they have a `close`) at the end of the run.
      exclude_host: `exclude_host(host, reason)` records a host for exclusion at the next restart (the control
        plane's, `RedisMetricsSink.exclude_host`); None without a control plane. Used with
        `observe.exclude_stragglers`.
    """

    def __init__(self, cfg: Any, sinks: Sequence[MetricsSink] = (),
                 exclude_host: Callable[[str, str], None] | None = None):
        self.cfg = cfg
        self.sinks = list(sinks)
        self.exclude_host = exclude_host
        self.stragglers: list[dict[str, Any]] = []  # events raised, for callers and tests
        self.window_rows: list[dict[str, Any]] = []
        self._queue: queue.Queue = queue.Queue()
        self._cv = threading.Condition()
        self._rows: list[dict[str, Any]] = []  # rows of the current window (watcher -> main thread)
        self._done_step = -1
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._data_wait: DataWait | None = None  # the run's, from on_start
        advisory = dict(ADVISORY_FIGURES) if cfg.probe else {}
        # rebuilt in on_start once the ranks' hosts are known (own_compute_s may be advisory there)
        self._detector = StragglerDetector({**SCORED_FIGURES, **advisory}, cfg.threshold, cfg.persist,
                                           advisory=tuple(advisory))

    # ---- set-up and tear-down -----------------------------------------------------------------------------------

    def on_start(self, ctx: RunContext) -> None:
        self.rank, self.nproc = jax.process_index(), jax.process_count()
        self.run_dir = Path(ctx.run_dir)
        self._data_wait = ctx.data_wait
        layout = ctx.program.layout
        self.tokens_per_step, self.peak = layout.tokens_per_step, layout.peak_flops
        self._mfu = layout.mfu
        self._lr = ctx.program.learning_rates  # lr of step s is entry s - 1, the table the loop logs
        hosts = self._gather_hosts()
        self.places: dict[int, RankPlace] = mesh_places(ctx.mesh.devices, hosts=hosts)
        here = self.places[self.rank].host
        self._shares_host = sum(place.host == here for place in self.places.values()) > 1
        advisory = dict(ADVISORY_FIGURES) if self.cfg.probe else {}
        per_host = [place.host for place in self.places.values()]
        if ctx.mesh.devices.flat[0].platform == "cpu" and len(set(per_host)) < len(per_host):
            # Processes whose devices are the same host's CPUs: each one's compute time follows how the OS shares
            # the cores among them, not its own speed (module docstring).
            advisory["own_compute_s"] = SCORED_FIGURES["own_compute_s"]
        self._detector = StragglerDetector({**SCORED_FIGURES, **advisory}, self.cfg.threshold, self.cfg.persist,
                                           advisory=tuple(advisory))
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
        self._tb_every = max(1, ctx.config.train.log_every)  # TensorBoard at the loop's log cadence (per-step rows are in JSONL)
        local = [d for d in ctx.mesh.devices.flat if d.process_index == self.rank]
        self._probe = None
        # One process has no peer to compare its probe with: no calibration (~0.5 s at start) and no probes.
        if self.cfg.window and self.cfg.probe and self.nproc > 1:
            self._probe = ComputeProbe(local)
            self._probe.cost = self._agreed_cost(self._probe)
            self._probe.chain = self._probe.repeats = 1  # no step time yet, no budget: the smallest probe at first
        # The first window's probe is that single 1-matmul call: one preemption shows in it whole (a healthy
        # worker of a loaded machine can score far past any threshold), so it is recorded but not scored; probes
        # are scored from the first one planned to the window's budget (`_replan`).
        self._probe_planned = False
        self._over_budget_logged = False
        self._observer_s = 0.0  # main-thread seconds inside on_step_end since the last window end
        self._watch_cpu = self._watch_cpu_mark = 0.0  # the watcher thread's CPU seconds (cumulative; at last window)
        ARRIVALS.clear()  # marks left by an earlier run in this process
        self._sentinel = LagSentinel().start()
        self._gc_was_enabled = gc.isenabled()
        if self.cfg.gc_every:
            gc.collect()
            gc.disable()
        self._thread = threading.Thread(target=self._watch, name=f"msjax-observe-rank{self.rank}", daemon=True)
        self._thread.start()
        self._window_t0 = time.perf_counter()

    def _allgather(self, x: np.ndarray) -> np.ndarray:
        """(P, ...) the same array from every process (jax's multihost all-gather; no collective alone)."""
        if self.nproc == 1:
            return np.asarray(x)[None]
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x))

    def _agreed_cost(self, probe: ComputeProbe) -> ProbeCost:
        """Calibrates the probe; every rank must then run the same size and chain (its figure is compared across
        ranks and the window's exchange waits for the slowest probe): the size is the smallest any rank chose,
        the cost model the median over ranks at that size. Two small all-gathers, once per run."""
        cost = probe.calibrate()
        if self.nproc == 1:
            return cost
        size = int(self._allgather(np.array([cost.size], np.int32))[:, 0].min())
        if size != cost.size:
            cost = probe.measure(size)
        every = self._allgather(np.array([cost.overhead_s, cost.matmul_s], np.float32))  # (P, 2)
        return ProbeCost(size, float(np.median(every[:, 0])), float(np.median(every[:, 1])))

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
        if getattr(self, "_sentinel", None) is not None:
            self._sentinel.stop()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=60.0)
            if self._thread.is_alive():
                _log("observe: the metrics thread did not finish within 60 s after the loop ended; leaving it")
        for sink in self.sinks:
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
        self._queue.put((step, metrics, issue_t, host, tm.get("steps", 1)))
        if self.cfg.window and step % self.cfg.window == 0:
            self._window_end(ctx, step, now)
        else:
            self._observer_s += time.perf_counter() - now

    def _watch(self) -> None:
        """Background thread: waits for each step's results in order and writes its row."""
        prev_done: float | None = None
        lag_mark = self._sentinel.lag_s
        first = True
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    return
                step, metrics, issue_t, host, n = item  # n: steps the call ran (train.steps_per_execution)
                # The step's outputs become ready together: the first conversion waits for the step, and its end
                # is the step's done time. float(np.asarray(x)) per scalar costs several times less CPU than
                # block_until_ready + jax.device_get of the whole dict.
                values, done = {}, None
                for k, v in metrics.items():
                    a = np.asarray(v)
                    if a.ndim == 0:  # scalars; an array report (a mixture of experts' load) is logged elsewhere
                        values[k] = float(a)
                    if done is None:
                        done = time.perf_counter()
                if prev_done is None:
                    step_s, stall, start = done - issue_t, 0.0, issue_t
                    data_idle = host["data_s"]
                else:
                    step_s = done - prev_done
                    stall = max(0.0, issue_t - prev_done)
                    start = max(issue_t, prev_done)
                    # the batch wait's part after the previous step was done (the loop fetched, then issued)
                    data_idle = max(0.0, issue_t - max(issue_t - host["data_s"], prev_done))
                if self._data_wait is not None:
                    self._data_wait.add(host["data_s"], data_idle)
                compute = done - start
                if n > 1:  # the row gives per-step figures: a call of n steps, averaged over them
                    step_s, stall, compute = step_s / n, stall / n, compute / n
                    host = {key: value / n for key, value in host.items()}
                marks = ARRIVALS.take(step)  # every local device's marks: the step is done, so they are in
                arrived = {}
                if marks.get("start") and marks.get("arrive"):
                    arrived["own_compute_s"] = max(0.0, max(marks["arrive"]) - min(marks["start"]))
                lag_now = self._sentinel.lag_s
                lag, lag_mark = lag_now - lag_mark, lag_now
                prev_done = done
                row = {"step": step, "time": time.time(), "step_s": step_s, "compute_s": compute, **arrived,
                       "host_lag_s": lag, "host_stall_s": stall, **host,
                       "tokens_per_s": self.tokens_per_step / step_s if step_s > 0 else 0.0,
                       "mfu": self._mfu(1.0 / step_s) if step_s > 0 else 0.0,
                       "lr": float(self._lr[min(step, len(self._lr)) - 1]), **values}
                if first:
                    row["compile"] = True
                self._emit(step, row)
                if first and self.cfg.per_rank:
                    self._jsonl.flush()  # the first row says "compiled and running" to whoever tails the file
                cpu = time.thread_time()
                with self._cv:
                    if not first:
                        self._rows.append(row)
                    self._watch_cpu = cpu
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
                for k in TB_FIGURES:
                    if k in row:
                        self._tb.add_scalar(k, row[k], step)
        values = {k: v for k, v in row.items() if k != "step"}
        for sink in self.sinks:
            sink.publish(self.rank, step, values)

    # ---- every window -------------------------------------------------------------------------------------------

    def _window_end(self, ctx: RunContext, step: int, entered: float) -> None:
        """The window's one host sync: waits for its last step, times the probe, gathers every rank's figures
        (`entered`: perf_counter when this on_step_end began)."""
        t_wait = time.perf_counter()
        with self._cv:
            ok = self._cv.wait_for(lambda: self._done_step >= step or self._error is not None, WAIT_TIMEOUT_S)
            waited = time.perf_counter() - t_wait  # the device finishing queued steps: not the observer's time
            if not ok:
                raise TimeoutError(f"observe: step {step}'s results were not ready on process {self.rank} within "
                                   f"{WAIT_TIMEOUT_S:.0f} s (window end)")
            if self._error is not None:
                raise RuntimeError(f"observe: the metrics thread failed: {self._error!r}") from self._error
            rows, self._rows = self._rows, []
            watch_cpu, self._watch_cpu_mark = self._watch_cpu - self._watch_cpu_mark, self._watch_cpu
            if self.cfg.per_rank:
                self._jsonl.flush()
        figures = {k: float(np.mean([r[k] for r in rows if k in r])) if any(k in r for r in rows) else 0.0
                   for k in ("step_s", "compute_s", "own_compute_s", "host_lag_s", "host_stall_s", "data_s",
                             "checkpoint_s", "gc_s")}
        figures["step_median_s"] = float(np.median([r["step_s"] for r in rows])) if rows else 0.0
        probe_plan = None
        if self._probe is not None:
            probe_plan = {"size": self._probe.cost.size, "chain": self._probe.chain, "repeats": self._probe.repeats}
            with host_probe_turn() if self._shares_host else nullcontext():
                figures["probe_s"], figures["probe_wall_s"] = self._probe()
        else:
            figures["probe_s"] = figures["probe_wall_s"] = 0.0
        t_probe = time.perf_counter()
        figures.update(window_s=t_probe - self._window_t0, observer_s=self._observer_s + t_probe - entered - waited,
                       watcher_cpu_s=watch_cpu)
        mine = np.array([figures[k] for k in WINDOW_FIGURES], np.float32)
        every = self._allgather(mine)  # (P, F): the window's one collective
        if rows:  # a window holding only the compilation step has nothing to compare
            per_fig = {k: every[:, i] for i, k in enumerate(WINDOW_FIGURES)}
            unscored = () if self._probe_planned else ("probe_s",)
            if not per_fig["own_compute_s"].any():  # no rank's step carried arrival marks
                unscored += ("own_compute_s",)
            if probe_plan is not None:
                probe_plan.update(self._replan(per_fig, step))
                self._probe_planned = True
            self._compare(ctx, step, per_fig, probe_plan, unscored)
        # The exchange (and the comparison) count toward the next window's observer time; the next window starts
        # where this one's probe ended.
        self._window_t0 = t_probe
        self._observer_s = time.perf_counter() - t_probe

    def _replan(self, per_fig: dict[str, np.ndarray], step: int) -> dict[str, Any]:
        """Sizes the next window's probe to `observe.probe_budget` of the window's wall time.

        Every rank computes the same plan from the same gathered figures: the expected window time is `window` x
        the median over ranks of the median step (robust to a checkpoint, an eval, the previous probe, and to the
        straggler itself), and the cost model is rescaled by the median over ranks of measured / predicted probe
        time (by at most PROBE_RESCALE_LIMIT), so the probe follows the machine's speed and the run's step time.
        Returns the plan's record for windows.jsonl.
        """
        probe = self._probe
        probe.rescale(float(np.median(per_fig["probe_wall_s"])))
        budget_s = self.cfg.probe_budget * self.cfg.window * float(np.median(per_fig["step_median_s"]))
        fits = probe.plan(budget_s)
        if not fits and not self._over_budget_logged:
            self._over_budget_logged = True
            _log(f"observe: at step {step} even a 1-matmul probe ({probe.cost.predict(1) * 1e3:.2f} ms predicted) "
                 f"is over observe.probe_budget={self.cfg.probe_budget} of the window ({budget_s * 1e3:.2f} ms); "
                 f"it runs anyway (a longer observe.window lowers its share)")
        return {"next_chain": probe.chain, "next_repeats": probe.repeats, "next_budget_s": budget_s, "next_fits": fits,
                "matmul_s_model": probe.cost.matmul_s, "overhead_s_model": probe.cost.overhead_s}

    def _compare(self, ctx: RunContext, step: int, per_fig: dict[str, np.ndarray],
                 probe_plan: dict[str, Any] | None, unscored: Sequence[str] = ()) -> None:
        verdict = self._detector.update(per_fig, step_s=float(np.median(per_fig["step_s"])), unscored=unscored)
        row = {"step": step, "time": time.time(), "figures": {k: v.tolist() for k, v in per_fig.items()},
               "scores": {k: v.tolist() for k, v in verdict.scores.items()}, "stragglers": verdict.stragglers,
               "probe": probe_plan}
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
        exclude = self.exclude_host
        if not self.cfg.exclude_stragglers or not place.host:
            return
        if exclude is None:
            _log(f"observe: exclude_stragglers is on but the run has no control plane: {place.host} is not excluded")
            return
        exclude(place.host, f"straggler: process {place.process} at step {step}, slowdown {why} (threshold "
                            f"{self.cfg.threshold} for {self.cfg.persist} windows)")
        _log(f"observe: host {place.host} recorded for exclusion at the next restart (observe.exclude_stragglers)")
        append_event(self.run_dir, "straggler_excluded", step=step, process=place.process, host=place.host)
