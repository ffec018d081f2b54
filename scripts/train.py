"""Train a GPT: `python scripts/train.py --config=gpt_tiny [--train.steps=200 --mesh.tensor=2 ... --resume]`.

The same command as `msjax-train` (msjax.launch.cli.train: msjax.train.main's flags and exit statuses, with the
planner's pre-flight check of mesh, split and memory against the devices before anything is read or compiled).
"""

import sys

from msjax.launch.cli import train

if __name__ == "__main__":
    sys.exit(train(sys.argv[1:]))
