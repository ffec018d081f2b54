"""`python -m msjax.launch`: the same as `msjax-launch` (msjax.launch.cli)."""

import sys

from msjax.launch.cli import main

sys.exit(main())
