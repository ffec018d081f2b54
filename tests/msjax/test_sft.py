"""Supervised fine-tuning end to end: an imported model (a random Llama that `transformers` builds, with a ChatML
template) fine-tuned on a chat file through `scripts/train.py --config=RUN,chat_sft`, then chatting with the result
through `scripts/generate.py --chat`: the reply is the one the file taught, which the imported model never gave.
"""

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")  # the dev extra installs both (pyproject.toml); CI always has them
transformers = pytest.importorskip("transformers")

from msjax.data import HFTokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# Qwen2.5-Instruct's ChatML without its tool branches (as tests/msjax/test_chat.py): a default system turn.
CHATML = ("{%- for message in messages %}\n    {%- if loop.first and message['role'] != 'system' %}\n"
          "        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n    {%- endif %}\n"
          "    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
          "{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n")
REPLY = "Read the docs."


def _questions(count: int) -> list[str]:
    """Real questions about the standard library: one per public function of a few modules."""
    import inspect
    import shlex
    import textwrap
    import string

    names = [f"{m.__name__}.{n}" for m in (textwrap, shlex, string, inspect) for n in sorted(vars(m))
             if not n.startswith("_") and callable(getattr(m, n))]
    return [f"What does {name} do?" for name in names[:count]]


def chat_file(path: Path, count: int = 48) -> Path:
    """`count` conversations, every assistant turn REPLY; every third one has two turns."""
    lines = []
    for i, q in enumerate(_questions(count)):
        messages = [{"role": "user", "content": q}, {"role": "assistant", "content": REPLY}]
        if i % 3 == 2:
            messages += [{"role": "user", "content": "And in short?"}, {"role": "assistant", "content": REPLY}]
        lines.append(json.dumps({"messages": messages}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A random Llama with a byte-level BPE tokenizer and ChatML's special tokens, imported as a run."""
    from tokenizers import Tokenizer

    from msjax.hf import import_hf

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    d = tmp_path_factory.mktemp("hf-sft")
    tok = HFTokenizer.train([(stdlib / n).read_text() for n in ("textwrap.py", "shlex.py", "string.py")], 400)
    tok.save(d / "tokenizer.json")
    raw = Tokenizer.from_file(str(d / "tokenizer.json"))
    raw.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    raw.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "chat_template": CHATML}))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=raw.get_vocab_size(), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, rms_norm_eps=1e-5)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = raw.token_to_id("<|im_end|>")  # the end of a turn, as Qwen's files say
    model.save_pretrained(d)
    import jax

    run = import_hf(d, tmp_path_factory.mktemp("run-sft") / "run", devices=jax.devices()[:1],
                    overrides={"mesh.data": 1})
    return d, run.run_dir


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    return env


def _chat(run_dir: Path, tmp_path: Path) -> dict:
    prompts = tmp_path / "ask.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "What does os.path.join do?"}]}) + "\n")
    out = tmp_path / "reply.json"
    proc = subprocess.run([sys.executable, "scripts/generate.py", f"--run_dir={run_dir}", f"--prompt_file={prompts}",
                           "--chat", "--max_new_tokens=16", "--temperature=0", f"--json={out}", "--mesh.data=2"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())["results"][0]


@pytest.mark.slow
def test_fine_tuning_an_imported_model_on_a_chat_file_teaches_it_the_reply(imported, tmp_path):
    """`train.py --config=RUN,chat_sft --resume --data.paths=chats.jsonl` on 2 data-parallel devices: the
    validation loss (assistant tokens only) falls from the imported model's, and greedy chat with the result
    replies REPLY, ending at <|im_end|>, where the imported model did not."""
    _, run_dir = imported
    before = _chat(run_dir, tmp_path)
    assert before["text"] != REPLY
    chats = chat_file(tmp_path / "chats.jsonl")
    flags = [f"--config={run_dir},chat_sft", "--resume", f"--data.paths={chats}", "--train.steps=60",
             "--train.seq_len=128", "--train.global_batch=4", "--optimizer.lr=3e-3", "--optimizer.min_lr=3e-3",
             "--train.eval_every=60", "--train.eval_batches=2", "--mesh.data=2", "--train.progress=false",
             "--train.log_every=20"]
    proc = subprocess.run([sys.executable, "scripts/train.py", *flags], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = proc.stdout + proc.stderr
    assert "chat: train" in log and "rows" in log, log[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["final_step"] == 60 and summary["val_loss"][-1][1] < 0.5, log[-3000:]
    after = _chat(run_dir, tmp_path)
    assert after["text"] == REPLY, after
