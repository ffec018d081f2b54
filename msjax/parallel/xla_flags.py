"""XLA flag presets per backend: the one place msjax sets XLA_FLAGS for performance.

XLA reads XLA_FLAGS once, when jax initialises its backend (the first device query or computation), so `apply`
must run before that: the entry points (scripts/train.py, scripts/bench_parallel.py) call it right after parsing
the config, before anything touches a device, and `run()` prints the flags in force at start-up. Flags already in
XLA_FLAGS (the user's, or `--xla_force_host_platform_device_count`) win over a preset's value for the same flag.
An unknown flag aborts XLA at start-up; every jaxlib parses every backend's flags, so tests/msjax/test_overlap.py
starts a process with each preset on CPU to check that the installed jaxlib knows them (their effect on a GPU was
not measured here: no multi-GPU machine).

GPU (sources: JAX's "GPU performance tips", docs.jax.dev/en/latest/gpu_performance_tips.html; NVIDIA JAX-Toolbox
"Tips for High-Performance LLMs with JAX and XLA", docs.nvidia.com/jax-toolbox/performance-profiling/
gpu-performance; the flags' definitions and defaults in xla/debug_options_flags.cc):
  --xla_gpu_enable_latency_hiding_scheduler=true  schedule with a cost model that moves async collectives'
      start/done apart so compute runs between them (JAX-Toolbox bakes it into its images). Collectives are
      asynchronous by default in XLA:GPU (`--xla_gpu_disable_async_collectives` is the off switch, left unset).
  --xla_gpu_all_gather_combine_threshold_bytes, --xla_gpu_reduce_scatter_combine_threshold_bytes,
  --xla_gpu_all_reduce_combine_threshold_bytes = 134217728 (128 MiB)  combine small collectives (FSDP's per-weight
      gathers, ZeRO's per-gradient scatters) into few large ones; the size MaxText's GPU configs and JAX-Toolbox's
      examples use.
  with mesh.tp_overlap=xla, also:
  --xla_gpu_threshold_for_windowed_einsum_mib=0  decompose every all-gather -> einsum and einsum ->
      reduce-scatter pair into a windowed (looped, collective-permute) einsum: XLA's own collective matmul.
  --xla_gpu_multi_streamed_windowed_einsum=true  run the windowed einsum's partial matmuls on several streams so
      they overlap with its collective-permutes.

CPU: no preset. Measured on a 2-core CPU machine (8 fake devices, gpt_tiny-sized step, docs/overlap.md): XLA:CPU runs
collectives synchronously in-process and its scheduler has no latency-hiding mode, so there is nothing to hide
communication behind; no flag was found that made the step faster.

TPU: XLA:TPU enables its latency-hiding scheduler and async collectives by default; no preset (MaxText sets
`--xla_tpu_*` flags per generation, which would need measuring on each).
"""

from __future__ import annotations

import importlib.util
import os
import sys

GPU_BASE = {
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    "xla_gpu_all_gather_combine_threshold_bytes": "134217728",
    "xla_gpu_reduce_scatter_combine_threshold_bytes": "134217728",
    "xla_gpu_all_reduce_combine_threshold_bytes": "134217728",
}
GPU_WINDOWED_EINSUM = {
    "xla_gpu_threshold_for_windowed_einsum_mib": "0",
    "xla_gpu_multi_streamed_windowed_einsum": "true",
}
BACKENDS = ("cpu", "gpu", "tpu")


def detect_backend() -> str:
    """The backend jax will pick, found without initialising it: JAX_PLATFORMS' first entry if set, else `gpu`
    when a CUDA plugin is installed and an NVIDIA device node exists, `tpu` when libtpu is installed, else `cpu`."""
    platforms = os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if platforms:
        return {"cuda": "gpu", "rocm": "gpu"}.get(platforms, platforms)
    has = lambda name: importlib.util.find_spec(name) is not None  # noqa: E731
    if (has("jax_cuda12_plugin") or has("jax_cuda13_plugin")) and os.path.exists("/dev/nvidia0"):
        return "gpu"
    if has("libtpu"):
        return "tpu"
    return "cpu"


def preset(backend: str, tp_overlap: str = "none") -> dict[str, str]:
    """The preset's flags {name without dashes: value} for `backend` and `mesh.tp_overlap`.

    Raises:
      ValueError: an unknown backend.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; allowed: {', '.join(BACKENDS)}")
    if backend != "gpu":
        return {}
    return {**GPU_BASE, **(GPU_WINDOWED_EINSUM if tp_overlap == "xla" else {})}


def merged(existing: str, flags: dict[str, str]) -> str:
    """XLA_FLAGS text `existing` plus `flags`, keeping any value `existing` already sets."""
    present = {tok[2:].split("=")[0] for tok in existing.split() if tok.startswith("--")}
    extra = [f"--{k}={v}" for k, v in flags.items() if k not in present]
    return " ".join([existing.strip(), *extra]).strip()


def backend_started() -> bool:
    """Whether jax has initialised a backend already (after which XLA_FLAGS changes are ignored)."""
    if "jax" not in sys.modules:
        return False
    from msjax.compat import backends_are_initialized  # no public API says this; jax's own check, read-only

    return backends_are_initialized()


def apply(tp_overlap: str = "none", backend: str | None = None) -> str:
    """Adds the preset for `backend` (default: `detect_backend()`) to os.environ['XLA_FLAGS'] and returns the
    resulting value. Call before jax touches a device.

    Raises:
      RuntimeError: jax's backend is already initialised (the flags would be silently ignored).
      ValueError: an unknown backend.
    """
    flags = preset(backend or detect_backend(), tp_overlap)
    if not flags:
        return os.environ.get("XLA_FLAGS", "")
    if backend_started():
        raise RuntimeError("msjax.parallel.xla_flags.apply: jax's backend is already initialised, so XLA_FLAGS can "
                           "no longer change; call it before the first device query")
    os.environ["XLA_FLAGS"] = merged(os.environ.get("XLA_FLAGS", ""), flags)
    return os.environ["XLA_FLAGS"]


def describe() -> str:
    """One start-up line naming the XLA flags in force (XLA_FLAGS as the backend read it)."""
    return f"XLA_FLAGS: {os.environ.get('XLA_FLAGS', '') or '(none)'}"
