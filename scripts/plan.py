"""Sharding-plan dry run: memory, communication, step time and MFU of a preset on a cluster, without it.

    python scripts/plan.py --config=gpt175b --devices=12288 --hardware=a100-80g --global_batch=6144 \
        --mesh.tensor=8 --mesh.pipeline=8 --pipeline.virtual_stages=6 \
        --tune_virtual_stages=false [--search] [--compile] [--json out.json]
    python scripts/plan.py --published        # the planner beside MegaScale / Megatron-LM's published rows

Flags: `python scripts/plan.py --help` and docs/planner.md.
"""

import sys

from msjax.planner.cli import main

if __name__ == "__main__":
    sys.exit(main())
