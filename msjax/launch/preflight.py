"""The launcher's check before it renders or starts anything: the trainer's own pre-flight check
(`msjax.planner.preflight.check_layout`: the mesh against the devices, divisibility, the planner's memory
estimate) on the devices the launch will give the job, `num_processes x devices_per_process` of them, so a job
that cannot run fails here with the error its workers would give, not on the cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

from msjax.config import Config
from msjax.launch.backends import BACKENDS
from msjax.launch.options import LaunchOptions


@dataclass(frozen=True)
class PlannedDevice:
    """A device the launch will give the job, described by what the pre-flight check reads of a jax device.

    Attributes:
      platform: "cpu", "gpu" or "tpu".
      device_kind: jax's device_kind or a msjax.hardware catalogue name ("cpu" on CPU; "" when unknown).
      process_index: the worker process holding it.
    """

    platform: str
    device_kind: str
    process_index: int

    def memory_stats(self) -> None:
        """No allocator to ask before launch: the catalogue's memory of `device_kind` is used (none: unchecked)."""
        return None


def planned_devices(opts: LaunchOptions) -> list[PlannedDevice]:
    """The job's devices: `devices_per_process` on each of `num_processes` processes. CPU devices on the local
    backend and with accelerator=none (their memory is this machine's RAM shared by a process's devices, as the
    trainer counts it); else `accelerator` devices of `device_kind`."""
    cpu = BACKENDS[opts.backend].runs_here or opts.accelerator == "none"
    platform, kind = ("cpu", "cpu") if cpu else (opts.accelerator, opts.device_kind)
    return [PlannedDevice(platform, kind, p) for p in range(opts.num_processes)
            for _ in range(opts.devices_per_process)]


def check(opts: LaunchOptions, cfg: Config, remat_fixed: bool = False) -> Config:
    """The config the workers are to run: `cfg`, or `cfg` with its remat policy raised to the cheapest that fits
    when the user did not set it (`remat_fixed`). Raises the trainer's ConfigError when `cfg` cannot run on the
    launch's devices (module docstring)."""
    from msjax.planner.preflight import check_layout

    return check_layout(cfg, planned_devices(opts), remat_fixed).config
