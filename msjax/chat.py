"""A run's chat format: its chat template, the ids that end a turn, and its sampling defaults.

What a model was published with sits beside its weights as Hugging Face files, which `scripts/convert.py --from_hf`
keeps in `<run_dir>/hf/` (msjax.hf.tokenizer.KEPT_FILES):
  - tokenizer_config.json: the special tokens (`eos_token`, `bos_token`, ...) and, in older files, `chat_template`;
  - chat_template.jinja: the template, in the file `transformers` >= 4.50 writes;
  - generation_config.json: `eos_token_id` (one id or a list: Llama-3-Instruct ends a turn at `<|eot_id|>` and
    text at `<|end_of_text|>`), and the sampling defaults `do_sample`, `temperature`, `top_k`, `top_p`.

Stop ids come from generation_config.json's `eos_token_id` (all of them), else from the tokenizer's own special
tokens (tokenizer_config.json's `eos_token`; msjax's own tokenizers' end-of-text), never from a list of likely
spellings: a guess stops Llama-3-Instruct at `<|end_of_text|>`, which it never writes after a turn.

The template is rendered as `transformers`' `apply_chat_template` renders it (jinja2, the library `transformers`
uses: a sandboxed environment with trim_blocks and lstrip_blocks, loop controls, `raise_exception`,
`strftime_now` and a `tojson` that keeps non-ASCII; the special tokens as variables), and encoded without adding
special tokens (the template writes them), so the ids are the ones `apply_chat_template(tokenize=True)` gives.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from msjax.config import ConfigError

# The directory of a run that holds an imported model's Hugging Face files (msjax.hf.convert writes it).
HF_DIR = "hf"
ROLES = ("system", "user", "assistant", "tool")
# generation_config.json's sampling fields and the defaults `transformers` gives the ones a file leaves out.
HF_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}


@dataclass(frozen=True)
class ChatFormat:
    """How a run's model chats.

    Attributes:
      template: the Jinja chat template, or None (the model has none: `--chat` is refused).
      special_tokens: the tokenizer's special tokens by name ("bos_token", "eos_token", ...), as text.
      stop_ids: token ids that end a generated turn.
      stop_source: where `stop_ids` came from (a file and field), for messages.
      sampling: {"temperature", "top_k", "top_p"} from generation_config.json (greedy when it has
        do_sample false: temperature 0), or {} when the run has none.
    """

    template: str | None = None
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    stop_ids: tuple[int, ...] = ()
    stop_source: str = "none"
    sampling: Mapping[str, float] = field(default_factory=dict)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """The conversation as the template writes it (`apply_chat_template(tokenize=False)`).

        Args:
          messages: [{"role": one of ROLES, "content": str}, ...] (`check_messages`).
          add_generation_prompt: end with the header of an assistant turn (for generation), or not (a finished
            conversation, for training).
        Raises:
          ConfigError: no template, or messages `check_messages` refuses.
          jinja2.TemplateError: the template raised (its `raise_exception`, e.g. roles out of order).
        """
        if self.template is None:
            raise ConfigError("this run has no chat template (no chat_template.jinja or tokenizer_config.json "
                              "`chat_template` in its hf/ directory); give plain prompts")
        check_messages(messages)
        return _compiled(self.template).render(messages=[dict(m) for m in messages], tools=None, documents=None,
                                               add_generation_prompt=add_generation_prompt,
                                               **self.special_tokens)

    def encode(self, tokenizer: Any, messages: Sequence[Mapping[str, Any]],
               add_generation_prompt: bool = True) -> list[int]:
        """Token ids of `render(messages)`, without the tokenizer adding special tokens (the template writes
        them), as `apply_chat_template(tokenize=True)`. Raises as `render`."""
        text = self.render(messages, add_generation_prompt)
        ids = tokenizer.encode(text, add_special_tokens=False) if _is_hf(tokenizer) else tokenizer.encode(text)
        return [int(i) for i in ids]


def check_messages(messages: Any, where: str = "messages") -> None:
    """Raises ConfigError unless `messages` is a non-empty list of {"role": one of ROLES, "content": str} (other
    keys allowed), naming `where` and the first bad message."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: allowed is a non-empty list of {{\"role\", \"content\"}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ConfigError(f"{where}[{i}]: allowed is an object with \"role\" and \"content\"; got {m!r:.80}")
        if m.get("role") not in ROLES:
            raise ConfigError(f"{where}[{i}]: role {m.get('role')!r} is not allowed; allowed: {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise ConfigError(f"{where}[{i}]: \"content\" must be a string; got {m.get('content')!r:.80}")


