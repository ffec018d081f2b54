"""Step time and tokens/s per parallel layout and overlap mode: `python scripts/bench_parallel.py
[--config=gpt_tiny] [--layouts=dp,pp2,pp4,pp2_dp2_tp2,tp,tp_sp,fsdp,zero2] [--steps=10] [--repeats=3]
[--json=out.json] [--model.d_model=...]`.

Pipelined layouts (pp2 with and without V = 2 chunks, pp4, pp2 x dp2 x tp2) run beside their non-pipelined
equivalents on the same devices (dp, tp); `pipeline.microbatches` is the config's (default: the stage count).

Each (layout, mode) row runs in a fresh process, so that its XLA flag preset (`msjax.parallel.xla_flags`, e.g. the
windowed einsum of `tp_overlap=xla`) is in force from backend start, exactly as `scripts/train.py` would run it.
The same command runs on GPUs and TPUs (the devices present) and on CPU, where it asks for 8 fake devices unless
XLA_FLAGS already sets a count. Prints a table, then the rows as JSON.
"""

import dataclasses
import json
import os
import subprocess
import sys

from msjax import cli
from msjax.config import Config, ConfigError

TP = {"mesh.data": -1, "mesh.tensor": 2}
ALL = "all"  # every device on this axis: filled in with the device count
# layout -> (mesh overrides, [(mode label, overrides)])
LAYOUTS = {
    # pipelined layouts (interleaved 1F1B, msjax/parallel/pipeline.py) beside their non-pipelined equivalents on
    # the same devices: dp (all data parallel) for pp2 / pp2 vpp2 / pp4, tp (data x tensor 2) for pp2 x dp2 x tp2
    "dp": ({"mesh.data": ALL}, [("none", {})]),
    "pp2": ({"mesh.pipeline": 2, "mesh.data": -1}, [("none", {}), ("vpp2", {"pipeline.virtual_stages": 2})]),
    "pp4": ({"mesh.pipeline": 4, "mesh.data": -1}, [("none", {})]),
    "pp2_dp2_tp2": ({"mesh.pipeline": 2, "mesh.data": 2, "mesh.tensor": 2}, [("none", {})]),
    "tp": (TP, [(m, {"mesh.tp_overlap": m}) for m in ("none", "xla", "collective_matmul")]),
    "tp_parallel": ({**TP, "model.block": "parallel"},
                    [(m, {"mesh.tp_overlap": m}) for m in ("none", "xla", "collective_matmul")]),
    "tp_sp": ({"mesh.data": -1, "mesh.sequence": 2, "mesh.tensor": 2},
              [(m, {"mesh.tp_overlap": m}) for m in ("none", "collective_matmul")]),
    "fsdp": ({"mesh.data": 1, "mesh.fsdp": ALL}, [("none", {}), ("prefetch", {"mesh.fsdp_prefetch": True})]),
    "zero2": ({"mesh.data": 1, "mesh.fsdp": ALL, "mesh.rules": "zero2"}, [("none", {})]),
}


@dataclasses.dataclass(frozen=True)
class ParallelBenchOptions:
    """bench_parallel.py's own flags; every config flag (`--model.d_model=...`) sets the base of every row.

    Attributes:
      layouts: the layouts to run, in this order: any of dp, pp2, pp4, pp2_dp2_tp2, tp, tp_parallel, tp_sp, fsdp, zero2.
      steps: timed steps per repeat.
      repeats: timed repeats of `steps` steps per row (msjax.bench.benchmark reports their median).
      json: also write the rows as JSON to this path.
      row: internal: run one row in this process (the config flags give its layout) and print it as JSON.
    """

    layouts: tuple[str, ...] = tuple(LAYOUTS)
    steps: int = 10
    repeats: int = 3
    json: str = ""
    row: bool = False


def row_argv(argv: list[str], layout: dict) -> list[str]:
    """The command line of a child process running one row: the user's flags, then the layout's dotted flags.
    Later flags win (as in argparse), so the layout overrides any mesh flag the user gave."""
    return ["--row=1", *argv, *(f"--{key}={value}" for key, value in layout.items())]


