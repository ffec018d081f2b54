"""The local launcher (`python -m msjax.launch`, msjax.launch.local) with real processes and a real Redis: two
workers of 4 CPU devices each train shakespeare_char on a mesh spanning both (data 2 x tensor 4) and log the same
losses as one process with 8 devices; the run survives Redis being killed and restarted, obeys checkpoint/stop
commands (a launcher SIGTERM becomes a stop command naming it: the workers save and exit 143, and so does the
launcher), and leaves nothing running. The terminal shows rank 0's lines; every rank's are in
<run_dir>/logs/rank<R>.log. Bad URLs, passwords and ports are one clear error each."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from msjax.configs.shakespeare_char import CORPUS
from msjax.control.server import RedisServer
from msjax.control.store import Store, connect

ROOT = Path(__file__).resolve().parents[2]
SHAKESPEARE = Path(str(CORPUS))  # the corpus shipped in the package
TOL = 1e-5


def _flags(tmp: Path, run: str, steps: int) -> list[str]:
    return ["--config=shakespeare_char", f"--data.paths={SHAKESPEARE}", f"--data.cache_dir={tmp / 'cache'}",
            "--model.num_layers=2", "--model.d_model=32", "--model.num_heads=4", "--model.vocab_multiple=8",
            "--train.global_batch=8", f"--train.steps={steps}", "--train.log_every=1", "--train.eval_every=0",
            "--train.eval_batches=1", "--train.sample_tokens=0", "--train.progress=false",
            f"--train.run_dir={tmp / run}", "--optimizer.warmup_steps=5", "--optimizer.decay_steps=200",
            "--checkpoint.every=1000", "--mesh.data=2", "--mesh.tensor=4",
            "--model.matmul_dtype=activations"]  # float32 matmuls: equal within TOL (bf16 operands round apart)


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "MSJAX_"))}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


_REFERENCES: dict[int, dict[int, float]] = {}


def _reference(tmp: Path, steps: int) -> dict[int, float]:
    """Losses of one process with 8 CPU devices on the same mesh (cached per module; a longer run serves)."""
    for n, losses in _REFERENCES.items():
        if n >= steps:
            return {s: v for s, v in losses.items() if s <= steps}
    run = f"ref{steps}"
    proc = subprocess.run([sys.executable, "-m", "msjax.train", *_flags(tmp, run, steps)], cwd=ROOT,
                          env=_env(XLA_FLAGS="--xla_force_host_platform_device_count=8"), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _REFERENCES[steps] = _losses(tmp / run)
    return _REFERENCES[steps]


def _assert_same_losses(got: dict[int, float], ref: dict[int, float], upto: int) -> None:
    steps = [s for s in ref if s <= upto]
    assert len(steps) >= upto - 1 and set(steps) <= set(got), (sorted(got), sorted(ref))
    worst = max(abs(got[s] - ref[s]) for s in steps)
    assert worst < TOL, f"largest loss difference {worst:.3g} over steps {steps[0]}..{steps[-1]}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def _logs(run_dir: Path) -> str:
    """Every rank's log (<run_dir>/logs/rank<R>.log), one after the other."""
    return "".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob("rank*.log")))


def _pids(output: str, run_dir: Path) -> list[int]:
    """Worker pids (from each worker's `msjax.control: rank R of N (..., pid P, ...)` line in its log) and the
    Redis pid (from the launcher's line)."""
    logs = _logs(run_dir) if (run_dir / "logs").is_dir() else ""
    pids = [int(p) for p in re.findall(r"msjax\.control: rank \d+ of \d+ \(worker \S+ pid (\d+)", logs)]
    pids += [int(p) for p in re.findall(r"\[launch\] Redis \S+ \(pid (\d+)\)", output)]
    return pids


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("launch")


