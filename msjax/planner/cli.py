"""Command line of `scripts/plan.py`: planner flags beside the normal dotted config flags, and `run`."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import typing
from typing import Sequence

from msjax.config import Config, ConfigError, _coerce, config_from_flags, split_flags

from msjax.planner.options import PlanError, PlanOptions

# Flags that are actions, not options (no value, or a path).
ACTIONS = {"search": bool, "compile": bool, "published": bool, "json": str, "top": int, "workers": int}
_OPTION_TYPES = typing.get_type_hints(PlanOptions)
USAGE = """usage: python scripts/plan.py --config=NAME --devices=N --hardware=NAME [--global_batch=B]
       [--mesh.tensor=T --mesh.pipeline=P ...] [--virtual_stages=V] [--microbatch_size=B] [--zero_stage=Z]
       [--baseline=megatron] [--search [--top=20]] [--compile] [--published] [--json=out.json]
  Planner options: """ + ", ".join(f"--{f.name}" for f in dataclasses.fields(PlanOptions)) + """
  Any config key as --section.key=value (see msjax/config.py); --global_batch is train.global_batch."""


def parse_plan_args(argv: Sequence[str]) -> tuple[Config, PlanOptions, dict]:
    """Splits planner flags from config flags and builds (config, options, actions).

    `--key=value` and `--key value` both work; --search, --compile and --published take no value. Without
    --devices, the mesh's own product is used when mesh.data is set (not -1).

    Raises:
      ConfigError / PlanError: unknown config keys, bad values (the message names the key and what is allowed).
    """
    option_values: dict = {}
    actions: dict = {"search": False, "compile": False, "published": False, "json": "", "top": 20, "workers": 0}
    types = {**_OPTION_TYPES, **ACTIONS}
    pairs, positional = split_flags(argv, valueless={k for k, t in types.items() if t is bool} | {"help", "h"})
    if positional:
        raise PlanError(f"unexpected arguments {positional}; flags are --key=value\n{USAGE}")
    config_flags: list[tuple[str, str]] = []
    for key, value in pairs:
        if key in ("help", "h"):
            raise PlanError(USAGE)
        if key == "global_batch":
            config_flags.append(("train.global_batch", value))
        elif key in ACTIONS:
            actions[key] = _coerce(f"--{key}", ACTIONS[key], value)
        elif key in _OPTION_TYPES:
            option_values[key] = _coerce(f"--{key}", _OPTION_TYPES[key], value)
        else:
            config_flags.append((key, value))
    cfg = config_from_flags(config_flags, default_preset="gpt_tiny")
    actions["plan"] = "devices" in option_values or not actions["published"]
    if "devices" not in option_values:
        sizes = cfg.mesh.axis_sizes()
        if sizes["data"] == -1:
            if not actions["published"]:
                raise PlanError("--devices=N is required (or set every mesh size, including --mesh.data)")
        else:
            option_values["devices"] = math.prod(sizes.values())
    return cfg, PlanOptions(**option_values).validate(), actions


def run(argv: Sequence[str], out=sys.stdout) -> dict:
    """The whole of `scripts/plan.py`: parse, plan (and search / compile / compare with the papers), print,
    and write JSON when asked. Returns the JSON-ready dict."""
    from msjax.planner import report
    from msjax.planner.plan import make_plan
    from msjax.planner.search import search

    cfg, opts, actions = parse_plan_args(argv)
    result: dict = {}
    if actions["published"]:
        text, rows = published_report()
        print(text, file=out)
        result["published"] = rows
    if actions["plan"]:
        if actions["search"]:
            found = search(cfg, opts, workers=actions["workers"])
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
        else:
            plan = make_plan(cfg, opts)
            print(report.plan_text(plan), file=out)
            result["plan"] = report.plan_dict(plan)
        if actions["compile"] and plan is not None:
            from msjax.planner.compile_check import compile_check

            lay = plan.layout
            check = compile_check(cfg, lay.axis_sizes(), lay.zero_stage, pipeline_microbatches=lay.microbatches,
                                  virtual_stages=lay.virtual_stages)
            m = plan.memory
            check["estimate"] = {"params": m.params, "grads": m.grads, "optimizer": m.optimizer,
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
            compiled = check["xla_argument_bytes"] + check["xla_temp_bytes"]
            lines += [f"  compiled per device (argument + temp)      {compiled:>16,d}",
                      f"  planner estimate per device (all parts)    {int(e['total']):>16,d}  "
                      f"(params {int(e['params']):,d}, grads {int(e['grads']):,d}, optimizer "
                      f"{int(e['optimizer']):,d}, activations {int(e['activations']):,d})"]
    return "\n".join(lines)


def published_report() -> tuple[str, list[dict]]:
    """The calibration table: every published row beside the planner's prediction (docs/planner.md)."""
    from msjax.planner.published import ROWS, predict

    lines = ["Published rows vs planner (A100-80GB; one constant, the A100 GEMM efficiency, was fitted on the "
             "row marked *)",
             f"  {'source':24s} {'row':40s} {'system':8s} {'metric':6s} {'paper':>6s} {'planner':>7s} {'error':>7s}"
             f" {'step paper':>10s} {'planner':>8s}"]
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
                     f"{row.published:5.1f}% {pred:6.1f}% {err:+7.1%} "
                     f"{(f'{row.step_s:.2f} s' if row.step_s else '-'):>10s} {res['step_s']:7.2f}s")
        rows.append({"source": row.source, "row": row.label, "system": row.system, "metric": row.metric,
                     "published": row.published, "predicted": pred, "relative_error": err,
                     "published_step_s": row.step_s, "predicted_step_s": res["step_s"], "role": row.role,
                     "configuration_verified": row.verified})
    errs = [abs(r["relative_error"]) for r in rows if r["role"] != "calibration"]
    lines.append(f"  {len(errs)} checked rows: mean |error| {sum(errs) / len(errs):.1%}, max {max(errs):.1%}  "
                 "(* calibration row, ? configuration recalled, not re-verified)")
    return "\n".join(lines), rows


def main(argv: Sequence[str] | None = None) -> int:
    try:
        run(sys.argv[1:] if argv is None else argv)
    except (ConfigError, PlanError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
