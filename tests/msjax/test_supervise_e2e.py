"""The supervisor with real processes and a real Redis server: 2 worker processes x 2 CPU devices train a tiny GPT
under `msjax.launch.cli.run_supervised` (what `msjax-launch --supervise` runs) while faults are injected by a
watcher the test passes in (scripts/bench_recovery.py's FaultInjector: it signals a worker's process, its pid from
the one heartbeat, once the worker reports the step).

- kill -9 of a random worker at a random step, then SIGSTOP of a worker in the restarted job, then SIGTERM of a
  worker (a preemption notice) in the next: each detected (exit code; missed heartbeats within the timeout; every
  worker saving at the same step and leaving with 143, "stopped", not finished and not diagnosed), the dead or
  hung worker blamed (never the one that left because of it), the job restarted from the newest checkpoint, at
  most one checkpoint interval recomputed (none after the SIGTERM), and the final parameters equal the
  uninterrupted run's bit for bit. The terminal shows what an unsupervised run shows (rank 0's lines and every
  rank's warnings and errors, `[rank R] `), and a worker that left because its peer died says so in one line:
  no traceback, no C++ stack.
- a fault loop (the same worker killed at every start): the restart budget ends the run with a report.
No process is left behind (every descendant carries a tag in its environment; none may survive the run).
Checkpoints are written synchronously here so "at most one interval" is exact (an asynchronous save that is
still being written when the kill lands is not restorable, which can cost one more interval).
"""

import importlib.util
import io
import json
import random
import re
import sys
import uuid
from pathlib import Path

import jax
import numpy as np
import psutil
import pytest

from msjax import cli
from msjax.checkpoint import Checkpointer
from msjax.config import config_from_flags
from msjax.launch.cli import run_supervised
from msjax.launch.options import LaunchOptions
from msjax.mesh import make_mesh
from msjax.events import read_events
from msjax.supervise.figures import fault_figures
from msjax.train_step import build_train_program

ROOT = Path(__file__).resolve().parents[2]
# A heartbeat timeout generous enough for a 2-core machine shared with other jobs (a worker's heartbeat thread can
# go seconds without CPU while XLA compiles); SIGSTOP detection then takes about TIMEOUT.
STEPS, EVERY, PERIOD, TIMEOUT = 12, 3, 1.0, 8.0


