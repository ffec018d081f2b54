"""Step time, process CPU time and tokens/s per parallel layout and overlap mode: `python scripts/bench_parallel.py
[--config=gpt_tiny] [--layouts=dp,pp2,pp4,pp2_dp2_tp2,tp,tp_sp,fsdp,zero2] [--steps=10] [--repeats=3]
[--baseline_src=DIR] [--json=out.json] [--model.d_model=...]`.

Pipelined layouts (pp2 with and without V = 2 chunks, pp4, pp2 x dp2 x tp2) run beside their non-pipelined
equivalents on the same devices (dp, tp); `pipeline.microbatches` is the config's (default: the stage count).
The arithmetic of a pipelined step is compared with one device's by `one` against `pp2_only` (with and without
V = 2) and `pp4_only`, pipelines alone on 1, 2 and 4 fake CPU devices, through the process's CPU seconds per step:
on fake devices that share the host's cores, the CPU time a step burns is the work all its devices do, where the
wall time is capped by the cores. E.g.:

    python scripts/bench_parallel.py --layouts=one,pp2_only,pp4_only --model.num_layers=8 \\
        --model.vocab_size=4096 --pipeline.microbatches=8 --baseline_src=/path/to/older/checkout

`--baseline_src` runs every row a second time with another checkout of msjax first on PYTHONPATH (the commit
before a change), alternating with this tree row by row, so both see the same machine load.

Each (layout, mode) row runs in a fresh process, so that its XLA flag preset (`msjax.parallel.xla_flags`, e.g. the
windowed einsum of `tp_overlap=xla`) is in force from backend start, exactly as `scripts/train.py` would run it; a
row whose mesh sizes are all given gets exactly that many fake CPU devices. The same command runs on GPUs and
TPUs (the devices present) and on CPU, where it asks for 8 fake devices unless XLA_FLAGS already sets a count.
Prints a table, then the rows as JSON.
"""

import dataclasses
import json
import math
import os
import re
import subprocess
import sys

from msjax import cli, runtime
from msjax.config import Config, ConfigError

# An entry point: the process set-up of a run (malloc on CPU, compilation cache, XLA:CPU collective flags),
# before jax starts a backend; importing msjax itself changes nothing (msjax.runtime).
runtime.setup()

