"""Observability overhead: `python scripts/bench_observe.py --config=gpt_tiny [--steps=100] [--repeats=5]
[--json=out.json] [--observe.window=20 ...]`. Times the train step with and without the observer's hooks
(interleaved repeats), prints a table and JSON."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from msjax.config import ConfigError, config_from_flags, split_flags  # noqa: E402


def main(argv: list[str]) -> int:
    try:
        pairs, positional = split_flags(argv)
        opts = {"steps": "100", "repeats": "5", "json": ""}
        opts.update((k, v) for k, v in pairs if k in opts)
        cfg = config_from_flags([(k, v) for k, v in pairs if k not in opts]).validate()
        if positional or not (opts["steps"].isdigit() and opts["repeats"].isdigit()):
            raise ConfigError(f"unexpected arguments {positional}, or --steps={opts['steps']!r} / --repeats="
                              f"{opts['repeats']!r} not integers")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from msjax.observe.bench import format_table, overhead_benchmark

    row = overhead_benchmark(cfg, steps=int(opts["steps"]), repeats=int(opts["repeats"]))
    print(format_table(row))
    print(json.dumps(row))
    if opts["json"]:
        with open(opts["json"], "w") as f:
            json.dump(row, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
