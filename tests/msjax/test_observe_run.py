"""Observability on a small real run (8 fake CPU devices, data 2 x fsdp 2 x tensor 2): per-step per-rank rows
that agree with the loop's own metrics and with the optax schedule, GC off during training and collected at the
configured steps, a live sink fed every step, and a profile requested mid-run (SIGUSR1) that lands as a trace of
exactly the requested steps while the losses stay bit-identical to the run without it."""

import gc
import json
import math
import os
import signal

import numpy as np
import pytest

from msjax.hooks import Hook
from msjax.events import read_events
from msjax.observe import traced_steps
from msjax.train import run

STEPS, WINDOW, GC_EVERY = 8, 4, 3


class Probe(Hook):
    """Records what the loop looks like from a hook and, as a live metrics sink, what the observer publishes;
    optionally sends SIGUSR1 to this process at one step."""

    def __init__(self, signal_at: int | None = None):
        self.signal_at = signal_at
        self.gc_enabled: list[bool] = []
        self.published: list[tuple[int, int, dict]] = []

    def publish(self, rank, step, values):
        self.published.append((rank, step, values))

    def on_step_end(self, ctx, step, metrics):
        self.gc_enabled.append(gc.isenabled())
        if step == self.signal_at:
            os.kill(os.getpid(), signal.SIGUSR1)


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "ranks" / "rank0.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_corpus):
    from tests.msjax.conftest import tiny_run_config

    out = {}
    for name, signal_at in (("plain", None), ("profiled", 3)):
        tmp = tmp_path_factory.mktemp(name)
        cfg = tiny_run_config(tmp, small_corpus, **{
            "train.steps": STEPS, "train.sample_tokens": 0, "observe.window": WINDOW,
            "observe.gc_every": GC_EVERY, "observe.profile_signal_steps": 2})
        probe = Probe(signal_at)
        gc_before = gc.isenabled()
        run(cfg, hooks=[probe], sinks=[probe])
        out[name] = (tmp / "run", probe, gc_before)
    return out


def test_every_step_has_a_row_consistent_with_the_loop_and_the_schedule(runs):
    run_dir, probe, _ = runs["plain"]
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[0].get("compile") and not any(r.get("compile") for r in rows[1:])
    logged = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
              if "loss" in r}
    assert logged, "the loop logged nothing"
    for r in rows:
        for k in ("step_s", "compute_s", "host_stall_s", "data_s", "dispatch_s", "checkpoint_s", "gc_s",
                  "tokens_per_s", "mfu", "loss", "grad_norm", "lr"):
            assert math.isfinite(r[k]) and r[k] >= 0, (k, r)
        assert r["step_s"] > 0 and r["compute_s"] <= r["step_s"] + 1e-9
        assert abs(r["tokens_per_s"] * r["step_s"] - 8 * 32) < 1e-6  # global_batch x seq_len tokens per step
        if r["step"] in logged:  # the same device values the loop read at its log steps
            assert r["loss"] == logged[r["step"]]["loss"] and r["grad_norm"] == logged[r["step"]]["grad_norm"]
        # optimizer.lr 1e-3 (default), warmup 2, cosine to min_lr over 8 steps; step s uses schedule(s)
        s, warm, lr, min_lr = r["step"], 2, 1e-3, 1e-4
        want = lr * s / warm if s <= warm else min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * (s - warm) /
                                                                                        (8 - warm)))
        assert r["lr"] == pytest.approx(want, rel=1e-5), (s, r["lr"], want)
    meta = json.loads((run_dir / "ranks" / "rank0.meta.json").read_text())
    assert meta["coords"]["data"] == [0, 1] and meta["coords"]["tensor"] == [0, 1] and len(meta["devices"]) == 8
    assert list((run_dir / "tb" / "rank0").iterdir())
    assert [(rk, st) for rk, st, _ in probe.published] == [(0, s) for s in range(1, STEPS + 1)]
    windows = [json.loads(line) for line in (run_dir / "ranks" / "windows.jsonl").read_text().splitlines()]
    assert [w["step"] for w in windows] == [WINDOW, 2 * WINDOW] and all(w["stragglers"] == [] for w in windows)
    # one process: no peer to compare a probe with, so none is calibrated or run
    assert all(w["figures"]["probe_s"] == [0.0] and w["probe"] is None for w in windows)


