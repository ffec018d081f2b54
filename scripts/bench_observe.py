"""Observability overhead: `python scripts/bench_observe.py --config=gpt_tiny [--steps=0] [--pairs=40]
[--redis=true] [--json=out.json] [--observe.window=20 ...]`. Times the train step with all metrics on (the
observer's hooks, per-rank JSONL/TensorBoard, the budgeted probe, and the control plane's Redis sink) and off, in
interleaved ABBA trials of whole observer periods (--steps=0: lcm(observe.window, observe.gc_every) steps, 100 by
default); prints a table (median, IQR, paired wall and CPU overheads with distribution-free 95% intervals, the
observer's own time per step) and JSON (msjax.observe.bench)."""

import json
import sys

from msjax.config import ConfigError, config_from_flags, split_flags


def main(argv: list[str]) -> int:
    try:
        pairs, positional = split_flags(argv)
        opts = {"steps": "0", "pairs": "40", "json": "", "redis": "true"}
        opts.update((k, v) for k, v in pairs if k in opts)
        cfg = config_from_flags([(k, v) for k, v in pairs if k not in opts]).validate()
        if positional or not (opts["steps"].isdigit() and opts["pairs"].isdigit() and int(opts["pairs"]) >= 6) \
                or opts["redis"] not in ("true", "false"):
            raise ConfigError(f"unexpected arguments {positional}, or --steps={opts['steps']!r} (allowed: 0, or a "
                              f"multiple of lcm(observe.window, observe.gc_every)) / --pairs={opts['pairs']!r} (an "
                              f"integer >= 6) / --redis={opts['redis']!r} (true or false)")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from msjax.observe.bench import format_table, overhead_benchmark

    try:
        row = overhead_benchmark(cfg, steps=int(opts["steps"]), pairs=int(opts["pairs"]),
                                 redis=opts["redis"] == "true")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(row))
    print(json.dumps(row))
    if opts["json"]:
        with open(opts["json"], "w") as f:
            json.dump(row, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
