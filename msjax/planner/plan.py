"""One plan: a layout of a config on a cluster, with its memory, communication, step time and MFU."""

from __future__ import annotations

from dataclasses import dataclass, field

from msjax.config import Config
from msjax.hardware import Hardware, lookup
from msjax.planner import comm as comm_mod
from msjax.planner import memory as mem
from msjax.planner import timing
from msjax.planner.layout import (
    PlanLayout, check_model_split, config_microbatch_size, legal_virtual_stages, make_layout, mesh_sizes, replica_batch,
    resolve_vocab, schedule_choices, schedule_virtual_stages,
)
from msjax.planner.options import REMATS, PlanError, PlanOptions


@dataclass
class Plan:
    """Everything the planner predicts for one layout (per device unless named otherwise).

    Attributes:
      config: the config planned (model, batch, mesh sizes as given).
      options: the planner options (after the baseline switch).
      hardware: the catalogue entry.
      layout: the resolved layout.
      memory: MemoryReport of the most loaded stage.
      collectives: every collective of a step (comm.Collective).
      time: StepTime breakdown.
      model_flops_per_token: msjax.flops count (causal, window-aware).
      paper_flops_per_token: Megatron-LM's count (full attention, Narayanan et al. 2021 eq. 3 without
        recompute): the convention of the published MFU figures.
      tokens_per_step, tokens_per_second, mfu, mfu_paper, hfu, days: throughput figures.
      total_params: parameters of the model; active_params: those a token uses (a mixture of experts' k of E
        experts; the total for a dense model). MFU counts the active ones' FLOPs (`msjax.flops.matmul_params`).
      auto: which knobs the planner chose, and from which candidates.
      schedules: with pipeline stages and the schedule free, the best layout of each schedule priced
        ({name: {"step": seconds, "bubble": seconds, "mfu", "fits", "virtual_stages"}}, fastest first).
    """

    config: Config
    options: PlanOptions
    hardware: Hardware
    layout: PlanLayout
    memory: mem.MemoryReport
    collectives: list
    time: timing.StepTime
    model_flops_per_token: float
    paper_flops_per_token: float
    total_params: int
    active_params: int = 0
    auto: dict = field(default_factory=dict)
    schedules: dict = field(default_factory=dict)

    @property
    def tokens_per_step(self) -> int:
        return self.config.train.global_batch * self.config.train.seq_len

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.time.step

    def _util(self, flops_per_token: float) -> float:
        return flops_per_token * self.tokens_per_second / (self.layout.devices * self.hardware.peak_flops)

    @property
    def mfu(self) -> float:
        return self._util(self.model_flops_per_token)

    @property
    def mfu_paper(self) -> float:
        return self._util(self.paper_flops_per_token)

    @property
    def hfu(self) -> float:
        return self.time.hw_flops_per_step / (self.time.step * self.hardware.peak_flops)

    @property
    def days(self) -> float:
        return self.options.token_budget / self.tokens_per_second / 86400.0

    @property
    def fits(self) -> bool:
        return self.memory.fits


def get_hardware(opts: PlanOptions) -> Hardware:
    """The catalogue entry for --hardware. Raises PlanError naming the unknown device."""
    try:
        return lookup(opts.hardware, opts.hardware_file or None)
    except KeyError as err:
        raise PlanError(err.args[0]) from None


def evaluate(cfg: Config, opts: PlanOptions, hw: Hardware, layout: PlanLayout,
             stage: mem.StageParams | None = None) -> Plan:
    """Memory, communication and timing of one explicit layout."""
    sizes = layout.axis_sizes()
    stage = stage or mem.stage_params(cfg, layout.vocab, sizes)
    memory = mem.memory_report(cfg, layout, stage, hw.memory_bytes, opts.memory_fraction)
    colls = comm_mod.inventory(cfg, layout, hw, stage)
    st = timing.step_time(cfg, layout, hw, opts, stage, colls)
    return Plan(cfg, opts.effective(), hw, layout, memory, colls, st,
                timing.model_flops_per_token(cfg, layout),
                timing.model_flops_per_token(cfg, layout, megatron_convention=True),
                mem.total_params(cfg, layout.vocab), mem.active_params(cfg, layout.vocab))


