"""Device mesh from the config: named axes (pipeline, data, fsdp, sequence, tensor), outer to inner."""

from __future__ import annotations

import math
from typing import Sequence

import jax
from jax.sharding import AxisType, Mesh

from msjax.config import ConfigError, MeshConfig
from sharding_rules.axes import MESH_AXES


def resolve_axis_sizes(mesh_cfg: MeshConfig, num_devices: int) -> dict[str, int]:
    """Axis sizes with `data=-1` filled in. Raises ConfigError when the sizes do not multiply to num_devices."""
    sizes = mesh_cfg.axis_sizes()
    fixed = math.prod(v for k, v in sizes.items() if not (k == "data" and v == -1))
    if sizes["data"] == -1:
        if num_devices % fixed:
            raise ConfigError(f"mesh {_fmt(sizes)} needs a multiple of {fixed} devices; {num_devices} present")
        sizes["data"] = num_devices // fixed
    if math.prod(sizes.values()) != num_devices:
        raise ConfigError(f"mesh {_fmt(sizes)} has {math.prod(sizes.values())} devices but {num_devices} are "
                          "present; set mesh.* so the sizes multiply to the device count (or mesh.data=-1)")
    return sizes


def _fmt(sizes: dict[str, int]) -> str:
    return " x ".join(f"{k}={v}" for k, v in sizes.items())


def make_mesh(mesh_cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A jax Mesh over `devices` (default: all) with axes MESH_AXES.

    Axes are `AxisType.Auto` (GSPMD propagation from our sharding constraints); jax 0.10's default is Explicit.
    Raises ConfigError when the sizes do not match the devices.
    """
    devices = list(devices if devices is not None else jax.devices())
    sizes = resolve_axis_sizes(mesh_cfg, len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)
