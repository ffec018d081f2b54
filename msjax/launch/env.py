"""What a launcher hands a worker process, for every backend: its environment (the one place that writes the
MSJAX_* variables the train command reads in msjax.control.worker) and, under the supervisor, its train flags
(`worker_flags`: the one place a typed config override becomes a command line).
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from msjax.cli import flag_value

# Set per worker by the rendezvous (msjax.control.worker): an inherited value would join the wrong job.
_JAX_LAUNCH_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def cpu_devices_flag(xla_flags: str, devices: int) -> str:
    """`xla_flags` with XLA's host platform device count set to `devices` (any earlier count replaced)."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", xla_flags).split()
    return " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])


def job_env(base: dict[str, str], *, redis_url: str, run_id: str, num_processes: int, rdzv_timeout_s: int,
            cpu_devices: int = 0) -> dict[str, str]:
    """What every worker of a job shares: `base` without inherited jax.distributed or MSJAX_* settings, plus the
    run's Redis, id and size, unbuffered output, and `cpu_devices` CPU devices per process through XLA_FLAGS (0:
    the device setup is left alone, e.g. GPU nodes).

    jax's persistent compilation cache (on by default: msjax.runtime) normally keeps only executables that took
    over 1 s to compile; a restarted worker wants every one of them back (init, restore, eval, step), so the
    threshold is 0 unless the caller set it."""
    env = {k: v for k, v in base.items() if k not in _JAX_LAUNCH_VARS and not k.startswith("MSJAX_")}
    env.update(MSJAX_REDIS_URL=redis_url, MSJAX_RUN_ID=run_id, MSJAX_NUM_PROCESSES=str(num_processes),
               MSJAX_RDZV_TIMEOUT_S=str(rdzv_timeout_s), PYTHONUNBUFFERED="1")
    for key in ("MSJAX_REDIS_PASSWORD", "MSJAX_REDIS_CA_CERT", "MSJAX_REDIS_CERT", "MSJAX_REDIS_KEY"):
        if base.get(key):  # the job's Redis credentials and TLS files travel with it
            env[key] = base[key]
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    if cpu_devices:
        env["XLA_FLAGS"] = cpu_devices_flag(env.get("XLA_FLAGS", ""), cpu_devices)
    return env


def worker_env(job: dict[str, str], *, rank: int, host: str, advertise_host: str,
               worker_id: str | None = None) -> dict[str, str]:
    """One worker's environment: the job's (`job_env`) plus its fixed rank (so the launcher's, the control plane's
    and jax's numbering is one), the host it runs on as the launcher names it, its identity across restarts
    (`worker_id`; default: the host) and the address its peers reach it on."""
    return {**job, "MSJAX_RANK": str(rank), "MSJAX_HOST": host, "MSJAX_WORKER_ID": worker_id or host,
            "MSJAX_ADVERTISE_HOST": advertise_host}


def worker_flags(train_flags: Sequence[str], overrides: Mapping[str, Any], resume: bool) -> list[str]:
    """A supervised worker's train flags: the job's own `train_flags`, then `--KEY=VALUE` for each of `overrides`
    (dotted config key -> typed value, as `msjax.config.apply_overrides` takes them: a re-plan's mesh sizes and
    microbatches), spelled so `msjax.config.coerce` reads the same value back (`msjax.cli.flag_value`), then
    `--resume` when `resume`. An override comes after the job's own flags: the train command keeps a key's last
    value."""
    return [*train_flags, *(f"--{key}={flag_value(value)}" for key, value in overrides.items()),
            *(["--resume"] if resume else [])]
