"""Benchmark a preset on the devices present, printing a table and JSON.

Step mode (default): `python scripts/bench.py --config=gpt_tiny [--steps=20] [--json=out.json] [--train.x=...]`
times the jitted train step on synthetic random tokens (tokens/s, step time, MFU): the state is created sharded
and the step is timed after compilation, as the loop calls it (K steps a call with `train.steps_per_execution`),
with a device sync around each timed window (the data pipeline is benchmarked separately and runs off the
critical path). With `--plain_jax`, msjax's step is timed against
nanoGPT's block written in plain JAX at the same shapes (scripts/bench_reference.py), in alternating windows;
with `--vs="--model.x=... --mesh.y=..."`, against itself under those overrides, the same way.

Recipe mode: `python scripts/bench.py --recipe --config=shakespeare_char [--repeats=3]
[--reference_cmd="python train.py ..." --reference_cwd=DIR] [--json=out.json]` runs the whole
`scripts/train.py` job as a child process (process wall, user, system, minor faults, peak RSS, ms/step, val loss),
and a reference recipe's command interleaved with it, so both see the same machine load.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from msjax import cli, runtime
from msjax.config import Config
from msjax.mesh import make_mesh
from msjax.train_step import build_train_program

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_reference.py beside this script, however loaded
from bench_reference import plain_train_step  # noqa: E402

# An entry point: the process set-up of a run (malloc on CPU, compilation cache, XLA:CPU collective flags),
# before jax starts a backend; importing msjax itself changes nothing (msjax.runtime).
runtime.setup()

log = logging.getLogger("msjax.bench")


def random_batch(program) -> dict[str, jax.Array]:
    """A batch of uniformly random token ids for `program`'s step: {"inputs", "targets"}, each (global_batch,
    seq_len) int32 with `program.batch_sharding`, the targets shifted by one (seed 0, so every arm and every run
    of a benchmark sees the same tokens)."""
    t = program.config.train
    tokens = np.random.default_rng(0).integers(0, program.config.model.vocab_size,
                                               (t.global_batch, t.seq_len + 1)).astype(np.int32)
    return {"inputs": jax.device_put(tokens[:, :-1], program.batch_sharding),
            "targets": jax.device_put(tokens[:, 1:], program.batch_sharding)}


def step_call(program) -> tuple[Any, Any, int]:
    """How the training loop calls `program`'s step: (jitted function, its batch argument for `random_batch`,
    steps per call). With `train.steps_per_execution` K > 1 that is `steps_fn` on a tuple of K batches (the same
    random batch K times), else `step_fn` on one batch."""
    batch = random_batch(program)
    k = program.config.train.steps_per_execution
    if program.steps_fn is not None:
        return program.steps_fn, (batch,) * k, k
    return program.step_fn, batch, 1


def time_train_step(cfg: Config, mesh, vocab_size: int, steps: int, warmup: int, repeats: int, trace_dir: str = ""):
    """Builds msjax's train program for `cfg` on `mesh`, compiles its step as the loop calls it (`step_call`) for
    random tokens (state created sharded) and times `repeats` windows of `steps` steps after `warmup` calls, each
    window ended by a device sync; with K steps per call a window is ceil(steps / K) calls. With `trace_dir`, one
    more window then runs under `jax.profiler.trace(trace_dir)` (untimed, with a Perfetto trace), and the compiled
    step's HLO text goes beside it (`program.hlo.txt`: `msjax.observe.profile.scope_share` reads both).

    Returns:
      (program, compile seconds, wall seconds per step of each window, this process's CPU seconds (user +
      system, every thread) per step of each window).
    """
    program = build_train_program(cfg, mesh, vocab_size=vocab_size)
    fn, batch, k = step_call(program)
    calls = -(-steps // k)
    t0 = time.perf_counter()
    state = program.init_fn(jax.random.key(0))
    compiled = fn.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    for _ in range(warmup):
        state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    walls, cpus = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        for _ in range(calls):
            state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        walls.append((time.perf_counter() - w0) / (calls * k))
        cpus.append((time.process_time() - c0) / (calls * k))
    if trace_dir:
        os.makedirs(trace_dir, exist_ok=True)
        with open(os.path.join(trace_dir, "program.hlo.txt"), "w") as f:
            f.write(compiled.as_text())
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(calls):
                state, metrics = compiled(state, batch)
            jax.block_until_ready(metrics)
    return program, compile_s, walls, cpus


def benchmark(cfg: Config, steps: int = 20, warmup: int = 3, repeats: int = 3, vocab_size: int | None = None,
              trace_dir: str = "") -> dict[str, Any]:
    """Times `steps` train steps `repeats` times after `warmup` steps.

    Args:
      cfg: a validated config (model.vocab_size 0 takes `vocab_size`, default 50304).
      trace_dir: also write a `jax.profiler` trace of `steps` more steps here ("" for none).
    Returns:
      dict with compile_s, step_s (median seconds per step), tokens_per_s, mfu (model FLOPs over
      `hardware.mesh_peak_flops`: datasheet peak x devices, or on CPU the best measured host rate), peak label,
      devices and mesh.
    """
    mesh = make_mesh(cfg.mesh)
    program, compile_s, times, _ = time_train_step(cfg, mesh, vocab_size or cfg.model.vocab_size or 50304, steps,
                                                   warmup, repeats, trace_dir)
    cfg, t = program.config, program.config.train
    step_s = statistics.median(times)
    layout = program.layout
    peak, label = layout.peak
    tokens_per_step, flops = layout.tokens_per_step, layout.step_flops
    return {
        "config": cfg.name, "devices": mesh.devices.size, "device_kind": jax.devices()[0].device_kind,
        "mesh": dict(mesh.shape), "global_batch": t.global_batch, "seq_len": t.seq_len,
        "params": program.param_count, "compile_s": compile_s, "step_s": step_s,
        "tokens_per_s": tokens_per_step / step_s, "model_flops_per_step": flops,
        "mfu": layout.mfu(1.0 / step_s), "peak_flops": peak, "peak_label": label,
    }


def alternating_windows(arms: dict[str, list], steps: int, repeats: int) -> dict[str, list[float]]:
    """Times several jitted steps in one process, in turn: round 0 compiles and warms each up (3 steps, untimed),
    then `repeats` rounds of one window of `steps` steps per arm, each window ended by a device sync, the order
    reversed every round (AB, BA, ...), so that a drift of the machine's speed hits every arm alike. Separate
    processes see that drift between them: on the 2-core development machines the same step took 22 ms and 34 ms
    half an hour apart (docs/cpu_speed.md).

    Args:
      arms: name -> [step function (state, batch) -> (state, outputs), state, batch, steps per call]; the states
        are carried. A function of K steps per call (`step_call`) runs ceil(steps / K) calls a window.
      steps, repeats: steps per window (>= 1), timed windows per arm.
    Returns:
      name -> seconds per step of each timed window, in round order.
    """
    times: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    for r in range(repeats + 1):
        for name in (names if r % 2 else names[::-1]):
            fn, state, b, k = arms[name]
            calls = -(-steps // k)
            t0 = time.perf_counter()
            for _ in range(calls if r else 3):
                state, out = fn(state, b)
            jax.block_until_ready(out)
            arms[name][1] = state
            if r:
                times[name].append((time.perf_counter() - t0) / (calls * k))
    return times


def config_comparison(base: Config, other: Config, overrides: str, steps: int = 20,
                      repeats: int = 12) -> dict[str, Any]:
    """msjax's train step under `base` against the step under `other` (the same config with `overrides`), both
    built and compiled in this process (each on its own mesh) and timed by `alternating_windows` on random
    tokens: a before/after ratio of two configs without the process-to-process drift of two separate runs.

    Args:
      base, other: validated configs; model.vocab_size 0 takes 50304.
      overrides: how `other` differs, as given on the command line (a label for the table and JSON).
    Returns:
      dict with base_step_s and vs_step_s (medians, seconds per step), ratio (vs / base, median of the rounds'
      ratios), faster_rounds (rounds in which the vs window was the shorter), each window's times, both
      parameter counts, and the configs' names and the overrides.
    Raises:
      msjax.config.ConfigError: a config that does not fit the devices present (from `build_train_program`).
    """
    arms, params = {}, {}
    for name, cfg in (("base", base), ("vs", other)):
        program = build_train_program(cfg, make_mesh(cfg.mesh), vocab_size=cfg.model.vocab_size or 50304)
        fn, batch, k = step_call(program)
        arms[name] = [fn, program.init_fn(jax.random.key(0)), batch, k]
        params[name] = program.param_count
    times = alternating_windows(arms, steps, repeats)
    ratios = [v / b for v, b in zip(times["vs"], times["base"])]
    return {"config": base.name, "overrides": overrides, "steps": steps, "repeats": repeats,
            "base_step_s": statistics.median(times["base"]), "vs_step_s": statistics.median(times["vs"]),
            "ratio": statistics.median(ratios), "faster_rounds": sum(r < 1 for r in ratios),
            "base_s": times["base"], "vs_s": times["vs"], "base_params": params["base"], "vs_params": params["vs"]}


def format_comparison_table(row: dict[str, Any]) -> str:
    """One line per config: median step time and its windows; then the ratio and how many rounds the change won."""
    label = max(len("base"), len(row["overrides"]))
    lines = [f"{'step':<{label}}    params  ms/step  (windows)"]
    for name, text in (("base", "base"), ("vs", row["overrides"])):
        windows = " ".join(f"{s * 1e3:.1f}" for s in row[f"{name}_s"])
        lines.append(f"{text:<{label}} {row[f'{name}_params']:>9,} {row[f'{name}_step_s'] * 1e3:>8.2f}  ({windows})")
    lines.append(f"with / without the overrides (median of the rounds' ratios): {row['ratio']:.3f}; shorter in "
                 f"{row['faster_rounds']} of {row['repeats']} rounds")
    return "\n".join(lines)


def plain_jax_comparison(cfg: Config, steps: int = 50, repeats: int = 6) -> dict[str, Any]:
    """msjax's train step against `bench_reference.plain_train_step` (nanoGPT's block in plain JAX) at the
    same shapes on one device, timed in alternating windows of `steps` steps (`repeats` each, ABAB...), so a
    drift of the machine's load hits both.

    Args:
      cfg: a validated single-device config; model.vocab_size 0 takes 50304.
    Returns:
      dict with msjax_step_s and plain_step_s (medians, seconds), ratio (msjax / plain, median of the windows'
      ratios), each window's times, params of both (to show they are the same model size) and model FLOPs.
    Raises:
      ValueError: a model the reference does not reproduce (`bench_reference.plain_train_step`).
    """
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])  # the reference has no sharding: compare on one device
    program = build_train_program(cfg, mesh, vocab_size=cfg.model.vocab_size or 50304)
    cfg = program.config
    batch = random_batch(program)
    plain_step, plain_state, plain_batch = plain_train_step(cfg, cfg.model.padded_vocab())
    # one step per call on both sides (the reference is a single jitted step), whatever train.steps_per_execution
    arms = {"msjax": [program.step_fn, program.init_fn(jax.random.key(0)), batch, 1],
            "plain": [plain_step, plain_state, plain_batch, 1]}
    times = alternating_windows(arms, steps, repeats)
    plain_params = sum(x.size for x in jax.tree.leaves(arms["plain"][1][0]))
    return {"config": cfg.name, "steps": steps, "repeats": repeats,
            "msjax_step_s": statistics.median(times["msjax"]), "plain_step_s": statistics.median(times["plain"]),
            "ratio": statistics.median([a / b for a, b in zip(times["msjax"], times["plain"])]),
            "msjax_s": times["msjax"], "plain_s": times["plain"], "msjax_params": program.param_count,
            "plain_params": int(plain_params),
            "model_flops_per_step": program.layout.step_flops}


def format_plain_table(row: dict[str, Any]) -> str:
    """One line per step: msjax's and the plain-JAX reference's median step time and the ratio."""
    lines = ["step                    params    ms/step  (windows)"]
    for name in ("msjax", "plain"):
        label = "msjax" if name == "msjax" else "plain JAX (reference)"
        windows = " ".join(f"{s * 1e3:.1f}" for s in row[f"{name}_s"])
        lines.append(f"{label:<21} {row[f'{name}_params']:>9,} {row[f'{name}_step_s'] * 1e3:>9.1f}  ({windows})")
    lines.append(f"msjax / plain (median of window ratios): {row['ratio']:.3f}")
    return "\n".join(lines)


def format_table(rows: list[dict[str, Any]]) -> str:
    cols = [("config", "{}"), ("devices", "{}"), ("params", "{:,}"), ("global_batch", "{}"), ("seq_len", "{}"),
            ("compile_s", "{:.2f}"), ("step_s", "{:.4f}"), ("tokens_per_s", "{:,.0f}"), ("mfu", "{:.1%}")]
    cells = [[c for c, _ in cols]] + [[f.format(r[c]) for c, f in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells)


# ---------------------------------------------------------------------------------------------------------------
# Whole-recipe timing: a training command run as a child process, measured as `/usr/bin/time -v` would.

_VAL_LOSS = re.compile(r"val loss[ =:]+([0-9]+\.[0-9]+)")
_ITER_MS = re.compile(r"time ([0-9]+\.[0-9]+)ms")


def time_command(cmd: Sequence[str], cwd: str | None = None, env: Mapping[str, str] | None = None,
                 timeout_s: float = 3600.0) -> dict[str, Any]:
    """Runs `cmd` to completion and measures it with the child's own rusage (os.wait4).

    Args:
      cmd: the command (argv list).
      cwd, env: its working directory and environment (None: ours).
      timeout_s: the child is killed after this many seconds and TimeoutError names the command.
    Returns:
      dict with wall_s (process wall time, s), user_s and system_s (CPU seconds), minor_faults, max_rss_mb
      (peak resident set, MiB), returncode, and stdout/stderr (text).
    Raises:
      TimeoutError: the command ran longer than `timeout_s`.
    """
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(list(cmd), cwd=cwd, env=None if env is None else dict(env), stdout=out,
                                stderr=err)
        deadline = t0 + timeout_s
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                proc.kill()
                proc.wait()
                raise TimeoutError(f"{' '.join(cmd)} ran past {timeout_s:.0f} s")
            time.sleep(0.05)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return {"wall_s": wall, "user_s": usage.ru_utime, "system_s": usage.ru_stime,
                "minor_faults": usage.ru_minflt, "max_rss_mb": usage.ru_maxrss / 1024,
                "returncode": proc.returncode, "stdout": out.read().decode("utf-8", "replace"),
                "stderr": err.read().decode("utf-8", "replace")}


def stderr_tail(stderr: str, lines: int = 12, chars: int = 2000) -> str:
    """The last `lines` non-blank lines of a failed run's stderr (at most `chars` characters), for its row: a
    parser's error box (tyro prints the message above a closing line such as "see the message above") or a
    traceback's last frames, not only the last line."""
    kept = [ln.rstrip() for ln in stderr.splitlines() if ln.strip()][-lines:]
    return "\n".join(kept)[-chars:] if kept else "no output"