TP = {"mesh.data": -1, "mesh.tensor": 2}
ALL = "all"  # every device on this axis: filled in with the device count
# layout -> (mesh overrides, [(mode label, overrides)])
LAYOUTS = {
    # pipelined layouts (interleaved 1F1B, msjax/parallel/pipeline.py) beside their non-pipelined equivalents on
    # the same devices: dp (all data parallel) for pp2 / pp2 vpp2 / pp4, tp (data x tensor 2) for pp2 x dp2 x tp2
    "dp": ({"mesh.data": ALL}, [("none", {})]),
    "pp2": ({"mesh.pipeline": 2, "mesh.data": -1}, [("none", {}), ("vpp2", {"pipeline.virtual_stages": 2})]),
    "pp4": ({"mesh.pipeline": 4, "mesh.data": -1}, [("none", {})]),
    # the schedules at one layout: interleaved (V = 1, 2) beside the tables, 1F1B, ZB-H1 and ZB-V
    # (msjax/parallel/zero_bubble.py); ZB-V and vpp2 need model.num_layers divisible by 8
    "pp4_schedules": ({"mesh.pipeline": 4, "mesh.data": -1},
                      [("none", {}), ("vpp2", {"pipeline.virtual_stages": 2}),
                       *[(s, {"pipeline.schedule": s}) for s in ("1f1b", "zb-h1")],
                       ("zb-v", {"pipeline.schedule": "zb-v", "pipeline.virtual_stages": 2})]),
    "pp2_dp2_tp2": ({"mesh.pipeline": 2, "mesh.data": 2, "mesh.tensor": 2}, [("none", {})]),
    # one device against pipelines alone (no data parallelism): the same global batch and arithmetic, so their
    # CPU seconds per step compare the work each layout does (the bubble's masked ticks included)
    "one": ({"mesh.data": 1}, [("none", {})]),
    "pp2_only": ({"mesh.pipeline": 2, "mesh.data": 1}, [("none", {}), ("vpp2", {"pipeline.virtual_stages": 2})]),
    "pp4_only": ({"mesh.pipeline": 4, "mesh.data": 1}, [("none", {})]),
    "tp": (TP, [(m, {"mesh.tp_overlap": m}) for m in ("none", "xla", "collective_matmul")]),
    "tp_parallel": ({**TP, "model.block": "parallel"},
                    [(m, {"mesh.tp_overlap": m}) for m in ("none", "xla", "collective_matmul")]),
    "tp_sp": ({"mesh.data": -1, "mesh.sequence": 2, "mesh.tensor": 2},
              [(m, {"mesh.tp_overlap": m}) for m in ("none", "collective_matmul")]),
    "fsdp": ({"mesh.data": 1, "mesh.fsdp": ALL}, [("none", {}), ("prefetch", {"mesh.fsdp_prefetch": True})]),
    "zero2": ({"mesh.data": 1, "mesh.fsdp": ALL, "mesh.rules": "zero2"}, [("none", {})]),
    # a mixture of experts (--config=moe_tiny) on all devices: experts replicated (ep1: each device still runs only
    # its own tokens) against expert parallelism (msjax/parallel/expert.py), alone, with tensor parallelism and
    # inside pipeline stages, beside `one`
    "expert": ({"mesh.data": -1}, [("ep1", {}), ("ep2", {"mesh.expert": 2}), ("ep4", {"mesh.expert": 4}),
                                   ("ep2_tp2", {"mesh.expert": 2, "mesh.tensor": 2}),
                                   ("ep2_pp2", {"mesh.expert": 2, "mesh.pipeline": 2})]),
}
MOE_ONLY = ("expert",)  # layouts that need a mixture-of-experts model: not in the default list
MESH_KEYS = ("mesh.pipeline", "mesh.data", "mesh.fsdp", "mesh.expert", "mesh.sequence", "mesh.tensor")


@dataclasses.dataclass(frozen=True)
class ParallelBenchOptions:
    """bench_parallel.py's own flags; every config flag (`--model.d_model=...`) sets the base of every row.

    Attributes:
      layouts: the layouts to run, in this order: any of dp, pp2, pp4, pp2_dp2_tp2, one, pp2_only, pp4_only, tp,
        tp_parallel, tp_sp, fsdp, zero2 (the default: all of these), expert (a mixture-of-experts config only).
      steps: timed steps per repeat.
      repeats: timed repeats of `steps` steps per row (the median is reported).
      baseline_src: another checkout of msjax (a directory holding its `msjax` package): every row also runs with
        it first on PYTHONPATH, alternating with this tree; "" runs this tree only.
      json: also write {"rows": [...]} as JSON to this path.
      row: internal: run one row in this process (the config flags give its layout) and print it as JSON.
    """

    layouts: tuple[str, ...] = tuple(name for name in LAYOUTS if name not in MOE_ONLY)
    steps: int = 10
    repeats: int = 3
    baseline_src: str = ""
    json: str = ""
    row: bool = False


def row_argv(argv: list[str], layout: dict) -> list[str]:
    """The command line of a child process running one row: the user's flags (less --baseline_src, which only
    the parent reads), then the layout's dotted flags. Later flags win (as in argparse), so the layout overrides
    any mesh flag the user gave."""
    own = [a for a in argv if not a.startswith("--baseline_src")]
    return ["--row=1", *own, *(f"--{key}={value}" for key, value in layout.items())]


def row_devices(layout: dict, default: int) -> int:
    """Fake devices a row's process gets: the product of its mesh sizes when all are given, else `default`."""
    sizes = [layout.get(k, 1) for k in MESH_KEYS]
    if any(s in (-1, ALL) for s in sizes):
        return default
    return math.prod(int(s) for s in sizes)


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
        if opts.baseline_src and not os.path.isdir(os.path.join(opts.baseline_src, "msjax")):
            raise ConfigError(f"--baseline_src={opts.baseline_src!r}: allowed is a directory holding an msjax "
                              "package (a checkout of this repository)")
        if opts.json:
            cli.check_writable(opts.json, "--json")
        return _run(argv, opts)

    return cli.main_guard(body)


