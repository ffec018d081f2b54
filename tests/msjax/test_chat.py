"""Chat formats (msjax.chat), checked against the real `transformers`:

- published chat templates (Llama 3 Instruct's, Mistral 7B Instruct v0.1's, a Qwen2.5-style ChatML with a
  default system turn, one using `namespace`, `tojson` and `{% generation %}`, one whose lines are block tags)
  render to the text and the ids
  `AutoTokenizer.apply_chat_template` gives, from tokenizer_config.json and from the chat_template.jinja file
  `save_pretrained` writes; a template's `raise_exception` is one error;
- stop ids are generation_config.json's eos_token_id (all of them), else the tokenizer's own eos_token, never a
  guess; sampling defaults come from generation_config.json;
- an imported model chatting through msjax (`generate_text(chat=True)`, scripts/generate.py --chat) gives
  `transformers`' `generate` ids for the same conversation, each row ending at its own end-of-turn id.
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

from msjax.chat import ChatFormat, load_chat_format  # noqa: E402
from msjax.config import ConfigError  # noqa: E402
from msjax.data import HFTokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SPECIAL = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|im_start|>",
           "<|im_end|>", "[INST]", "[/INST]", "</s>"]

# Meta-Llama-3-8B-Instruct's tokenizer_config.json chat_template, verbatim.
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
          "{{ content }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# Mistral-7B-Instruct-v0.1's, verbatim: roles must alternate, from a user turn.
MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) "
           "%}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
           "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
           "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}"
           "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
# Qwen2.5-Instruct's without its tool branches: ChatML with a default system turn, whitespace control.
CHATML = ("{%- for message in messages %}\n    {%- if loop.first and message['role'] != 'system' %}\n"
          "        {{- '<|im_start|>system\\nYou are Qwen, a helpful assistant.<|im_end|>\\n' }}\n    {%- endif %}\n"
          "    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
          "{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n")
# Namespaces, tojson of non-ASCII text, and the generation tag transformers defines for assistant masks.
TRACKED = ("{%- set ns = namespace(n=0) %}{%- for m in messages %}{%- set ns.n = ns.n + 1 %}"
           "{{- m['role'] + ' ' + (m['content'] | tojson) + '\\n' }}{%- if m['role'] == 'assistant' %}"
           "{% generation %}{{ m['content'] + eos_token }}{% endgeneration %}{%- endif %}{%- endfor %}"
           "{{- 'turns: ' ~ ns.n }}{%- if add_generation_prompt %}{{ '\\nassistant:' }}{%- endif %}")
# Block tags on lines of their own, indented, with no whitespace control: trim_blocks and lstrip_blocks decide
# every line break and indent of the text.
MULTILINE = ("{% for message in messages %}\n  {% if message['role'] == 'user' %}\n<user>{{ message['content'] }}"
             "</user>\n  {% else %}\n<bot>{{ message['content'] }}</bot>\n  {% endif %}\n{% endfor %}\n"
             "{% if add_generation_prompt %}\n<bot>\n{% endif %}\n")
TEMPLATES = {"llama3": (LLAMA3, "<|eot_id|>"), "mistral": (MISTRAL, "</s>"), "chatml": (CHATML, "<|im_end|>"),
             "tracked": (TRACKED, "</s>"), "multiline": (MULTILINE, "</s>")}
CONVERSATIONS = [
    [{"role": "user", "content": "def add(a, b):"}],
    [{"role": "user", "content": "  Why is the sky blue?  "}, {"role": "assistant", "content": "Rayleigh — é."},
     {"role": "user", "content": "And the sea?"}],
]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> Path:
    """msjax's own byte-level BPE on a few standard-library sources, plus the special tokens the templates use."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tok = HFTokenizer.train([(stdlib / n).read_text() for n in ("textwrap.py", "shlex.py")], 300)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(path)
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(path))
    raw.add_special_tokens(SPECIAL)
    raw.save(str(path))
    return path