def msjax_recipe_row(timed: dict[str, Any]) -> dict[str, Any]:
    """A recipe row from a timed `scripts/train.py` run: adds steps, ms_per_step (after the first, compiling,
    step; evaluation included) and the final val_loss, read from the summary JSON train.py prints last."""
    row = {k: v for k, v in timed.items() if k not in ("stdout", "stderr")}
    lines = [ln for ln in timed["stdout"].splitlines() if ln.startswith("{")]
    if timed["returncode"] != 0 or not lines:
        row["error"] = stderr_tail(timed["stderr"])
        return row
    summary = json.loads(lines[-1])
    steps = summary["final_step"] - summary["start_step"]
    row.update(steps=steps, first_step_s=summary["first_step_s"],
               val_loss=summary["val_loss"][-1][1] if summary["val_loss"] else None,
               ms_per_step=1e3 * (summary["wall_s"] - summary["first_step_s"]) / max(steps - 1, 1))
    return row


def reference_recipe_row(timed: dict[str, Any]) -> dict[str, Any]:
    """A recipe row from a timed reference command that prints nanoGPT-style lines (`... val loss X` and
    `iter N: loss X, time Yms`): val_loss is the last one printed, ms_per_step the median iteration time."""
    row = {k: v for k, v in timed.items() if k not in ("stdout", "stderr")}
    text = timed["stdout"] + timed["stderr"]
    losses = _VAL_LOSS.findall(text)
    iters = [float(x) for x in _ITER_MS.findall(text)[1:]]  # the first iteration includes set-up
    row.update(val_loss=float(losses[-1]) if losses else None,
               ms_per_step=statistics.median(iters) if iters else None, steps=len(iters) + 1 if iters else None)
    if timed["returncode"] != 0:
        row["error"] = stderr_tail(timed["stderr"])
    return row


