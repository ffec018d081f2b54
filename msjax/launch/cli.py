"""The launcher's commands: start a job here, or write (and submit) the spec a cluster runs; run the supervisor.

    msjax-launch --backend=local --num_processes=2 --devices_per_process=4 [--supervise] -- --config=... --mesh.data=2
    msjax-launch --backend=slurm --num_processes=16 [--supervise] [--output=job.sbatch | --submit] -- <train flags>
    msjax-launch --backend=k8s --num_processes=16 --image=IMAGE [--supervise] [--output=job.yaml] -- <train flags>
    msjax-supervise --backend=local|slurm|k8s --num_processes=N ... -- <train flags>

`msjax-launch` (also `python -m msjax.launch`, scripts/launch.py) starts a local job (msjax.launch.local), under
the supervisor with --supervise, or writes the job's SLURM script (msjax.launch.slurm) or Kubernetes manifest
(msjax.launch.k8s), with the supervisor as its controller with --supervise. `msjax-supervise` is the supervisor
itself (msjax.supervise): a local supervised run, or a cluster job's controller, which the specs run (inside a
SLURM allocation: its nodes; beside a JobSet: its pods). Both take the same flags (`LaunchOptions`, before
`--`; `--help` lists them) and the train command's flags after `--` (`msjax-train --help`).

Before anything is rendered or started: the flags are parsed (a bad one is one `error: ...` line, status 2), and
the job's config is checked against its devices, num_processes x devices_per_process (msjax.launch.preflight:
the error the trainer itself would give, status 2).

Exit statuses: a local run, msjax.launch.local; under the supervisor 0 finished, 2 bad input, 3 no host or no
layout left, 4 restart budget exhausted, 128 + N stopped by signal N (the workers saved first); a spec: 0 when
written (and submitted).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from msjax import cli, runtime
from msjax.config import Config, ConfigError
from msjax.control.errors import ControlError
from msjax.launch import preflight
from msjax.launch.backends import BACKENDS
from msjax.launch.options import LaunchOptions, parse
from msjax.launch.output import Router


def _error(msg: object) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def new_run_id(name: str) -> str:
    """NAME-DATE-TIME-RANDOM: unique enough to keep concurrent runs apart on one Redis."""
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def _parse(argv: Sequence[str] | None, prog: str) -> tuple[cli.LoggingOptions, LaunchOptions, Config, list[str]]:
    common, opts, cfg, train_flags = parse(sys.argv[1:] if argv is None else argv, prog=prog, description=__doc__)
    if opts.submit and not BACKENDS[opts.backend].submits:
        raise ConfigError(f"--submit: allowed with --backend=slurm only (a Kubernetes manifest is applied with "
                          f"kubectl apply -f), not --backend={opts.backend}")
    checked = preflight.check(opts, cfg, remat_fixed="model.remat" in cli.explicit_keys(train_flags))
    if checked.model.remat != cfg.model.remat:  # the planner raised the preset's remat: the workers run it too
        train_flags = [*train_flags, f"--model.remat={checked.model.remat}"]
    return common, opts, checked, train_flags


def train(argv: Sequence[str] | None = None) -> int:
    """`msjax-train` (and scripts/train.py): the train command, `msjax.train.main`, with the planner's pre-flight
    check (`msjax.planner.preflight.check_layout`: mesh, split and memory estimate against the devices, with
    overrides that would fit; a preset's remat policy that does not fit is raised to the cheapest that does,
    unless `--model.remat` is given) before anything is read or compiled. The loop itself reads no planner; its
    entry point above it composes the two. Returns the exit status of `msjax.train.main`."""
    from msjax.planner.preflight import check_layout
    from msjax.train import main as train_main

    argv = list(sys.argv[1:] if argv is None else argv)
    remat_fixed = "model.remat" in cli.explicit_keys(argv)
    return train_main(argv, preflight=lambda cfg: check_layout(cfg, remat_fixed=remat_fixed).config)


def main(argv: Sequence[str] | None = None) -> int:
    """`msjax-launch`: returns the exit status (see the module docstring)."""
    runtime.setup()  # an entry point: the process set-up of a run (msjax.runtime)
    try:
        common, opts, cfg, train_flags = _parse(argv, "msjax-launch")
    except ConfigError as e:
        return _error(e)
    cli.setup_logging(common)
    run_id = opts.run_id or new_run_id(opts.name)
    if BACKENDS[opts.backend].runs_here:
        if opts.supervise:
            return run_supervised(opts, cfg, run_id, train_flags)
        from msjax.launch import local

        try:
            return local.run(opts, cfg, run_id, train_flags)
        except ControlError as e:
            return _error(e)
    try:
        text = spec(opts, cfg, run_id, train_flags)
    except ValueError as e:
        return _error(e)
    if opts.submit:
        from msjax.launch.slurm import submit

        path = Path(opts.output or f"{opts.name}-{run_id}.sbatch")
        try:
            job = submit(text, path)
        except (ValueError, OSError) as e:
            return _error(e)
        print(f"submitted {path} as job {job}", file=sys.stderr)
        print(job)
    elif opts.output:
        Path(opts.output).write_text(text)
        print(f"wrote {opts.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def spec(opts: LaunchOptions, cfg: Config, run_id: str, train_flags: Sequence[str]) -> str:
    """The cluster spec of the job as text: an sbatch script or a Kubernetes manifest, with the supervisor as its
    controller when `opts.supervise` (`msjax.launch.backends`). Raises ValueError for options the backend cannot
    honour, or for a backend whose workers run here (it has no spec)."""
    backend = BACKENDS[opts.backend]
    if backend.spec is None:
        raise ValueError(f"--backend={opts.backend} runs its workers here; it renders no spec")
    return backend.spec(opts, cfg, run_id, train_flags)


def supervise(argv: Sequence[str] | None = None) -> int:
    """`msjax-supervise`: the supervisor on the backend its flags name; returns the exit status."""
    runtime.setup()  # an entry point: the process set-up of a run (msjax.runtime)
    try:
        common, opts, cfg, train_flags = _parse(argv, "msjax-supervise")
        if BACKENDS[opts.backend].needs_run_id and not opts.run_id:
            raise ConfigError(f"--backend={opts.backend} needs --run_id (the {opts.backend} workers' MSJAX_RUN_ID, "
                              "given when their spec was rendered)")
    except ConfigError as e:
        return _error(e)
    cli.setup_logging(common)
    return run_supervised(opts, cfg, opts.run_id or new_run_id(opts.name), train_flags)


class SupervisorInterrupted(Exception):
    """SIGTERM or SIGINT reached the supervisor (its workers are stopped on the way out)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def run_supervised(opts: LaunchOptions, cfg: Config, run_id: str, train_flags: Sequence[str], out=sys.stdout,
                   watchers: Sequence[Callable] = ()) -> int:
    """Runs the job under the supervisor (msjax.supervise.supervisor) on `opts.backend` to its end.

    Args:
      opts: the launch options (backend, num_processes, devices_per_process, redis_url, nodes, ...).
      cfg: the workers' config (its `supervisor` section is the policy).
      run_id: the run's namespace in Redis.
      train_flags: the workers' train flags.
      out: where the supervisor's lines and the workers' routed output go (msjax.launch.output).
      watchers: passed to the Supervisor (a benchmark's fault injector).
    Returns:
      The exit status (see the module docstring); errors of setting up print `error: ...` and return 2.
    """
    from msjax.control.server import RedisServer
    from msjax.supervise.supervisor import Supervisor

    router = Router(out)
    backend = BACKENDS[opts.backend]
    try:
        hosts = backend.hosts(opts)
    except (ValueError, OSError) as e:
        return _error(e)

    def interrupted(signum, frame):  # unwind through Supervisor.run's cleanup: workers stopped, Redis stopped
        raise SupervisorInterrupted(signum)

    previous = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGTERM, signal.SIGINT)}
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: [signal.signal(sig, h) for sig, h in previous.items()])
        redis_url = opts.redis_url
        if backend.job_redis:  # the job's Redis (the batch script's, the manifest's Service)
            redis_url = redis_url or os.environ.get("MSJAX_REDIS_URL", "")
        try:
            if not redis_url:
                redis_url = stack.enter_context(RedisServer()).url
            workers = backend.worker_backend(opts, cfg, train_flags, hosts, router, redis_url, run_id)
            sup = Supervisor(cfg, workers, redis_url, opts.num_processes, opts.devices_per_process, run_id=run_id,
                             out=router, hosts=hosts, watchers=watchers)
        except ControlError as e:
            return _error(e)
        try:
            return sup.run().exit_code
        except SupervisorInterrupted as e:
            router.say(f"[supervisor] interrupted by {signal.Signals(e.signum).name}: workers stopped")
            return 128 + e.signum