def candidate_choices(cfg: Config, opts: PlanOptions, sizes: dict[str, int]) -> tuple[list, list, list]:
    """(microbatch sizes, virtual-stage counts, zero stages) to try for the free knobs."""
    per_replica = replica_batch(cfg, sizes)
    if not opts.tune_microbatches or (sizes["pipeline"] == 1 and cfg.train.microbatches > 1):
        mbs = [config_microbatch_size(cfg, sizes)]
    else:
        mbs = [b for b in range(1, per_replica + 1) if per_replica % b == 0]
    zeros = [opts.zero_stage] if opts.zero_stage >= 0 else [0, 1, 2]
    return mbs, [] if opts.tune_virtual_stages else [cfg.pipeline.virtual_stages], zeros


def make_plan(cfg: Config, opts: PlanOptions, remat_fixed: bool = False, schedule_fixed: bool = False) -> Plan:
    """The plan for `cfg` (mesh sizes from cfg.mesh, data=-1 filled in) on `opts.devices` x `opts.hardware`.

    Free knobs (the interleaving and microbatch size with tune_virtual_stages / tune_microbatches, zero_stage
    at -1) are chosen to maximise predicted MFU among the choices that fit in memory (smallest ZeRO stage on ties).
    When nothing fits under `model.remat` and `remat_fixed` is false (the user did not set it; a preset's policy
    is a preference), the policies that recompute more are tried in `REMATS` order and the first with a layout
    that fits is taken: the cheapest remat that fits, named in `auto`. If none fits, the smallest-memory choice
    under `model.remat` is returned with `fits` False. With pipeline stages and `schedule_fixed` false (the user
    did not set `pipeline.schedule`), every schedule the step runs on the layout is priced
    (`layout.schedule_choices`), each under the remat rule above, and the fastest that fits is taken, with each
    one's best step time in `auto` and `schedules`.

    Raises:
      PlanError: unknown hardware, a mesh that does not match the device count, or a model / batch that does
        not divide over it (the message names the key).
    """
    opts = opts.validate()
    hw = get_hardware(opts)
    sizes = mesh_sizes(cfg, opts.devices)
    vocab = resolve_vocab(cfg)
    # Fail early, with the named reason, on a layout no choice of the free knobs can fix.
    check_model_split(cfg, sizes, vocab)
    mbs, vs_fixed, zeros = candidate_choices(cfg, opts, sizes)
    stage = mem.stage_params(cfg, vocab, sizes)
    errors: list[str] = []

    schedules = schedule_choices(cfg, opts, sizes["pipeline"], schedule_fixed)

    def key(plan: Plan) -> tuple:
        return plan.fits, plan.mfu if plan.fits else -plan.memory.total, -plan.layout.zero_stage

    def best_under(remat: str, schedule: str) -> Plan | None:
        best = None
        for b in mbs:
            per_replica = replica_batch(cfg, sizes)
            legal = vs_fixed or legal_virtual_stages(cfg.model.num_layers, sizes["pipeline"], per_replica // b)
            if schedule != "interleaved" and not vs_fixed:  # a table's own chunk count, legal or not
                legal = [{"zb-v": 2}.get(schedule, 1)]
            for v in schedule_virtual_stages(schedule, legal):
                for z in zeros:
                    try:
                        layout = make_layout(cfg, opts, hw, sizes, v, b, z, remat, schedule)
                    except PlanError as err:
                        errors.append(str(err))
                        continue
                    plan = evaluate(cfg, opts, hw, layout, stage)
                    if best is None or key(plan) > key(best):
                        best = plan
        return best

    # Each schedule under the config's remat, or (not pinned) the cheapest policy under which it fits; then the
    # fastest schedule that fits.
    by_schedule: dict[str, Plan] = {}
    remat_notes: dict[str, str] = {}
    for schedule in schedules:
        asked = best_under(cfg.model.remat, schedule)
        if asked is None:
            continue
        by_schedule[schedule] = asked
        if not asked.fits and not remat_fixed:
            for remat in REMATS[REMATS.index(cfg.model.remat) + 1:]:
                plan = best_under(remat, schedule)
                if plan is not None and plan.fits:
                    by_schedule[schedule] = plan
                    remat_notes[schedule] = (
                        f"{remat} (model.remat={cfg.model.remat} needs {asked.memory.total / 2**30:.1f} of "
                        f"{asked.memory.capacity / 2**30:.1f} GiB; {remat} is the cheapest policy that fits; "
                        "--model.remat pins one)")
                    break
    if not by_schedule:
        raise PlanError(errors[0] if errors else "no legal layout")
    best = max(by_schedule.values(), key=key)
    auto = {}
    if best.layout.schedule in remat_notes:
        auto["remat"] = remat_notes[best.layout.schedule]
    if len(mbs) > 1:
        auto["microbatch_size"] = f"{best.layout.microbatch_size} (best of {len(mbs)} legal sizes)"
    if opts.tune_virtual_stages and sizes["pipeline"] > 1:
        auto["virtual_stages"] = f"{best.layout.virtual_stages} (best legal)"
    if len(schedules) > 1:
        ranked = sorted(by_schedule.items(), key=lambda kv: (not kv[1].fits, kv[1].time.step))
        best.schedules = {name: {"step": p.time.step, "bubble": p.time.bubble, "mfu": p.mfu, "fits": p.fits,
                                 "virtual_stages": p.layout.virtual_stages} for name, p in ranked}
        others = "; ".join(f"{name} {p.time.step:.3f} s, MFU {p.mfu:.1%}"
                           + (f", remat {p.layout.remat}" if p.layout.remat != cfg.model.remat else "")
                           + ("" if p.fits else " (does not fit)") for name, p in ranked)
        auto["schedule"] = (f"{best.layout.schedule} (fastest that fits; best step by schedule: {others}; "
                            "--pipeline.schedule pins one)")
    if opts.zero_stage < 0:
        auto["zero_stage"] = f"{best.layout.zero_stage} (fastest that fits)" if best.fits else \
            f"{best.layout.zero_stage} (nothing fits)"
    best.auto = auto
    return best


def run_overrides(plan: Plan) -> tuple[dict, str]:
    """The config overrides that make msjax's train step run this plan's layout, and a note ("" when none).

    The planner's own choices map onto config keys, so the config, not the planner, is what a run reads: the mesh
    sizes; `pipeline.virtual_stages` and `pipeline.microbatches` (M = the microbatches per replica per step) with
    pipeline stages, otherwise `train.microbatches` (gradient accumulation); `model.remat`; and ZeRO-1/2 over
    `data` as the `zero2` rule set over an `fsdp` axis of that size (parameters replicated over it, gradients and
    optimizer state sharded: the same collectives, `test_zero2_rule_set_is_priced_as_zero2_not_fsdp`; msjax has
    no ZeRO-1 alone, so ZeRO-1 runs as ZeRO-2, which holds less). ZeRO over `data` beside an FSDP axis has no
    rule set: the note says so and the overrides keep ZeRO-0.

    Returns:
      (overrides, note): dotted config keys to values, for `msjax.config.apply_overrides` or the command line.
    """
    lay = plan.layout
    sizes = lay.axis_sizes()
    rules, note = plan.config.mesh.rules, ""
    if lay.zero_stage >= 1 and lay.data > 1:
        if lay.fsdp == 1:
            sizes["fsdp"], sizes["data"], rules = lay.data, 1, "zero2"
        else:
            note = (f"ZeRO-{lay.zero_stage} over data beside fsdp={lay.fsdp} has no rule set in msjax; the overrides "
                    "run ZeRO-0 over data")
    out = {f"mesh.{k}": v for k, v in sizes.items()}
    out["mesh.rules"] = rules
    if lay.pipeline > 1:
        out.update({"pipeline.schedule": lay.schedule, "pipeline.virtual_stages": lay.virtual_stages,
                    "pipeline.microbatches": lay.microbatches, "train.microbatches": 1})
    else:
        out["train.microbatches"] = lay.microbatches
    out["model.remat"] = lay.remat
    return out, note
