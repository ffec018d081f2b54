"""Command line of `scripts/plan.py`: planner flags beside the normal dotted config flags, and `run`."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from typing import Sequence

from msjax import cli
from msjax.config import Config, apply_overrides
from msjax.planner.goodput import DEFAULT_SHARES, LLAMA3_FAILURES_PER_DEVICE_HOUR
from msjax.parallel.schedules import SCHEDULES
from msjax.planner.options import PlanError, PlanOptions

# The records --goodput reads by default: the repository's own measurements (docs/results).
RECORDS = {"recovery_record": "recovery_ettr_slurm.json", "checkpoint_record": "checkpoint_save_restore.json",
           "startup_record": "startup_redis_vs_tcpstore.json"}


@dataclasses.dataclass(frozen=True)
class PlanActions:
    """What plan.py does beyond planning one layout.

    Attributes:
      search: enumerate every legal layout and rank them (MFU, memory).
      compile: compile the train step for the plan's layout on fake CPU devices and compare XLA's bytes.
      published: print the planner beside MegaScale's and Megatron-LM's published rows.
      json: also write the result as JSON to this path.
      top: layouts listed by --search.
      workers: processes for --search (0: one per core).
      global_batch: sequences per step (train.global_batch); 0 keeps the preset's.
      goodput: project the planned layout's goodput over a long run (msjax.planner.goodput): expected failures,
        what each costs, the checkpoint interval that maximises the effective training time ratio, and that ratio.
      run_days: the run's length for --goodput, days.
      failure_rate: failures per device per hour, every kind together (default: Llama 3's 419 unexpected
        interruptions in 54 days on 16,384 GPUs).
      failure_shares: kind:share pairs summing to 1 (kinds: process, host, hang).
      checkpoint_minutes: the checkpoint interval to project, minutes of training; 0: the optimum.
      recovery_record, checkpoint_record, startup_record: docs/results JSON records of scripts/bench_recovery.py,
        bench_checkpoint.py and bench_init.py the costs come from ("": the repository's own).
      schedule: also print this pipeline schedule (`msjax.parallel.schedules`: 1f1b, interleaved, zb-h1, zb-v) on
        the plan's stages and microbatches, as a grid of forward (F), input-gradient (B) and weight-gradient (W)
        passes per stage and tick with its bubble, and every schedule's bubble at the same P and M.
    """

    search: bool = False
    compile: bool = False
    published: bool = False
    json: str = ""
    top: int = 20
    workers: int = 0
    global_batch: int = 0
    goodput: bool = False
    run_days: float = 30.0
    failure_rate: float = LLAMA3_FAILURES_PER_DEVICE_HOUR
    failure_shares: str = ",".join(f"{k}:{v}" for k, v in DEFAULT_SHARES.items())
    checkpoint_minutes: float = 0.0
    recovery_record: str = ""
    checkpoint_record: str = ""
    startup_record: str = ""
    schedule: str = ""


def parse_plan_args(argv: Sequence[str]) -> tuple[Config, PlanOptions, dict]:
    """plan.py's command line (`msjax.cli.parse` with `PlanOptions` and `PlanActions`): (config, options,
    actions as a dict). Without --devices, the mesh's own product is used when mesh.data is set (not -1).

    Raises:
      ConfigError / PlanError: unknown flags (listing the config keys and the planner's own flags), bad values
        (the message names the key and what is allowed), a missing --hardware_file or an unwritable --json.
    """
    cfg, (common, opts, acts) = cli.parse(argv, PlanOptions(devices=0), PlanActions(), prog="plan.py",
                                          description=__doc__)
    cli.setup_logging(common)
    actions = dataclasses.asdict(acts)
    if acts.global_batch:
        cfg = apply_overrides(cfg, {"train.global_batch": acts.global_batch}).validate()
    if opts.hardware_file and not os.path.isfile(os.path.expanduser(opts.hardware_file)):
        raise PlanError(f"--hardware_file={opts.hardware_file!r} does not exist (or is not a file)")
    if acts.json:
        cli.check_writable(acts.json, "--json")
    if acts.schedule and acts.schedule not in SCHEDULES:
        raise PlanError(f"--schedule={acts.schedule}: allowed are {', '.join(SCHEDULES)}")
    actions["plan"] = bool(opts.devices) or not acts.published
    explicit = cli.explicit_keys(argv)
    actions["remat_fixed"] = "model.remat" in explicit
    actions["schedule_fixed"] = "pipeline.schedule" in explicit
    if not opts.devices:
        sizes = cfg.mesh.axis_sizes()
        if sizes["data"] == -1:
            if not acts.published:
                raise PlanError("--devices=N is required (or set every mesh size, including --mesh.data)")
            opts = dataclasses.replace(opts, devices=8)
        else:
            opts = dataclasses.replace(opts, devices=math.prod(sizes.values()))
    return cfg, opts.validate(), actions


# Exit status of plan.py when the plan's layout does not fit in memory, or a search finds no layout that fits
# (the supervisor's "no layout fits" stop uses the same status).
EXIT_DOES_NOT_FIT = 3


def run(argv: Sequence[str], out=None) -> dict:
    """The whole of `scripts/plan.py`: parse, plan (and search / compile / compare with the papers), print,
    and write JSON when asked. Returns the JSON-ready dict; its "fits" is False when the planned layout does not
    fit in memory or a search found none that does (absent when nothing was planned)."""
    from msjax.planner import report
    from msjax.planner.plan import make_plan
    from msjax.planner.search import search

    out = out or sys.stdout  # looked up at call time, so a redirected stdout is honoured
    cfg, opts, actions = parse_plan_args(argv)
    result: dict = {}
    if actions["published"]:
        text, rows = published_report()
        print(text, file=out)
        result["published"] = rows
    if actions["plan"]:
        if actions["search"]:
            found = search(cfg, opts, workers=actions["workers"], schedule_fixed=actions["schedule_fixed"])
            title = f"msjax search: {cfg.name} on {opts.devices:,} x {opts.hardware} ({opts.baseline} design)"
            print(report.search_text(found, actions["top"], title), file=out)
            result["search"] = report.search_dict(found)
            best = found.best_plan(cfg, opts)
            if best is not None:
                print("\nBest layout in full:\n", file=out)
                print(report.plan_text(best), file=out)
                result["plan"] = report.plan_dict(best)
                plan = best
            else:
                plan = None
            result["fits"] = best is not None
        else:
            plan = make_plan(cfg, opts, remat_fixed=actions["remat_fixed"], schedule_fixed=actions["schedule_fixed"])
            print(report.plan_text(plan), file=out)
            result["plan"] = report.plan_dict(plan)
            result["fits"] = plan.fits
        if actions["schedule"] and plan is not None:
            text, result["schedule"] = schedule_report(plan, actions["schedule"])
            print("\n" + text, file=out)
        if actions["goodput"] and plan is not None:
            text, result["goodput"] = goodput_report(plan, actions)
            print("\n" + text, file=out)
        if actions["compile"] and plan is not None:
            from msjax.planner.compile_check import compile_check

            lay = plan.layout
            check = compile_check(cfg, lay.axis_sizes(), lay.zero_stage, pipeline_microbatches=lay.microbatches,
                                  virtual_stages=lay.virtual_stages)
            m = plan.memory  # the plan's own layout (ZeRO stage, microbatch): printed beside the compiled step's
            check["plan_estimate"] = {"params": m.params, "grads": m.grads, "optimizer": m.optimizer,
                                      "activations": m.activations + m.working, "total": m.total}
            print("\n" + compile_text(check), file=out)
            result["compile"] = check
    if actions["json"]:
        with open(actions["json"], "w") as f:
            # a search lists every candidate (10^5 or more): write it compactly
            json.dump(result, f, default=str, **({"separators": (",", ":")} if "search" in result else
                                                 {"indent": 1}))
        print(f"\nwrote {actions['json']}", file=out)
    return result


def schedule_report(plan, name: str) -> tuple[str, dict]:
    """`--schedule=NAME`: the schedule's action table on the plan's P stages and M microbatches (V: the plan's
    interleaving for `interleaved`, 1 for 1f1b and zb-h1, 2 for zb-v), as text and a JSON-ready dict. Raises
    PlanError when the plan has no pipeline stages or the schedule does not run on them."""
    from msjax.parallel.schedules import ActionTable, check, paper_bubble

    lay = plan.layout
    p, m = lay.pipeline, lay.microbatches
    if p == 1:
        raise PlanError(f"--schedule={name}: the plan has no pipeline stages (mesh.pipeline=1)")
    chunks = {"interleaved": lay.virtual_stages, "zb-v": 2}
    try:
        table = ActionTable(name, p, chunks.get(name, 1), m)
    except ValueError as err:
        raise PlanError(f"--schedule={name}: {err}") from None
    bubbles = {}
    for other in SCHEDULES:
        try:
            check(other, p, chunks.get(other, 1), m)
        except ValueError:
            continue
        bubbles[other] = paper_bubble(other, p, chunks.get(other, 1), m)
    lines = [f"Pipeline schedule (--schedule={name}; one tick = one chunk's forward, input-gradient or weight-gradient "
             "pass)", table.text(),
             f"  activations in flight per stage (chunk-microbatches between F and B): "
             f"{', '.join(str(table.in_flight(s)) for s in range(min(p, 8)))}{' ...' if p > 8 else ''}; "
             f"waiting for W: {', '.join(str(table.awaiting_w(s)) for s in range(min(p, 8)))}{' ...' if p > 8 else ''}",
             f"  bubble at P={p}, M={m} by schedule: "
             + ", ".join(f"{k} {v:.1%}" + (f" (V={chunks[k]})" if k in chunks else "") for k, v in bubbles.items())]
    out = {"name": name, "stages": p, "virtual_stages": table.virtual_stages, "microbatches": m,
           "ticks": table.ticks, "idle": table.idle, "bubble": table.bubble,
           "in_flight": [table.in_flight(s) for s in range(p)],
           "awaiting_w": [table.awaiting_w(s) for s in range(p)], "bubble_by_schedule": bubbles}
    return "\n".join(lines), out


def parse_shares(text: str) -> dict[str, float]:
    """`--failure_shares` ("process:0.6,host:0.3,hang:0.1") as {kind: share}. Raises PlanError naming the flag."""
    from msjax.planner.goodput import RECORD_FAULTS

    shares = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        kind, _, value = item.partition(":")
        try:
            share = float(value)
        except ValueError:
            share = -1.0
        if kind not in RECORD_FAULTS or not 0.0 <= share <= 1.0 or kind in shares:
            raise PlanError(f"--failure_shares={text}: allowed are kind:share pairs, each kind once (kinds: "
                            f"{', '.join(RECORD_FAULTS)}), shares in [0, 1] summing to 1")
        shares[kind] = share
    if not shares or abs(sum(shares.values()) - 1.0) > 1e-6:
        raise PlanError(f"--failure_shares={text}: the shares sum to {sum(shares.values()):g}; they must sum to 1")
    return shares


def goodput_report(plan, actions: dict) -> tuple[str, dict]:
    """--goodput for one plan: (the table, the JSON-ready dict) of `msjax.planner.goodput.project` over
    --run_days, with inputs from the measured records (`inputs_from_records`). Raises PlanError for a bad flag
    or record."""
    from pathlib import Path

    from msjax.planner import goodput

    if actions["run_days"] <= 0 or actions["failure_rate"] <= 0 or actions["checkpoint_minutes"] < 0:
        raise PlanError(f"--run_days={actions['run_days']}, --failure_rate={actions['failure_rate']}, "
                        f"--checkpoint_minutes={actions['checkpoint_minutes']}: allowed are days > 0, failures per "
                        "device-hour > 0 and minutes >= 0 (0: the optimum)")
    shares = parse_shares(actions["failure_shares"])
    results = Path(__file__).resolve().parents[2] / "docs" / "results"
    records = {key: actions[key] or str(results / name) for key, name in RECORDS.items()}
    hw, devices = plan.hardware, plan.layout.devices
    try:
        inputs = goodput.inputs_from_records(
            state_bytes_per_device=plan.memory.params + plan.memory.optimizer,
            devices_per_host=min(hw.devices_per_node, devices), hosts=-(-devices // hw.devices_per_node),
            step_s=plan.time.step, shares=shares, **records)
        projection = goodput.project(actions["run_days"] * 86_400.0, devices, actions["failure_rate"],
                                     inputs.kinds, inputs.stall_s, inputs.lag_s,
                                     interval_s=actions["checkpoint_minutes"] * 60.0 or None)
    except ValueError as e:
        raise PlanError(str(e)) from None
    inputs.assumptions.append(f"failure rate {actions['failure_rate']:.3g} per device-hour"
                              + (" (Llama 3's)" if actions["failure_rate"] == goodput.LLAMA3_FAILURES_PER_DEVICE_HOUR
                                 else ""))
    title = (f"Goodput projection: {plan.config.name} on {devices:,} x {hw.name}, "
             f"{actions['run_days']:g} days (msjax.planner.goodput; Daly 2006)")
    return goodput.projection_text(projection, inputs, title), goodput.projection_dict(projection, inputs)


def compile_text(check: dict) -> str:
    a = check["analytic"]
    lines = ["Compile check (XLA vs analytic, bytes per device)",
             f"  compiled: {check['what']} in {check['compile_seconds']:.1f} s",
             f"  XLA argument bytes             {check['xla_argument_bytes']:>16,d}",
             f"  analytic params                {a['state_params']:>16,d}",
             f"  analytic optimizer state       {a['state_opt_state']:>16,d}",
             f"  analytic scalars (step, rng)   {a['state_scalars']:>16,d}",
             f"  analytic batch shard           {a['batch']:>16,d}",
             f"  analytic total                 {a['total']:>16,d}",
             f"  from the step's own shardings  {check['sharding_bytes']:>16,d}",
             f"  difference {check['relative_difference']:+.4%}: "
             f"{'agree within 1%' if check['agree'] else 'DISAGREE (more than 1%)'}"]
    if "xla_temp_bytes" in check:
        lines += [f"  XLA temp bytes (activations, gradients, workspace) {check['xla_temp_bytes']:>16,d}",
                  f"  XLA output bytes (new state; aliased with the donated argument: "
                  f"{check['xla_alias_bytes']:,d})"]
        if "estimate" in check:
            e = check["estimate"]
            bound = check["xla_peak_bound_bytes"]
            lines += [f"  compiled per device (argument + temp + output - alias) {bound:>16,d}",
                      f"  planner estimate of this step per device               {int(e['total']):>16,d}  "
                      f"({e['total'] / bound:.3f}x; params {int(e['params']):,d}, grads {int(e['grads']):,d}, "
                      f"optimizer {int(e['optimizer']):,d}, activations {int(e['activations']):,d}, working "
                      f"{int(e['working']):,d})"]
            if check.get("xla_live_peak_bytes"):
                lines.append(f"  XLA's peak of live bytes (before packing)             "
                             f"{check['xla_live_peak_bytes']:>16,d}")
        if "plan_estimate" in check:
            lines.append(f"  the plan's layout (its ZeRO stage and microbatch)      "
                         f"{int(check['plan_estimate']['total']):>16,d}")
    return "\n".join(lines)


def published_report() -> tuple[str, list[dict]]:
    """The calibration table: every published row beside the planner's prediction (docs/planner.md)."""
    from msjax.planner.published import ROWS, predict

    lines = ["Published rows vs planner (A100-80GB; one constant, the A100 GEMM efficiency, was fitted on the "
             "row marked *)",
             f"  {'source':24s} {'row':40s} {'system':8s} {'metric':6s} {'paper':>6s} {'planner':>7s} {'points':>6s}"
             f" {'error':>7s} {'step paper':>10s} {'planner':>8s}"]
    rows = []
    for row in ROWS:
        res = predict(row)
        pred = res["predicted"]
        if row.step_s:  # same FLOP convention as the paper: scale its MFU by the step-time ratio
            pred = row.published * row.step_s / res["step_s"]
        err = pred / row.published - 1
        metric = {"mfu": "MFU", "hfu_narayanan": "TF/pk"}[row.metric]
        mark = "*" if row.role == "calibration" else ("?" if not row.verified else " ")
        lines.append(f" {mark}{row.source[:24]:24s} {row.label[:40]:40s} {row.system:8s} {metric:6s} "
                     f"{row.published:5.1f}% {pred:6.1f}% {pred - row.published:+6.1f} {err:+7.1%} "
                     f"{(f'{row.step_s:.2f} s' if row.step_s else '-'):>10s} {res['step_s']:7.2f}s")
        rows.append({"source": row.source, "row": row.label, "system": row.system, "metric": row.metric,
                     "published": row.published, "predicted": pred, "relative_error": err,
                     "published_step_s": row.step_s, "predicted_step_s": res["step_s"], "role": row.role,
                     "configuration_verified": row.verified})
    errs = [abs(r["relative_error"]) for r in rows if r["role"] != "calibration"]
    points = [abs(r["predicted"] - r["published"]) for r in rows if r["role"] != "calibration"]
    lines.append(f"  {len(errs)} checked rows: mean |error| {sum(errs) / len(errs):.1%}, max {max(errs):.1%}; "
                 f"{sum(x <= 3.0 for x in points)} within 3 points, max {max(points):.1f} points  "
                 "(* calibration row, ? configuration recalled, not re-verified)")
    return "\n".join(lines), rows


def main(argv: Sequence[str] | None = None) -> int:
    """plan.py's exit status: 0 planned (and the layout fits), 2 a bad flag or path (one `error: ...` line),
    3 (`EXIT_DOES_NOT_FIT`) the planned layout does not fit in memory or `--search` found no layout that fits,
    after the report, which then gives no throughput."""
    def body() -> int:
        result = run(sys.argv[1:] if argv is None else argv)
        if result.get("fits") is False:
            print(f"plan.py: {'no layout fits' if 'search' in result else 'the layout does not fit'} "
                  f"(exit status {EXIT_DOES_NOT_FIT})", file=sys.stderr)
            return EXIT_DOES_NOT_FIT
        return 0

    return cli.main_guard(body)
