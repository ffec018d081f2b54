"""What loop-level and multi-process tests share (importable, unlike conftest.py): the tiny run config, and a
job of several processes."""

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

from msjax.config import Config, apply_overrides


def tiny_run_config(tmp: Path, corpus: Path, **overrides) -> Config:
    """An 8-step char-level run of a 2-layer, width-32 GPT on data 2 x fsdp 2 x tensor 2, checkpoint every 4."""
    base = {
        "model.num_layers": 2, "model.d_model": 32, "model.num_heads": 2, "model.max_seq_len": 32,
        "data.paths": (str(corpus),), "data.tokenizer": "char", "data.val_fraction": 0.2,
        "data.cache_dir": str(tmp / "cache"), "train.seq_len": 32, "train.global_batch": 8, "train.steps": 8,
        "train.eval_every": 4, "train.eval_batches": 2, "train.log_every": 2, "train.sample_tokens": 20,
        "train.run_dir": str(tmp / "run"), "train.progress": False, "optimizer.warmup_steps": 2,
        "optimizer.decay_steps": 8, "checkpoint.every": 4, "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2,
    }
    return apply_overrides(Config(name="test"), {**base, **overrides}).validate()


def run_ranks(script: str, args: list[str], env: dict, cwd: Path, count: int = 2, timeout_s: float = 120.0
              ) -> list[str]:
    """Runs `python -c script RANK PORT *args` as `count` processes of one job (PORT: a free port for its
    jax.distributed coordinator) and returns their stdouts. Each must end within `timeout_s` seconds (else every
    one is killed and subprocess.TimeoutExpired raised) with exit status 0 (else an AssertionError with its stderr's
    tail)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), str(rank), str(port), *args], env=env,
                              cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(count)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout_s))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
                q.communicate()
            raise
    for rank, (p, (_, stderr)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank}: {stderr[-3000:]}"
    return [stdout for stdout, _ in outs]
