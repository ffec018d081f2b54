"""Faults with real processes, files and signals: a checkpoint directory made read-only mid-run, SIGTERM/SIGINT
and a second signal. Each run is a subprocess (tests/msjax/fault_driver.py) on the tiny config; a shared
persistent compilation cache keeps the repeats cheap. (kill -9 inside a save: test_checkpoint_kill.py, each kill
seen to land mid-write, and test_supervise_e2e.py, kills of supervised workers during their saves.)

The reference is an uninterrupted run of the same config; every interrupted-then-resumed run must end with a
state whose sha256 over all leaves equals the reference's (bit-identical)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from msjax.checkpoint import Checkpointer
from msjax.config import CheckpointConfig
from msjax.faults import DUPLICATE_WINDOW_S

DRIVER = Path(__file__).resolve().parent / "fault_driver.py"
STEPS = 40  # long enough that a signal sent at step 3 arrives before the run ends


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("jax_cache")


def _env(jax_cache: Path) -> dict:
    return {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(jax_cache),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def _start(tmp: Path, corpus: Path, jax_cache: Path, overrides: dict, *extra: str) -> subprocess.Popen:
    base = {"train.steps": STEPS, "optimizer.decay_steps": STEPS, "train.eval_every": 0, "train.sample_tokens": 0}
    out = tmp / f"out-{time.monotonic_ns()}.json"
    proc = subprocess.Popen([sys.executable, str(DRIVER), str(tmp), str(corpus), json.dumps({**base, **overrides}),
                             str(out), *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(jax_cache))
    proc.out_path = out
    return proc


def _finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str, dict | None]:
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"the run did not exit within {timeout} s (hung)")
    out = json.loads(proc.out_path.read_text()) if proc.out_path.exists() else None
    return proc.returncode, stdout, stderr, out


def _wait_for_line(proc: subprocess.Popen, prefix: str, timeout: float = 240) -> list[str]:
    """Reads stdout lines until one starts with `prefix`; returns the lines read."""
    lines, deadline = [], time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.strip())
        if line.startswith(prefix):
            return lines
    proc.kill()
    pytest.fail(f"no line starting with {prefix!r} within {timeout} s; got {lines[-5:]}")


@pytest.fixture(scope="module")
def reference_digest(tmp_path_factory, small_corpus, jax_cache) -> str:
    tmp = tmp_path_factory.mktemp("fault_reference")
    rc, _, err, out = _finish(_start(tmp, small_corpus, jax_cache, {"checkpoint.every": 100}))
    assert rc == 0, err
    return out["digest"]


def _resume(tmp: Path, corpus: Path, jax_cache: Path, overrides: dict | None = None) -> dict:
    rc, _, err, out = _finish(_start(tmp, corpus, jax_cache, {"checkpoint.resume": True, **(overrides or {})}))
    assert rc == 0, err
    return out


# ---- 1: a checkpoint write that fails ------------------------------------------------------------------------

@pytest.mark.slow
def test_failed_write_stops_promptly_with_one_error_and_keeps_the_previous_checkpoint(tmp_path, small_corpus,
                                                                                       jax_cache):
    ckpt_dir = tmp_path / "run" / "checkpoints"
    proc = _start(tmp_path, small_corpus, jax_cache, {"checkpoint.every": 4}, "--lock-after-checkpoint=4")
    try:
        rc, stdout, stderr, _ = _finish(proc, timeout=400)  # never hangs (a run takes ~15 s on a quiet machine)
    finally:
        subprocess.run(["chattr", "-i", str(ckpt_dir)], check=False)
    assert "locked" in stdout, stdout
    steps = [int(line.split()[1]) for line in stdout.splitlines() if line.startswith("step ")]
    # The write of step 8 fails in the background; the run stops within a step or two (0.5 s each), not at the
    # next save (step 12), where Orbax would first notice it.
    assert rc == 1 and steps[-1] < 12, (rc, steps[-1], stderr[-2000:])
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert f"{ckpt_dir}/8" in errors[0] and "Operation not permitted" in errors[0], errors[0]
    # run() raised in the driver's own process and left no thread behind: the driver then returned 1 through a
    # normal interpreter exit (which waits for every non-daemon thread), not os._exit.
    assert "threads left: []" in stdout, [line for line in stdout.splitlines() if line.startswith("threads left")]
    assert Checkpointer(CheckpointConfig(), ckpt_dir).all_steps() == [4]  # the previous checkpoint is kept


# ---- 4: signals ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.slow
def test_signal_finishes_the_step_saves_exits_0_and_resumes_bit_identically(tmp_path, small_corpus, jax_cache,
                                                                           reference_digest, sig):
    proc = _start(tmp_path, small_corpus, jax_cache, {"checkpoint.every": 100})
    _wait_for_line(proc, "step 3")
    proc.send_signal(sig)
    rc, stdout, stderr, out = _finish(proc, timeout=300)
    assert rc == 0, stderr[-3000:]
    stopped = out["summary"]["final_step"]
    assert out["summary"]["stop_reason"] == f"received {sig.name}" and 3 <= stopped < STEPS
    assert out["summary"]["checkpoints"] == [stopped]
    resumed = _resume(tmp_path, small_corpus, jax_cache)
    assert resumed["summary"]["start_step"] == stopped and resumed["digest"] == reference_digest
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [(r["step"], tuple(sorted(r))) for r in rows]
    assert len(logged) == len(set(logged))  # no row of a step written twice by the stopped and the resumed run


@pytest.mark.slow
def test_second_signal_exits_at_once_and_leaves_nothing_taken_for_complete(tmp_path, small_corpus, jax_cache,
                                                                          reference_digest):
    # The stop's last step lasts 10 s (--slow-stop): without it the tiny run may stop, save and restore the default
    # SIGTERM handler before the second signal comes, and die of it (-15) rather than exit 143 by our handler.
    proc = _start(tmp_path, small_corpus, jax_cache, {"checkpoint.every": 1}, "--slow-stop=10")
    _wait_for_line(proc, "checkpoint 3 started")
    proc.send_signal(signal.SIGTERM)
    # Signals sent back to back coalesce into one Python handler call: wait until the first was handled.
    deadline = time.time() + 120
    while "SIGTERM received" not in proc.stderr.readline() and time.time() < deadline:
        pass
    # Later than a duplicate delivery of the same notice, which is ignored (msjax.faults.DUPLICATE_WINDOW_S).
    time.sleep(DUPLICATE_WINDOW_S + 0.1)
    proc.send_signal(signal.SIGTERM)
    t0 = time.time()
    rc, _, stderr, out = _finish(proc, timeout=60)
    assert rc == 128 + signal.SIGTERM and out is None and time.time() - t0 < 30, stderr[-2000:]
    resumed = _resume(tmp_path, small_corpus, jax_cache)
    assert resumed["digest"] == reference_digest


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.slow
def test_the_train_command_exits_128_plus_the_signal_after_saving(tmp_path, small_corpus, jax_cache, sig):
    """`python -m msjax.train` stopped by a signal: it finishes the step, saves, says so and exits 128 + the signal
    (143, 130), never 0 (0 means finished: a shell's `train && next_step`, or a Kubernetes pod taken for
    succeeded, must not mistake an interrupted run for a finished one); --resume then finishes it with 0 (after
    SIGTERM)."""
    run_dir = tmp_path / "run"
    flags = ["--config=gpt_tiny", "--model.num_layers=2", "--model.d_model=32", "--model.num_heads=2",
             "--model.max_seq_len=32", f"--data.paths={small_corpus}", "--data.tokenizer=char",
             "--train.seq_len=32", "--train.global_batch=8", "--train.eval_every=0", "--train.sample_tokens=0",
             "--train.progress=false", "--train.log_every=1", f"--train.run_dir={run_dir}",
             "--checkpoint.every=1000", "--mesh.data=1", f"--train.steps={STEPS}",
             f"--optimizer.decay_steps={STEPS}"]
    env = {**_env(jax_cache), "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    proc = subprocess.Popen([sys.executable, "-m", "msjax.train", *flags], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 240
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, (proc.returncode, stderr[-2000:])
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["stop_reason"] == f"received {sig.name}" and summary["stop_signal"] == sig
    assert summary["checkpoints"] == [summary["final_step"]] and summary["final_step"] < STEPS
    assert f"{sig.name} received: finishing the step, saving" in stderr
    if sig != signal.SIGTERM:
        return  # resuming is the same after either signal: once is enough for the suite's time
    done = subprocess.run([sys.executable, "-m", "msjax.train", *flags, "--resume"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["start_step"] == summary["final_step"]
