import sys

from msjax.supervise.cli import main

sys.exit(main())
