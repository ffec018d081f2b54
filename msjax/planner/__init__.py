"""Sharding-plan dry runs: memory, communication, step time and MFU of any preset on any cluster, without the
hardware.

    from msjax.config import load_preset
    from msjax.planner import PlanOptions, make_plan, plan_text
    plan = make_plan(load_preset("gpt175b"), PlanOptions(devices=12288, hardware="a100-80g"))
    print(plan_text(plan))

Modules: options (PlanOptions, PlanError, the model's constants), layout (mesh sizes, legality, links),
memory (parameters, optimizer state, Korthikanti activations), comm (every collective of a step), timing
(compute, overlap, step time), plan (one plan), search (every legal layout), compile_check (the real train step
compiled on fake CPU devices), published (the papers' rows and the calibration), report, cli. docs/planner.md
explains the model and lists every constant with its source.
"""

from msjax.planner.compile_check import compile_check
from msjax.planner.options import PlanError, PlanOptions
from msjax.planner.plan import Plan, evaluate, make_plan
from msjax.planner.report import plan_dict, plan_text, search_dict, search_text
from msjax.planner.search import SearchResult, search

__all__ = ["PlanError", "PlanOptions", "Plan", "SearchResult", "compile_check", "evaluate", "make_plan",
           "plan_dict", "plan_text", "search", "search_dict", "search_text"]
