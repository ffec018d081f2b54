"""Observability overhead: `python scripts/bench_observe.py --config=gpt_tiny [--steps=0] [--pairs=40]
[--redis=true] [--json=out.json] [--observe.window=20 ...]`. Times the train step with all metrics on (the
observer's hooks, per-rank JSONL/TensorBoard, the budgeted probe, and the control plane's Redis sink) and off, in
interleaved ABBA trials of whole observer periods (--steps=0: lcm(observe.window, observe.gc_every) steps, 100 by
default); prints a table (median, IQR, paired wall and CPU overheads with distribution-free 95% intervals, the
observer's own time per step) and JSON (msjax.observe.bench)."""

import dataclasses
import sys

from msjax import cli
from msjax.config import ConfigError


@dataclasses.dataclass(frozen=True)
class ObserveBenchOptions:
    """bench_observe.py's own flags.

    Attributes:
      steps: steps per trial; 0: one whole observer period, lcm(observe.window, observe.gc_every) (100 by default).
      pairs: ABBA pairs of trials (>= 6; the 95% interval needs at least 6).
      json: also write the result as JSON to this path.
      redis: stream the metrics to a Redis server started for the bench (the control plane's sink).
    """

    steps: int = 0
    pairs: int = 40
    json: str = ""
    redis: bool = True


def main(argv: list[str]) -> int:
    def body() -> int:
        cfg, (common, opts) = cli.parse(argv, ObserveBenchOptions(), prog="bench_observe.py", description=__doc__)
        cli.setup_logging(common)
        if opts.steps < 0 or opts.pairs < 6:
            raise ConfigError(f"--steps={opts.steps} / --pairs={opts.pairs}: allowed is --steps=0 or a multiple of "
                              "lcm(observe.window, observe.gc_every), and --pairs >= 6")
        if opts.json:
            cli.check_writable(opts.json, "--json")
        from msjax.observe.bench import format_table, overhead_benchmark

        try:
            row = overhead_benchmark(cfg, steps=opts.steps, pairs=opts.pairs, redis=opts.redis)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        cli.print_result(format_table(row), row, opts.json)
        return 0

    return cli.main_guard(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
