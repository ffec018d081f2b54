"""Logical axis names and the named rule sets that map them to mesh axes.

The model only names its axes (`embed`, `mlp`, `heads`, ...); a rule set, picked by `mesh.rules` in the config,
decides which mesh axis each name lands on. This package imports nothing from msjax (data flows one way).

Mesh axes, outer to inner: `pipeline`, `data`, `fsdp`, `sequence`, `tensor`.
"""

from .axes import *  # noqa: F401,F403  (the constants are this package's API)
from .rules import OPTIMIZER_STATE_RULES, RULE_SETS, Rules, logical_to_mesh_spec, optimizer_state_rules  # noqa: F401