def main(argv: list[str]) -> int:
    def body() -> int:
        cfg, (common, opts) = cli.parse(argv, ParallelBenchOptions(), prog="bench_parallel.py",
                                        description=__doc__)
        cli.setup_logging(common)
        if opts.row:
            return _row(cfg, opts)
        unknown = [name for name in opts.layouts if name not in LAYOUTS]
        if unknown or not opts.layouts:
            raise ConfigError(f"--layouts={','.join(opts.layouts)!r}: allowed is a comma-separated list of "
                              f"{', '.join(LAYOUTS)}")
        if opts.steps < 1 or opts.repeats < 1:
            raise ConfigError(f"--steps={opts.steps} --repeats={opts.repeats}: allowed is >= 1 each")
        if opts.json:
            cli.check_writable(opts.json, "--json")
        return _run(argv, opts)

    return cli.main_guard(body)


def _row(cfg: Config, opts: ParallelBenchOptions) -> int:
    """Child process: one benchmark row, printed as JSON on the last line."""
    from msjax.parallel import xla_flags

    flags = xla_flags.apply(cfg.mesh.tp_overlap)  # before the backend starts: XLA reads XLA_FLAGS once
    from msjax.bench import benchmark

    row = benchmark(cfg, steps=opts.steps, repeats=opts.repeats)
    row["xla_flags"] = flags
    print(json.dumps(row))
    return 0


def _run(argv: list[str], opts: ParallelBenchOptions) -> int:
    """Parent process: one child per (layout, mode) row; prints the table and the rows as JSON."""
    env = dict(os.environ)
    from msjax.parallel.xla_flags import detect_backend

    if detect_backend() == "cpu" and "device_count" not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    n_devices = _device_count(env)
    rows = []
    for name in opts.layouts:
        mesh, modes = LAYOUTS[name]
        for mode, overrides in modes:
            layout = {k: n_devices if v == ALL else v for k, v in {**mesh, **overrides}.items()}
            # A row's budget: compilation plus the timed steps of a small model; a hung child must not hang us.
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), *row_argv(argv, layout)], env=env,
                                  capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:
                print(f"error: layout {name} mode {mode} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
                return 1
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            row.update(layout=name, mode=mode)
            rows.append(row)
            print(f"{name:12s} {mode:18s} step {row['step_s'] * 1e3:9.2f} ms  {row['tokens_per_s']:12,.0f} tok/s",
                  file=sys.stderr, flush=True)
    cli.print_result(format_table(rows), rows, opts.json)
    return 0


def _device_count(env: dict) -> int:
    """The number of devices a child will see (asked of a child process, so this one never starts a backend)."""
    proc = subprocess.run([sys.executable, "-c", "import jax; print(jax.device_count())"], env=env,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"could not count devices: {proc.stderr[-1000:]}")
    return int(proc.stdout.strip().splitlines()[-1])


def format_table(rows: list[dict]) -> str:
    base = {}
    for r in rows:
        base.setdefault(r["layout"], r["step_s"])
    # vs_first: against the layout's first mode; vs_row1: against the first row (dp when it ran, so pipelined
    # layouts read against all-data-parallel on the same devices)
    cols = ["layout", "mode", "mesh", "step_ms", "tokens_per_s", "vs_first", "vs_row1", "mfu", "compile_s"]
    cells = [cols] + [[r["layout"], r["mode"], "x".join(f"{k[0]}{v}" for k, v in r["mesh"].items() if v > 1),
                       f"{r['step_s'] * 1e3:.2f}", f"{r['tokens_per_s']:,.0f}",
                       f"{base[r['layout']] / r['step_s']:.2f}x", f"{rows[0]['step_s'] / r['step_s']:.2f}x",
                       f"{r['mfu']:.1%}", f"{r['compile_s']:.1f}"]
                      for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