def test_gc_is_off_during_training_and_runs_at_the_same_steps(runs):
    run_dir, probe, gc_before = runs["plain"]
    assert gc_before and not any(probe.gc_enabled) and gc.isenabled()
    collected = [r["step"] for r in _rows(run_dir) if r["gc_s"] > 0]
    assert collected == [s for s in range(1, STEPS + 1) if s % GC_EVERY == 0]


def test_profile_requested_mid_run_covers_the_steps_and_changes_no_loss(runs):
    plain_dir, _, _ = runs["plain"]
    prof_dir, _, _ = runs["profiled"]
    events = read_events(prof_dir, "profile")
    # SIGUSR1 arrives during step 3's hooks, after the profiler's own hook ran: the profiler sees the request at
    # the end of step 4 and traces the next 2 steps.
    assert [(e["first_step"], e["last_step"]) for e in events] == [(5, 6)]
    assert traced_steps(events[0]["path"]) == [5, 6]
    assert not (plain_dir / "profile").exists()
    assert [r["loss"] for r in _rows(prof_dir)] == [r["loss"] for r in _rows(plain_dir)]


class InFlightAtStepEnd(Hook):
    """How many dispatched steps are still being computed when the hooks after the observer see each step (`is_ready`
    of every earlier step's loss: no wait), with a host sync of its own (float of the loss, before looking) at the
    steps in `sync_at`."""

    def __init__(self, sync_at: tuple[int, ...]):
        self.sync_at, self.losses, self.in_flight = sync_at, {}, {}

    def on_step_end(self, ctx, step, metrics):
        if step in self.sync_at:
            float(metrics["loss"])
        # the first shard: what a host read (float, np.asarray) waits for; the other devices' replicas may lag
        self.losses[step] = metrics["loss"].addressable_shards[0].data
        self.in_flight[step] = sum(not x.is_ready() for x in self.losses.values())


@pytest.mark.slow
def test_the_observer_adds_no_host_sync_between_window_ends(tmp_path, small_corpus):
    """With all per-step metrics on, the loop does not wait for a step before dispatching the next: between window
    ends the host runs ahead of the devices, so the steps still being computed pile up when the hooks see a step
    (several at once), except at window ends (the window's one sync) and where a hook syncs on purpose (the
    control, proving that a sync shows). A host sync on every step would leave none in flight; one every other
    step at most one (the step after each sync), so the test asks for 3 in flight at some step of the first window
    and for most free steps to be unfinished when seen. The model (width 128, 16 x 64 tokens, 8 devices) is sized
    so a step's compute outlasts the host's per-step work."""
    from tests.msjax.conftest import tiny_run_config

    steps, window, sync_at = 16, 8, (12, 13)
    cfg = tiny_run_config(tmp_path, small_corpus, **{
        "model.d_model": 128, "model.num_heads": 4, "model.max_seq_len": 64, "train.seq_len": 64,
        "train.global_batch": 16, "train.steps": steps, "train.eval_every": 0, "train.log_every": 0,
        "train.sample_tokens": 0, "checkpoint.every": 0, "observe.window": window, "observe.gc_every": 3,
        "optimizer.decay_steps": steps})
    hook = InFlightAtStepEnd(sync_at)
    run(cfg, hooks=[hook])
    assert len(_rows(tmp_path / "run")) == steps  # every step's row was written, by the watcher thread
    assert all(hook.in_flight[s] == 0 for s in (window, *sync_at)), sorted(hook.in_flight.items())
    free = [s for s in range(2, steps) if s % window and s not in sync_at]  # step 1 compiles
    assert max(hook.in_flight[s] for s in range(2, window)) >= 3, sorted(hook.in_flight.items())
    assert sum(hook.in_flight[s] > 0 for s in free) >= 0.75 * len(free), sorted(hook.in_flight.items())


