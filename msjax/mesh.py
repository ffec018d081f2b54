"""Device mesh from the config: named axes (pipeline, data, fsdp, expert, sequence, tensor), outer to inner.

Which links each axis uses (docs/overlap.md, "Hybrid mesh"): `tensor` and `sequence` carry per-layer
activations (Megatron-SP's all-gathers and reduce-scatters, context parallelism's K/V gathers), so they stay
inside a node's NVLink/ICI domain, as does `expert` (two all-to-alls of every MoE layer's tokens, forward and
backward); across nodes go, in this order, `data` (one gradient reduction per step),
then `fsdp` (per-layer gathers, prefetchable), then `pipeline` (point-to-point activations, the lightest traffic).
Within the node-spanning axes `pipeline` is outermost and `data` inner to it, so consecutive nodes form
data-parallel groups before pipeline groups, as MegaScale does (sec. 3.3 / 4: data-parallel groups first, so the
heavy gradient traffic stays under the same switches and pipeline hops take the far links).
When processes span several hosts the mesh is built with `mesh_utils.create_hybrid_device_mesh`
(process_is_granule: one granule per host); on one process the same order comes from the device ids.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from msjax.config import ConfigError, MeshConfig
from msjax.sharding_rules.axes import DATA, FSDP, MESH_AXES, PIPELINE

# The axes allowed to span hosts, in the order they absorb the host count (see the module docstring).
CROSS_NODE_ORDER = (DATA, FSDP, PIPELINE)


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
    hosts = len({d.process_index for d in devices})
    if hosts > 1:
        per_node, across = hybrid_shapes(sizes, hosts)
        grid = mesh_utils.create_hybrid_device_mesh(per_node, across, devices, process_is_granule=True)
        return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def hybrid_shapes(sizes: dict[str, int], hosts: int) -> tuple[list[int], list[int]]:
    """Splits each mesh axis into a within-host and an across-host factor.

    Args:
      sizes: axis name -> size (all of MESH_AXES, no -1).
      hosts: number of hosts (granules) the devices span.
    Returns:
      (per-host shape, across-host shape), each over MESH_AXES, whose elementwise product is `sizes`. The host
      count is taken by `data` first, then `fsdp`, then `pipeline` (CROSS_NODE_ORDER); `expert`, `sequence` and
      `tensor` never leave a host.
    Raises:
      ConfigError: the host count does not factor into those axes.
    """
    across = {a: 1 for a in MESH_AXES}
    left = hosts
    for axis in CROSS_NODE_ORDER:
        across[axis] = math.gcd(sizes[axis], left)
        left //= across[axis]
    if left != 1:
        raise ConfigError(f"mesh {_fmt(sizes)} cannot span {hosts} hosts with expert, sequence and tensor inside each "
                          f"host: data x fsdp x pipeline must be a multiple of the host count")
    return [sizes[a] // across[a] for a in MESH_AXES], [across[a] for a in MESH_AXES]
