"""Tokenizers in Hugging Face form: the files `transformers`' `AutoTokenizer.from_pretrained(dir)` loads.

A HF tokenizer (msjax's byte-level BPE, or one imported with a model) is its own tokenizer.json. msjax's `char`
and `byte` tokenizers are written as the `tokenizers` models that give the same ids:
  char: a BPE without merges over the run's characters (no pre-tokenizer: the text is one word, split into its
    characters; `Fuse` decodes by concatenation), so every character maps to its msjax id;
  byte: GPT-2's byte-level BPE without merges (`ByteLevel` maps each byte b to a printable character, Radford et
    al. 2019's `bytes_to_unicode`; that character has id b) plus `<|endoftext|>` as id 256.
Beside it, tokenizer_config.json names the generic fast tokenizer class and the special tokens (end-of-text as
eos), unless the run kept the original model's (`hf/` in the run directory, from `--from_hf`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from msjax.data import ByteTokenizer, CharTokenizer, HFTokenizer
from msjax.data.tokenizer import EOT_TOKEN

# Files kept from an imported model's directory (in `<run_dir>/hf/`), written back on export: the tokenizer's
# settings (chat template, special tokens) with the tokenizer, and the generation defaults.
TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
KEPT_FILES = TOKENIZER_FILES + ("generation_config.json",)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 byte values onto printable characters (openai/gpt-2 `encoder.py`):
    printable Latin-1 bytes map to themselves, the others to characters from U+0100 on, in order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    chars, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def hf_tokenizer_json(tokenizer: Any) -> str:
    """tokenizer.json text for an msjax tokenizer (module docstring). Raises TypeError for another kind."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if isinstance(tokenizer, HFTokenizer):
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            tokenizer.save(Path(tmp) / "tokenizer.json")
            return (Path(tmp) / "tokenizer.json").read_text(encoding="utf-8")
    if isinstance(tokenizer, CharTokenizer):
        tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(tokenizer.chars)}, merges=[]))
        tok.decoder = decoders.Fuse()
        return tok.to_str()
    if isinstance(tokenizer, ByteTokenizer):
        vocab = {ch: b for b, ch in bytes_to_unicode().items()}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([EOT_TOKEN])  # id 256, after the 256 bytes
        return tok.to_str()
    raise TypeError(f"no Hugging Face form for tokenizer {type(tokenizer).__name__}")


def special_token_ids(tokenizer: Any) -> dict[str, int | None]:
    """bos/eos/pad ids for the HF config: the end-of-text token as eos (and bos, as GPT-2 does), no padding."""
    eot = tokenizer.eot_id
    return {"bos": eot, "eos": eot, "pad": None}


def write_tokenizer(tokenizer: Any, out_dir: Path, kept: Path | None, max_len: int) -> None:
    """tokenizer.json and tokenizer_config.json (and the imported model's kept files) into `out_dir`."""
    (out_dir / "tokenizer.json").write_text(hf_tokenizer_json(tokenizer), encoding="utf-8")
    names = [n for n in TOKENIZER_FILES if kept is not None and (kept / n).is_file()]
    for name in names:
        (out_dir / name).write_bytes((kept / name).read_bytes())
    if "tokenizer_config.json" not in names:
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
                  "clean_up_tokenization_spaces": False}
        if tokenizer.eot_id is not None:
            eot = tokenizer.decode([tokenizer.eot_id])
            config.update(eos_token=eot, bos_token=eot)
        (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
