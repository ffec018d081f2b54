"""Generate text from a run: `python scripts/generate.py --run_dir=RUN --prompt="To be" --max_new_tokens=50`.

The run's newest verified checkpoint, its config and tokenizer (from training, or `scripts/convert.py --from_hf`),
decoded with a KV cache (msjax.generate). Only the parameters are read from the checkpoint, in their stored dtype
or `--dtype=bfloat16`. `--prompt` may be given several times (a batch of prompts of any lengths, each ending at its
own end-of-text), or `--prompt_file` (one prompt per line, or JSON Lines: a string or {"prompt": ...} per line);
`--temperature=0` is greedy; `--json=PATH` also writes each prompt's token ids, the generated ids and the text.
`--chat` renders each prompt as a user turn (or a JSONL line's {"messages": [...]}, a whole conversation) with the
model's own chat template and ends each reply at its end-of-turn ids (msjax.chat). Sampling flags not given take
the model's generation_config.json defaults. Config flags lay the model out on another mesh (`--mesh.tensor=2
--mesh.data=1`).
"""

import dataclasses
import json
import sys
from pathlib import Path

from msjax import cli, runtime
from msjax.config import ConfigError

# An entry point: the process set-up of a run (malloc on CPU, compilation cache, XLA:CPU collective flags),
# before jax starts a backend; importing msjax itself changes nothing (msjax.runtime).
runtime.setup()


@dataclasses.dataclass(frozen=True)
class GenerateOptions:
    """Generation flags.

    Attributes:
      run_dir: the run directory (config.json, checkpoints/, tokenizer.json).
      prompt_file: prompts added after the --prompt flags: a text file with one prompt per line, or a `.jsonl`
        file with one JSON string, {"prompt": string} or (with --chat) {"messages": [{"role", "content"}, ...]}
        object per line.
      chat: apply the model's chat template (a prompt is one user turn) and stop at its end-of-turn ids.
      dtype: the parameters, activations and KV cache in "float32" or "bfloat16"; empty: as the run trained.
      max_new_tokens: tokens to generate per prompt.
      temperature: softmax temperature; 0 is greedy (the most likely token every step). Not given: the model's
        generation_config.json's (greedy when it has do_sample false), else this default.
      top_k: sample among the k most likely tokens only; 0: all. Not given: as temperature.
      top_p: sample among the fewest most likely tokens whose probabilities add up to top_p; 1: all. Not given:
        as temperature.
      seed: the random seed of the draws.
      cache: decode against a KV cache; false recomputes the whole sequence for every token.
      stop_at_eot: end a prompt's generation at the tokenizer's end-of-text token.
      rolling: generate past model.max_seq_len by keeping the last max_seq_len / 2 tokens as the context.
      json: also write the results as JSON to this file.
    """

    run_dir: str = ""
    prompt_file: str = ""
    chat: bool = False
    dtype: str = ""
    max_new_tokens: int = 64
    temperature: float = 0.8
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    cache: bool = True
    stop_at_eot: bool = True
    rolling: bool = False
    json: str = ""


def _take_prompts(argv: list[str]) -> tuple[list[str], list[str]]:
    """The values of every --prompt flag (kept whole: a prompt may hold commas), and the other flags."""
    prompts, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--prompt="):
            prompts.append(arg.split("=", 1)[1])
        elif arg == "--prompt" and i + 1 < len(argv):
            prompts.append(argv[i + 1])
            i += 1
        else:
            rest.append(arg)
        i += 1
    return prompts, rest


def read_prompts(path: str, chat: bool = False) -> list:
    """The prompts of a --prompt_file (GenerateOptions.prompt_file): empty lines are skipped; with `chat`, a
    `.jsonl` line may hold a conversation ({"messages": [...]}, returned as its list).

    Raises:
      ConfigError: the file cannot be read, or (`.jsonl`) a line is not JSON, or not a string or an object with a
        string "prompt" (or, with `chat`, valid "messages"); the error names the file and the line.
    """
    from msjax.chat import check_messages

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--prompt_file={path!r}: {e}") from None
    if not path.endswith(".jsonl"):
        return [line for line in text.splitlines() if line]
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--prompt_file={path!r} line {n}: not JSON ({e.msg})") from None
        if chat and isinstance(item, dict) and "messages" in item:
            check_messages(item["messages"], f"--prompt_file={path!r} line {n}: messages")
            prompts.append(item["messages"])
            continue
        prompt = item.get("prompt") if isinstance(item, dict) else item
        if not isinstance(prompt, str):
            raise ConfigError(f"--prompt_file={path!r} line {n}: allowed is a JSON string or an object with a "
                              f"string \"prompt\"; got {line[:80]!r}")
        prompts.append(prompt)
    return prompts


def _flag(argv: list[str], name: str) -> str:
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
    return ""


def main(argv: list[str]) -> int:
    def body() -> int:
        prompts, rest = _take_prompts(argv)
        run_dir = _flag(rest, "run_dir")
        if not run_dir and "--help" not in rest:
            raise ConfigError("--run_dir is required: a run directory (from training or scripts/convert.py)")
        # The run's own config.json gives every other flag its default; --mesh.* and the like override it.
        default = str(Path(run_dir) / "config.json") if run_dir else "gpt_tiny"
        cfg, (common, opts) = cli.parse(rest, GenerateOptions(), prog="generate.py", description=__doc__,
                                        default_preset=default)
        cli.setup_logging(common)
        if opts.prompt_file:
            prompts += read_prompts(opts.prompt_file, opts.chat)
        if opts.dtype not in ("", "float32", "bfloat16"):
            raise ConfigError(f"--dtype={opts.dtype!r}: allowed: 'float32', 'bfloat16' (or empty: as stored)")
        if not prompts:
            raise ConfigError("give at least one --prompt (or --prompt_file)")
        if opts.json:
            cli.check_writable(opts.json, "--json")
        from msjax.checkpoint import CheckpointError
        from msjax.generate import generate_text, load_run, sampling_settings

        try:
            run = load_run(opts.run_dir, config=cfg, dtype=opts.dtype or None)
        except CheckpointError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        # A sampling flag given on the command line wins; the others come from the model's generation config.
        given = {name: getattr(opts, name) for name in ("temperature", "top_k", "top_p") if _flag(rest, name)}
        settings = dict(max_new_tokens=opts.max_new_tokens, **sampling_settings(run, **given), seed=opts.seed,
                        cache=opts.cache, stop_at_eot=opts.stop_at_eot, rolling=opts.rolling, chat=opts.chat)
        try:
            results = generate_text(run, prompts, **settings)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        for r in results:
            print(r.prompt + r.text)
            print("-" * 40)
        if opts.json:
            doc = {"run_dir": str(run.run_dir), "step": run.step, "mesh": dict(run.generator.mesh.shape),
                   "dtype": run.config.model.param_dtype, "stop_ids": list(run.chat.stop_ids),
                   "stop_source": run.chat.stop_source,
                   **settings, "results": [{"prompt": r.prompt, "prompt_ids": r.prompt_ids,
                                            "generated_ids": r.generated_ids, "text": r.text} for r in results]}
            Path(opts.json).write_text(json.dumps(doc, indent=1, ensure_ascii=False))
        return 0

    return cli.main_guard(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
