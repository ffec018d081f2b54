"""The launch backends as one table: what each of `local`, `slurm` and `k8s` does at every step of a launch.

`msjax.launch.cli` and `msjax.launch.preflight` dispatch through `BACKENDS[opts.backend]` and nowhere compare the
backend's name, so a new backend is one entry here plus its own module. Each entry's functions import their
backend module when called: rendering a Kubernetes manifest needs none of SLURM's code, and the reverse.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from msjax.config import Config
from msjax.launch.options import LaunchOptions


@dataclass(frozen=True)
class Backend:
    """One launch backend.

    Attributes:
      name: the `--backend` value.
      runs_here: its workers are processes on this machine (their devices are this host's CPU devices, and an
        unsupervised job runs to its end here); otherwise the launcher renders a cluster spec.
      submits: `--submit` hands the rendered spec to the cluster (sbatch).
      needs_run_id: `msjax-supervise` needs `--run_id` (the workers were started elsewhere, with that id).
      job_redis: the supervisor uses the job's own Redis (`MSJAX_REDIS_URL`, the spec's server) when
        `--redis_url` names none.
      spec: (opts, cfg, run_id, train_flags) -> the cluster spec as text; None when `runs_here`. Raises
        ValueError for options the backend cannot honour.
      hosts: opts -> the supervisor's hosts (None: it names its own). Raises ValueError or OSError.
      worker_backend: (opts, cfg, train_flags, hosts, router, redis_url, run_id) -> the supervisor's
        `msjax.supervise.supervisor.WorkerBackend`.
    """

    name: str
    runs_here: bool
    submits: bool
    needs_run_id: bool
    job_redis: bool
    spec: Callable[[LaunchOptions, Config, str, Sequence[str]], str] | None
    hosts: Callable[[LaunchOptions], list[str] | None]
    worker_backend: Callable[..., Any]


def _no_hosts(opts: LaunchOptions) -> None:
    return None


def _log_dir(cfg: Config) -> Path:
    return Path(cfg.train.run_dir) / "logs"


def _local_backend(opts, cfg, train_flags, hosts, router, redis_url, run_id):
    from msjax.launch.local import LocalBackend

    return LocalBackend(train_flags, opts.devices_per_process, _log_dir(cfg), router,
                        rdzv_timeout_s=opts.rdzv_timeout_s, standby=cfg.supervisor.standby)


def _slurm_spec(opts: LaunchOptions, cfg: Config, run_id: str, train_flags: Sequence[str]) -> str:
    from msjax.launch.slurm import sbatch_script

    supervisor = ([f"--num_processes={opts.num_processes}",
                   *opts.flags("devices_per_process", "accelerator", "device_kind", "rdzv_timeout_s", "srun_args")]
                  if opts.supervise else [])
    return sbatch_script(opts, run_id, train_flags, cfg.train.run_dir, spares=cfg.supervisor.spares,
                         supervisor=supervisor).render()


def _slurm_hosts(opts: LaunchOptions) -> list[str]:
    from msjax.launch.slurm import allocation_nodes

    hosts = list(opts.nodes) or allocation_nodes()
    if len(hosts) < opts.num_processes:
        raise ValueError(f"--num_processes={opts.num_processes} but the allocation has {len(hosts)} node(s) {hosts}")
    return hosts


def _slurm_backend(opts, cfg, train_flags, hosts, router, redis_url, run_id):
    from msjax.launch.slurm import SlurmBackend

    return SlurmBackend(train_flags, hosts, _log_dir(cfg), router,
                        cpu_devices=opts.devices_per_process if opts.accelerator == "none" else 0,
                        rdzv_timeout_s=opts.rdzv_timeout_s, srun_args=opts.srun_args)


def _k8s_spec(opts: LaunchOptions, cfg: Config, run_id: str, train_flags: Sequence[str]) -> str:
    from msjax.launch import k8s

    return k8s.render(k8s.manifest(opts, run_id, train_flags, cfg if opts.supervise else None), run_id)


def _k8s_backend(opts, cfg, train_flags, hosts, router, redis_url, run_id):
    from msjax.control.store import Store, connect
    from msjax.launch.k8s import JobSetBackend

    return JobSetBackend(Store(connect(redis_url, password=os.environ.get("MSJAX_REDIS_PASSWORD") or None), run_id))


BACKENDS: dict[str, Backend] = {
    "local": Backend("local", runs_here=True, submits=False, needs_run_id=False, job_redis=False, spec=None,
                     hosts=_no_hosts, worker_backend=_local_backend),
    "slurm": Backend("slurm", runs_here=False, submits=True, needs_run_id=False, job_redis=True, spec=_slurm_spec,
                     hosts=_slurm_hosts, worker_backend=_slurm_backend),
    "k8s": Backend("k8s", runs_here=False, submits=False, needs_run_id=True, job_redis=True, spec=_k8s_spec,
                   hosts=_no_hosts, worker_backend=_k8s_backend),
}