@pytest.mark.slow
def test_each_device_times_its_own_forward_and_backward_inside_the_step(layout_tokens):
    """msjax.parallel.arrival (observe.own_compute) on 8 devices (data 2 x fsdp 2 x tensor 2): every step records a
    start on each device and an arrival per device and accumulated microbatch, inside the step's wall time. From
    the first start to the last arrival is the forward pass and the backward's activation-gradient chain: with one
    microbatch most of the step (marks whose callbacks fired as soon as XLA reached them, not once their block was
    computed, spanned ~10% of it), never all of it. Evaluation records nothing, and neither does a step compiled
    without observe.own_compute."""
    import time

    import jax

    from msjax.mesh import make_mesh
    from msjax.parallel.arrival import ARRIVALS
    from msjax.train_step import build_train_program
    from tests.msjax.layouts import VOCAB, tiny_config

    spans = {}
    for micro in (2, 1):
        cfg = tiny_config(**{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "train.microbatches": micro,
                             "model.d_model": 128, "model.num_heads": 4, "observe.own_compute": True})
        program = build_train_program(cfg, make_mesh(cfg.mesh, jax.devices()[:8]), vocab_size=VOCAB)
        state = program.init_fn(jax.random.key(0))
        batch = {"inputs": jax.device_put(layout_tokens[:, :-1], program.batch_sharding),
                 "targets": jax.device_put(layout_tokens[:, 1:], program.batch_sharding)}
        state, metrics = program.step_fn(state, batch)  # compiles
        jax.block_until_ready(metrics)
        ARRIVALS.clear()
        spans[micro] = []
        for step in range(2, 6):
            t0 = time.perf_counter()
            state, metrics = program.step_fn(state, batch)
            jax.block_until_ready(metrics)
            wall = time.perf_counter() - t0
            marks = ARRIVALS.take(step)
            assert sorted(marks) == ["arrive", "start"]
            assert (len(marks["start"]), len(marks["arrive"])) == (8, 8 * micro)
            assert t0 < min(marks["start"]) and max(marks["arrive"]) < t0 + wall
            spans[micro].append((max(marks["arrive"]) - min(marks["start"])) / wall)
        jax.block_until_ready(program.eval_fn(state["params"], batch))
        assert ARRIVALS.take(6) == {}
    assert 0.35 < np.median(spans[1]) < 1.0, spans
    unmarked = build_train_program(tiny_config(**{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}),
                                   make_mesh(cfg.mesh, jax.devices()[:8]), vocab_size=VOCAB)
    jax.block_until_ready(unmarked.step_fn(unmarked.init_fn(jax.random.key(0)), batch))
    assert ARRIVALS.take(1) == {}


_LAG_CHILD = """
import sys, time
from msjax.observe.timing import LagSentinel
sentinel = LagSentinel().start()
print("ready", flush=True)
time.sleep(float(sys.argv[1]))
sentinel.stop()
print(sentinel.lag_s, flush=True)
"""


def test_the_lag_sentinel_counts_the_time_its_process_was_stopped():
    """Real signals: a process stopped twice for 0.4 s (SIGSTOP, SIGCONT) over 2 s of sleep reports at least 0.7 s
    of host lag; the same process left alone reports under 0.3 s (its timer slack and wake-up latency)."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    lags = {}
    for stopped in (True, False):
        child = subprocess.Popen([sys.executable, "-c", _LAG_CHILD, "2.0"], cwd=root, stdout=subprocess.PIPE,
                                 text=True)
        try:
            assert child.stdout.readline().strip() == "ready"
            if stopped:
                for _ in range(2):
                    time.sleep(0.3)
                    os.kill(child.pid, signal.SIGSTOP)
                    time.sleep(0.4)
                    os.kill(child.pid, signal.SIGCONT)
            lags[stopped] = float(child.stdout.readline())
            assert child.wait(30) == 0
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(10)
    assert lags[True] >= 0.7 and lags[False] < 0.3, lags
