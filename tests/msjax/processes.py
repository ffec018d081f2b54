"""Two processes of one jax job on this machine, optionally as two hosts that share no disk."""

import json
import socket
import subprocess
import sys
from pathlib import Path


def two_processes(script: str, args: list[str], timeout: float, private_tmpfs: Path | None = None) -> list:
    """Runs `script` (python -c) as processes 0 and 1 of one jax job (a free loopback port as the coordinator's),
    each given `args`; returns the JSON object each printed last. A process still running at the end is killed.
    `private_tmpfs`: each process runs in a mount namespace of its own with a fresh tmpfs mounted there, as two
    hosts whose local disks are their own (gone with the process)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    repo = Path(__file__).resolve().parents[2]
    private = ([] if private_tmpfs is None else  # unshare(1): util-linux, and root, as the SLURM tests need
               ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                'mount -t tmpfs msjax-host "$0" && exec "$@"', str(private_tmpfs)])
    procs = [subprocess.Popen([*private, sys.executable, "-c", script, str(i), str(port), *args], cwd=repo,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
        return outs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