class _Launch:
    """A launch.py process whose output lines are collected by a thread (so waits can look for lines)."""

    def __init__(self, args: list[str]):
        self.proc = subprocess.Popen([sys.executable, "-m", "msjax.launch", *args], cwd=ROOT, env=_env(),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, what, timeout_s: float, desc: str):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = what()
            if got:
                return got
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout_s:g} s waiting for {desc}; output:\n{self.output[-4000:]}")

    def finish(self, timeout_s: float = 300) -> int:
        try:
            code = self.proc.wait(timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        self._reader.join(10)
        return code


@pytest.mark.slow
def test_redis_restart_commands_and_sigterm_mid_run(tmp):
    """Kill and restart Redis mid-run: both workers reconnect and train on with the same losses; a checkpoint
    command saves at a non-checkpoint step; SIGTERM to the launcher stops both workers after the same step."""
    with RedisServer() as srv:
        run = _Launch(["--backend=local", "--num_processes=2", "--devices_per_process=4", f"--redis_url={srv.url}",
                       "--run_id=restart-test", "--term_grace_s=120", "--", *_flags(tmp, "restart", 100_000)])
        try:
            store = Store(connect(srv.url), "restart-test")
            run.wait_for(lambda: {0, 1} <= set(store.heartbeats()) and min(
                h["step"] for h in store.heartbeats().values()) >= 2, 300, "both ranks training (heartbeats)")
            pids = _pids(run.output, tmp / "restart")
            sentinel = store.key("test-sentinel")
            store.client.set(sentinel, "before the restart")
            srv.kill()
            time.sleep(1.0)
            srv.start()
            # A fresh, empty server. (Not `heartbeats() == {}`: a worker may re-register between start and here.)
            assert store.client.get(sentinel) is None
            run.wait_for(lambda: {0, 1} <= set(store.heartbeats()), 90, "heartbeats of both ranks after restart")
            store.send_command("checkpoint")
            run.wait_for(lambda: _logs(tmp / "restart").count("checkpoint command applied") == 2, 120,
                         "the checkpoint command on both ranks")
            run.proc.send_signal(signal.SIGTERM)
            code = run.finish()
        finally:
            if run.proc.poll() is None:
                run.proc.kill()
        out = run.output
        logs = _logs(tmp / "restart")
    assert code == 128 + signal.SIGTERM, out[-4000:]
    assert "[launch] SIGTERM: stop command sent" in out
    # each worker saved, said why it stopped, and exited with the relayed signal's status: stopped, resumable
    assert "[launch] interrupted (SIGTERM); worker exit statuses [143, 143]" in out, out[-4000:]
    assert logs.count("re-registered with a restarted Redis") == 2, logs[-4000:]
    out = logs
    ckpt_steps = set(int(s) for s in re.findall(r"checkpoint command applied at step (\d+)", out))
    stop_steps = set(int(s) for s in re.findall(r"stop command applied at step (\d+)", out))
    assert len(ckpt_steps) == 1 and len(stop_steps) == 1, out[-4000:]  # the same step on both ranks
    (ckpt_step,), (stop_step,) = ckpt_steps, stop_steps
    saved = sorted(int(p.name) for p in (tmp / "restart" / "checkpoints").iterdir() if p.name.isdigit())
    assert saved == sorted({ckpt_step, stop_step}), (saved, ckpt_step, stop_step)
    assert len(pids) == 2 and not any(_alive(p) for p in pids)
    # One reference run serves both tests (the next one needs 12 steps): it covers every step of this run,
    # those after the Redis restart included.
    _assert_same_losses(_losses(tmp / "restart"), _reference(tmp, max(stop_step, 12)), stop_step)


@pytest.mark.slow
def test_two_processes_match_one_and_leave_nothing_running(tmp):
    steps = 12
    run = _Launch(["--backend=local", "--num_processes=2", "--devices_per_process=4", "--",
                   *_flags(tmp, "two", steps)])
    code = run.finish()
    out = run.output
    assert code == 0, out[-4000:]
    # the terminal: rank 0's lines (its JSON summary among them), none of rank 1's (no warning, no error); both
    # ranks' whole output in their log files
    assert re.search(r"^\[rank 0\] \{\"val_loss\"", out, re.M) and not re.search(r"^\[rank 1\] ", out, re.M), out
    assert "msjax.control: rank 1 of 2" in (tmp / "two" / "logs" / "rank1.log").read_text()
    assert "[launch] all 2 workers finished" in out
    pids = _pids(out, tmp / "two")
    assert len(pids) == 3 and not any(_alive(p) for p in pids), pids  # two workers and the private Redis
    _assert_same_losses(_losses(tmp / "two"), _reference(tmp, steps), steps)


@pytest.mark.slow
def test_launcher_errors_are_clear_and_start_nothing(tmp):
    with RedisServer() as srv:
        cases = [
            ([f"--redis_url={srv.url.replace(srv.password, 'wrong')}"], "refused the password"),
            (["--redis_url=redis://:pw@127.0.0.1:1/0"], "cannot reach Redis at redis://:***@127.0.0.1:1/0"),
            (["--redis_url=127.0.0.1:6379"], "is malformed"),
        ]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            port = s.getsockname()[1]
            cases.append(([f"--redis_port={port}"], f"port {port} on 127.0.0.1 is already in use"))
            cases.append((["--num_processes=0"], "--num_processes=0: must be >= 1"))
            for extra, message in cases:
                args = ["--backend=local", "--num_processes=2", "--devices_per_process=4", *extra, "--",
                        *_flags(tmp, "never", 2)]
                if extra[0].startswith("--num_processes"):
                    args.remove("--num_processes=2")
                proc = subprocess.run([sys.executable, "-m", "msjax.launch", *args], cwd=ROOT, env=_env(),
                                      capture_output=True, text=True, timeout=60)
                assert proc.returncode == 2 and proc.stderr.startswith("error: ") and message in proc.stderr, \
                    (extra, proc.stdout, proc.stderr)
                assert "[launch] Redis" not in proc.stdout and "msjax.control: rank" not in proc.stdout
    assert not (tmp / "never").exists()


def test_worker_with_a_wrong_password_is_one_error(tmp):
    with RedisServer() as srv:
        env = _env(MSJAX_REDIS_URL=srv.url.replace(srv.password, "wrong"), MSJAX_RUN_ID="pw",
                   MSJAX_NUM_PROCESSES="2", XLA_FLAGS="--xla_force_host_platform_device_count=4")
        proc = subprocess.run([sys.executable, "-m", "msjax.train", *_flags(tmp, "pw", 2)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: Redis at redis://:***@127.0.0.1:")
    assert "refused the password" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_sigkilled_launcher_leaves_no_orphans(tmp):
    """Even a SIGKILL of the launcher (no cleanup code runs) takes its workers and its Redis with it."""
    run = _Launch(["--backend=local", "--num_processes=2", "--devices_per_process=4", "--",
                   *_flags(tmp, "orphans", 100_000)])
    try:
        run.wait_for(lambda: len(_pids(run.output, tmp / "orphans")) == 3, 300,
                     "both workers' rank lines and the Redis line")
        pids = _pids(run.output, tmp / "orphans")
        assert all(_alive(p) for p in pids)
        run.proc.send_signal(signal.SIGKILL)
        run.finish(30)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), [p for p in pids if _alive(p)]
