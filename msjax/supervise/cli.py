"""Entry points of a supervised local run.

    python scripts/launch.py --backend=local --num_processes=2 --devices_per_process=2 --supervise -- <train flags>
    python -m msjax.supervise --hosts=2 --devices_per_host=2 <train flags> [--inject=kill:1@40 ...]
    python -m msjax.supervise --backend=slurm [--nodes=n1,n2,n3] --hosts=2 <train flags>   (inside an allocation)
    python -m msjax.supervise --backend=k8s --hosts=4 --run_id=RUN <train flags>   (a JobSet's controller)

`launch.py` (msjax.control.launch) hands a local run to `supervise_local` when `--supervise` is given or the
train flags say `--supervisor.enabled=true`. `python -m msjax.supervise` is the same with its own flags:
`--hosts`, `--devices_per_host` (CPU devices each; 0 leaves devices alone), `--redis_url` (an existing Redis;
default: MSJAX_REDIS_URL, else a private server for this run), `--run_id`, `--inject` (repeatable),
`--backend` (local: worker processes on this machine; slurm: an srun step on the allocation's nodes, see
msjax.supervise.slurm; k8s: watch a JobSet's workers and restart them through it, see msjax.supervise.k8s),
`--nodes` (slurm: the nodes to use, default the allocation's; `--hosts` of them run
workers, the rest are spares).

Fault injection is for tests and benchmarks only: `--inject=SPEC` or MSJAX_TEST_INJECT=SPEC[,SPEC...] (what
`launch.py` runs take), SPEC as in `msjax.supervise.supervisor.Fault.parse`.

Exit codes: 0 finished, 2 bad input, 3 no hosts or no layout left, 4 restart budget exhausted.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Sequence

from msjax.config import ConfigError, config_from_flags, parse_args, split_flags

INJECT_ENV = "MSJAX_TEST_INJECT"


def faults_from_env() -> list:
    """The faults in MSJAX_TEST_INJECT (comma-separated specs). Raises ValueError naming a bad spec."""
    from msjax.supervise.supervisor import Fault

    return [Fault.parse(x) for x in os.environ.get(INJECT_ENV, "").split(",") if x.strip()]


def supervise_local(train_flags: Sequence[str], num_hosts: int, devices_per_host: int = 0,
                    redis_url: str | None = None, run_id: str | None = None, faults: Sequence = (),
                    rdzv_timeout_s: int = 300, out=sys.stdout, backend: str = "local",
                    nodes: Sequence[str] | None = None) -> int:
    """Runs `scripts/train.py <train_flags>` on `num_hosts` local worker processes under the supervisor.

    Args:
      train_flags: the workers' flags (the config, including its `supervisor` section, is parsed from them).
      num_hosts: worker processes (one per host); `supervisor.spares` more are held back.
      devices_per_host: CPU devices per worker (0: leave the device setup alone, one device each on CPU).
      redis_url: an existing Redis; None starts a private one (msjax.control.server.RedisServer).
      run_id: the run's namespace in Redis (default: generated).
      faults: faults to inject (tests, benchmarks), plus those in MSJAX_TEST_INJECT.
      rdzv_timeout_s: the workers' rendezvous timeout.
      backend: "local" (worker processes here) or "slurm" (an srun step over `nodes`: msjax.supervise.slurm).
      nodes: slurm: the allocation's nodes in SLURM's order (None: `scontrol show hostnames $SLURM_JOB_NODELIST`).
    Returns:
      The exit code (see the module docstring); bad flags print `error: ...` and return 2.
    """
    from msjax.control.server import RedisServer
    from msjax.supervise.supervisor import LocalBackend, Supervisor

    try:
        cfg, rest = parse_args(list(train_flags))
        if rest:
            raise ConfigError(f"unexpected train flags {rest}; flags look like --train.steps=100")
        faults = list(faults) + faults_from_env()
        hosts = None
        if backend == "slurm":
            from msjax.supervise.slurm import allocation_nodes

            hosts = list(nodes) if nodes else allocation_nodes()
            if len(hosts) < num_hosts:
                raise ValueError(f"--hosts={num_hosts} but the allocation has {len(hosts)} node(s) {hosts}")
        elif backend == "k8s" and not run_id:
            raise ValueError("--backend=k8s needs --run_id (the JobSet workers' MSJAX_RUN_ID)")
        elif backend not in ("local", "k8s"):
            raise ValueError(f"--backend={backend!r}: allowed are local, slurm, k8s")
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    def interrupted(signum, frame):  # unwind through Supervisor.run's cleanup: workers stopped, Redis stopped
        raise SupervisorInterrupted(signum)

    previous = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGTERM, signal.SIGINT)}
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: [signal.signal(sig, h) for sig, h in previous.items()])
        if backend in ("slurm", "k8s"):  # the job's Redis (the batch script's, the manifest's Service)
            redis_url = redis_url or os.environ.get("MSJAX_REDIS_URL")
        if not redis_url:
            redis_url = stack.enter_context(RedisServer()).url
        log_dir = Path(cfg.train.run_dir) / "supervisor"
        if backend == "slurm":
            from msjax.supervise.slurm import SlurmBackend

            workers = SlurmBackend(train_flags, hosts, log_dir, devices_per_host, rdzv_timeout_s=rdzv_timeout_s)
        elif backend == "k8s":
            from msjax.supervise.k8s import JobSetBackend
            from msjax.supervise.store import HeartbeatStore

            workers = JobSetBackend(HeartbeatStore.from_url(redis_url, run_id or ""))
        else:
            workers = LocalBackend(train_flags, devices_per_host, log_dir, rdzv_timeout_s=rdzv_timeout_s,
                                   standby=cfg.supervisor.standby)
        sup = Supervisor(cfg, workers, redis_url, num_hosts, devices_per_host or _devices_per_host(backend),
                         faults, run_id=run_id, out=out, hosts=hosts)
        try:
            return sup.run().exit_code
        except SupervisorInterrupted as e:
            print(f"[supervisor] interrupted by {signal.Signals(e.signum).name}: workers stopped", file=out,
                  flush=True)
            return 128 + e.signum


def _devices_per_host(backend: str) -> int:
    """Devices on each host when not forced (for re-planning): 1 for local CPU workers; on SLURM, the GPUs per
    node of the allocation (SLURM_GPUS_ON_NODE, else SLURM_GPUS_PER_NODE as `N` or `TYPE:N`), else 1. Not asked of
    jax: the supervisor shares the first node with a worker and must not take its accelerators."""
    if backend != "slurm":
        return 1
    for var in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        value = os.environ.get(var, "").rsplit(":", 1)[-1]
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


class SupervisorInterrupted(Exception):
    """SIGTERM or SIGINT reached the supervisor (its workers are stopped on the way out)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def main(argv: Sequence[str] | None = None, out=sys.stdout) -> int:
    """`python -m msjax.supervise`: returns the exit code (see the module docstring)."""
    from msjax.supervise.supervisor import Fault

    try:
        pairs, positional = split_flags(sys.argv[1:] if argv is None else argv, valueless={"resume"})
        if positional:
            raise ConfigError(f"unexpected arguments {positional}; flags look like --train.steps=100")
        own = {"hosts": 1, "devices_per_host": 0, "redis_url": "", "run_id": "", "backend": "local", "nodes": ""}
        faults, train_flags = [], []
        for key, value in pairs:
            if key == "inject":
                faults.append(Fault.parse(value))
            elif key in ("hosts", "devices_per_host"):
                try:
                    own[key] = int(value)
                except ValueError:
                    raise ConfigError(f"--{key}={value!r}: allowed is an integer") from None
                if own[key] < (1 if key == "hosts" else 0):
                    raise ConfigError(f"--{key}={value}: allowed is an integer >= {1 if key == 'hosts' else 0}")
            elif key in own:
                own[key] = value
            else:
                train_flags.append("--resume" if key == "resume" else f"--{key}={value}")
        config_from_flags([])  # the presets load (a broken checkout fails here, before anything starts)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    nodes = [x for x in own["nodes"].split(",") if x] or None
    return supervise_local(train_flags, own["hosts"], own["devices_per_host"], own["redis_url"] or None,
                           own["run_id"] or None, faults, out=out, backend=own["backend"], nodes=nodes)
