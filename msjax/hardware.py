"""Accelerator catalogue: peak dense bf16 FLOP/s, memory and link bandwidths per device.

Used by the training loop (MFU denominator) and the sharding-plan dry runs (`msjax.planner`). Figures are the
vendors' published numbers; each entry names its source. Bandwidths are per device and per direction in bytes/s
(a "900 GB/s NVLink" GPU moves 450 GB/s each way). Users add their own devices with a JSON file
(`load_catalogue`).

What "node" means: the set of devices joined by the fast fabric (an NVLink/NVSwitch server of 8 GPUs; for TPUs
the ICI-connected slice). Collectives whose group stays inside a node run at `intra_node_bandwidth`; groups that
span nodes go through the network at `inter_node_bandwidth` per device (rail-optimised: each GPU has its own
NIC, MegaScale sec. 3.6; Narayanan et al. 2021 sec. 5).

The three efficiency fields are *achievable fractions of the datasheet figure*, used only by the planner:
  matmul_efficiency: large bf16 GEMMs, including the clock throttling of sustained training. A100: calibrated
    once on the MegaScale headline row (175B, 12,288 GPUs, 55.2% MFU; see docs/planner.md); the same value is
    assumed for the other devices until someone measures them.
  intra_link_efficiency / inter_link_efficiency: NCCL bus bandwidth over line rate (nccl-tests "busbw"),
    assumed 0.8 for both (typical nccl-tests results on DGX A100/H100 are 75-90% of line rate).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

GiB = 2**30
GB = 10**9

# See the module docstring. A100 GEMM efficiency: the one constant fitted (docs/planner.md, "Calibration").
A100_MATMUL_EFFICIENCY = 0.6342
LINK_EFFICIENCY = 0.8


@dataclass(frozen=True)
class Hardware:
    """One accelerator model.

    Attributes:
      name: catalogue key, e.g. "a100-80g".
      peak_flops: dense bf16 matmul peak, FLOP/s (no 2:4 sparsity).
      memory_bytes: device memory, bytes.
      hbm_bandwidth: device memory bandwidth, bytes/s.
      intra_node_bandwidth: NVLink / ICI bandwidth per device per direction, bytes/s.
      inter_node_bandwidth: network bandwidth per device per direction, bytes/s (NICs x link rate / devices).
      devices_per_node: devices that share the fast intra-node fabric (8 for DGX/HGX; a TPU slice's ICI domain).
      nics_per_node: network cards per node.
      source: where the figures come from.
      matmul_efficiency: achievable fraction of `peak_flops` for large GEMMs (planner only).
      intra_link_efficiency, inter_link_efficiency: achievable fraction of the link bandwidths (planner only).
    """

    name: str
    peak_flops: float
    memory_bytes: float
    hbm_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    devices_per_node: int
    nics_per_node: int
    source: str
    matmul_efficiency: float = A100_MATMUL_EFFICIENCY
    intra_link_efficiency: float = LINK_EFFICIENCY
    inter_link_efficiency: float = LINK_EFFICIENCY


_NV = "NVIDIA datasheet"
_GC = "Google Cloud TPU docs (system architecture page)"
CATALOGUE: dict[str, Hardware] = {
    h.name: h
    for h in (
        # A100 SXM: 312 TFLOP/s dense bf16; NVLink 3 600 GB/s both directions per GPU; DGX A100: 8 x 200 Gb/s HDR
        # InfiniBand per node (one NIC per GPU, 25 GB/s). MegaScale's servers: 8 x 200G NICs (sec. 3.6).
        Hardware("a100-40g", 312e12, 40 * GiB, 1555 * GB, 300 * GB, 25 * GB, 8, 8,
                 f"{_NV} A100 (2020): 40 GB HBM2 1555 GB/s; DGX A100 8x HDR 200 Gb/s"),
        Hardware("a100-80g", 312e12, 80 * GiB, 2039 * GB, 300 * GB, 25 * GB, 8, 8,
                 f"{_NV} A100 80GB SXM: 80 GB HBM2e 2039 GB/s; DGX A100 8x HDR 200 Gb/s"),
        # H100 SXM5: 989 TFLOP/s dense bf16 (1979 with sparsity); NVLink 4 900 GB/s; DGX H100: 8 x 400 Gb/s NDR.
        Hardware("h100", 989e12, 80 * GiB, 3350 * GB, 450 * GB, 50 * GB, 8, 8,
                 f"{_NV} H100 SXM5: 80 GB HBM3 3.35 TB/s, NVLink 900 GB/s; DGX H100 8x NDR 400 Gb/s"),
        Hardware("h200", 989e12, 141 * GB, 4800 * GB, 450 * GB, 50 * GB, 8, 8,
                 f"{_NV} H200 SXM: 141 GB HBM3e 4.8 TB/s, NVLink 900 GB/s; HGX H200 8x 400 Gb/s"),
        # B200: HGX B200 lists 36 PFLOP/s bf16 with sparsity for 8 GPUs -> 2.25 PFLOP/s dense per GPU; 180 GB
        # HBM3e at 8 TB/s in DGX B200 (1,440 GB, 64 TB/s per system); NVLink 5 1.8 TB/s; 8 x 400 Gb/s.
        Hardware("b200", 2250e12, 180 * GB, 8000 * GB, 900 * GB, 50 * GB, 8, 8,
                 f"{_NV} DGX/HGX B200: 180 GB HBM3e 8 TB/s, NVLink 1.8 TB/s, 8x 400 Gb/s"),
        # TPUs: the "node" is the ICI slice. ICI per direction = half the bidirectional per-chip figure.
        # v4: 275 TFLOP/s, 32 GiB HBM2 1200 GB/s, 4096-chip pod; "all-reduce bandwidth per pod 1.1 PB/s" ->
        # 268 GB/s per chip. DCN per chip is not on the v4 page: 50 Gb/s assumed (v5p's published figure).
        Hardware("tpu-v4", 275e12, 32 * GiB, 1200 * GB, 1.1e15 / 4096, 6.25 * GB, 4096, 1024,
                 f"{_GC} v4; DCN 50 Gb/s per chip assumed (v5p's figure)"),
        # v5e: 197 TFLOP/s, 16 GB HBM 819 GB/s, 400 GB/s bidirectional ICI per chip, 256-chip pod, 8 chips and
        # 2 x 100 Gb/s NICs per host (25 Gb/s per chip).
        Hardware("tpu-v5e", 197e12, 16 * GB, 819 * GB, 200 * GB, 3.125 * GB, 256, 64, f"{_GC} v5e"),
        # v5p: 459 TFLOP/s, 95 GiB HBM2e 2765 GB/s, 1200 GB/s bidirectional ICI per chip, 50 Gb/s DCN per chip;
        # the largest single slice is 6,144 chips (16x16x24), 4 chips per host.
        Hardware("tpu-v5p", 459e12, 95 * GiB, 2765 * GB, 600 * GB, 6.25 * GB, 6144, 1536, f"{_GC} v5p"),
    )
}

# jax `device_kind` strings -> catalogue keys (checked in order; first substring match wins).
_DEVICE_KINDS = (
    ("A100-SXM4-40GB", "a100-40g"), ("A100", "a100-80g"), ("H100", "h100"), ("H200", "h200"), ("B200", "b200"),
    ("TPU v4", "tpu-v4"), ("TPU v5 lite", "tpu-v5e"), ("TPU v5e", "tpu-v5e"), ("TPU v5p", "tpu-v5p"),
    ("TPU v5", "tpu-v5p"),
)

_OPTIONAL = {f.name for f in dataclasses.fields(Hardware) if f.default is not dataclasses.MISSING}


def lookup(name: str, extra_file: str | None = None) -> Hardware:
    """The catalogue entry `name` (case-insensitive), also searching a user JSON file.

    Raises:
      KeyError: unknown name; the message lists the known ones.
    """
    catalogue = load_catalogue(extra_file) if extra_file else CATALOGUE
    key = name.lower()
    if key not in catalogue:
        raise KeyError(f"unknown hardware {name!r}; known: {', '.join(sorted(catalogue))}"
                       + ("" if extra_file else " (add your own with a JSON file: --hardware_file)"))
    return catalogue[key]


def load_catalogue(path: str | None) -> dict[str, Hardware]:
    """CATALOGUE plus the devices in a JSON file: a list of objects with the `Hardware` fields.

    `source` and the three efficiency fields are optional (defaults: the file name and the catalogue's
    assumptions). Raises ValueError naming the file and the missing or unknown fields.
    """
    catalogue = dict(CATALOGUE)
    if not path:
        return catalogue
    entries = json.loads(Path(path).read_text())
    fields = {f.name for f in dataclasses.fields(Hardware)}
    for i, entry in enumerate(entries if isinstance(entries, list) else [entries]):
        missing, unknown = fields - set(entry) - {"source"} - _OPTIONAL, set(entry) - fields
        if missing or unknown:
            raise ValueError(f"{path} entry {i}: missing fields {sorted(missing)}, unknown fields {sorted(unknown)}")
        entry = {"source": path, **entry}
        catalogue[entry["name"].lower()] = Hardware(**entry)
    return catalogue


def for_device_kind(device_kind: str) -> Hardware | None:
    """Catalogue entry for a jax `device.device_kind` string, or None (e.g. CPU)."""
    for needle, key in _DEVICE_KINDS:
        if needle.lower() in device_kind.lower():
            return CATALOGUE[key]
    return None


def measured_cpu_matmul_flops(n: int = 1024, repeats: int = 5, dtype: str = "float32") -> float:
    """A quick measured matmul rate of this host, FLOP/s: the CPU stand-in for a datasheet peak.

    Times `repeats` (n x n) @ (n x n) products after one warm-up and returns the best rate (2 n^3 FLOP each).
    `dtype` is the operands' dtype ("float32" or "bfloat16"; products accumulate in float32, as
    `model.matmul_dtype` computes them). The figure falls under load (other processes take the cores):
    `cpu_peak_flops` keeps the best a machine has shown.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    # From numpy: jax.random.normal would compile a program of its own (~0.2 s of every CPU run's start).
    a = jax.device_put(np.random.default_rng(0).standard_normal((n, n), np.float32)).astype(dtype)
    matmul = jax.jit(lambda x: jnp.matmul(x, x, preferred_element_type=jnp.float32))
    matmul(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


# The file (in msjax's cache directory) that keeps the best CPU matmul rate each machine has shown.
CPU_PEAK_FILE = "cpu_peak.json"
_cpu_peak: dict[str, float] = {}  # this process's figure, by machine key


def cpu_model() -> str:
    """The CPU's model name as `lscpu` prints it (the first "model name" of /proc/cpuinfo), else the platform's
    processor string, else "unknown CPU". Every figure msjax and its benchmarks measure on a CPU names it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


# Linux's x86-64 arch_prctl: a process asks for the AMX tile data state before its first AMX instruction (Linux
# 5.16+, Documentation/arch/x86/xstate.rst); without the grant that instruction faults.
_SYS_ARCH_PRCTL = 158
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


@functools.cache
def cpu_amx_bf16_usable() -> bool:
    """Whether this process can run AMX-BF16 tile matmuls: the CPU reports `amx_bf16` in /proc/cpuinfo and the
    kernel grants the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM). False where either is missing or cannot be
    read (another OS, another architecture, a kernel before 5.16, a seccomp profile that refuses the request).

    Why the grant and not the flag alone: XLA:CPU's matmul libraries ask for the same grant and, refused, run
    bf16 dots on their AVX-512 kernels, slower than float32 ones (`scripts/refuse_amx.py` refuses it; measured in
    docs/cpu_speed.md). Asking grants nothing those libraries would not ask for themselves. Read once per
    process: every module of the model resolves `model.matmul_dtype=auto` (`msjax.ops.matmul.resolve`) when it
    is built."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return False
    if "amx_bf16" not in flags.split(":", 1)[1].split() or os.uname().machine != "x86_64":
        return False
    # ctypes, not a C extension: one syscall, once per process; libc's syscall() is the documented way to make it
    # (its arguments are longs: the kernel reads whole registers).
    libc = ctypes.CDLL(None, use_errno=True)
    args = (ctypes.c_long(_SYS_ARCH_PRCTL), ctypes.c_long(ARCH_REQ_XCOMP_PERM), ctypes.c_long(XFEATURE_XTILEDATA))
    return libc.syscall(*args) == 0


