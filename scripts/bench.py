"""Benchmark a preset on the devices present, printing a table and JSON.

Step mode (default): `python scripts/bench.py --config=gpt_tiny [--steps=20] [--json=out.json] [--train.x=...]`
times the jitted train step on synthetic tokens (tokens/s, step time, MFU); with `--plain_jax`, against nanoGPT's
block written in plain JAX at the same shapes (msjax/bench_reference.py), in alternating windows.

Recipe mode: `python scripts/bench.py --recipe --config=shakespeare_char [--repeats=3]
[--reference_cmd="python train.py ..." --reference_cwd=DIR] [--json=out.json]` runs the whole
`scripts/train.py` job as a child process (process wall, user, system, minor faults, peak RSS, ms/step, val loss),
and a reference recipe's command interleaved with it, so both see the same machine load.
"""

import dataclasses
import shlex
import sys

from msjax import cli


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    """bench.py's own flags.

    Attributes:
      steps: step mode: train steps per timed window (median of 3 windows after 3 warm-up steps).
      json: also write the result as JSON to this path.
      recipe: time the whole scripts/train.py job as a child process instead of the step.
      repeats: recipe mode: runs of each command, interleaved.
      reference_cmd: recipe mode: a reference recipe's command line (e.g. nanoGPT's train.py), timed beside msjax.
      reference_cwd: recipe mode: the reference command's working directory.
      plain_jax: step mode: time msjax's step against nanoGPT's block in plain JAX at the same shapes
        (msjax/bench_reference.py), in alternating windows of --steps steps.
    """

    steps: int = 20
    json: str = ""
    recipe: bool = False
    repeats: int = 1
    reference_cmd: str = ""
    reference_cwd: str = ""
    plain_jax: bool = False


def main(argv: list[str]) -> int:
    def body() -> int:
        cfg, (common, opts) = cli.parse(argv, BenchOptions(), prog="bench.py", description=__doc__)
        cli.setup_logging(common)
        from msjax import bench

        if opts.json:
            cli.check_writable(opts.json, "--json")
        if opts.recipe:
            config_args = [a for a in argv if a.split("=", 1)[0].lstrip("-") not in
                           {f.name for f in dataclasses.fields(BenchOptions)}]
            rows = bench.recipe_benchmark(config_args, repeats=opts.repeats,
                                          reference_cmd=shlex.split(opts.reference_cmd),
                                          reference_cwd=opts.reference_cwd or None)
            result = {"config": cfg.name, "rows": rows, "summary": bench.recipe_ratios(rows)}
            table = bench.format_recipe_table(rows)
        elif opts.plain_jax:
            result = bench.plain_jax_comparison(cfg, steps=opts.steps)
            table = bench.format_plain_table(result)
        else:
            result = bench.benchmark(cfg, steps=opts.steps)
            table = bench.format_table([result])
        cli.print_result(table, result, opts.json)
        return 1 if any("error" in r for r in result.get("rows", ())) else 0  # a timed run failed

    return cli.main_guard(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
