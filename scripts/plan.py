"""Sharding-plan dry run: memory, communication, step time and MFU of a preset on a cluster, without it.

    python scripts/plan.py --config=gpt175b --devices=12288 --hardware=a100-80g --global_batch=6144 \
        --mesh.tensor=8 --mesh.pipeline=8 --virtual_stages=6 [--search] [--compile] [--json out.json]
    python scripts/plan.py --published        # the planner beside MegaScale / Megatron-LM's published rows

Flags: `python scripts/plan.py --help` and docs/planner.md.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from msjax.planner.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