def _cpu_key(dtype: str = "float32") -> str:
    """Names what a CPU matmul rate depends on: the CPU model, the cores this process may use, jaxlib (which
    picks the matmul library: Eigen, YNNPACK), the operands' dtype (float32 keys carry none, as before bf16
    rates were kept) and, for bf16, whether this process may use AMX (refused, the same CPU's bf16 rate is ~7x
    lower: `cpu_amx_bf16_usable`)."""
    import jaxlib

    model = cpu_model()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    key = f"{model} | {cores} cores | jaxlib {jaxlib.__version__}"
    if dtype == "float32":
        return key
    return f"{key} | {dtype}" if cpu_amx_bf16_usable() else f"{key} | {dtype} without AMX"


def cpu_peak_flops(dtype: str = "float32") -> float:
    """The CPU stand-in for a datasheet peak, FLOP/s: the best matmul rate this machine has shown with `dtype`
    operands ("float32", or "bfloat16" accumulating in float32: 3-4x float32's on a CPU with AMX-BF16).

    One measurement per process (`measured_cpu_matmul_flops`), combined with the best earlier one kept in
    `<msjax cache>/cpu_peak.json` under `_cpu_key()`; the file is updated when this one is better. Why not the
    measurement alone: on a shared machine it is the rate of the moment, not of the hardware. Measured on the 2-core
    development machine: 167-211 GFLOP/s in idle processes, 104 inside a starting training run (its data loader
    and compilation threads busy), so the printed MFU of the same job read 0.50 in one run and 0.98 in the next. The
    best rate seen is a stable denominator that only rises toward the hardware's. A cache directory that cannot be
    read or written leaves this process's measurement.
    """
    key = _cpu_key(dtype)
    if key in _cpu_peak:
        return _cpu_peak[key]
    from msjax.runtime import cache_home

    measured = measured_cpu_matmul_flops(dtype=dtype)
    path = cache_home() / CPU_PEAK_FILE
    try:
        known = json.loads(path.read_text())
        known = known if isinstance(known, dict) else {}
    except (OSError, ValueError):
        known = {}
    previous = known.get(key)
    previous = float(previous) if isinstance(previous, (int, float)) and previous > 0 else 0.0
    best = max(measured, previous)
    if best > previous:
        known[key] = best
        tmp = path.with_name(f".{CPU_PEAK_FILE}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(known, indent=1))
            os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one
        except OSError:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:  # no directory to hold it
                pass
    _cpu_peak[key] = best
    return best


def device_peak_flops(device, matmul_dtype: str = "float32") -> tuple[float, str]:
    """(peak FLOP/s per device, label) for a jax device: the catalogue's bf16 peak, or on CPU the best measured
    rate of this machine's matmuls with `matmul_dtype` operands (`cpu_peak_flops`: "float32" or "bfloat16", the
    dtype the step's matmuls take, `msjax.ops.matmul.resolve`), labelled as such."""
    hw = for_device_kind(device.device_kind)
    if hw is not None:
        return hw.peak_flops, f"{hw.name} bf16 peak"
    if device.platform == "cpu":
        short = {"float32": "f32", "bfloat16": "bf16"}.get(matmul_dtype, matmul_dtype)
        return cpu_peak_flops(matmul_dtype), f"best measured CPU {short} matmul rate"
    return float("nan"), f"unknown device {device.device_kind!r}"


def mesh_peak_flops(devices, matmul_dtype: str = "float32") -> tuple[float, str]:
    """(peak FLOP/s of all `devices` together, label): the MFU denominator; `matmul_dtype` as `device_peak_flops`.

    Accelerators: per-device peak times the device count. CPU: the best measured host rate (`cpu_peak_flops`)
    times the number of processes, whatever the device count, because fake CPU devices
    (`--xla_force_host_platform_device_count`) share their host's cores.
    """
    devices = list(devices)
    peak, label = device_peak_flops(devices[0], matmul_dtype)
    if devices[0].platform == "cpu":
        hosts = len({d.process_index for d in devices})
        return peak * hosts, f"{label} x {hosts} host(s)"
    return peak * len(devices), f"{label} x {len(devices)} devices"