def _run_dir(tmp_path: Path, tokenizer_json: Path, tok_config: dict, generation: dict | None = None,
             jinja: str | None = None) -> Path:
    """A run directory's tokenizer and hf/ files, as `scripts/convert.py --from_hf` keeps them."""
    run = tmp_path / "run"
    (run / "hf").mkdir(parents=True)
    (run / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    (run / "hf" / "tokenizer_config.json").write_text(json.dumps(tok_config))
    if generation is not None:
        (run / "hf" / "generation_config.json").write_text(json.dumps(generation))
    if jinja is not None:
        (run / "hf" / "chat_template.jinja").write_text(jinja)
    return run


def _hf_tokenizer(run: Path):
    """`transformers`' tokenizer from the same files (tokenizer.json beside its tokenizer_config.json)."""
    d = run / "as_hf"
    d.mkdir(exist_ok=True)
    (d / "tokenizer.json").write_bytes((run / "tokenizer.json").read_bytes())
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        if (run / "hf" / name).is_file():
            (d / name).write_bytes((run / "hf" / name).read_bytes())
    return transformers.AutoTokenizer.from_pretrained(d)


@pytest.mark.parametrize("name", TEMPLATES)
def test_templates_render_the_text_and_ids_transformers_gives(name, tokenizer_json, tmp_path):
    template, eos = TEMPLATES[name]
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": eos,
           "chat_template": template}
    run = _run_dir(tmp_path, tokenizer_json, cfg)
    tok = HFTokenizer.from_file(run / "tokenizer.json")
    chat = load_chat_format(run, tok)
    ref = _hf_tokenizer(run)
    for messages in CONVERSATIONS:
        for opened in (True, False):
            text = ref.apply_chat_template(messages, add_generation_prompt=opened, tokenize=False)
            assert chat.render(messages, add_generation_prompt=opened) == text
            want = ref.apply_chat_template(messages, add_generation_prompt=opened, tokenize=True)
            want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
            assert chat.encode(tok, messages, add_generation_prompt=opened) == list(want)
    assert chat.stop_ids == (tok.token_to_id(eos),) and chat.stop_source == "tokenizer_config.json eos_token"
    # save_pretrained writes the template to chat_template.jinja, not into tokenizer_config.json: read from there
    saved = tmp_path / "saved"
    ref.save_pretrained(saved)
    cfg_saved = json.loads((saved / "tokenizer_config.json").read_text())
    assert (saved / "chat_template.jinja").is_file() and "chat_template" not in cfg_saved
    run2 = _run_dir(tmp_path / "2", tokenizer_json, cfg_saved, jinja=(saved / "chat_template.jinja").read_text())
    assert load_chat_format(run2, tok).render(CONVERSATIONS[1]) == chat.render(CONVERSATIONS[1])


def test_a_template_that_raises_is_one_error(tokenizer_json, tmp_path):
    import jinja2

    run = _run_dir(tmp_path, tokenizer_json, {"bos_token": "<|begin_of_text|>", "eos_token": "</s>",
                                              "chat_template": MISTRAL})
    chat = load_chat_format(run, HFTokenizer.from_file(run / "tokenizer.json"))
    with pytest.raises(jinja2.TemplateError, match="Conversation roles must alternate"):
        chat.render([{"role": "assistant", "content": "hi"}])
    with pytest.raises(ConfigError, match=r"messages\[1\]: role 'robot' is not allowed; allowed: system, user"):
        chat.render([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}])
    with pytest.raises(ConfigError, match="no chat template"):
        ChatFormat().render([{"role": "user", "content": "a"}])


