"""Start-up benchmark: `python scripts/bench_init.py --json init.json [--ranks 256,2048 --tcpstore wait,poll]`.

N simulated workers rendezvous through a real Redis with msjax's protocol (msjax/control/rendezvous.py), beside
torch's TCPStore patterns; prints a table and writes the rows as JSON. See msjax/control/bench.py.
"""

import sys

from msjax import cli
from msjax.control.bench import InitBenchOptions, run


def main(argv: list[str]) -> int:
    def body() -> int:
        common, opts = cli.parse_options(argv, InitBenchOptions(), prog="bench_init.py", description=__doc__)
        cli.setup_logging(common)
        opts.checked()
        if opts.json:
            cli.check_writable(opts.json, "--json")
        return run(opts)

    return cli.main_guard(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