def _bench():
    spec = importlib.util.spec_from_file_location("bench_recovery", ROOT / "scripts" / "bench_recovery.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their class's module up while it is being defined
    spec.loader.exec_module(module)
    return module


bench = _bench()


def _flags(corpus: Path, run_dir: Path, cache: Path, **extra) -> list[str]:
    flags = {
        "config": "gpt_tiny", "model.num_layers": 2, "model.d_model": 32, "model.num_heads": 2,
        "model.max_seq_len": 32, "data.paths": corpus, "data.tokenizer": "char", "data.val_fraction": 0.2,
        "data.cache_dir": cache, "train.seq_len": 32, "train.global_batch": 8, "train.steps": STEPS,
        "train.eval_every": 0, "train.eval_batches": 2, "train.sample_tokens": 0, "train.progress": False,
        "train.log_every": 1, "train.run_dir": run_dir, "optimizer.warmup_steps": 2, "optimizer.decay_steps": STEPS,
        "checkpoint.every": EVERY, "checkpoint.async_save": False, "mesh.data": 2, "mesh.fsdp": 2,
        "mesh.tensor": 1, "supervisor.heartbeat_period_s": PERIOD, "supervisor.heartbeat_timeout_s": TIMEOUT,
        "supervisor.stop_grace_s": 2, "supervisor.backoff_s": 0.1, "supervisor.startup_timeout_s": 240,
        "supervisor.diagnose_timeout_s": 90, **extra,
    }
    return [f"--{k}={v}" for k, v in flags.items()]


def _supervise(tmp: Path, corpus: Path, cache: Path, monkeypatch, *faults, **cfg) -> tuple[int, str, list[dict]]:
    """Runs a supervised 2-host job to its end with `faults` injected; returns (exit code, the terminal's text,
    events) and checks that nothing it started survived."""
    tag = uuid.uuid4().hex
    monkeypatch.setenv("SUPERVISE_TEST_TAG", tag)
    flags = _flags(corpus, tmp / "run", cache, **cfg)
    config, _ = cli.parse(flags)
    out = io.StringIO()
    code = run_supervised(LaunchOptions(num_processes=2, devices_per_process=2, supervise=True), config,
                          f"e2e-{tag[:8]}", flags, out=out,
                          watchers=[bench.FaultInjector(list(faults), tmp / "health")])
    left = []
    for p in psutil.process_iter():
        try:
            if p.pid != psutil.Process().pid and p.environ().get("SUPERVISE_TEST_TAG") == tag:
                left.append((p.pid, " ".join(p.cmdline())[:120]))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    assert not left, f"processes left behind: {left}"
    events = read_events(tmp / "run" / "events.jsonl") if (tmp / "run" / "events.jsonl").exists() else []
    return code, out.getvalue(), events


def _final_params(run_dir: Path, step: int = STEPS) -> list[np.ndarray]:
    """The parameters of a run's newest checkpoint (which must be `step`), restored onto its own (2 x 2) layout on
    4 of our devices."""
    saved = json.loads((run_dir / "config.json").read_text())
    flags = [(k, str(v)) for k, v in (("model.vocab_size", saved["model"]["vocab_size"]),
                                      ("mesh.data", 2), ("mesh.fsdp", 2), ("mesh.tensor", 1),
                                      ("train.microbatches", 1))]
    cfg = config_from_flags([("model.num_layers", "2"), ("model.d_model", "32"), ("model.num_heads", "2"),
                             ("model.max_seq_len", "32"), ("train.seq_len", "32"), ("train.global_batch", "8"),
                             ("train.steps", str(STEPS)), ("optimizer.warmup_steps", "2"),
                             ("optimizer.decay_steps", str(STEPS)), *flags])
    program = build_train_program(cfg, make_mesh(cfg.mesh, jax.devices()[:4]))
    got, state, _ = Checkpointer(cfg.checkpoint, run_dir / "checkpoints").restore(program.abstract_state)
    assert got == step  # the newest verified checkpoint is the final step
    return jax.tree.leaves(jax.device_get(state["params"]))


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("token_cache")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_corpus, cache) -> tuple[Path, str]:
    """The uninterrupted supervised run (no faults): its run directory and its terminal text."""
    tmp = tmp_path_factory.mktemp("reference")
    with pytest.MonkeyPatch.context() as monkeypatch:
        # no restart here: no warm standby workers to pay for (they import jax while the run trains)
        code, out, events = _supervise(tmp, small_corpus, cache, monkeypatch, **{"supervisor.standby": False})
    assert code == 0, out[-3000:]
    assert [e["kind"] for e in events].count("launch") == 1
    return tmp / "run", out


def _terminal_ranks(out: str) -> dict[int, list[str]]:
    ranks: dict[int, list[str]] = {}
    for m in re.finditer(r"^\[rank (\d+)\] (.*)$", out, re.M):
        ranks.setdefault(int(m.group(1)), []).append(m.group(2))
    return ranks