def test_stop_ids_and_sampling_come_from_the_model_files_never_a_guess(tokenizer_json, tmp_path):
    tok = HFTokenizer.from_file(tokenizer_json)
    eot, end = tok.token_to_id("<|eot_id|>"), tok.token_to_id("</s>")
    # every id of generation_config.json's list, over tokenizer_config.json's eos_token
    gen = {"eos_token_id": [end, eot], "do_sample": True, "temperature": 0.6, "top_p": 0.9}
    chat = load_chat_format(_run_dir(tmp_path / "a", tokenizer_json, {"eos_token": "<|im_end|>"}, gen), tok)
    assert chat.stop_ids == (end, eot) and chat.stop_source == "generation_config.json eos_token_id"
    assert dict(chat.sampling) == {"temperature": 0.6, "top_k": 50, "top_p": 0.9}  # transformers' top_k default
    greedy = load_chat_format(_run_dir(tmp_path / "b", tokenizer_json, {}, {"eos_token_id": eot}), tok)
    assert greedy.stop_ids == (eot,) and dict(greedy.sampling) == {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
    # an imported tokenizer that names no eos: no stop id (the tokenizer.json's "</s>" is not guessed)
    assert load_chat_format(_run_dir(tmp_path / "c", tokenizer_json, {}), tok).stop_ids == ()
    # a run msjax trained (no hf/): its own end-of-text
    own = tmp_path / "own"
    own.mkdir()
    assert load_chat_format(own, tok).stop_ids == (tok.token_to_id("<|endoftext|>"),)
    for gen_bad, needle in (({"eos_token_id": "</s>"}, "eos_token_id='</s>'; allowed is an id or a list of ids"),
                            ({"eos_token_id": []}, "allowed is an id or a list of ids")):
        with pytest.raises(ConfigError, match=needle):
            load_chat_format(_run_dir(tmp_path / f"d{len(needle)}", tokenizer_json, {}, gen_bad), tok)
    with pytest.raises(ConfigError, match="eos_token '<nope>' is not a token of the run's tokenizer.json"):
        load_chat_format(_run_dir(tmp_path / "e", tokenizer_json, {"eos_token": "<nope>"}), tok)
    broken = _run_dir(tmp_path / "f", tokenizer_json, {})
    (broken / "hf" / "generation_config.json").write_text("{oops")
    with pytest.raises(ConfigError, match="generation_config.json: not valid JSON"):
        load_chat_format(broken, tok)


@pytest.fixture(scope="module")
def chat_model(tokenizer_json, tmp_path_factory):
    """A random Llama saved as a user's download (safetensors, tokenizer.json, tokenizer_config.json with Llama 3's
    chat template), with generation_config.json's eos_token_id set to two ids this model writes in its greedy replies
    (the first reply's 3rd token, the second's 6th), and that download imported as a run."""
    from msjax.hf import import_hf

    torch.manual_seed(0)
    tok = HFTokenizer.from_file(tokenizer_json)
    config = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=48, intermediate_size=84,
                                      num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                                      max_position_embeddings=128, rms_norm_eps=1e-5)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    d = tmp_path_factory.mktemp("hf-chat")
    (d / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
        "chat_template": LLAMA3}))
    ref_tok = transformers.AutoTokenizer.from_pretrained(d)
    replies = []
    for messages in CONVERSATIONS:
        ids = torch.tensor([list(_ids(ref_tok.apply_chat_template(messages, add_generation_prompt=True)))])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        replies.append(out[0, ids.shape[1]:].tolist())
    model.generation_config.eos_token_id = [replies[0][2], replies[1][5]]
    model.generation_config.do_sample = False
    model.save_pretrained(d)
    run = import_hf(d, tmp_path_factory.mktemp("run-chat") / "run",
                    overrides={"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2})
    return d, model, ref_tok, run.run_dir


def _ids(x):
    return x["input_ids"] if hasattr(x, "keys") else x


def test_chatting_with_an_imported_model_equals_transformers_generate(chat_model):
    """generate_text(chat=True): the template's ids, greedy by the model's generation_config.json (do_sample false),
    each reply ending at its own end-of-turn id from its eos_token_id list, as `transformers`' generate."""
    import jax

    from msjax.generate import generate_text, load_run, sampling_settings

    d, model, ref_tok, run_dir = chat_model
    run = load_run(run_dir, overrides={"mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1}, devices=jax.devices()[:1])
    eos = model.generation_config.eos_token_id
    assert run.chat.stop_ids == tuple(eos) and sampling_settings(run)["temperature"] == 0.0
    got = generate_text(run, CONVERSATIONS, 12, chat=True)
    lengths = []
    for messages, completion in zip(CONVERSATIONS, got):
        ids = list(_ids(ref_tok.apply_chat_template(messages, add_generation_prompt=True)))
        assert completion.prompt_ids == ids
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=eos,
                                 pad_token_id=0)
        want = out[0, len(ids):].tolist()
        assert completion.generated_ids == want
        assert want[-1] in eos and completion.text == ref_tok.decode(want[:-1])
        lengths.append(len(want))
    assert lengths[0] <= 3 and lengths[0] != lengths[1]  # each row stopped at its own end
    # a plain string is one user turn
    assert generate_text(run, ["def add(a, b):"], 12, chat=True)[0].generated_ids == got[0].generated_ids


@pytest.mark.slow
def test_generate_script_chats_from_a_jsonl_conversation(chat_model, tmp_path):
    _, _, _, run_dir = chat_model
    prompts = tmp_path / "chat.jsonl"
    prompts.write_text("\n".join(json.dumps({"messages": m}) for m in CONVERSATIONS) + "\n")
    out = tmp_path / "out.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    flags = [f"--run_dir={run_dir}", f"--prompt_file={prompts}", "--chat", "--max_new_tokens=12", f"--json={out}",
             "--mesh.data=1", "--mesh.fsdp=1", "--mesh.tensor=1"]
    proc = subprocess.run([sys.executable, "scripts/generate.py", *flags], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["temperature"] == 0.0 and doc["chat"] is True  # the model's greedy default, no flag given
    assert doc["stop_source"] == "generation_config.json eos_token_id" and len(doc["stop_ids"]) == 2
    assert [r["generated_ids"][-1] in doc["stop_ids"] for r in doc["results"]] == [True, True]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]}))
    proc = subprocess.run([sys.executable, "scripts/generate.py", f"--run_dir={run_dir}", f"--prompt_file={bad}",
                           "--chat"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and last.startswith("error: ") and "line 1: messages[1]: role 'robot'" in last, last
