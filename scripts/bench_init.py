"""Start-up benchmark: `python scripts/bench_init.py --json init.json [--ranks 256,2048 --tcpstore wait,poll]`.

N simulated workers rendezvous through a real Redis with msjax's protocol (msjax/control/rendezvous.py), beside
torch's TCPStore patterns; prints a table and writes the rows as JSON. See msjax/control/bench.py.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from msjax.control.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