@pytest.mark.slow
def test_kill_sigstop_and_sigterm_recover_to_the_uninterrupted_parameters(tmp_path, small_corpus, cache, reference,
                                                                         monkeypatch):
    rng = random.Random()
    # The injector acts at the heartbeat that shows the step (one per PERIOD): up to a couple of steps late. The
    # SIGSTOP must land before the loop's last step, or it stops a worker that is exiting, which the supervisor
    # rightly gives its startup timeout, not the heartbeat timeout.
    kill, stop, term = (bench.Fault("kill", rng.randint(0, 1), rng.randint(EVERY + 1, 2 * EVERY), 0),
                        bench.Fault("stop", rng.randint(0, 1), rng.randint(1, 2), 1),
                        bench.Fault("term", rng.randint(0, 1), 1, 2))
    code, out, events = _supervise(tmp_path, small_corpus, cache, monkeypatch, kill, stop, term)
    note = f"{kill}, {stop}, {term}\n{out[-4000:]}"
    assert code == 0, note
    kinds = [e["kind"] for e in events]
    assert kinds.count("fault_injected") == 3 and kinds.count("launch") == 4, note
    launches = [e for e in events if e["kind"] == "launch"]
    assert [e["standbys_used"] for e in launches] == [0, 2, 2, 2], note  # restarts start from warm standbys
    detected = [e for e in events if e["kind"] == "detected"]
    # the dead worker is blamed, not the one that left because it died
    assert [(f["rank"], f["kind"]) for f in detected[0]["failures"]] == [(kill.rank, "exit")], note
    assert "SIGKILL" in detected[0]["failures"][0]["detail"]
    assert all(f["kind"] == "peer_lost" for f in detected[0]["collateral"]), note
    assert [(f["rank"], f["kind"]) for f in detected[1]["failures"]] == [(stop.rank, "heartbeat")], note
    # a preemption notice: every worker saved at the same step and left with 143, "stopped"
    assert {(f["kind"], f["detail"]) for f in detected[2]["failures"]} == {
        ("stopped", "stopped by SIGTERM (exit code 143)")}, note
    figures = fault_figures(events)
    # SIGSTOP: found by the heartbeat timeout, within it plus one heartbeat period of polling slack
    assert figures[1]["detection_s"] <= TIMEOUT + PERIOD, (figures[1], note)
    for f in figures[:2]:
        assert 0 <= f["recomputed_steps"] <= EVERY, (f, note)  # at most one checkpoint interval recomputed
    starts = [e["start_step"] for e in events if e["kind"] == "worker_start" and e["attempt"] == 3]
    assert starts and starts[0] >= figures[2]["step"] and figures[2]["recomputed_steps"] == 0, note
    assert not [e for e in events if e["kind"] == "excluded"]  # healthy hosts pass their diagnostics
    # a worker killed or stopped by a signal from outside points at no device: no self-checks then; a hang
    # (SIGSTOP) gets them
    assert kinds.count("diagnosis_skipped") == 2 and kinds.count("diagnosed") == 1, note
    assert kinds.index("diagnosis_skipped") < kinds.index("diagnosed") < len(kinds) - kinds[::-1].index(
        "diagnosis_skipped"), note
    assert "effective training time" in out
    # the goodput ledger over the four attempts: every second of the run's wall time in a bucket (within 1%),
    # restarts and the recomputed steps named, and the ETTR the supervisor printed is the ledger's
    ledger = json.loads((tmp_path / "run" / "goodput.json").read_text())
    b, wall = ledger["buckets"], ledger["wall_s"]
    assert ledger["source"] == "supervisor" and len(ledger["attempts"]) == 4, note
    assert abs(sum(b.values()) - wall) <= 0.01 * wall, (b, wall)
    assert b["restart"] > 0 and b["productive"] > 0 and b["compilation"] > 0 and b["startup"] > 0, b
    # the ledger counts the steps rank 0 completed past the next restore (a heartbeat's step is only dispatched)
    for a, f in zip(ledger["attempts"], figures):
        assert 0 <= a["recomputed_steps"] <= f["recomputed_steps"], (ledger["attempts"], figures)
    assert (b["recomputed"] > 0) == any(a["recomputed_steps"] for a in ledger["attempts"]), b
    assert f"effective training time: {ledger['ettr']:.1%}" in out
    # the terminal: as an unsupervised run's (rank 0's lines; another rank's only warnings and errors) ...
    ranks = _terminal_ranks(out)
    assert any(line.startswith('{"val_loss"') for line in ranks[0]), note
    alert = re.compile(r"^(error: |warning: |msjax: rank \d+ stopping: |stopping: lost the JAX|[WEF]\d{4} |"
                       r"Traceback|\S.*Warning: |  )")
    assert all(alert.match(line) for line in ranks.get(1, [])), ranks.get(1)
    # ... and the worker that left because its peer died said so in one line, without a stack
    survivor = 1 - kill.rank
    leave = [line for line in ranks.get(survivor, []) if "stopping" in line]
    assert leave and ("rank %d (host%d) failed" % (kill.rank, kill.rank) in leave[0]
                      or leave[0].startswith("stopping: lost the JAX distributed service")), note
    assert "Traceback" not in out and not re.search(r"^\[rank \d\]\s+@\s+0x", out, re.M), note
    # the same thing, fault-free: the reference run's terminal has rank 0's lines and nothing of rank 1
    assert 1 not in _terminal_ranks(reference[1])
    for x, y in zip(_final_params(reference[0]), _final_params(tmp_path / "run")):
        np.testing.assert_array_equal(x, y)


@pytest.mark.slow
def test_fault_loop_ends_on_the_restart_budget(tmp_path, small_corpus, cache, monkeypatch):
    code, out, events = _supervise(tmp_path, small_corpus, cache, monkeypatch, bench.Fault("kill", 1, 0, None),
                                   **{"supervisor.restart_budget": 1, "supervisor.diagnose": False,
                                      "supervisor.standby": False})
    assert code == 4, out[-3000:]
    assert "restart budget exhausted: 1 restart(s) allowed (supervisor.restart_budget=1)" in out
    assert "fault loop" in out
    kinds = [e["kind"] for e in events]
    assert kinds.count("launch") == 2 and events[-1]["kind"] == "run_end"
    assert events[-1]["status"] == "budget_exhausted"
