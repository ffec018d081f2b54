"""Peak memory and speed of generating from a run: the whole train state restored (as generation read checkpoints
before), the parameters alone (Orbax partial restore), and the parameters alone in bfloat16.

    python scripts/bench_generate_memory.py --run_dir=RUN [--batch=4] [--prompt_len=16] [--new_tokens=64]
                                            [--json=PATH]

Each mode runs in a fresh process (peak resident memory, `ru_maxrss`, only grows): it starts jax's backend, notes
its resident memory (the baseline: interpreter, jax, XLA), restores the run's newest verified checkpoint onto one
device, generates `--batch` random prompts of `--prompt_len` tokens plus `--new_tokens` greedy tokens with the KV
cache (once to compile, once timed), and reports its peak. On a CPU host and device memory are one, so the peak
above the baseline is what restoring and generating took. The table gives it beside the parameters' bytes (as
restored), the KV cache's bytes (`msjax.generate.cache_length` slots), the peak over the baseline once the restore
was done ("restored") and the ratio (peak - baseline - cache) / parameters; the generation compiles XLA programs,
whose memory is in the peak too. On XLA:CPU a bfloat16 decode step holds float32 copies of the weights (its dots
run in float32: the compiled decode's temporary bytes are the float32 weights' size), which a GPU does not.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import subprocess
import sys
import time

from msjax import cli, runtime
from msjax.config import ConfigError
from msjax.hardware import cpu_model

# An entry point: the process set-up of a run (malloc on CPU, compilation cache, XLA:CPU collective flags),
# before jax starts a backend; importing msjax itself changes nothing (msjax.runtime).
runtime.setup()

MODES = ("train_state", "params", "params_bf16")


@dataclasses.dataclass(frozen=True)
class MemoryOptions:
    """Benchmark flags.

    Attributes:
      run_dir: the run directory to generate from (training's, or scripts/convert.py --from_hf's).
      batch: prompts generated together.
      prompt_len: tokens per (random) prompt.
      new_tokens: tokens generated per prompt.
      mode: run one mode in this process and print its JSON (what the parent starts); empty: every mode.
      json: also write the result as JSON to this file.
    """

    run_dir: str = ""
    batch: int = 4
    prompt_len: int = 16
    new_tokens: int = 64
    mode: str = ""
    json: str = ""


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _current_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(run_dir: str, mode: str, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """One mode in this process (see the module docstring): {"mode", "baseline_bytes", "peak_bytes",
    "param_bytes", "cache_bytes", "tokens_per_s", "restore_s", ...}."""
    import jax
    import numpy as np

    from msjax.checkpoint import Checkpointer, checkpoint_dir
    from msjax.generate import Generator, cache_length, load_run
    from msjax.layout import resolve
    from msjax.model import cache_slots
    from msjax.runs import run_config
    from msjax.train_step import build_train_program

    jax.devices()  # the backend up before the baseline
    one_device = {"mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1, "mesh.sequence": 1, "mesh.pipeline": 1}
    baseline = _current_bytes()
    t0 = time.perf_counter()
    if mode == "train_state":  # what generation did before: the whole state read and verified, then params kept
        cfg = run_config(run_dir, one_device)
        program = build_train_program(resolve(cfg, jax.devices()[:1], strict=False))
        ckpt = Checkpointer(cfg.checkpoint, checkpoint_dir(cfg.checkpoint, run_dir), read_only=True)
        try:
            step, state, _ = ckpt.restore(program.abstract_state)
        finally:
            ckpt.close()
        params = state.pop("params")
        del state
        model = program.config.model
        gen = Generator(model, program.graphdef, params, program.mesh, program.layout.rules)
    else:
        run = load_run(run_dir, one_device, devices=jax.devices()[:1],
                       dtype="bfloat16" if mode == "params_bf16" else None)
        step, model, gen = run.step, run.config.model, run.generator
    restore_s = time.perf_counter() - t0
    after_restore = _peak_bytes()
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(gen.params))
    prompts = np.random.default_rng(0).integers(0, model.vocab_size, (batch, prompt_len)).tolist()
    gen.generate(prompts, new_tokens, temperature=0)  # compiles
    t0 = time.perf_counter()
    ids = gen.generate(prompts, new_tokens, temperature=0)
    seconds = time.perf_counter() - t0
    slots = cache_slots(model, cache_length(prompt_len, new_tokens, model.max_seq_len))
    cache_bytes = 2 * model.num_layers * batch * slots * model.kv_heads * model.head_size * np.dtype(
        model.dtype).itemsize
    return {"mode": mode, "step": step, "dtype": model.param_dtype, "baseline_bytes": baseline,
            "peak_after_restore_bytes": after_restore, "peak_bytes": _peak_bytes(), "param_bytes": param_bytes,
            "cache_bytes": int(cache_bytes), "cache_slots": slots, "restore_s": restore_s, "generate_s": seconds,
            "tokens_per_s": batch * new_tokens / seconds, "generated": sum(map(len, ids))}


def main(argv: list[str]) -> int:
    def body() -> int:
        cfg, (common, opts) = cli.parse(argv, MemoryOptions(), prog="bench_generate_memory.py",
                                        description=__doc__, default_preset="gpt_tiny", validate=False)
        cli.setup_logging(common)
        if not opts.run_dir:
            raise ConfigError("--run_dir is required: a run directory with a checkpoint")
        if opts.mode:
            if opts.mode not in MODES:
                raise ConfigError(f"--mode={opts.mode!r}: allowed: {', '.join(MODES)}")
            print(json.dumps(measure(opts.run_dir, opts.mode, opts.batch, opts.prompt_len, opts.new_tokens)))
            return 0
        if opts.json:
            cli.check_writable(opts.json, "--json")
        rows = []
        for mode in MODES:
            child = subprocess.run(
                [sys.executable, __file__, f"--run_dir={opts.run_dir}", f"--mode={mode}", f"--batch={opts.batch}",
                 f"--prompt_len={opts.prompt_len}", f"--new_tokens={opts.new_tokens}"],
                capture_output=True, text=True, timeout=3600)
            if child.returncode != 0:
                raise RuntimeError(f"mode {mode} failed (exit {child.returncode}): {child.stderr[-2000:]}")
            rows.append(json.loads(child.stdout.strip().splitlines()[-1]))
        mib = 2 ** 20
        table = (f"generation from {opts.run_dir} (step {rows[0]['step']}); batch {opts.batch}, prompt "
                 f"{opts.prompt_len} + {opts.new_tokens} new tokens, greedy, one device ({cpu_model()})\n"
                 f"{'mode':>12} {'params MiB':>10} {'cache MiB':>9} {'restored MiB':>12} {'peak-base MiB':>13} "
                 f"{'x params':>8} {'restore s':>9} {'tokens/s':>9}\n")
        for r in rows:
            r["peak_over_baseline_bytes"] = r["peak_bytes"] - r["baseline_bytes"]
            r["ratio_to_params"] = (r["peak_over_baseline_bytes"] - r["cache_bytes"]) / r["param_bytes"]
            table += (f"{r['mode']:>12} {r['param_bytes'] / mib:>10.1f} {r['cache_bytes'] / mib:>9.1f} "
                      f"{(r['peak_after_restore_bytes'] - r['baseline_bytes']) / mib:>12.1f} "
                      f"{r['peak_over_baseline_bytes'] / mib:>13.1f} {r['ratio_to_params']:>8.2f} "
                      f"{r['restore_s']:>9.2f} {r['tokens_per_s']:>9.1f}\n")
        result = {"run_dir": opts.run_dir, "batch": opts.batch, "prompt_len": opts.prompt_len,
                  "new_tokens": opts.new_tokens, "cpu": cpu_model(), "rows": rows}
        cli.print_result(table.rstrip("\n"), result, opts.json)
        return 0

    return cli.main_guard(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
