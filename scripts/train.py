"""Train a GPT: `python scripts/train.py --config=gpt_tiny [--train.steps=200 --mesh.tensor=2 ... --resume]`.

The same command as `msjax-train` and `python -m msjax.train` (msjax.train.main: flags, exit statuses), with the
planner's pre-flight check (mesh, split and memory estimate against the devices, `msjax.planner.preflight`) before
anything is read or compiled.
"""

import sys

from msjax.planner.preflight import check_layout
from msjax.train import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], preflight=check_layout))
