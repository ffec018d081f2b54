"""The straggler proof without a launcher: two jax.distributed processes (4 CPU devices each) train through
scripts/train.py, each pinned to its own core by the test. In one run, CPU burners pinned to process 1's core
slow it from outside (no hook in msjax's code), starting once the first step (compilation) is done, so a straggler
appears mid-run: process 1 must be flagged, with its host and mesh coordinates, in the log, events.jsonl and the
report. In the same run without burners nobody is flagged. Both runs share jax's persistent compilation cache so
that only the first compiles (compiling on a third of a core takes minutes).

(When scripts/launch.py lands, this moves onto it with 4 processes.)"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SLOW = 1  # the process the burners slow down
# jax.make_mesh orders devices by process (0-3 then 4-7) and data is the outermost non-trivial axis here.
SLOW_COORDS = {"pipeline": [0], "data": [1], "fsdp": [0, 1], "sequence": [0], "tensor": [0, 1]}

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                reason="needs Linux CPU affinity and at least 2 cores")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flags(tmp: Path, corpus: Path) -> list[str]:
    return ["--config=gpt_tiny", "--model.num_layers=2", "--model.d_model=64", "--model.num_heads=2",
            "--model.max_seq_len=32", f"--data.paths={corpus}", "--data.tokenizer=char", "--data.val_fraction=0.2",
            f"--data.cache_dir={tmp / 'cache'}", "--train.seq_len=32", "--train.global_batch=8",
            "--train.steps=20", "--train.eval_every=0", "--train.eval_batches=1", "--train.sample_tokens=0",
            "--train.log_every=4", f"--train.run_dir={tmp / 'run'}", "--train.progress=false",
            "--checkpoint.every=1000", "--mesh.data=2", "--mesh.fsdp=2", "--mesh.tensor=2",
            "--observe.window=4", "--observe.threshold=1.5", "--observe.persist=2"]


def _train_two_processes(tmp: Path, corpus: Path, cache: Path, burners: int) -> tuple[list[str], Path]:
    cores = sorted(os.sched_getaffinity(0))[:2]
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=4", PYTHONUNBUFFERED="1",
               JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
               JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    procs, burn = [], []
    try:
        for i in range(2):
            procs.append(subprocess.Popen(
                [sys.executable, "scripts/train.py", *_flags(tmp, corpus)], cwd=ROOT,
                env={**env, "JAX_PROCESS_ID": str(i)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                preexec_fn=lambda core=cores[i]: os.sched_setaffinity(0, {core})))  # every thread inherits it
        if burners:
            rows = tmp / "run" / "ranks" / f"rank{SLOW}.jsonl"
            deadline = time.monotonic() + 400
            while not (rows.exists() and rows.read_text().count("\n") >= 1):  # step 1 (compilation) done
                assert time.monotonic() < deadline, f"waited 400 s for {rows} to show step 1"
                ended = [p for p in procs if p.poll() is not None]
                assert not ended, f"a training process ended before step 1: {ended[0].communicate()[0][-3000:]}"
                time.sleep(0.2)
            burn = [subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cores[SLOW]}}})"
                                      "\nwhile True: pass"]) for _ in range(burners)]
        outs = []
        for p in procs:
            out, _ = p.communicate(timeout=400)
            assert p.returncode == 0, out[-3000:]
            outs.append(out)
    finally:
        for p in procs + burn:
            p.kill()
            p.wait(timeout=30)
    return outs, tmp / "run"


@pytest.fixture(scope="module")
def corpus(small_corpus):
    return small_corpus


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("jax_cache")


@pytest.mark.slow
def test_the_same_run_unslowed_flags_nobody(tmp_path, corpus, cache):
    _, run_dir = _train_two_processes(tmp_path / "plain", corpus, cache, burners=0)
    windows = [json.loads(line) for line in (run_dir / "ranks" / "windows.jsonl").read_text().splitlines()]
    assert [w["step"] for w in windows] == [4, 8, 12, 16, 20]
    assert all(w["stragglers"] == [] for w in windows), windows
    events = (run_dir / "events.jsonl").read_text() if (run_dir / "events.jsonl").exists() else ""
    assert '"straggler"' not in events


@pytest.mark.slow
def test_a_process_slowed_from_outside_is_flagged_with_its_coordinates(tmp_path, corpus, cache):
    outs, run_dir = _train_two_processes(tmp_path / "slowed", corpus, cache, burners=2)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    flagged = [e for e in events if e["kind"] == "straggler"]
    windows = [json.loads(line) for line in (run_dir / "ranks" / "windows.jsonl").read_text().splitlines()]
    assert flagged, ("no straggler flagged", windows)
    assert {e["process"] for e in flagged} == {SLOW}, flagged
    assert flagged[0]["coords"] == SLOW_COORDS and flagged[0]["host"] == socket.gethostname()
    assert flagged[0]["scores"]["probe_s"] >= 1.5
    assert f"straggler at step {flagged[0]['step']}: process {SLOW} on {socket.gethostname()}" in outs[0]
    proc = subprocess.run([sys.executable, "scripts/report.py", str(run_dir)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    page = (run_dir / "report" / "index.html").read_text()
    assert f"<td>{flagged[0]['step']}</td><td>{SLOW}</td>" in page and "heatmap_probe.png" in page
