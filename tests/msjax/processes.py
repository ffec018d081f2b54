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


# A script prelude for `two_processes`: after `jax.distributed.initialize`, a (data 2, fsdp 2) mesh over the two
# processes' 4 devices and a small state on it, `state(k)` (k times `full`, exactly) and its `abstract` twin:
# w split over fsdp (so replicated over data), b split over all four devices, n a replicated scalar.
TWO_HOST_STATE = r"""
mesh = jax.make_mesh((2, 2), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
rng = np.random.default_rng(0)
full = {"w": rng.normal(size=(8, 6)).astype(np.float32), "b": rng.normal(size=(16,)).astype(np.float32),
        "n": np.int32(7)}
specs = {"w": P("fsdp", None), "b": P(("data", "fsdp")), "n": P()}
def state(k):
    return {name: jax.make_array_from_callback(x.shape, NamedSharding(mesh, specs[name]),
                                               lambda i, x=x: (k * x)[i] if x.ndim else k * x)
            for name, x in full.items()}
abstract = {name: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, specs[name]))
            for name, x in full.items()}
"""
