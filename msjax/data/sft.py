"""Supervised fine-tuning data: chat conversations -> token ids with an assistant mask -> packed (N, T) rows.

Owns what `data.format=chat` reads and the rows it trains on, from JSONL files of
`{"messages": [{"role", "content"}, ...]}`:

  - rendering: each conversation is rendered whole with the run's chat template (msjax.chat.ChatFormat, the text
    `transformers`' `apply_chat_template` gives) and encoded once; no special tokens are added (the template
    writes them).
  - the assistant mask: which tokens belong to an assistant message's rendered text, found by rendering the
    conversation's prefixes (TRL's approach, which needs no `{% generation %}` tag in the template; see
    `assistant_tokens`). The loss is taken on those tokens only: a target token weighs 1 when it is the
    assistant's, 0 otherwise.
  - packing: examples are packed into rows of T positions by best-fit decreasing (`pack_examples`); segment ids
    keep the examples of a row apart (attention and loss never cross them) and positions restart at 0 for each
    example, so a packed example computes what it would alone.
  - the train/validation split: by example, shuffled with the data seed.

Everything here is deterministic and in memory; nothing is written (a chat corpus is small next to a
pre-training corpus: the rows of 100k conversations of 1k tokens are ~2 GB as int32/float32). Files must be local.

Dims: N rows, T sequence length (train.seq_len), n tokens of one example.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import numpy as np

from msjax import paths
from msjax.chat import ChatFormat, check_messages, load_chat_format
from msjax.config import ConfigError
from msjax.data.corpus import DataError, resolve_files
from msjax.data.tokenizer import HFTokenizer

log = logging.getLogger(__name__)

# The arrays of a packed batch, each (N, T): the model's inputs and next-token targets, the loss weight of each
# target (1 on an assistant's token), the example each position belongs to (1, 2, ... within a row; 0 padding),
# and each position's index within its example.
ROW_KEYS = ("inputs", "targets", "weights", "segments", "positions")
# Second seed word of the train/validation split of examples, so it is no stream the batch sampler draws.
_SPLIT_STREAM = 0x73706C6974  # "split"


@dataclass(frozen=True, eq=False)  # eq=False: a generated __eq__ would compare arrays, which has no truth value
class ChatExample:
    """One conversation, tokenized.

    Attributes:
      ids: int32 (n,): the token ids of the whole rendered conversation.
      assistant: bool (n,): True where the token belongs to an assistant message's rendered text (its content
        and the end-of-turn text the template writes after it).
      where: "file.jsonl:LINE", for messages.
    """

    ids: np.ndarray
    assistant: np.ndarray
    where: str


def assistant_tokens(chat: ChatFormat, tokenizer: HFTokenizer, messages: Sequence[Mapping[str, Any]]
                     ) -> tuple[np.ndarray, np.ndarray]:
    """The ids of a finished conversation and which of them are the assistant's (TRL's prefix approach).

    The conversation is rendered with add_generation_prompt=False and encoded with character offsets. Assistant
    message i owns the characters [len(render(messages[:i], add_generation_prompt=True)),
    len(render(messages[:i+1], add_generation_prompt=False))): after the header that opens its turn, through the
    end-of-turn text the template writes after its content (e.g. ChatML's "<|im_end|>\\n"), which the model must
    learn to emit to stop. A token is the assistant's when its first character lies in such a span; a token
    that straddles a span's start (e.g. " Hi" across "assistant:" + " Hi") is not, one that straddles its end is.
    `transformers`' `return_assistant_tokens_mask` marks the tokens that overlap a `{% generation %}` block
    instead: on templates whose blocks hold the content only, its mask is this one without the end-of-turn text.

    Args:
      chat: the chat format (its template renders the conversation).
      tokenizer: the run's tokenizer (`HFTokenizer.encode_offsets`).
      messages: [{"role", "content"}, ...] as `check_messages` allows; the first message is not the assistant's.
    Returns:
      ids: int32 (n,); mask: bool (n,).
    Raises:
      DataError: an assistant message first (no prompt renders before it), or a template that is not
        prefix-consistent at an assistant message (a prefix of the conversation renders to text that does not
        begin the whole rendering, so the assistant's tokens cannot be found).
      ConfigError, jinja2.TemplateError: as `ChatFormat.render` (bad messages; the template raised).
    """
    whole = chat.render(messages, add_generation_prompt=False)
    ids, offsets = tokenizer.encode_offsets(whole)
    first_char = offsets[:, 0]
    mask = np.zeros(ids.shape, dtype=bool)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise DataError("messages[0] is an assistant message: a conversation must open with a system or user "
                            "message (the assistant's turn is found after the prompt that precedes it)")
        opened = chat.render(messages[:i], add_generation_prompt=True)
        finished = chat.render(messages[:i + 1], add_generation_prompt=False)
        for part, how in ((opened, "messages[:i] with the generation prompt"),
                          (finished, "messages[:i+1] without it")):
            if not whole.startswith(part):
                at = next((k for k, (a, b) in enumerate(zip(part, whole)) if a != b), min(len(part), len(whole)))
                raise DataError(f"the chat template is not prefix-consistent at message {i} (an assistant message):"
                                f" rendering {how} differs from the whole conversation's rendering at character "
                                f"{at} ({part[at:at + 30]!r} vs {whole[at:at + 30]!r}), so the assistant's tokens "
                                "cannot be found; use a template that renders earlier turns the same way whatever "
                                "follows (data.chat_template)")
        mask |= (first_char >= len(opened)) & (first_char < len(finished))
    return ids, mask


def read_chat_file(path: str | Path, chat: ChatFormat, tokenizer: HFTokenizer) -> list[ChatExample]:
    """The conversations of one JSONL file, tokenized with their assistant masks, in file order.

    Each non-blank line is an object {"messages": [{"role": "system" | "user" | "assistant" | "tool",
    "content": str}, ...], ...} (other keys ignored) holding at least one assistant message.

    Args:
      path: a local .jsonl file.
      chat: the chat format; tokenizer: the run's tokenizer (`assistant_tokens`).
    Returns:
      One `ChatExample` per non-blank line, `where` = "<path>:<line>".
    Raises:
      DataError: one, naming the file and the line: not UTF-8, invalid JSON, not an object with "messages", a
        bad message (role, content), no assistant message, the template raised (jinja2.TemplateError, e.g. roles
        out of order) or is not prefix-consistent (`assistant_tokens`); or a path in object storage (chat files
        must be local for now) or one that cannot be read.
    """
    import jinja2

    path = _local_path(path, "data.paths", "chat files must be local for now (data.format=chat); copy them to "
                       "this machine")
    try:
        raw_lines = path.read_bytes().split(b"\n")
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror or e})") from None
    out = []
    for n, raw in enumerate(raw_lines, start=1):
        at = f"{path} line {n}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{at}: not valid UTF-8 at byte {e.start} of the line ({e.reason})") from None
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{at}: invalid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(record, dict) or "messages" not in record:
            got = f"an object with keys {sorted(record)}" if isinstance(record, dict) else type(record).__name__
            raise DataError(f"{at}: allowed is an object with \"messages\": [{{\"role\", \"content\"}}, ...]; "
                            f"got {got}")
        messages = record["messages"]
        try:
            check_messages(messages, "messages")
        except ConfigError as e:
            raise DataError(f"{at}: {e}") from None
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{at}: no assistant message: nothing to train on")
        try:
            ids, mask = assistant_tokens(chat, tokenizer, messages)
        except jinja2.TemplateError as e:
            raise DataError(f"{at}: the chat template raised: {e}") from None
        except (ConfigError, DataError) as e:
            raise DataError(f"{at}: {e}") from None
        out.append(ChatExample(ids, mask, f"{path}:{n}"))
    return out


@dataclass
class PackedRows:
    """Examples packed into rows of T positions: what the loader batches (msjax.data.loader).

    Attributes:
      arrays: {key: (N, T)} for the keys of `ROW_KEYS`: "inputs", "targets" int32 (padding 0); "weights"
        float32 (1 where the target is an assistant's token, else 0); "segments" int32 (1, 2, ... for the
        examples of a row in order, 0 for padding); "positions" int32 (0, 1, ... within each example, 0 for
        padding).
      num_examples: examples packed.
      num_tokens: real (non-padding) input positions, sum over examples of n - 1.
      num_loss_tokens: positions trained on (the weights' sum).
      truncated: examples cut to T + 1 tokens (too_long="truncate").
      dropped: examples left out: fewer than 2 tokens, or no assistant token among the targets.
    """

    arrays: dict[str, np.ndarray]
    num_examples: int = 0
    num_tokens: int = 0
    num_loss_tokens: int = 0
    truncated: int = 0
    dropped: int = 0

    @property
    def num_rows(self) -> int:
        """N."""
        return int(self.arrays["inputs"].shape[0])

    @property
    def seq_len(self) -> int:
        """T."""
        return int(self.arrays["inputs"].shape[1])


def pack_examples(examples: Sequence[ChatExample], seq_len: int, *, pack: bool = True,
                  too_long: Literal["error", "truncate"] = "error") -> PackedRows:
    """Packs examples into (N, T) rows (`PackedRows`).

    An example of n tokens takes n - 1 positions: inputs ids[:-1], targets ids[1:], weights assistant[1:] (the
    loss is on targets that are the assistant's), positions 0 .. n-2. With `pack`, rows are filled by best-fit
    decreasing (longest first, each into the open row with the least room that fits it; rows in the order they
    were opened); without, each example has a row of its own, in input order. Same examples, same rows.

    Args:
      examples: the tokenized conversations.
      seq_len: T (train.seq_len).
      pack: several examples per row, or one.
      too_long: an example of more than T + 1 tokens is an error ("error"), or keeps its first T + 1
        ("truncate", counted in `truncated`).
    Returns:
      The rows. Examples with fewer than 2 tokens or no loss token (after truncation) are left out, counted in
      `dropped`, with one warning saying how many.
    Raises:
      DataError: an example too long with too_long="error" (names it, its token count and train.seq_len, and
        the two fixes); seq_len < 1; too_long not one of "error", "truncate".
    """
    if seq_len < 1:
        raise DataError(f"seq_len={seq_len}: allowed is an integer >= 1")
    if too_long not in ("error", "truncate"):
        raise DataError(f"data.too_long={too_long!r}; allowed: 'error', 'truncate'")
    kept: list[tuple[np.ndarray, np.ndarray]] = []
    truncated = dropped = 0
    for ex in examples:
        ids, mask = np.asarray(ex.ids, dtype=np.int32), np.asarray(ex.assistant, dtype=bool)
        if len(ids) - 1 > seq_len:
            if too_long == "error":
                raise DataError(f"{ex.where}: the conversation is {len(ids)} tokens, more than train.seq_len + 1 "
                                f"= {seq_len + 1} (train.seq_len={seq_len}); raise train.seq_len or set "
                                "data.too_long=truncate to keep its first train.seq_len + 1 tokens")
            ids, mask = ids[:seq_len + 1], mask[:seq_len + 1]
            truncated += 1
        if len(ids) < 2 or not mask[1:].any():
            dropped += 1
            continue
        kept.append((ids, mask))
    if dropped:
        log.warning("%d of %d chat examples left out: fewer than 2 tokens, or no assistant token to train on "
                    "(after truncation to train.seq_len + 1 = %d tokens)", dropped, len(examples), seq_len + 1)
    rows = _best_fit_decreasing([len(ids) - 1 for ids, _ in kept], seq_len) if pack else [[j] for j in
                                                                                           range(len(kept))]
    arrays = {k: np.zeros((len(rows), seq_len), np.float32 if k == "weights" else np.int32) for k in ROW_KEYS}
    for r, members in enumerate(rows):
        at = 0
        for segment, j in enumerate(members, start=1):
            ids, mask = kept[j]
            n = len(ids) - 1
            arrays["inputs"][r, at:at + n] = ids[:-1]
            arrays["targets"][r, at:at + n] = ids[1:]
            arrays["weights"][r, at:at + n] = mask[1:]
            arrays["segments"][r, at:at + n] = segment
            arrays["positions"][r, at:at + n] = np.arange(n)
            at += n
    return PackedRows(arrays, num_examples=len(kept), num_tokens=sum(len(ids) - 1 for ids, _ in kept),
                      num_loss_tokens=int(sum(int(mask[1:].sum()) for _, mask in kept)), truncated=truncated,
                      dropped=dropped)


def _best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bin packing of `lengths` (each <= capacity) into rows: indices of `lengths` per row, rows in opening order.

    Best-fit decreasing: longest first (a stable sort, so ties keep their input order), each into the open row
    whose free room is the smallest that fits it, else a new row. Why best fit: it fills the nearly full rows and
    keeps the roomy ones for what comes, and with decreasing lengths it opens at most 11/9 OPT + O(1) rows
    (Johnson 1973, for first- and best-fit decreasing alike), while next fit (close a row when the next example
    does not fit) can open twice the rows needed. `open_rows` is kept sorted by (free room, row), so the best fit
    is one `bisect`; a row with no room left is closed.
    """
    order = sorted(range(len(lengths)), key=lambda j: -lengths[j])
    rows: list[list[int]] = []
    open_rows: list[tuple[int, int]] = []  # (free positions, row index), sorted
    for j in order:
        n = lengths[j]
        k = bisect.bisect_left(open_rows, (n, -1))  # the first row with room >= n; on a tie, the earliest row
        if k < len(open_rows):
            free, r = open_rows.pop(k)
        else:
            free, r = capacity, len(rows)
            rows.append([])
        rows[r].append(j)
        if free - n > 0:
            bisect.insort(open_rows, (free - n, r))
    return rows


@dataclass
class ChatDatasets:
    """A chat corpus, tokenized and packed (what `prepare_chat_data` returns).

    Attributes:
      tokenizer: the run's tokenizer (data.tokenizer_path).
      chat: the chat format the conversations were rendered with.
      train, val: the packed rows of each split.
      meta: counts for logs and the run's records: files, examples, rows, tokens, loss tokens, packing
        efficiency (real tokens / (rows * T)), truncated and dropped examples, per split.
    """

    tokenizer: HFTokenizer
    chat: ChatFormat
    train: PackedRows
    val: PackedRows
    meta: dict[str, Any] = field(default_factory=dict)


def prepare_chat_data(data_cfg, seq_len: int) -> ChatDatasets:
    """Reads, tokenizes, splits and packs the chat corpus of `data_cfg` (data.format=chat).

    The tokenizer is data.tokenizer_path (a Hugging Face tokenizer.json); the chat format is the one beside it
    (`load_chat_format` of its directory: the run an imported model lives in, with hf/), its template replaced by
    data.chat_template when set. Validation holds out round(val_fraction * n) of the n examples (at least 1,
    at most n - 1), picked by a shuffle seeded with data.seed; each split is packed on its own.

    Args:
      data_cfg: `DataConfig` (paths, tokenizer_path, chat_template, val_fraction, seed, pack, too_long).
      seq_len: T (train.seq_len).
    Raises:
      DataError: no data.paths, or a path in object storage, or a file other than .jsonl; no or no HF
        data.tokenizer_path; no chat template (names data.tokenizer_path and data.chat_template), or a
        data.chat_template that is not a readable .jinja file; a file's error (`read_chat_file`); fewer than 2
        examples; a split left with no rows; an example too long (`pack_examples`).
    """
    tokenizer, chat = _tokenizer_and_chat(data_cfg)
    if not data_cfg.paths:
        raise DataError("data.format=chat needs data.paths: .jsonl files (or directories of them) of "
                        "{\"messages\": [{\"role\", \"content\"}, ...]}")
    for raw in data_cfg.paths:
        _local_path(raw, "data.paths", "chat files must be local for now (data.format=chat); copy them to this "
                    "machine")
    files = resolve_files(data_cfg.paths)
    others = [str(f) for f in files if f.suffix != ".jsonl"]
    if others:
        raise DataError(f"data.format=chat reads .jsonl files only; data.paths holds {others[:5]}"
                        f"{' ...' if len(others) > 5 else ''}")
    examples = [ex for f in files for ex in read_chat_file(f, chat, tokenizer)]
    n = len(examples)
    if n < 2:
        raise DataError(f"data.paths={list(data_cfg.paths)!r} hold {n} conversation(s); a train and a validation "
                        "split need at least 2")
    n_val = min(max(round(data_cfg.val_fraction * n), 1), n - 1)
    shuffled = np.random.default_rng([data_cfg.seed, _SPLIT_STREAM]).permutation(n)
    # Each split keeps file order (the packer's ties, and pack=False's rows, follow it).
    val_idx, train_idx = np.sort(shuffled[:n_val]), np.sort(shuffled[n_val:])
    splits = {}
    for name, idx in (("train", train_idx), ("val", val_idx)):
        rows = pack_examples([examples[i] for i in idx], seq_len, pack=data_cfg.pack, too_long=data_cfg.too_long)
        if rows.num_rows == 0:
            raise DataError(f"the {name} split of data.paths has no example left to train on ({rows.dropped} "
                            "dropped: fewer than 2 tokens or no assistant token after truncation)")
        splits[name] = rows
    train, val = splits["train"], splits["val"]
    meta = {
        "format": "chat",
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "seq_len": seq_len,
        "pack": data_cfg.pack,
        "num_files": len(files),
        "paths": list(data_cfg.paths),
    }
    for name, rows in splits.items():
        meta.update({
            f"{name}_examples": rows.num_examples,
            f"{name}_rows": rows.num_rows,
            f"{name}_tokens": rows.num_tokens,
            f"{name}_loss_tokens": rows.num_loss_tokens,
            f"{name}_packing_efficiency": rows.num_tokens / (rows.num_rows * seq_len),
            f"{name}_truncated": rows.truncated,
            f"{name}_dropped": rows.dropped,
        })
    return ChatDatasets(tokenizer, chat, train, val, meta)


def _tokenizer_and_chat(data_cfg) -> tuple[HFTokenizer, ChatFormat]:
    """The tokenizer at data.tokenizer_path and the chat format beside it (or data.chat_template's)."""
    raw = data_cfg.tokenizer_path
    if not raw:
        raise DataError("data.format=chat needs a Hugging Face tokenizer: set data.tokenizer_path (an imported "
                        "run's tokenizer.json)")
    path = _local_path(raw, "data.tokenizer_path", "data.format=chat needs a local tokenizer.json for now")
    if not path.is_file():
        raise DataError(f"data.tokenizer_path={raw!r} does not exist; data.format=chat needs a Hugging Face "
                        "tokenizer.json (an imported run's)")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"data.tokenizer_path={raw!r}: not a JSON file ({e})") from None
    if isinstance(doc, dict) and "msjax_tokenizer" in doc:
        raise DataError(f"data.tokenizer_path={raw!r} is msjax's own {doc['msjax_tokenizer']!r} tokenizer; "
                        "data.format=chat needs a Hugging Face tokenizer.json (an imported run's)")
    tokenizer = HFTokenizer.from_file(path, name=f"hf:{path.name}")
    try:
        chat = load_chat_format(path.parent, tokenizer)
    except ConfigError as e:
        raise DataError(f"the chat format beside data.tokenizer_path={raw!r}: {e}") from None
    if data_cfg.chat_template:
        template = _local_path(data_cfg.chat_template, "data.chat_template", "a local .jinja file")
        if template.suffix != ".jinja" or not template.is_file():
            raise DataError(f"data.chat_template={data_cfg.chat_template!r}: allowed is an existing .jinja file "
                            "(a chat template's text, as transformers' chat_template.jinja)")
        chat = dataclasses.replace(chat, template=template.read_text(encoding="utf-8"))
    if chat.template is None:
        raise DataError(f"no chat template: {path.parent / 'hf'} (beside data.tokenizer_path={raw!r}) has no "
                        "chat_template.jinja or tokenizer_config.json chat_template; set data.chat_template to a "
                        ".jinja file")
    return tokenizer, chat


def _local_path(raw: str | Path, key: str, why: str) -> Path:
    """`raw` (a local path or file:// URL) as an absolute Path; DataError naming `key` and `why` for a URL."""
    if paths.scheme(raw) not in (None, "file"):
        raise DataError(f"{key}={str(raw)!r} must be local: {why}")
    try:
        return Path(paths.check(raw, key))
    except ConfigError as e:  # msjax.paths.PathError
        raise DataError(str(e)) from None
