"""Entry points of a supervised local run.

    python scripts/launch.py --backend=local --num_processes=2 --devices_per_process=2 --supervise -- <train flags>
    python -m msjax.supervise --hosts=2 --devices_per_host=2 <train flags> [--inject=kill:1@40 ...]
    python -m msjax.supervise --backend=slurm [--nodes=n1,n2,n3] --hosts=2 <train flags>   (inside an allocation)
    python -m msjax.supervise --backend=k8s --hosts=4 --run_id=RUN <train flags>   (a JobSet's controller)

`launch.py` (msjax.control.launch) hands a local run to `supervise_local` when `--supervise` is given or the
train flags say `--supervisor.enabled=true`. `python -m msjax.supervise` is the same with its own flags
(`SuperviseOptions`, parsed by msjax.cli; `--help` lists them and every config flag); every other flag is a
train.py flag, passed on to the workers as given.

Fault injection is for tests and benchmarks only: `--inject=SPEC[,SPEC...]` (repeatable) or
MSJAX_TEST_INJECT=SPEC[,SPEC...] (what `launch.py` runs take), SPEC as in `msjax.supervise.supervisor.Fault.parse`.

Exit codes: 0 finished, 2 bad input, 3 no hosts or no layout left, 4 restart budget exhausted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
from pathlib import Path
from typing import Literal, Sequence

from msjax import cli
from msjax.config import ConfigError

INJECT_ENV = "MSJAX_TEST_INJECT"


@dataclasses.dataclass(frozen=True)
class SuperviseOptions:
    """`python -m msjax.supervise`'s own flags (each takes a value); every other flag is a train.py flag.

    Attributes:
      hosts: worker hosts (one worker process each, >= 1); `supervisor.spares` more are held back.
      devices_per_host: CPU devices per worker (XLA_FLAGS); 0 leaves the device setup alone.
      redis_url: an existing Redis; empty: MSJAX_REDIS_URL (slurm, k8s), else a private server for this run.
      run_id: the run's namespace in Redis; empty: generated (k8s: required, the JobSet workers' MSJAX_RUN_ID).
      backend: local: workers on this machine; slurm: an srun step (msjax.supervise.slurm); k8s: a JobSet's workers.
      nodes: slurm: the nodes to use (default: the allocation's); `hosts` of them run workers, the rest are spares.
      inject: faults to inject (tests, benchmarks): KIND:RANK@[+]STEP[#ATTEMPT|#*], comma-separated or repeated.
    """

    hosts: int = 1
    devices_per_host: int = 0
    redis_url: str = ""
    run_id: str = ""
    backend: Literal["local", "slurm", "k8s"] = "local"
    nodes: tuple[str, ...] = ()
    inject: tuple[str, ...] = ()


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
        cfg, _ = cli.parse(list(train_flags), prog="train.py")
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


def parse_flags(argv: Sequence[str]) -> tuple[SuperviseOptions, list, list[str]]:
    """Parses `python -m msjax.supervise`'s command line (msjax.cli: its own flags, then config flags).

    Returns:
      (options, faults: list[Fault] from every --inject, train flags: `argv` less the supervisor's own flags, as
      given, for the workers' train.py).
    Raises:
      ConfigError: an unknown flag, a bad value (naming the flag and what is allowed) or a bad fault spec.
      SystemExit: after printing `--help` (status 0).
    """
    from msjax.supervise.supervisor import Fault

    # A repeated flag keeps its last value (argparse's rule): the repeated --inject flags become one list.
    injects, argv = _take_flags(argv, {"inject"})
    argv += [f"--inject={','.join(value for _, value in injects)}"] if injects else []
    _, (_, opts) = cli.parse(argv, SuperviseOptions(), prog="python -m msjax.supervise", description=__doc__)
    for flag, value, least in (("--hosts", opts.hosts, 1), ("--devices_per_host", opts.devices_per_host, 0)):
        if value < least:
            raise ConfigError(f"{flag}={value}: allowed is an integer >= {least}")
    try:
        faults = [Fault.parse(spec) for spec in opts.inject]
    except ValueError as e:
        raise ConfigError(f"--inject: {e}") from None
    _, train_flags = _take_flags(argv, {f.name for f in dataclasses.fields(SuperviseOptions)})
    return opts, faults, train_flags


def _take_flags(argv: Sequence[str], names: set[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """Splits `argv` into the flags named in `names` that have a value (`--name=value`, or `--name value` when
    the next argument is not a flag), as (name, value), and the other arguments, in order."""
    taken, rest, args = [], [], list(argv)
    while args:
        arg = args.pop(0)
        key, eq, value = arg.partition("=")
        if key.startswith("--") and key[2:] in names and (eq or (args and not args[0].startswith("--"))):
            taken.append((key[2:], value if eq else args.pop(0)))
        else:
            rest.append(arg)
    return taken, rest


def main(argv: Sequence[str] | None = None, out=sys.stdout) -> int:
    """`python -m msjax.supervise`: returns the exit code (see the module docstring)."""
    try:
        opts, faults, train_flags = parse_flags(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return supervise_local(train_flags, opts.hosts, opts.devices_per_host, opts.redis_url or None,
                           opts.run_id or None, faults, out=out, backend=opts.backend, nodes=list(opts.nodes) or None)
