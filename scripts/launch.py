"""Launch a multi-process run: `python scripts/launch.py --backend=local --num_processes=2 -- <train flags>`.

The same command as `msjax-launch` (msjax.launch.cli): local processes, or a SLURM script / Kubernetes manifest;
`--supervise` runs the job under the supervisor.
"""

import sys

from msjax.launch.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
