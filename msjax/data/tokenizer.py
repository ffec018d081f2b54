"""Tokenizers: `char` (nanoGPT's shakespeare_char), `byte` (UTF-8 bytes) and `bpe` (HF `tokenizers` byte-level BPE,
GPT-2 style, Radford et al. 2019 sec. 2.2), behind one small protocol.

Every tokenizer saves to one JSON file (`TOKENIZER_FILE`, "tokenizer.json"): char and byte write a small
`{"msjax_tokenizer": kind, ...}` document, bpe writes the HF `tokenizer.json` itself, so a user's HF file loads
the same way. `load_tokenizer` tells them apart.

Document separator: `eot_id` is appended after each document of the token stream (GPT-2's `<|endoftext|>`); the
char tokenizer has none, so its stream is the plain concatenation of the text, as in nanoGPT.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Iterable, Protocol, Sequence, runtime_checkable

import numpy as np

from msjax.data.corpus import DataError

TOKENIZER_FILE = "tokenizer.json"
EOT_TOKEN = "<|endoftext|>"
# End-of-text spellings looked for in a user's tokenizer.json when it has no `<|endoftext|>` (Llama, T5, ...).
_EOT_CANDIDATES = (EOT_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline and the sampler need from a tokenizer.

    vocab_size: number of ids, special tokens included (ids are 0 .. vocab_size-1).
    eot_id: id appended after each document, or None (char).
    name: short description for logs and meta.json, e.g. 'bpe-4096'.
    """

    vocab_size: int
    eot_id: int | None
    name: str

    def encode(self, text: str) -> np.ndarray:
        """Ids of `text`, int32 (N,), without a trailing eot."""

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """`encode` of each text (may run in parallel)."""

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Text of `ids`; exact inverse of `encode` (invalid byte sequences from sampling become U+FFFD)."""

    def save(self, path: str | os.PathLike) -> None:
        """Writes the tokenizer to the JSON file `path` (atomically); `load_tokenizer(path)` reads it back."""


def _write_atomic(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class CharTokenizer:
    """One id per character; the vocabulary is the sorted set of characters of the corpus (nanoGPT's
    `data/shakespeare_char/prepare.py`). Encoding a character outside it raises DataError."""

    eot_id = None

    def __init__(self, chars: Sequence[str]):
        chars = list(chars)
        if not chars or len(set(chars)) != len(chars) or any(len(c) != 1 for c in chars):
            raise DataError("char tokenizer needs a non-empty list of distinct single characters")
        self.chars = chars
        self.vocab_size = len(chars)
        self.name = f"char-{self.vocab_size}"
        codepoints = np.array([ord(c) for c in chars], dtype=np.int64)
        # Dense code point -> id table: the corpus' largest code point is small (a few thousand at most for text;
        # 0x10FFFF bounds it at 4 MiB of int32), and a table lookup encodes ~100x faster than a dict per char.
        self._table = np.full(int(codepoints.max()) + 1, -1, dtype=np.int32)
        self._table[codepoints] = np.arange(len(chars), dtype=np.int32)

    @classmethod
    def fit(cls, texts: Iterable[str]) -> "CharTokenizer":
        seen: set[str] = set()
        for text in texts:
            seen.update(text)
        if not seen:
            raise DataError("char tokenizer: the corpus has no characters")
        return cls(sorted(seen))

    def encode(self, text: str) -> np.ndarray:
        cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        ids = np.full(cps.shape, -1, dtype=np.int32)
        known = cps < len(self._table)
        ids[known] = self._table[cps[known]]
        if (ids < 0).any():
            bad = sorted({chr(c) for c in cps[ids < 0].tolist()})[:10]
            raise DataError(f"char tokenizer: characters not in its vocabulary: {bad!r}")
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        return "".join(self.chars[i] for i in np.asarray(ids, dtype=np.int64).reshape(-1).tolist())

    def save(self, path: str | os.PathLike) -> None:
        _write_atomic(path, json.dumps({"msjax_tokenizer": "char", "chars": self.chars}, ensure_ascii=False))


class ByteTokenizer:
    """UTF-8 bytes: ids 0..255 are bytes, 256 is end-of-text (vocab 257). Needs no training."""

    vocab_size = 257
    eot_id = 256
    name = "byte"

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        parts, start = [], 0
        for cut in np.flatnonzero(ids >= 256).tolist() + [len(ids)]:
            parts.append(ids[start:cut].astype(np.uint8).tobytes().decode("utf-8", errors="replace"))
            if cut < len(ids):
                parts.append(EOT_TOKEN if ids[cut] == self.eot_id else "\ufffd")
            start = cut + 1
        return "".join(parts)

    def save(self, path: str | os.PathLike) -> None:
        _write_atomic(path, json.dumps({"msjax_tokenizer": "byte"}))


class HFTokenizer:
    """A HF `tokenizers.Tokenizer` (our byte-level BPE, or a user's tokenizer.json).

    Byte-level BPE without a prefix space or normalizer maps every string to ids and back exactly, newlines and
    indentation included (sentencepiece's defaults do not: they fold whitespace).
    """

    def __init__(self, tok, name: str | None = None):
        self._tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.eot_id = next((i for i in (tok.token_to_id(t) for t in _EOT_CANDIDATES) if i is not None), None)
        self.name = name or f"bpe-{self.vocab_size}"
        self._offsets_tok = None  # `encode_offsets`' copy without offset trimming, made on first use

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "HFTokenizer":
        from tokenizers import Tokenizer as _HF, decoders, models, pre_tokenizers, trainers

        if vocab_size < 257 + 1:
            raise DataError(f"data.bpe_vocab_size={vocab_size}: allowed is >= 258 (256 bytes, end-of-text, "
                            "and at least one merge)")
        tok = _HF(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT_TOKEN], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts, trainer=trainer)
        # A small corpus can run out of merges before `vocab_size`: the name gives the size actually reached.
        return cls(tok)

    @classmethod
    def from_file(cls, path: str | os.PathLike, name: str | None = None) -> "HFTokenizer":
        from tokenizers import Tokenizer as _HF

        try:
            tok = _HF.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception with the serde message
            raise DataError(f"{path}: not a HF tokenizers tokenizer.json ({e})") from None
        return cls(tok, name)

    def token_to_id(self, token: str) -> int | None:
        """The id of one token of the vocabulary (a special token's text, e.g. "<|eot_id|>"), or None."""
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
        """Ids of `text`; `add_special_tokens` runs the tokenizer.json's post-processor (e.g. Llama's
        begin-of-text), as `transformers`' tokenizer(text) does for a prompt (msjax.generate)."""
        return np.asarray(self._tok.encode(text, add_special_tokens=add_special_tokens).ids, dtype=np.int32)

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Ids of `text` (no special tokens added) and the characters of `text` each token came from.

        Returns:
          ids: int32 (n,), equal to `encode(text)`.
          offsets: int64 (n, 2): token j came from text[offsets[j, 0]:offsets[j, 1]], in characters (Python
            str indices, not UTF-8 bytes). Every byte token of one multi-byte character has that character's
            range (the three byte tokens of '日' all span it).
        """
        # Measured with tokenizers 0.23 on byte-level BPE: `Encoding.offsets` are character offsets into the str
        # (code points: an emoji outside the BMP counts 1, as in Python), and without trimming they tile the text
        # in order. A ByteLevel post-processor with trim_offsets=true (RobertaProcessing has the same switch),
        # which runs even when no special tokens are added, trims them: "Ġw" over " w" reports only "w", and a
        # token of spaces alone ("Ġ") reports an empty range at its end, so a token's first character is lost.
        # Offsets are therefore taken from a copy of the tokenizer with trimming off; the ids are the same
        # (trimming moves offsets only).
        if self._offsets_tok is None:
            self._offsets_tok = _untrimmed(self._tok)
        enc = self._offsets_tok.encode(text, add_special_tokens=False)
        return np.asarray(enc.ids, dtype=np.int32), np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        # encode_batch_fast skips offset bookkeeping; the Rust side spreads the batch over all cores.
        encodings = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1).tolist()
        return self._tok.decode(ids, skip_special_tokens=False)

    def save(self, path: str | os.PathLike) -> None:
        _write_atomic(path, self._tok.to_str())


def _untrimmed(tok):
    """`tok`, or a copy of it whose post-processors do not trim offsets (see `HFTokenizer.encode_offsets`)."""
    from tokenizers import Tokenizer as _HF

    doc = json.loads(tok.to_str())
    changed = False

    def untrim(node) -> None:
        nonlocal changed
        if isinstance(node, dict):
            if node.get("trim_offsets") is True:
                node["trim_offsets"], changed = False, True
            for value in node.values():
                untrim(value)
        elif isinstance(node, list):
            for value in node:
                untrim(value)

    untrim(doc.get("post_processor"))
    return _HF.from_str(json.dumps(doc)) if changed else tok


def build_tokenizer(data_cfg, train_texts_iterable: Iterable[str], cache_dir: str | os.PathLike | None = None
                    ) -> Tokenizer:
    """The tokenizer `data_cfg` asks for, fitted on `train_texts_iterable` where it needs fitting.

    Args:
      data_cfg: `DataConfig` (`tokenizer`, `tokenizer_path`, `bpe_vocab_size`).
      train_texts_iterable: texts to fit on, iterated once and only when fitting: bpe trains on the train
        split; char takes its vocabulary from these texts, so pass every text you will encode (nanoGPT builds
        it from the whole corpus) or encoding an unseen character raises DataError. Ignored by byte and by a
        given `tokenizer_path`.
      cache_dir: if given, a directory specific to this corpus and config (`prepare_data` passes its
        fingerprinted cache directory): `<cache_dir>/tokenizer.json` is loaded when present and of the right
        kind (bpe/char), and a freshly fitted tokenizer is saved there.
    Raises:
      DataError: `tokenizer_path` missing or not a tokenizer.json; `tokenizer_path` set with a tokenizer other
        than bpe; too small a bpe vocabulary; an empty corpus.
    """
    kind = data_cfg.tokenizer
    if data_cfg.tokenizer_path:
        if kind != "bpe":
            raise DataError(f"data.tokenizer_path={data_cfg.tokenizer_path!r} is a HF tokenizer.json, but "
                            f"data.tokenizer={kind!r}; set data.tokenizer=bpe or clear data.tokenizer_path")
        path = Path(data_cfg.tokenizer_path).expanduser()
        if not path.is_file():
            raise DataError(f"data.tokenizer_path={data_cfg.tokenizer_path!r} does not exist")
        return HFTokenizer.from_file(path, name=f"hf:{path.name}")
    if kind == "byte":
        return ByteTokenizer()
    cached = Path(cache_dir) / TOKENIZER_FILE if cache_dir is not None else None
    if cached is not None and cached.is_file():
        tok = load_tokenizer(cached)
        if isinstance(tok, CharTokenizer if kind == "char" else HFTokenizer):
            return tok
    if kind == "char":
        tok = CharTokenizer.fit(train_texts_iterable)
    elif kind == "bpe":
        tok = HFTokenizer.train(train_texts_iterable, data_cfg.bpe_vocab_size)
    else:
        raise DataError(f"data.tokenizer={kind!r}; allowed: 'bpe', 'byte', 'char'")
    if cached is not None:
        tok.save(cached)
    return tok


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Reads a tokenizer written by `Tokenizer.save` (or any HF tokenizer.json).

    Raises DataError if the file is missing or is neither format.
    """
    path = Path(path)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise DataError(f"tokenizer file {path} does not exist")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not a tokenizer JSON file ({e})") from None
    kind = doc.get("msjax_tokenizer") if isinstance(doc, dict) else None
    if kind == "char":
        return CharTokenizer(doc["chars"])
    if kind == "byte":
        return ByteTokenizer()
    if kind is not None:
        raise DataError(f"{path}: unknown msjax tokenizer kind {kind!r}; allowed: 'char', 'byte'")
    return HFTokenizer.from_file(path)
