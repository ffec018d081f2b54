"""Supervised fine-tuning with and without packing, side by side on the same chat data: rows, padding, and the
speed of the tokens that are examples' (not padding's).

    python scripts/bench_sft.py [--config=llama_tiny] [--examples=600] [--seq_len=512] [--steps=30] [--json=PATH]

The chat data is real text on every machine: one conversation per documented public function or class of a few
standard-library modules (the user asks what it does, the assistant answers with its docstring, cut at 1,500
characters), so example lengths vary as real instruction data does, from a dozen tokens to hundreds. The
tokenizer is a byte-level BPE trained on the same modules with ChatML's special tokens, the template ChatML.
Each mode trains `--steps` steps of the preset's model (`data.format=chat`, `data.pack` true or false) in a
fresh `scripts/train.py` process; the two runs alternate `--repeats` times. Reported per mode: the rows one
epoch of the data fills, the share of their token slots that hold example tokens, the train step's token slots
per second (`tokens_per_s` of the run, the compiled step's speed over all slots), and from them example tokens
per second and seconds per epoch; the ratio packed / unpacked of example tokens per second.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from msjax import cli, runtime
from msjax.hardware import cpu_model

runtime.setup()  # an entry point: the process set-up of a run, before jax starts a backend (msjax.runtime)

ROOT = Path(__file__).resolve().parents[1]
MODULES = ("textwrap", "shlex", "string", "inspect", "argparse", "json", "pathlib", "subprocess", "functools",
           "collections", "dataclasses", "logging", "typing", "re", "os", "shutil", "tempfile", "csv", "random")
CHATML = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
          "{%- endif %}")


@dataclasses.dataclass(frozen=True)
class SFTBenchOptions:
    """Benchmark flags.

    Attributes:
      examples: conversations in the chat file (at most the documented names of MODULES).
      seq_len: train.seq_len of both runs (the model's max_seq_len is raised to it).
      batch: train.global_batch (rows per step).
      steps: steps per run (the first compiles; tokens_per_s is the run's own figure).
      repeats: runs per mode, alternating.
      json: also write the result as JSON to this file.
    """

    examples: int = 600
    seq_len: int = 512
    batch: int = 8
    steps: int = 30
    repeats: int = 2
    json: str = ""


def chat_data(directory: Path, count: int) -> tuple[Path, Path, Path]:
    """Writes (chats.jsonl, tokenizer.json, chatml.jinja) into `directory` (module docstring)."""
    from tokenizers import Tokenizer

    from msjax.data import HFTokenizer

    lines = []
    for name in MODULES:
        module = importlib.import_module(name)
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            doc = inspect.getdoc(obj) if not attr.startswith("_") and callable(obj) else None
            if doc and getattr(obj, "__module__", None) == name:
                lines.append(json.dumps({"messages": [
                    {"role": "user", "content": f"What does {name}.{attr} do?"},
                    {"role": "assistant", "content": doc[:1500]}]}))
    lines = lines[:count]
    chats = directory / "chats.jsonl"
    chats.write_text("\n".join(lines) + "\n")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tok = HFTokenizer.train([(stdlib / f"{n}.py").read_text() for n in MODULES if (stdlib / f"{n}.py").is_file()],
                            2048)
    tok_path = directory / "tokenizer.json"
    tok.save(tok_path)
    raw = Tokenizer.from_file(str(tok_path))
    raw.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    raw.save(str(tok_path))
    template = directory / "chatml.jinja"
    template.write_text(CHATML)
    return chats, tok_path, template


def main(argv: list[str]) -> int:
    def body() -> int:
        cfg, (common, opts) = cli.parse(argv, SFTBenchOptions(), prog="bench_sft.py",
                                        description=__doc__.split("\n\n")[0], default_preset="llama_tiny")
        cli.setup_logging(common)
        if opts.json:
            cli.check_writable(opts.json, "--json")
        from msjax.config import apply_overrides
        from msjax.data import prepare_chat_data

        with tempfile.TemporaryDirectory(prefix="msjax-bench-sft-") as tmp:
            chats, tok_path, template = chat_data(Path(tmp), opts.examples)
            keys = {"data.format": "chat", "data.paths": (str(chats),), "data.tokenizer_path": str(tok_path),
                    "data.chat_template": str(template), "data.too_long": "truncate", "train.seq_len": opts.seq_len,
                    "model.max_seq_len": max(opts.seq_len, cfg.model.max_seq_len), "train.global_batch": opts.batch,
                    "train.steps": opts.steps}
            modes = {}
            for pack in (True, False):
                data = prepare_chat_data(apply_overrides(cfg, {**keys, "data.pack": pack}).data, opts.seq_len)
                tr = data.train
                modes["packed" if pack else "unpacked"] = {
                    "rows": tr.num_rows, "examples": tr.num_examples, "example_tokens": tr.num_tokens,
                    "loss_tokens": tr.num_loss_tokens, "slot_share": tr.num_tokens / (tr.num_rows * opts.seq_len),
                    "truncated": tr.truncated, "slots_per_s": []}
            for repeat in range(opts.repeats):
                for name, mode in modes.items():
                    run_dir = Path(tmp) / f"run-{name}-{repeat}"
                    flags = [f"--config={cfg.name}", *[f"--{k}={','.join(v) if isinstance(v, tuple) else v}"
                                                       for k, v in keys.items()],
                             f"--data.pack={name == 'packed'}", f"--train.run_dir={run_dir}", "--train.progress=false",
                             "--train.eval_every=0", "--train.eval_batches=1", "--train.sample_tokens=0",
                             "--checkpoint.every=0", f"--train.log_every={opts.steps}"]
                    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), *flags], cwd=ROOT,
                                          capture_output=True, text=True, timeout=3600)
                    if proc.returncode != 0:
                        raise RuntimeError(f"train.py ({name}) failed:\n{proc.stderr[-3000:]}")
                    summary = json.loads(proc.stdout.strip().splitlines()[-1])
                    mode["slots_per_s"].append(summary["tokens_per_s"])
            for mode in modes.values():
                best = max(mode["slots_per_s"])
                mode["example_tokens_per_s"] = best * mode["slot_share"]
                mode["epoch_s"] = mode["rows"] * opts.seq_len / best
        packed, unpacked = modes["packed"], modes["unpacked"]
        result = {"config": cfg.name, "cpu": cpu_model(), "seq_len": opts.seq_len, "batch": opts.batch,
                  "steps": opts.steps, "modes": modes,
                  "ratio": packed["example_tokens_per_s"] / unpacked["example_tokens_per_s"]}
        rows = [f"{'mode':<9} {'rows':>6} {'examples':>8} {'slots used':>10} {'slots/s':>9} {'example tok/s':>13} "
                f"{'epoch':>8}"]
        for name, m in modes.items():
            rows.append(f"{name:<9} {m['rows']:>6,} {m['examples']:>8,} {m['slot_share']:>10.1%} "
                        f"{max(m['slots_per_s']):>9,.0f} {m['example_tokens_per_s']:>13,.0f} {m['epoch_s']:>7.1f}s")
        rows.append(f"packed / unpacked example tokens per second: {result['ratio']:.2f}x "
                    f"({cfg.name}, T={opts.seq_len}, B={opts.batch}, {result['cpu']})")
        cli.print_result("\n".join(rows), result, opts.json)
        return 0

    return cli.main_guard(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
