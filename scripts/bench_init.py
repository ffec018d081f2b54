"""Start-up benchmark: `python scripts/bench_init.py --json init.json [--ranks 256,2048 --tcpstore wait,poll]`.

N simulated workers rendezvous through a real Redis with msjax's protocol (msjax/control/rendezvous.py), beside
torch's TCPStore patterns; prints a table and writes the rows as JSON. See msjax/control/bench.py.
"""

import sys

from msjax.control.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