def format_recipe_table(rows: list[dict[str, Any]]) -> str:
    """Rows of `msjax_recipe_row` / `reference_recipe_row` (plus `name`, `repeat`) as an aligned text table."""
    cols = [("name", "{}"), ("repeat", "{}"), ("wall_s", "{:.1f}"), ("user_s", "{:.1f}"), ("system_s", "{:.1f}"),
            ("minor_faults", "{:,}"), ("max_rss_mb", "{:.0f}"), ("ms_per_step", "{:.1f}"), ("val_loss", "{:.4f}"),
            ("load", "{}")]
    def cell(r, c, f):
        v = r.get(c)
        return "-" if v is None else f.format(v)
    cells = [[c for c, _ in cols]] + [[cell(r, c, f) for c, f in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells)


def recipe_benchmark(train_args: Sequence[str], repeats: int = 1, reference_cmd: Sequence[str] = (),
                     reference_cwd: str | None = None, timeout_s: float = 3600.0) -> list[dict]:
    """Times `python scripts/train.py *train_args` (and `reference_cmd`, when given) `repeats` times each,
    interleaved (msjax, reference, msjax, ...) so both see the same machine load.

    Each msjax run gets a fresh temporary `train.run_dir` (no checkpoint to resume) unless `train_args` sets
    one, and prints no sample. Returns one row per run (see `msjax_recipe_row`), each with `name`, `repeat`
    and `load` (the 1-minute load average when it started); each finished run is logged (INFO).
    """
    script = str(Path(__file__).resolve().parent / "train.py")
    rows = []
    for i in range(repeats):
        with tempfile.TemporaryDirectory(prefix="msjax-recipe-") as tmp:
            args = [f"--train.run_dir={tmp}/run", "--train.sample_tokens=0", "--train.progress=false",
                    *train_args]
            load = f"{os.getloadavg()[0]:.1f}"
            row = msjax_recipe_row(time_command([sys.executable, script, *args], timeout_s=timeout_s))
        rows.append({"name": "msjax", "repeat": i, "load": load, **row})
        log.info("msjax run %d: %s", i, json.dumps(rows[-1]))
        if "error" in row:
            log.error("msjax run %d failed (exit %s):\n%s", i, row["returncode"], row["error"])
        if reference_cmd:
            load = f"{os.getloadavg()[0]:.1f}"
            row = reference_recipe_row(time_command(list(reference_cmd), cwd=reference_cwd, timeout_s=timeout_s))
            rows.append({"name": "reference", "repeat": i, "load": load, "command": shlex.join(reference_cmd),
                         **row})
            log.info("reference run %d: %s", i, json.dumps(rows[-1]))
            if "error" in row:
                log.error("reference run %d failed (exit %s):\n%s", i, row["returncode"], row["error"])
    return rows


def recipe_ratios(rows: list[dict]) -> dict[str, float]:
    """Medians over repeats: msjax wall / reference wall, and each side's median wall and val loss."""
    def med(name, key):
        vals = [r[key] for r in rows if r["name"] == name and r.get(key) is not None]
        return statistics.median(vals) if vals else None
    out = {"msjax_wall_s": med("msjax", "wall_s"), "msjax_val_loss": med("msjax", "val_loss"),
           "reference_wall_s": med("reference", "wall_s"), "reference_val_loss": med("reference", "val_loss")}
    if out["msjax_wall_s"] and out["reference_wall_s"]:
        out["wall_ratio"] = out["msjax_wall_s"] / out["reference_wall_s"]
    return out


# ---------------------------------------------------------------------------------------------------------------
# The command line.

@dataclasses.dataclass(frozen=True)
class BenchOptions:
    """bench.py's own flags.

    Attributes:
      steps: step mode: train steps per timed window (median of 3 windows after 3 warm-up steps).
      json: also write the result as JSON to this path.
      recipe: time the whole scripts/train.py job as a child process instead of the step.
      repeats: recipe mode: runs of each command, interleaved; --vs: timed rounds (12 when 1).
      reference_cmd: recipe mode: a reference recipe's command line (e.g. nanoGPT's train.py), timed beside msjax.
      reference_cwd: recipe mode: the reference command's working directory.
      plain_jax: step mode: time msjax's step against nanoGPT's block in plain JAX at the same shapes
        (scripts/bench_reference.py), in alternating windows of --steps steps.
      trace: step mode: after timing, run --steps more steps under `jax.profiler.trace` into this directory
        (TensorBoard's profile plugin or Perfetto reads it); the timed figures do not include them.
      vs: step mode: config overrides, e.g. "--model.matmul_dtype=activations --model.remat=full" (give it with
        "="): the step is built with and without them in this one process and the two are timed in alternating
        windows of --steps steps (--repeats rounds; 12 when --repeats is 1), for a before/after ratio.
    """

    steps: int = 20
    json: str = ""
    recipe: bool = False
    repeats: int = 1
    reference_cmd: str = ""
    reference_cwd: str = ""
    plain_jax: bool = False
    trace: str = ""
    vs: str = ""


def main(argv: list[str]) -> int:
    def body() -> int:
        cfg, (common, opts) = cli.parse(argv, BenchOptions(), prog="bench.py", description=__doc__)
        cli.setup_logging(common)
        if opts.json:
            cli.check_writable(opts.json, "--json")
        config_args = [a for a in argv if a.split("=", 1)[0].lstrip("-") not in
                       {f.name for f in dataclasses.fields(BenchOptions)}]
        if opts.recipe:
            rows = recipe_benchmark(config_args, repeats=opts.repeats,
                                          reference_cmd=shlex.split(opts.reference_cmd),
                                          reference_cwd=opts.reference_cwd or None)
            result = {"config": cfg.name, "rows": rows, "summary": recipe_ratios(rows)}
            table = format_recipe_table(rows)
        elif opts.vs:
            other, _ = cli.parse(config_args + shlex.split(opts.vs), prog="bench.py --vs")
            result = config_comparison(cfg, other, opts.vs, steps=opts.steps,
                                       repeats=opts.repeats if opts.repeats > 1 else 12)
            table = format_comparison_table(result)
        elif opts.plain_jax:
            result = plain_jax_comparison(cfg, steps=opts.steps)
            table = format_plain_table(result)
        else:
            result = benchmark(cfg, steps=opts.steps, trace_dir=opts.trace)
            table = format_table([result])
        cli.print_result(table, result, opts.json)
        return 1 if any("error" in r for r in result.get("rows", ())) else 0  # a timed run failed

    return cli.main_guard(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
