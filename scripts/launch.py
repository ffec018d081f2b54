"""Launch a multi-process run: `python scripts/launch.py --backend=local --num_processes=2 -- <train.py flags>`.

Backends: local (a private Redis + N worker processes here), k8s (prints a JobSet manifest), slurm (prints an
sbatch script). See msjax/control/launch.py.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from msjax.control.launch import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
