"""Benchmark a preset on the devices present, printing a table and JSON.

Step mode (default): `python scripts/bench.py --config=gpt_tiny [--steps=20] [--json=out.json] [--train.x=...]`
times the jitted train step on synthetic tokens (tokens/s, step time, MFU).

Recipe mode: `python scripts/bench.py --recipe --config=shakespeare_char [--repeats=3]
[--reference_cmd="python train.py ..." --reference_cwd=DIR] [--json=out.json]` runs the whole
`scripts/train.py` job as a child process (process wall, user, system, minor faults, peak RSS, ms/step, val loss),
and a reference recipe's command interleaved with it, so both see the same machine load.
"""

import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from msjax.config import ConfigError, config_from_flags, split_flags  # noqa: E402


def main(argv: list[str]) -> int:
    try:
        pairs, positional = split_flags(argv, valueless={"recipe"})
        opts = {"steps": "20", "json": "", "recipe": "false", "repeats": "1", "reference_cmd": "",
                "reference_cwd": ""}
        opts.update((k, v) for k, v in pairs if k in opts)
        config_pairs = [(k, v) for k, v in pairs if k not in opts]
        cfg = config_from_flags(config_pairs)
        if positional or not opts["steps"].isdigit() or not opts["repeats"].isdigit():
            raise ConfigError(f"unexpected arguments {positional}, or --steps={opts['steps']!r} / "
                              f"--repeats={opts['repeats']!r} not an integer")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from msjax import bench

    if opts["recipe"].lower() in ("true", "1", "yes"):
        rows = bench.recipe_benchmark([f"--{k}={v}" for k, v in config_pairs], repeats=int(opts["repeats"]),
                                      reference_cmd=shlex.split(opts["reference_cmd"]),
                                      reference_cwd=opts["reference_cwd"] or None,
                                      log=lambda m: print(m, file=sys.stderr))
        result = {"config": cfg.name, "rows": rows, "summary": bench.recipe_ratios(rows)}
        print(bench.format_recipe_table(rows))
    else:
        result = bench.benchmark(cfg, steps=int(opts["steps"]))
        print(bench.format_table([result]))
    print(json.dumps(result))
    if opts["json"]:
        with open(opts["json"], "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
