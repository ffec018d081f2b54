"""Pre-flight: the layout and memory check `msjax.train.run` does before anything is allocated.

Before the data is tokenized, the run directory is created or anything is compiled, `check_layout(cfg)` checks
  1. the mesh against the devices present (`msjax.mesh.resolve_axis_sizes`),
  2. divisibility of the model and batch over the mesh (`msjax.planner.layout`),
  3. the planner's per-device memory estimate of the most loaded pipeline stage (`msjax.planner.memory`) against
     the device's memory,
and raises one ConfigError that gives the estimate by part (parameters, gradients, optimizer state,
activations), the limit, and overrides that would fit, when the run cannot fit. A preset's `model.remat` is a
preference: when it does not fit and a policy that recomputes more does, the run takes the cheapest such policy and
says so (a warning); a policy the user set (`--model.remat`) is kept, and a layout it does not fit is refused.

The limit per device: an accelerator's own `memory_stats()["bytes_limit"]` (what the allocator may use; the
catalogue's datasheet figure x the planner's memory fraction when the backend reports none). On CPU every fake
device shares the host: the limit is the host's physical RAM divided by the local device count (the state of all
local devices lives in the same RAM).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Sequence

from msjax.config import Config, ConfigError, apply_overrides
from msjax.hardware import Hardware, for_device_kind
from msjax.layout import split_batch
from msjax.planner.layout import check_model_split, make_layout, resolve_vocab
from msjax.planner.memory import MemoryReport, memory_report, stage_params
from msjax.planner.options import REMATS, PlanOptions

_GIB = 2.0**30
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DeviceBudget:
    """Per-device memory limit and how it was obtained."""

    bytes: float
    how: str
    hardware: Hardware


def device_budget(devices: Sequence) -> DeviceBudget:
    """The memory one device of `devices` may use (module docstring), bytes, with a sentence saying why."""
    d = devices[0]
    hw = for_device_kind(d.device_kind)
    local = max(1, sum(1 for x in devices if x.process_index == d.process_index))
    if d.platform == "cpu":
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        how = f"host RAM {ram / _GIB:.1f} GiB / {local} local CPU device(s)"
        limit = ram / local
    else:
        stats = d.memory_stats() or {}
        if stats.get("bytes_limit"):
            limit, how = float(stats["bytes_limit"]), f"{d.device_kind} allocator limit"
        elif hw is not None:
            limit = hw.memory_bytes * PlanOptions.memory_fraction
            how = f"{hw.name} {hw.memory_bytes / _GIB:.0f} GiB x {PlanOptions.memory_fraction}"
        else:
            return DeviceBudget(float("inf"), f"unknown memory of {d.device_kind!r}: not checked", cpu_hardware(0))
    return DeviceBudget(limit, how, hw or cpu_hardware(limit))


def cpu_hardware(memory: float) -> Hardware:
    """A catalogue entry for a CPU device with `memory` bytes: only the name and memory matter to the memory
    model (`attention_is_flash` reads the name)."""
    return Hardware("cpu", 0.0, memory, 0.0, 0.0, 0.0, 1, 0, "host")


def estimate(cfg: Config, sizes: dict[str, int], hw: Hardware, limit: float) -> MemoryReport:
    """The planner's per-device memory of the most loaded stage for `cfg` on mesh `sizes`, as the step runs it
    (ZeRO over data 0, `pipeline.schedule` and `pipeline.virtual_stages`, microbatch from the batch split).
    Raises PlanError when the layout does not divide."""
    if not cfg.model.vocab_size and cfg.data.tokenizer == "char":
        # the char vocabulary is only known after reading the corpus; 256 bounds byte-range text
        cfg = apply_overrides(cfg, {"model.vocab_size": 256})
    vocab = resolve_vocab(cfg)
    check_model_split(cfg, sizes, vocab)
    p, b = sizes["pipeline"], split_batch(cfg, sizes).microbatch
    layout = make_layout(cfg, PlanOptions(devices=math.prod(sizes.values())), hw, sizes,
                         cfg.pipeline.virtual_stages if p > 1 else 1, b, 0, cfg.model.remat,
                         cfg.pipeline.schedule if p > 1 else "interleaved")
    return memory_report(cfg, layout, stage_params(cfg, vocab, sizes), limit, 1.0)


def _parts(r: MemoryReport) -> str:
    rows = [("parameters", r.params), ("gradients", r.grads), ("optimizer state", r.optimizer),
            ("activations", r.activations + r.working)]
    if r.grads_in_backward is not None:  # msjax's step: the larger of its two phases, and XLA's packing
        rows += [("peak transient", r.transient), ("heap packing", r.packing)]
    rows.append(("total", r.total))
    return "\n".join(f"    {name:16s} {value / _GIB:10.2f} GiB" for name, value in rows)


def _candidates(cfg: Config, sizes: dict[str, int], n: int) -> list[dict[str, object]]:
    """Override sets to try, cheapest change first: remat, smaller microbatches, FSDP instead of DP, and the
    mesh re-split over the devices present."""
    out: list[dict[str, object]] = []
    if cfg.model.remat != "full":
        out.append({"model.remat": "full"})
    p = sizes["pipeline"]
    if p > 1:
        m = cfg.pipeline_microbatches(p)
        out += [{"pipeline.microbatches": m * k} for k in (2, 4, 8)]
    else:
        out += [{"train.microbatches": cfg.train.microbatches * k} for k in (2, 4, 8)]
    dp = sizes["data"] * sizes["fsdp"]
    for f in (2, 4, 8, 16, 32, 64):
        if dp % f == 0 and f != sizes["fsdp"]:
            out.append({"mesh.fsdp": f, "mesh.data": dp // f})
            out.append({"mesh.fsdp": f, "mesh.data": dp // f, "model.remat": "full"})
    # the devices present, split between tensor, pipeline and fsdp (when the configured mesh does not match)
    for t in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8):
            if n % (t * pp) == 0 and (t, pp) != (sizes["tensor"], p):
                over = {"mesh.tensor": t, "mesh.pipeline": pp, "mesh.data": 1, "mesh.fsdp": n // (t * pp),
                        "mesh.sequence": 1}
                out += [over, {**over, "model.remat": "full"}]
    return out


def _fitting_overrides(cfg: Config, sizes: dict[str, int], n: int, hw: Hardware, limit: float,
                       most: int = 3) -> list[str]:
    found = []
    for over in _candidates(cfg, sizes, n):
        try:
            c = apply_overrides(cfg, over)
            if c.pipeline.virtual_stages > 1 and c.mesh.pipeline == 1:
                c = apply_overrides(c, {"pipeline.virtual_stages": 1})
            c = c.validate()
            s = {**c.mesh.axis_sizes()}
            if math.prod(s.values()) != n:
                continue
            if estimate(c, s, hw, limit).total <= limit:
                found.append(" ".join(f"--{k}={v}" for k, v in over.items()))
        except ConfigError:
            continue
        if len(found) >= most:
            break
    return found


@dataclasses.dataclass(frozen=True)
class Preflight:
    """What the pre-flight check found.

    Attributes:
      config: the config to run: the one checked, or, where its remat policy did not fit and the caller left it
        free, the same with `model.remat` set to the cheapest policy that fits.
      memory: the planner's memory estimate of `config`.
      note: one line saying why `model.remat` changed ("" when it did not).
    """

    config: Config
    memory: MemoryReport
    note: str = ""


def _cheapest_fitting_remat(cfg: Config, sizes: dict[str, int], hw: Hardware, limit: float
                            ) -> tuple[Config, MemoryReport] | None:
    """`cfg` with the first remat policy after its own in `REMATS` (least recompute first) whose estimate fits."""
    for remat in REMATS[REMATS.index(cfg.model.remat) + 1:]:
        c = apply_overrides(cfg, {"model.remat": remat})
        report = estimate(c, sizes, hw, limit)
        if report.total <= limit:
            return c, report
    return None


def check_layout(cfg: Config, devices: Sequence | None = None, remat_fixed: bool = False) -> Preflight:
    """Checks `cfg` against the devices before anything is allocated (module docstring).

    Args:
      cfg: a validated config (`msjax.train.run(..., preflight=...)` calls it so).
      devices: the job's devices (default `jax.devices()`: every process's).
      remat_fixed: the user chose `model.remat` (a command-line flag). Otherwise the config's policy is the
        preset's preference: when it does not fit and a policy that recomputes more does, the first such policy in
        `msjax.planner.options.REMATS` (the cheapest that fits) is returned in `Preflight.config`, and logged.
    Returns:
      the config to run and its memory estimate.
    Raises:
      ConfigError: the mesh does not match the devices, the model or batch does not divide over the mesh, or the
        estimate exceeds the limit (under every remat policy, unless `remat_fixed`); the message has the estimate
        by part, the limit and overrides that fit.
    """
    import jax

    from msjax.mesh import resolve_axis_sizes

    devices = list(devices if devices is not None else jax.devices())
    n = len(devices)
    budget = device_budget(devices)
    mesh_error = None
    try:
        sizes = resolve_axis_sizes(cfg.mesh, n)
    except ConfigError as err:
        mesh_error = str(err)
        sizes = {**cfg.mesh.axis_sizes()}
        sizes["data"] = max(sizes["data"], 1)
    report = estimate(cfg, sizes, budget.hardware, budget.bytes)
    if mesh_error is None and report.total <= budget.bytes:
        return Preflight(cfg, report)
    if mesh_error is None and not remat_fixed:
        found = _cheapest_fitting_remat(cfg, sizes, budget.hardware, budget.bytes)
        if found is not None:
            fixed, fixed_report = found
            note = (f"model.remat={fixed.model.remat}: {cfg.model.remat} needs {report.total / _GIB:.2f} GiB per "
                    f"device of {budget.bytes / _GIB:.2f} GiB ({budget.how}); {fixed.model.remat} is the cheapest "
                    f"policy that fits ({fixed_report.total / _GIB:.2f} GiB); --model.remat pins one")
            log.warning(note)
            return Preflight(fixed, fixed_report, note)
    what = (f"{cfg.name}: {mesh_error}" if mesh_error else
            f"{cfg.name} does not fit: the estimate is over the limit of this device")
    lines = [what,
             f"  per-device memory estimate (msjax.planner, most loaded pipeline stage, mesh "
             f"{' x '.join(f'{k}={v}' for k, v in sizes.items())}):", _parts(report),
             f"  limit per device: {budget.bytes / _GIB:.2f} GiB ({budget.how})"
             + ("" if report.total <= budget.bytes else " - does not fit")]
    fits = _fitting_overrides(cfg, sizes, n, budget.hardware, budget.bytes) if report.total > budget.bytes or \
        mesh_error else []
    if fits:
        lines.append("  overrides that would fit on the " + f"{n} device(s) present: " + " | ".join(fits))
    else:
        state = report.params + report.grads + report.optimizer
        total_state = state * math.prod(sizes.values()) / max(1, sizes["data"])
        need = math.ceil(total_state / budget.bytes) if budget.bytes > 0 else 0
        lines.append(f"  no override of remat, microbatches, FSDP, tensor or pipeline size fits on the {n} "
                     f"device(s) present: parameters, gradients and optimizer state alone are "
                     f"{total_state / _GIB:,.0f} GiB, at least {need:,} devices of this memory "
                     "(scripts/plan.py --search ranks layouts for a cluster)")
    raise ConfigError("\n".join(lines))
