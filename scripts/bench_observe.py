"""Observability overhead: `python scripts/bench_observe.py --config=gpt_tiny [--steps=200] [--pairs=10]
[--redis=true] [--json=out.json] [--observe.window=20 ...]`. Times the train step with all metrics on (the
observer's hooks, per-rank JSONL/TensorBoard, the probe, and the control plane's Redis sink) and off, in
interleaved ABBA trials; prints a table (median, IQR, paired overhead with a 95% CI) and JSON
(msjax.observe.bench)."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from msjax.config import ConfigError, config_from_flags, split_flags  # noqa: E402


def main(argv: list[str]) -> int:
    try:
        pairs, positional = split_flags(argv)
        opts = {"steps": "200", "pairs": "10", "json": "", "redis": "true"}
        opts.update((k, v) for k, v in pairs if k in opts)
        cfg = config_from_flags([(k, v) for k, v in pairs if k not in opts]).validate()
        if positional or not (opts["steps"].isdigit() and opts["pairs"].isdigit() and int(opts["steps"]) >= 1
                              and int(opts["pairs"]) >= 2) or opts["redis"] not in ("true", "false"):
            raise ConfigError(f"unexpected arguments {positional}, or --steps={opts['steps']!r} (allowed: an "
                              f"integer >= 1) / --pairs={opts['pairs']!r} (an integer >= 2) / --redis="
                              f"{opts['redis']!r} (true or false)")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from msjax.observe.bench import format_table, overhead_benchmark

    row = overhead_benchmark(cfg, steps=int(opts["steps"]), pairs=int(opts["pairs"]),
                             redis=opts["redis"] == "true")
    print(format_table(row))
    print(json.dumps(row))
    if opts["json"]:
        with open(opts["json"], "w") as f:
            json.dump(row, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
