"""Benchmark a preset's train step on the devices present: `python scripts/bench.py --config=gpt_tiny
[--steps=20] [--json=out.json] [--train.global_batch=32 ...]`. Prints a table and JSON."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from msjax.config import ConfigError, config_from_flags, split_flags  # noqa: E402


def main(argv: list[str]) -> int:
    try:
        pairs, positional = split_flags(argv)
        opts = {"steps": "20", "json": ""}
        opts.update((k, v) for k, v in pairs if k in opts)
        cfg = config_from_flags([(k, v) for k, v in pairs if k not in opts])
        if positional or not opts["steps"].isdigit():
            raise ConfigError(f"unexpected arguments {positional} or --steps={opts['steps']!r} (an integer)")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from msjax.bench import benchmark, format_table

    row = benchmark(cfg, steps=int(opts["steps"]))
    print(format_table([row]))
    print(json.dumps(row))
    if opts["json"]:
        with open(opts["json"], "w") as f:
            json.dump(row, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
