"""Benchmark a preset's train step on the devices present: `python scripts/bench.py --config=gpt_tiny
[--steps=20] [--json out.json] [--train.global_batch=32 ...]`. Prints a table and JSON."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from msjax.config import ConfigError, parse_args  # noqa: E402


def main(argv: list[str]) -> int:
    opts = {"steps": 20, "json": ""}
    rest = []
    for arg in argv:
        key = arg[2:].split("=", 1)[0] if arg.startswith("--") else ""
        if key in opts and "=" in arg:
            opts[key] = type(opts[key])(arg.split("=", 1)[1])
        else:
            rest.append(arg)
    try:
        cfg, _ = parse_args(rest)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from msjax.bench import benchmark, format_table

    row = benchmark(cfg, steps=opts["steps"])
    print(format_table([row]))
    print(json.dumps(row))
    if opts["json"]:
        with open(opts["json"], "w") as f:
            json.dump(row, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