def _row(cfg: Config, opts: ParallelBenchOptions) -> int:
    """Child process: one benchmark row, printed as JSON on the last line. Uses only APIs an older msjax has too
    (the `--baseline_src` tree runs this same function)."""
    from msjax.parallel import xla_flags

    flags = xla_flags.apply(cfg.mesh.tp_overlap)  # before the backend starts: XLA reads XLA_FLAGS once
    row = measure(cfg, opts.steps, opts.repeats)
    row["xla_flags"] = flags
    print(json.dumps(row))
    return 0


def measure(cfg: Config, steps: int, repeats: int, warmup: int = 2) -> dict:
    """Compiles the train step of `cfg` on the devices its mesh names and times `repeats` windows of `steps`
    steps after `warmup`: wall seconds and this process's CPU seconds (user + system, every thread) per step,
    medians over the windows.

    Returns:
      dict with step_s, cpu_s (seconds per step), tokens_per_s, mfu (model FLOPs over
      `msjax.hardware.mesh_peak_flops`), compile_s, devices, mesh and the shape of the run; with expert
      parallelism also dispatch_share: the share of the devices' op time in the token dispatch (its packing,
      all-to-alls and unpacking: `msjax.parallel.expert.DISPATCH_SCOPE`) over one more, profiled window.
    """
    import statistics
    import tempfile

    import jax
    from bench import time_train_step  # scripts/bench.py, beside this script: imports jax, so not at the top

    from msjax.mesh import make_mesh

    sizes = cfg.mesh.axis_sizes()
    n = len(jax.devices()) if -1 in sizes.values() else math.prod(sizes.values())
    mesh = make_mesh(cfg.mesh, jax.devices()[:n])
    dispatch = cfg.model.moe.num_experts and sizes.get("expert", 1) > 1
    trace_dir = tempfile.mkdtemp(prefix="bench_parallel_trace_") if dispatch else ""
    program, compile_s, walls, cpus = time_train_step(cfg, mesh, cfg.model.vocab_size or 50304, steps, warmup,
                                                      repeats, trace_dir)
    cfg, t = program.config, program.config.train
    step_s, cpu_s = statistics.median(walls), statistics.median(cpus)
    layout = program.layout
    peak, label = layout.peak
    tokens_per_step, flops = layout.tokens_per_step, layout.step_flops
    return {"config": cfg.name, "devices": mesh.devices.size, "device_kind": jax.devices()[0].device_kind,
            "mesh": dict(mesh.shape), "global_batch": t.global_batch, "seq_len": t.seq_len,
            "pipeline_microbatches": layout.microbatches, "virtual_stages": layout.virtual_stages, "params": program.param_count,
            "compile_s": compile_s, "step_s": step_s, "cpu_s": cpu_s, "step_s_windows": walls,
            "cpu_s_windows": cpus, "tokens_per_s": tokens_per_step / step_s, "model_flops_per_step": flops,
            "mfu": layout.mfu(1.0 / step_s), "peak_flops": peak, "peak_label": label,
            **({"dispatch_share": _dispatch_share(trace_dir)} if dispatch else {})}


def _dispatch_share(trace_dir: str) -> float:
    """`scope_share` of the dispatch in the trace `time_train_step` wrote to `trace_dir` (then removed)."""
    import shutil

    from msjax.observe.profile import scope_share
    from msjax.parallel.expert import DISPATCH_SCOPE

    try:
        with open(os.path.join(trace_dir, "program.hlo.txt")) as f:
            return scope_share(trace_dir, f.read(), DISPATCH_SCOPE)["share"]
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)


