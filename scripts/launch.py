"""Launch a multi-process run: `python scripts/launch.py --backend=local --num_processes=2 -- <train.py flags>`.

Backends: local (a private Redis + N worker processes here), k8s (prints a JobSet manifest), slurm (prints an
sbatch script). See msjax/control/launch.py.
"""

import sys

from msjax.control.launch import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
