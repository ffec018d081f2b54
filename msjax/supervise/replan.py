"""Re-planning: the best layout of the same global batch on the devices that are left after a host is excluded.

No anchor does this (MegaScale and ByteRobust replace the host from a spare pool; Orbax only restores onto a
given mesh). Here the supervisor asks the sharding planner (`msjax.planner.search`) for every legal layout of the
run's model and global batch on the remaining devices and keeps the best predicted MFU among those the training
step can run and that keep the numerics:
  - no pipeline axis (the train step has none yet) and ZeRO-0 over `data` (what the step does);
  - the run's remat policy (recompute changes nothing numerically, but the planner should not pick a policy the
    user did not ask for);
  - a per-replica microbatch no larger than before, so the activation memory that fitted still fits: where the
    data-parallel width shrinks, gradient accumulation (`train.microbatches`) grows instead.
The global batch and every other setting stay, so the loss curve continues: the batch of step s is the same
(msjax.data.BatchLoader draws it from (seed, s) alone) and gradient accumulation over equal microbatches averages
to the same gradient (within float32 rounding; tests/msjax/test_supervise_replan.py checks 1e-5).

On CPU the planner has no hardware model of its own; the A100 entry stands in (the ranking of layouts of a tiny
model barely depends on it), and the report says so.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from msjax.config import Config, apply_overrides
from msjax.hardware import for_device_kind
from msjax.planner import PlanError, PlanOptions, make_plan, search
from msjax.planner.layout import AXES

CPU_STAND_IN = "a100-80g"


def planner_hardware(configured: str, device_kind: str) -> tuple[str, str]:
    """(catalogue name, note) of the hardware model to plan with: `configured` if set, else the catalogue entry
    of `device_kind`, else (CPU or unknown) the A100 stand-in with a note saying so."""
    if configured:
        return configured, ""
    hw = for_device_kind(device_kind or "")
    if hw is not None:
        return hw.name, ""
    return CPU_STAND_IN, (f"no catalogue entry for device kind {device_kind!r}: predicted MFU uses {CPU_STAND_IN} "
                          "as a stand-in hardware model")


@dataclass
class Replan:
    """The old and the new layout of a re-planned run.

    Attributes:
      old, new: {"devices", "pipeline", "data", "fsdp", "sequence", "tensor", "microbatches",
        "microbatch_size" (sequences per microbatch per replica), "mfu" (predicted)}.
      overrides: dotted config keys -> values that turn the old config into the new layout.
      hardware: the planner's hardware model; note: a caveat about it, or "".
      candidates: how many legal layouts the planner ranked.
    """

    old: dict
    new: dict
    overrides: dict
    hardware: str
    note: str = ""
    candidates: int = 0

    def text(self) -> str:
        def row(name, d):
            return (f"  {name}: {d['devices']} devices  data={d['data']} fsdp={d['fsdp']} sequence={d['sequence']} "
                    f"tensor={d['tensor']} pipeline={d['pipeline']}  microbatches={d['microbatches']} x "
                    f"{d['microbatch_size']} seq/replica  predicted MFU {d['mfu']:.2%}")
        lines = [f"re-plan (planner on {self.hardware}, best of {self.candidates} legal layouts, same global batch):",
                 row("old", self.old), row("new", self.new)]
        if self.note:
            lines.append(f"  note: {self.note}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _layout(cfg: Config, devices: int, mfu: float) -> dict:
    sizes = cfg.mesh.axis_sizes()
    fixed = 1
    for k, v in sizes.items():
        if not (k == "data" and v == -1):
            fixed *= v
    if sizes["data"] == -1:
        sizes["data"] = devices // fixed
    replicas = sizes["data"] * sizes["fsdp"]
    return {"devices": devices, **sizes, "microbatches": cfg.train.microbatches,
            "microbatch_size": cfg.train.global_batch // (cfg.train.microbatches * replicas), "mfu": mfu}


def replan(cfg: Config, old_devices: int, new_devices: int, hardware: str = CPU_STAND_IN,
           note: str = "") -> Replan:
    """The best layout of `cfg`'s global batch on `new_devices` devices (see the module docstring).

    Args:
      cfg: the run's config (model.vocab_size filled in, as the run's config.json has it).
      old_devices: devices of the layout in `cfg`.
      new_devices: devices left.
      hardware: the planner's hardware model (see `planner_hardware`); note: its caveat.
    Returns:
      A Replan with the overrides to restart with.
    Raises:
      PlanError: no layout fits (the message gives the rejection reasons), or `new_devices` < 1.
    """
    if new_devices < 1:
        raise PlanError(f"no devices left to re-plan onto (the run had {old_devices})")
    # No pipeline axis after a re-plan: plain 1F1B's single chunk, the microbatch chosen (at most the run's).
    run_virtual_stages = cfg.pipeline.virtual_stages
    cfg = apply_overrides(cfg, {"pipeline.virtual_stages": 1})
    opts = PlanOptions(devices=new_devices, hardware=hardware, zero_stage=0, tune_virtual_stages=False)
    try:
        old_mfu = make_plan(cfg, dataclasses.replace(opts, devices=old_devices)).mfu
    except PlanError:
        old_mfu = float("nan")
    old = _layout(cfg, old_devices, old_mfu)
    result = search(cfg, opts)
    fits = [c for c in result.ranked
            if c.sizes[0] == 1 and c.remat == cfg.model.remat and c.microbatch_size <= old["microbatch_size"]]
    if not fits:
        reasons = "; ".join(f"{k} ({n})" for k, n in list(result.reason_counts().items())[:4]) or "none legal"
        too_big = len([c for c in result.ranked if c.sizes[0] == 1]) - len(fits)
        raise PlanError(f"no layout of train.global_batch={cfg.train.global_batch} fits on {new_devices} devices "
                        f"without a pipeline axis and with microbatches of at most {old['microbatch_size']} "
                        f"sequences per replica ({too_big} ranked layouts need larger microbatches or another "
                        f"remat policy; rejected: {reasons})")
    best = fits[0]
    sizes = dict(zip(AXES, best.sizes))
    replicas = sizes["data"] * sizes["fsdp"]
    microbatches = cfg.train.global_batch // (best.microbatch_size * replicas)
    overrides = {f"mesh.{k}": v for k, v in sizes.items()}
    overrides["train.microbatches"] = microbatches
    if run_virtual_stages != 1:
        overrides["pipeline.virtual_stages"] = 1
    new_cfg = apply_overrides(cfg, overrides).validate()
    return Replan(old=old, new=_layout(new_cfg, new_devices, best.mfu), overrides=overrides, hardware=hardware,
                  note=note, candidates=len(fits))
