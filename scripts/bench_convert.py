"""Peak memory and time of Hugging Face conversion, both ways, for a model of a chosen size.

    python scripts/bench_convert.py [--arch=gpt2|llama] [--layers=12] [--width=768] [--vocab=50257] [--json=PATH]

Needs the dev extra (`transformers` + `torch` make the random model, as a user's `save_pretrained` would). A random
model of the given shape is saved as safetensors in a temporary directory, then `scripts/convert.py --from_hf` and
`--to_hf` each run as a child process on one CPU device; their peak resident memory is the kernel's count for that
child (`os.wait4` -> ru_maxrss). For scale the table gives the bytes of the safetensors, of the parameters in
float32, and of a run's train state (parameters + AdamW's two moments; the import writes the parameters alone),
and the peak of a child that only imports msjax and starts jax (the fixed cost of the libraries).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from msjax import cli, runtime
from msjax.config import ConfigError

# An entry point: the process set-up of a run (malloc on CPU, compilation cache, XLA:CPU collective flags),
# before jax starts a backend; importing msjax itself changes nothing (msjax.runtime).
runtime.setup()

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    """Benchmark flags.

    Attributes:
      arch: gpt2 or llama (a Llama with a quarter of the heads as key/value heads and an MLP of 8/3 width).
      layers: transformer layers.
      width: model width (heads of 64).
      vocab: vocabulary size.
      json: also write the result as JSON to this file.
    """

    arch: str = "gpt2"
    layers: int = 12
    width: int = 768
    vocab: int = 50257
    json: str = ""


# A small launcher runs each measured command: Linux carries a process's peak RSS across fork and exec, so a child
# forked from this process (torch and transformers loaded) would report this process's peak as its own.
_LAUNCHER = ("import os, subprocess, sys\n"
             "p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)\n"
             "_, status, usage = os.wait4(p.pid, 0)\n"
             "print(os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024)\n")


def _child(argv: list[str]) -> tuple[float, int, int, str]:
    """(seconds, exit status, peak RSS bytes, stderr tail) of a command, measured by `_LAUNCHER`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _LAUNCHER, *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=3600)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0 or not proc.stdout.strip():
        return seconds, proc.returncode or 1, 0, proc.stderr[-2000:]
    status, rss = map(int, proc.stdout.split()[-2:])
    return seconds, status, rss, proc.stderr[-2000:]


def main(argv: list[str]) -> int:
    def body() -> int:
        (_, opts) = cli.parse_options(argv, BenchOptions(), prog="bench_convert.py", description=__doc__)
        if opts.json:
            cli.check_writable(opts.json, "--json")
        if opts.arch not in ("gpt2", "llama"):
            raise ConfigError(f"--arch={opts.arch!r}: allowed: gpt2, llama")
        import torch
        import transformers

        heads = opts.width // 64
        if opts.arch == "gpt2":
            config = transformers.GPT2Config(vocab_size=opts.vocab, n_positions=1024, n_embd=opts.width,
                                             n_layer=opts.layers, n_head=heads)
        else:
            config = transformers.LlamaConfig(vocab_size=opts.vocab, hidden_size=opts.width,
                                              intermediate_size=8 * opts.width // 3 // 64 * 64,
                                              num_hidden_layers=opts.layers, num_attention_heads=heads,
                                              num_key_value_heads=max(1, heads // 4), max_position_embeddings=1024)
        rows = {}
        with tempfile.TemporaryDirectory(prefix="msjax_bench_convert_") as tmp:
            tmp = Path(tmp)
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(config)
            params = sum(p.numel() for p in model.parameters())
            model.save_pretrained(tmp / "hf")
            del model
            st_bytes = sum(p.stat().st_size for p in (tmp / "hf").glob("*.safetensors"))
            rows["baseline"] = _child([sys.executable, "-c",
                                       "import msjax, jax; jax.numpy.zeros(1).block_until_ready()"])
            rows["import"] = _child([sys.executable, "scripts/convert.py", f"--from_hf={tmp / 'hf'}",
                                     f"--run_dir={tmp / 'run'}"])
            rows["export"] = _child([sys.executable, "scripts/convert.py", "--to_hf", f"--run_dir={tmp / 'run'}",
                                     f"--out={tmp / 'out'}"])
        for name, (_, status, _, err) in rows.items():
            if status != 0:
                raise RuntimeError(f"{name} failed ({status}): {err}")
        state_bytes = 3 * 4 * params
        table = (f"{opts.arch}: {opts.layers} layers, width {opts.width}, vocab {opts.vocab}: {params / 1e6:.1f}M "
                 f"parameters; safetensors {st_bytes / 2**20:.0f} MiB, float32 parameters {4 * params / 2**20:.0f} "
                 f"MiB, train state (parameters + 2 AdamW moments) {state_bytes / 2**20:.0f} MiB\n"
                 f"{'step':>10} {'seconds':>8} {'peak RSS MiB':>13}\n")
        for name, (seconds, _, rss, _) in rows.items():
            table += f"{name:>10} {seconds:>8.1f} {rss / 2**20:>13.0f}\n"
        result = {"arch": opts.arch, "layers": opts.layers, "width": opts.width, "vocab": opts.vocab,
                  "params": params, "safetensors_bytes": st_bytes, "train_state_bytes": state_bytes,
                  **{f"{name}_seconds": r[0] for name, r in rows.items()},
                  **{f"{name}_peak_rss_bytes": r[2] for name, r in rows.items()}}
        cli.print_result(table.rstrip(), result, opts.json)
        return 0

    return cli.main_guard(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
