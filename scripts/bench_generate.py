"""Decoding speed: tokens/s with the KV cache against recomputing the whole sequence for every token.

    python scripts/bench_generate.py [--config=llama_tiny] [--batch=1,8] [--prompt_len=16] [--new_tokens=96]
                                     [--repeats=3] [--json=PATH]
    python scripts/bench_generate.py --smoke      # seconds: a tiny model, to check that every path runs

The preset's model with random parameters (vocabulary `--vocab`), greedy decoding of `--batch` random prompts of
`--prompt_len` tokens, `--new_tokens` new tokens each, on one device (msjax.generate.Generator). Each mode is
compiled by an untimed first call; the table gives the median of `--repeats` timed calls: seconds, generated
tokens per second (batch x new tokens / seconds), milliseconds per decoding step, and the cached/uncached ratio
measured side by side in the same process. Both modes must produce the same tokens (`same_tokens`), and the KV
cache's size is given (with a sliding window it is a ring of W slots: memory O(W), not O(sequence)).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

import jax
import numpy as np

from msjax import cli, runtime
from msjax.config import ConfigError, apply_overrides
from msjax.hardware import cpu_model

# An entry point: the process set-up of a run (malloc on CPU, compilation cache, XLA:CPU collective flags),
# before jax starts a backend; importing msjax itself changes nothing (msjax.runtime).
runtime.setup()


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    """Benchmark flags.

    Attributes:
      batch: batch sizes to time, comma-separated.
      prompt_len: tokens per prompt.
      new_tokens: tokens generated per prompt.
      vocab: vocabulary size of the random model.
      repeats: timed calls per mode (the median is reported).
      smoke: a tiny model and few tokens (checks that everything runs; the timings mean nothing).
      json: also write the result as JSON to this file.
    """

    batch: str = "1,8"
    prompt_len: int = 16
    new_tokens: int = 96
    vocab: int = 4096
    repeats: int = 3
    smoke: bool = False
    json: str = ""


def main(argv: list[str]) -> int:
    def body() -> int:
        cfg, (common, opts) = cli.parse(argv, BenchOptions(), prog="bench_generate.py", description=__doc__,
                                        default_preset="llama_tiny", validate=False)
        cli.setup_logging(common)
        if opts.json:
            cli.check_writable(opts.json, "--json")
        from msjax.generate import Generator, cache_length
        from msjax.model import abstract_model, cache_slots, init_params

        prompt_len, new_tokens, batches = opts.prompt_len, opts.new_tokens, [int(b) for b in opts.batch.split(",")]
        if opts.smoke:
            cfg = apply_overrides(cfg, {"model.num_layers": 2, "model.d_model": 32, "model.num_heads": 2,
                                        "model.num_kv_heads": 0, "model.d_ff": 64})
            prompt_len, new_tokens, batches = 4, 8, [1, 2]
        model = apply_overrides(cfg, {"model.vocab_size": opts.vocab, "model.remat": "none"}).validate().model
        if prompt_len + new_tokens > model.max_seq_len:
            raise ConfigError(f"--prompt_len={prompt_len} + --new_tokens={new_tokens} is longer than "
                                  f"model.max_seq_len={model.max_seq_len}")
        graphdef, _, _ = abstract_model(model)
        gen = Generator(model, graphdef, init_params(model, jax.random.key(0)))
        rng = np.random.default_rng(0)
        rows, same = [], True
        for b in batches:
            prompts = rng.integers(0, model.vocab_size, (b, prompt_len)).tolist()
            timing, outputs = {}, {}
            for cached in (True, False):
                call = lambda: gen.generate(prompts, new_tokens, temperature=0, cache=cached)  # noqa: E731
                outputs[cached] = call()  # compiles
                seconds = []
                for _ in range(opts.repeats):
                    t0 = time.perf_counter()
                    call()
                    seconds.append(time.perf_counter() - t0)
                timing[cached] = statistics.median(seconds)
            same &= outputs[True] == outputs[False]
            # msjax.generate's cache: prompt + new tokens rounded up to a block, or the window's ring
            slots = cache_slots(model, cache_length(prompt_len, new_tokens, model.max_seq_len))
            cache_bytes = 2 * model.num_layers * b * slots * model.kv_heads * model.head_size * np.dtype(
                model.dtype).itemsize
            for cached in (True, False):
                rows.append({"batch": b, "mode": "kv_cache" if cached else "recompute", "seconds": timing[cached],
                             "tokens_per_s": b * new_tokens / timing[cached],
                             "ms_per_step": 1e3 * timing[cached] / new_tokens,
                             "cached_speedup": timing[False] / timing[True], "cache_slots": slots,
                             "cache_bytes": int(cache_bytes) if cached else 0})
        load = os.getloadavg()[0]
        header = (f"{cfg.name}: {model.num_layers} layers, d_model {model.d_model}, {model.num_heads} heads "
                  f"({model.kv_heads} kv), window {model.attention.window}, {model.position}/{model.norm}/{model.mlp}"
                  f"; prompt {prompt_len} + {new_tokens} new tokens, greedy\n"
                  f"device: {jax.devices()[0].device_kind} ({cpu_model()}), load average {load:.1f}; median of "
                  f"{opts.repeats}\n")
        table = header + f"{'batch':>5} {'mode':>10} {'seconds':>9} {'tokens/s':>10} {'ms/step':>8} {'x':>6} " \
                         f"{'cache':>10}\n"
        for r in rows:
            table += (f"{r['batch']:>5} {r['mode']:>10} {r['seconds']:>9.3f} {r['tokens_per_s']:>10.1f} "
                      f"{r['ms_per_step']:>8.2f} {r['cached_speedup'] if r['mode'] == 'kv_cache' else 1.0:>6.2f} "
                      f"{(str(r['cache_bytes'] // 1024) + ' KiB') if r['cache_bytes'] else '-':>10}\n")
        table += f"cached and recomputed tokens identical: {same}"
        result = {"preset": cfg.name, "model": dataclasses.asdict(model), "prompt_len": prompt_len,
                  "new_tokens": new_tokens, "repeats": opts.repeats, "device": jax.devices()[0].device_kind,
                  "cpu": cpu_model(), "load_average": load, "same_tokens": same, "rows": rows}
        cli.print_result(table, result, opts.json)
        return 0 if same else 1

    return cli.main_guard(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