def load_chat_format(run_dir: str | Path, tokenizer: Any) -> ChatFormat:
    """The chat format of a run (module docstring) from `<run_dir>/hf/` and its tokenizer.

    Raises:
      ConfigError: a file in hf/ that is not valid JSON, an `eos_token_id` that is not an id or a list of ids, or
        an `eos_token` the tokenizer does not hold.
    """
    hf = Path(run_dir) / HF_DIR
    tok_cfg = _json(hf / "tokenizer_config.json")
    special = dict(_json(hf / "special_tokens_map.json"))
    special.update({k: v for k, v in tok_cfg.items() if k.endswith("_token") and v is not None})
    special = {k: _token_text(v) for k, v in special.items() if _token_text(v) is not None}
    template = None
    if (hf / "chat_template.jinja").is_file():
        template = (hf / "chat_template.jinja").read_text(encoding="utf-8")
    elif tok_cfg.get("chat_template") is not None:
        template = _default_template(tok_cfg["chat_template"], hf / "tokenizer_config.json")
    gen_path = hf / "generation_config.json"
    gen = _json(gen_path)
    stop_ids: tuple[int, ...] = ()
    source = "none"
    if gen.get("eos_token_id") is not None:
        eos = gen["eos_token_id"]
        eos = [eos] if isinstance(eos, int) else eos
        if not (isinstance(eos, list) and eos and all(isinstance(i, int) and not isinstance(i, bool) for i in eos)):
            raise ConfigError(f"{gen_path}: eos_token_id={gen['eos_token_id']!r}; allowed is an id or a list of ids")
        stop_ids, source = tuple(eos), f"{gen_path.name} eos_token_id"
    elif "eos_token" in special:
        tid = _token_id(tokenizer, special["eos_token"])
        if tid is None:
            raise ConfigError(f"{hf / 'tokenizer_config.json'}: eos_token {special['eos_token']!r} is not a token of "
                              "the run's tokenizer.json")
        stop_ids, source = (tid,), "tokenizer_config.json eos_token"
    elif not (hf / "tokenizer_config.json").is_file() and getattr(tokenizer, "eot_id", None) is not None \
            and _own_end_of_text(tokenizer):
        stop_ids, source = (tokenizer.eot_id,), "the tokenizer's end-of-text token"
    sampling: dict[str, float] = {}
    if gen:
        if gen.get("do_sample"):
            sampling = {k: gen.get(k) if gen.get(k) is not None else d for k, d in HF_SAMPLING_DEFAULTS.items()}
        else:
            sampling = {"temperature": 0.0, "top_k": 0, "top_p": 1.0}  # transformers' default: greedy
    return ChatFormat(template, special, stop_ids, source, sampling)


def _json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: allowed is a JSON object")
    return doc


def _token_text(value: Any) -> str | None:
    """A special token's text: a string, or the {"content": ...} form of an AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _default_template(value: Any, path: Path) -> str:
    """tokenizer_config.json's chat_template: a string, or a list of {"name", "template"} of which `transformers`
    uses the one named "default"."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ConfigError(f"{path}: chat_template must be a string or a list holding a template named 'default'")


def _is_hf(tokenizer: Any) -> bool:
    from msjax.data import HFTokenizer

    return isinstance(tokenizer, HFTokenizer)


def _token_id(tokenizer: Any, text: str) -> int | None:
    if _is_hf(tokenizer):
        return tokenizer.token_to_id(text)
    ids = tokenizer.encode(text)
    return int(ids[0]) if len(ids) == 1 else None


def _own_end_of_text(tokenizer: Any) -> bool:
    """Whether the tokenizer's end-of-text is msjax's own `<|endoftext|>` (its char/byte/BPE tokenizers), not a
    spelling picked from a user's tokenizer.json."""
    from msjax.data.tokenizer import EOT_TOKEN

    if not _is_hf(tokenizer):
        return True
    return tokenizer.token_to_id(EOT_TOKEN) == tokenizer.eot_id


_TEMPLATES: dict[str, Any] = {}


def _compiled(template: str) -> Any:
    """The template compiled in the environment `transformers` renders chat templates in (module docstring)."""
    if template not in _TEMPLATES:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
                   sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        class Generation(jinja2.ext.Extension):
            """`{% generation %}...{% endgeneration %}`, which `transformers` defines to find assistant tokens:
            its body, rendered as it is."""

            tags = {"generation"}

            def parse(self, parser: Any) -> Any:
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return jinja2.nodes.Scope(body).set_lineno(lineno)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        _TEMPLATES[template] = env.from_string(template)
    return _TEMPLATES[template]