def _run(argv: list[str], opts: ParallelBenchOptions) -> int:
    """Parent process: one child per (layout, mode) row (and tree); prints the table and the rows as JSON."""
    env = dict(os.environ)
    from msjax.parallel.xla_flags import detect_backend

    cpu = detect_backend() == "cpu"
    if cpu and "device_count" not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    n_devices = _device_count(env)
    trees = [("baseline", os.path.abspath(opts.baseline_src)), ("this", "")] if opts.baseline_src else \
        [("this", "")]
    rows = []
    for name in opts.layouts:
        mesh, modes = LAYOUTS[name]
        for mode, overrides in modes:
            layout = {k: n_devices if v == ALL else v for k, v in {**mesh, **overrides}.items()}
            row_env = dict(env)
            if cpu:
                count = f"--xla_force_host_platform_device_count={row_devices(layout, n_devices)}"
                row_env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", count, env["XLA_FLAGS"])
            for tree, src in trees:
                tree_env = dict(row_env)
                if src:
                    tree_env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
                # A row's budget: compilation plus the timed steps of a small model; a hung child must not hang us.
                proc = subprocess.run([sys.executable, os.path.abspath(__file__), *row_argv(argv, layout)],
                                      env=tree_env, capture_output=True, text=True, timeout=1800)
                if proc.returncode != 0:
                    print(f"error: layout {name} mode {mode} ({tree} tree) failed:\n{proc.stderr[-3000:]}",
                          file=sys.stderr)
                    return 1
                row = json.loads(proc.stdout.strip().splitlines()[-1])
                row.update(layout=name, mode=mode, tree=tree, src=src or os.path.dirname(os.path.dirname(
                    os.path.abspath(__file__))))
                rows.append(row)
                print(f"{name:12s} {mode:18s} {tree:8s} step {row['step_s'] * 1e3:9.2f} ms  cpu "
                      f"{row['cpu_s'] * 1e3:9.2f} ms  {row['tokens_per_s']:12,.0f} tok/s", file=sys.stderr,
                      flush=True)
    cli.print_result(format_table(rows), {"rows": rows}, opts.json)
    return 0


def _device_count(env: dict) -> int:
    """The number of devices a child will see (asked of a child process, so this one never starts a backend)."""
    proc = subprocess.run([sys.executable, "-c", "import jax; print(jax.device_count())"], env=env,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"could not count devices: {proc.stderr[-1000:]}")
    return int(proc.stdout.strip().splitlines()[-1])


def format_table(rows: list[dict]) -> str:
    """vs_first: step time against the layout's first mode (same tree); vs_row1: against the tree's first row (dp
    when it ran, so pipelined layouts read against all-data-parallel on the same devices); cpu_vs_one: CPU
    seconds per step against the tree's `one` row (one device, same batch) when it ran; dispatch: the expert
    layouts' dispatch share of the op time (`measure`)."""
    base, first, one = {}, {}, {}
    for r in rows:
        base.setdefault((r["tree"], r["layout"]), r["step_s"])
        first.setdefault(r["tree"], r["step_s"])
        if r["layout"] == "one":
            one.setdefault(r["tree"], r["cpu_s"])
    cols = ["layout", "mode", "tree", "mesh", "step_ms", "cpu_ms", "tokens_per_s", "vs_first", "vs_row1",
            "cpu_vs_one", "mfu", "compile_s", "dispatch"]
    cells = [cols] + [[r["layout"], r["mode"], r["tree"],
                       "x".join(f"{k[0]}{v}" for k, v in r["mesh"].items() if v > 1) or "1",
                       f"{r['step_s'] * 1e3:.2f}", f"{r['cpu_s'] * 1e3:.1f}", f"{r['tokens_per_s']:,.0f}",
                       f"{base[(r['tree'], r['layout'])] / r['step_s']:.2f}x",
                       f"{first[r['tree']] / r['step_s']:.2f}x",
                       f"{r['cpu_s'] / one[r['tree']]:.2f}x" if r["tree"] in one else "-",
                       f"{r['mfu']:.1%}", f"{r['compile_s']:.1f}",
                       f"{r['dispatch_share']:.1%}" if "dispatch_share" in r else "-"]
                      for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
