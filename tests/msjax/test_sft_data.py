"""Supervised fine-tuning data (msjax.data.sft) and the loader's packed rows (msjax.data.loader), on a real byte-level
BPE tokenizer with added special tokens and the real `transformers`:

- the assistant mask is `transformers`' `return_assistant_tokens_mask` over each assistant message's content, plus
  exactly the end-of-turn text the template writes after it; token ids are `apply_chat_template`'s;
- character offsets tile the text, also under a post-processor that trims offsets;
- packing places every example's tokens, targets, weights and positions exactly once, in one segment, as the
  plain best-fit-decreasing rule places them; too long examples are an error naming them, or truncated;
- the loader's row batches are a pure function of (seed, step), cover each row once per epoch, resume from a
  step, and assemble the same global arrays on an 8-device (data, sequence) mesh and across 2 processes;
- file and configuration errors are one DataError naming the file and line, or the key.

Everything compared is integer or exact; no tolerance is needed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sysconfig
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

transformers = pytest.importorskip("transformers")  # the dev extra installs it (pyproject.toml)

from msjax.chat import ChatFormat  # noqa: E402
from msjax.config import DataConfig  # noqa: E402
from msjax.data import (BatchLoader, ChatExample, DataError, HFTokenizer, PackedRows, assistant_tokens,  # noqa: E402
                        eval_batches, pack_examples, prepare_chat_data, read_chat_file, row_indices)
from msjax.data import sft  # noqa: E402
from tests.msjax.tiny_runs import run_ranks  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SPECIAL = ["<|im_start|>", "<|im_end|>"]
# ChatML whose assistant content (only) is a `{% generation %}` block, as transformers' assistant masks need.
TEMPLATE = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
            "{%- if message['role'] == 'assistant' %}{% generation %}{{- message['content'] }}{% endgeneration %}"
            "{%- else %}{{- message['content'] }}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
END_OF_TURN = "<|im_end|>\n"
_WORDS = ["def", "return", "the", "of", "value", "données", "naïve", "über", "数据", "λ", "🎉", "if", "(x)", ":",
          "42", "3.14", "'s'", "self", "import", "é", "日本語"]
_SEPS = [" ", " ", "  ", "\n", "\n    ", "\n\n", ", "]


def _text(rng: np.random.Generator, lo: int = 1, hi: int = 12) -> str:
    """Random words (non-ASCII among them) with code-like whitespace between, none at either end."""
    words = rng.choice(_WORDS, int(rng.integers(lo, hi + 1))).tolist()
    return "".join(w + str(rng.choice(_SEPS)) for w in words[:-1]) + words[-1]


def _conversation(rng: np.random.Generator) -> list[dict]:
    """System message or not, then 1-3 user/assistant exchanges, sometimes a last user message with no reply."""
    messages = [{"role": "system", "content": _text(rng)}] if rng.random() < 0.5 else []
    for _ in range(int(rng.integers(1, 4))):
        messages += [{"role": "user", "content": _text(rng)}, {"role": "assistant", "content": _text(rng)}]
    if rng.random() < 0.3:
        messages.append({"role": "user", "content": _text(rng)})
    return messages


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> Path:
    """msjax's byte-level BPE trained on two standard-library sources and the random words (so merges span
    non-ASCII characters and leading spaces), plus the ChatML special tokens."""
    from tokenizers import Tokenizer

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    rng = np.random.default_rng(0)
    texts = [(stdlib / n).read_text() for n in ("textwrap.py", "shlex.py")] + [_text(rng, 50, 80) for _ in range(40)]
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    HFTokenizer.train(texts, 600).save(path)
    raw = Tokenizer.from_file(str(path))
    raw.add_special_tokens(SPECIAL)
    raw.save(str(path))
    return path


@pytest.fixture(scope="module")
def tok(tokenizer_json) -> HFTokenizer:
    return HFTokenizer.from_file(tokenizer_json)


@pytest.fixture(scope="module")
def chat() -> ChatFormat:
    return ChatFormat(template=TEMPLATE)


def _run_dir(root: Path, tokenizer_json: Path, jinja: str | None = TEMPLATE) -> Path:
    """A run directory as `convert.py --from_hf` leaves it: tokenizer.json and hf/ (tokenizer_config.json, and
    chat_template.jinja unless `jinja` is None)."""
    (root / "hf").mkdir(parents=True)
    (root / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    (root / "hf" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    if jinja is not None:
        (root / "hf" / "chat_template.jinja").write_text(jinja)
    return root


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """The maximal runs [a, b) of True in a bool (n,) mask."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


# ---- offsets and the assistant mask --------------------------------------------------------------------------


def _assert_tiles(text: str, ids: np.ndarray, offsets: np.ndarray) -> None:
    """The offsets cover `text` in order without gap or overlap: consecutive tokens share a range (byte tokens of
    one character) or the next starts where the last ended; the distinct ranges concatenate to `text`."""
    assert offsets.shape == (len(ids), 2) and offsets.dtype == np.int64
    assert offsets[0, 0] == 0 and offsets[-1, 1] == len(text)
    for (a0, a1), (b0, b1) in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        assert (b0, b1) == (a0, a1) or b0 == a1, (a0, a1, b0, b1)
    distinct = [tuple(o) for i, o in enumerate(offsets.tolist()) if i == 0 or o != offsets[i - 1].tolist()]
    assert "".join(text[a:b] for a, b in distinct) == text


def test_offsets_are_characters_that_tile_the_text_even_when_the_file_trims_them(tokenizer_json, tok, tmp_path):
    """encode_offsets gives `encode`'s ids and character (not byte) offsets that tile the text, non-ASCII and
    astral characters included; a tokenizer.json whose ByteLevel post-processor trims offsets (which moves a
    token's start past its leading spaces) gives the same ids and offsets."""
    from tokenizers import Tokenizer, processors

    rng = np.random.default_rng(1)
    texts = ["héllo  wörld 日本語 🎉 x", "<|im_start|>user\nçà  va?<|im_end|>\n  \n", *(_text(rng, 20, 40)
                                                                                      for _ in range(5))]
    raw = Tokenizer.from_file(str(tokenizer_json))
    raw.post_processor = processors.ByteLevel(trim_offsets=True)
    trimmed_path = tmp_path / "trimmed.json"
    raw.save(str(trimmed_path))
    trimmed = HFTokenizer.from_file(trimmed_path)
    for text in texts:
        ids, offsets = tok.encode_offsets(text)
        np.testing.assert_array_equal(ids, tok.encode(text))
        _assert_tiles(text, ids, offsets)
        assert len(text) < len(text.encode("utf-8")) or text.isascii()  # the offsets above are in characters
        t_ids, t_offsets = trimmed.encode_offsets(text)
        np.testing.assert_array_equal(t_ids, ids)
        np.testing.assert_array_equal(t_offsets, offsets)
    # what the trimming does, which encode_offsets undoes: the file's own offsets do not tile
    enc = raw.encode(texts[0], add_special_tokens=False)
    with pytest.raises(AssertionError):
        _assert_tiles(texts[0], np.asarray(enc.ids), np.asarray(enc.offsets, np.int64))


def test_assistant_mask_is_transformers_mask_plus_the_end_of_turn(tok, tokenizer_json, chat):
    """On random conversations (system optional, 1-3 assistant turns, non-ASCII text), ids equal
    `apply_chat_template`'s, and the mask is `return_assistant_tokens_mask`'s (the `{% generation %}` content)
    extended by exactly the tokens of the end-of-turn text "<|im_end|>\\n" after each assistant message:
    one run of mask tokens per assistant message, transformers' mask is a non-empty prefix of that run decoding
    to the message's content, the rest of the run decodes to the end-of-turn text, and both masks are False
    everywhere else."""
    from tokenizers import Tokenizer

    ref = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(tokenizer_json)))
    rng = np.random.default_rng(2)
    for _ in range(30):
        messages = _conversation(rng)
        ids, mask = assistant_tokens(chat, tok, messages)
        out = ref.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        np.testing.assert_array_equal(ids, out["input_ids"])
        theirs = np.asarray(out["assistant_masks"], dtype=bool)
        assert ids.dtype == np.int32 and mask.dtype == bool and mask.shape == ids.shape
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        runs = _runs(mask)
        assert len(runs) == len(replies)
        assert not (theirs & ~mask).any()  # transformers' mask lies inside ours
        for (a, b), reply in zip(runs, replies):
            content = np.flatnonzero(theirs[a:b])
            assert len(content) and content[0] == 0 and content[-1] == len(content) - 1  # a prefix of the run
            c = a + len(content)
            assert tok.decode(ids[a:c]) == reply
            assert tok.decode(ids[c:b]) == END_OF_TURN


def test_assistant_mask_refuses_a_template_that_is_not_prefix_consistent(tok, chat):
    """A template that renders the last message differently from earlier ones (so a prefix of the conversation is
    not a prefix of its rendering) is a DataError naming the assistant message; an opening assistant message
    too (no prompt renders before it)."""
    marks_last = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% if loop.last %} <end>{% endif %}\n" \
                 "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"}]
    with pytest.raises(DataError, match=r"not prefix-consistent at message 1 .*cannot be found"):
        assistant_tokens(ChatFormat(template=marks_last), tok, messages)
    with pytest.raises(DataError, match=r"messages\[0\] is an assistant message"):
        assistant_tokens(chat, tok, messages[1:])


# ---- reading files -------------------------------------------------------------------------------------------


def _jsonl(path: Path, lines: list) -> Path:
    """Writes each item as a JSON line (a str is written as it is)."""
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x, ensure_ascii=False)) + "\n" for x in lines),
                    encoding="utf-8")
    return path


def test_read_chat_file_examples_and_line_numbers(tok, chat, tmp_path):
    """Non-blank lines become examples in file order, named by their line (blank lines counted, not read), with
    the ids of the rendered conversation and its assistant mask."""
    rng = np.random.default_rng(3)
    convs = [_conversation(rng) for _ in range(3)]
    path = _jsonl(tmp_path / "a.jsonl", [{"messages": convs[0], "id": 7}, "", {"messages": convs[1]}, "  ",
                                         {"messages": convs[2]}])
    examples = read_chat_file(path, chat, tok)
    assert [ex.where for ex in examples] == [f"{path}:1", f"{path}:3", f"{path}:5"]
    for ex, messages in zip(examples, convs):
        assert ex.ids.tolist() == chat.encode(tok, messages, add_generation_prompt=False)
        np.testing.assert_array_equal(ex.assistant, assistant_tokens(chat, tok, messages)[1])


@pytest.mark.parametrize("bad,needle", [
    ('{"messages": [', r"line 3: invalid JSON \("),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]},
     r"line 3: messages\[1\]: role 'robot' is not allowed"),
    ({"messages": [{"role": "user", "content": 5}]}, r"line 3: messages\[0\]: \"content\" must be a string"),
    ({"messages": [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]},
     r"line 3: no assistant message: nothing to train on"),
    ({"prompt": "a"}, r"line 3: allowed is an object with \"messages\".*got an object with keys \['prompt'\]"),
    ([1, 2], r"line 3: allowed is an object with \"messages\".*got list"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "no"}]},
     r"line 3: the chat template raised: replies must not say no"),
])
def test_read_chat_file_errors_name_the_file_and_line(bad, needle, tok, chat, tmp_path):
    """Each bad line is one DataError naming the file and the line (after a good line and a blank one)."""
    raising = chat.template.replace("{%- for message in messages %}",
                                    "{%- for message in messages %}{%- if message['content'] == 'no' %}"
                                    "{{ raise_exception('replies must not say no') }}{%- endif %}")
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    path = _jsonl(tmp_path / "bad.jsonl", [good, "", bad, good])
    with pytest.raises(DataError, match=needle) as e:
        read_chat_file(path, dataclasses.replace(chat, template=raising), tok)
    assert str(e.value).startswith(f"{path} line 3: ")


def test_read_chat_file_is_local_only(tok, chat):
    with pytest.raises(DataError, match=r"data.paths='s3://bucket/chat.jsonl' must be local: chat files must be "
                                        "local for now"):
        read_chat_file("s3://bucket/chat.jsonl", chat, tok)


# ---- packing -------------------------------------------------------------------------------------------------

T = 24


def _examples(rng: np.random.Generator, count: int, max_len: int = T + 1) -> list[ChatExample]:
    """Random examples whose ids say who they are: example k's token p is k * 1000 + p. Masks are random; some
    examples have no loss token among their targets or fewer than 2 tokens (both dropped by packing)."""
    out = []
    for k in range(count):
        n = int(rng.integers(1, max_len + 1))
        mask = rng.random(n) < 0.5
        if rng.random() < 0.1:
            mask[1:] = False
        out.append(ChatExample((k * 1000 + np.arange(n)).astype(np.int32), mask, f"f.jsonl:{k + 1}"))
    return out


def _segments(rows: PackedRows) -> dict[int, dict[str, np.ndarray]]:
    """{example k: its five arrays}, read back from the rows, checking that each segment is one example's
    contiguous positions, every example has one segment, and padding is all zeros."""
    a = rows.arrays
    found: dict[int, dict[str, np.ndarray]] = {}
    for r in range(rows.num_rows):
        seg = a["segments"][r]
        used = int((seg > 0).sum())
        assert (seg[:used] > 0).all() and (seg[used:] == 0).all()  # examples first, padding after
        assert (np.diff(seg[:used]) >= 0).all() and (np.diff(seg[:used]) <= 1).all() and (used == 0 or seg[0] == 1)
        for key in ("inputs", "targets", "weights", "positions"):
            assert (a[key][r, used:] == 0).all()
        for s in range(1, int(seg.max(initial=0)) + 1):
            cols = np.flatnonzero(seg == s)
            k = int(a["inputs"][r, cols[0]]) // 1000
            assert (a["inputs"][r, cols] // 1000 == k).all(), "a segment mixes examples"
            assert k not in found, f"example {k} appears twice"
            found[k] = {key: a[key][r, cols] for key in sft.ROW_KEYS}
    return found


def _plain_best_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing written as plainly as possible: O(examples * rows)."""
    rows, free = [], []
    for j in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        fits = [r for r in range(len(rows)) if free[r] >= lengths[j]]
        if fits:
            r = min(fits, key=lambda r: (free[r], r))
        else:
            r = len(rows)
            rows.append([])
            free.append(capacity)
        rows[r].append(j)
        free[r] -= lengths[j]
    return rows


def _next_fit_rows(lengths: list[int], capacity: int) -> int:
    rows, room = 0, 0
    for n in lengths:
        if n > room:
            rows, room = rows + 1, capacity
        room -= n
    return rows


@pytest.mark.parametrize("pack", [True, False])
def test_packing_places_every_example_exactly_once(pack, caplog):
    """Every kept example's inputs (ids[:-1]), targets (ids[1:]), weights (assistant[1:]) and positions
    (0..n-2) appear exactly once, in one segment of one row; padding is zero; the counts add up; dropped
    examples are warned about once. pack=False: one example per row, in input order."""
    rng = np.random.default_rng(4)
    examples = _examples(rng, 200)
    with caplog.at_level(logging.WARNING, logger="msjax.data.sft"):
        rows = pack_examples(examples, T, pack=pack)
    kept = [ex for ex in examples if len(ex.ids) >= 2 and ex.assistant[1:].any()]
    assert rows.num_examples == len(kept) and rows.dropped == len(examples) - len(kept) > 0
    warnings = [r for r in caplog.records if r.name == "msjax.data.sft"]
    assert len(warnings) == 1 and f"{rows.dropped} of 200 chat examples left out" in warnings[0].getMessage()
    assert {k: v.shape for k, v in rows.arrays.items()} == {k: (rows.num_rows, T) for k in sft.ROW_KEYS}
    assert rows.arrays["weights"].dtype == np.float32 and rows.arrays["segments"].dtype == np.int32
    found = _segments(rows)
    assert sorted(found) == sorted(int(ex.ids[0]) // 1000 for ex in kept)
    for ex in kept:
        got = found[int(ex.ids[0]) // 1000]
        np.testing.assert_array_equal(got["inputs"], ex.ids[:-1])
        np.testing.assert_array_equal(got["targets"], ex.ids[1:])
        np.testing.assert_array_equal(got["weights"], ex.assistant[1:].astype(np.float32))
        np.testing.assert_array_equal(got["positions"], np.arange(len(ex.ids) - 1))
    assert rows.num_tokens == sum(len(ex.ids) - 1 for ex in kept) == int((rows.arrays["segments"] > 0).sum())
    assert rows.num_loss_tokens == int(rows.arrays["weights"].sum()) == sum(int(ex.assistant[1:].sum())
                                                                            for ex in kept)
    if not pack:
        assert rows.num_rows == len(kept)
        assert [int(rows.arrays["inputs"][r, 0]) // 1000 for r in range(rows.num_rows)] == \
            [int(ex.ids[0]) // 1000 for ex in kept]
        assert (rows.arrays["segments"].max(axis=1) == 1).all()


def test_best_fit_decreasing_rows_and_their_count():
    """The packer's rows are exactly those of a plain best-fit-decreasing loop (same members, same order), and
    on random lengths it never opens more rows than next fit, nor fewer than the tokens need."""
    for seed in range(20):
        rng = np.random.default_rng(seed)
        lengths = rng.integers(1, T + 1, int(rng.integers(1, 120))).tolist()
        rows = sft._best_fit_decreasing(lengths, T)
        assert rows == _plain_best_fit(lengths, T)
        assert sorted(j for row in rows for j in row) == list(range(len(lengths)))
        assert all(sum(lengths[j] for j in row) <= T for row in rows)
        assert -(-sum(lengths) // T) <= len(rows) <= _next_fit_rows(lengths, T)
    # the packed rows themselves follow it: rows of examples whose (n - 1) are those lengths
    rng = np.random.default_rng(5)
    examples = [ex for ex in _examples(rng, 80) if len(ex.ids) >= 2 and ex.assistant[1:].any()]
    rows = pack_examples(examples, T)
    want = _plain_best_fit([len(ex.ids) - 1 for ex in examples], T)
    got = [[int(rows.arrays["inputs"][r, np.flatnonzero(rows.arrays["segments"][r] == s)[0]]) // 1000
            for s in range(1, int(rows.arrays["segments"][r].max()) + 1)] for r in range(rows.num_rows)]
    assert got == [[int(examples[j].ids[0]) // 1000 for j in row] for row in want]


def test_too_long_examples_are_an_error_or_truncated():
    """An example of more than T + 1 tokens: too_long=error names it, its token count and train.seq_len, and the
    two fixes; truncate keeps its first T + 1 tokens (a full row) and counts it; one whose loss tokens all lie
    beyond the cut is dropped."""
    ids = np.arange(T + 5, dtype=np.int32)
    mask = np.zeros(T + 5, dtype=bool)
    mask[5:] = True
    long = ChatExample(ids, mask, "chat.jsonl:9")
    late = ChatExample(ids + 1000, np.arange(T + 5) > T + 1, "chat.jsonl:10")
    with pytest.raises(DataError, match=rf"chat.jsonl:9: the conversation is {T + 5} tokens, more than "
                                        rf"train.seq_len \+ 1 = {T + 1} \(train.seq_len={T}\); raise train.seq_len "
                                        "or set data.too_long=truncate"):
        pack_examples([long], T)
    rows = pack_examples([long, late], T, too_long="truncate")
    assert rows.num_rows == 1 and rows.truncated == 2 and rows.dropped == 1 and rows.num_tokens == T
    np.testing.assert_array_equal(rows.arrays["inputs"][0], ids[:T])
    np.testing.assert_array_equal(rows.arrays["targets"][0], ids[1:T + 1])
    np.testing.assert_array_equal(rows.arrays["weights"][0], mask[1:T + 1])
    # exactly T + 1 tokens fit without truncation
    assert pack_examples([ChatExample(ids[:T + 1], mask[:T + 1], "x")], T).truncated == 0


# ---- the loader on packed rows -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rows() -> PackedRows:
    """12 packed rows (the first of more), each distinct (example ids say which)."""
    rng = np.random.default_rng(6)
    examples = [ex for ex in _examples(rng, 80, max_len=T // 2) if len(ex.ids) >= 2 and ex.assistant[1:].any()]
    out = pack_examples(examples, T)
    out = dataclasses.replace(out, arrays={k: v[:12] for k, v in out.arrays.items()})
    assert out.num_rows == 12
    return out


def _host(batch: dict) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in batch.items()}


def _assert_batch(batch: dict, rows: PackedRows, idx: np.ndarray) -> None:
    got = _host(batch)
    assert sorted(got) == sorted(sft.ROW_KEYS)
    for k in sft.ROW_KEYS:
        assert got[k].dtype == rows.arrays[k].dtype
        np.testing.assert_array_equal(got[k], rows.arrays[k][idx])


def test_row_batches_follow_the_epoch_formula_and_cover_each_epoch(rows):
    """Step s holds positions s*B .. s*B+B-1 of the epochs' permutations: with N % B == 0 one epoch's steps
    hold every row exactly once, each epoch in another order; N < B is allowed (a batch spans epochs)."""
    B, N = 4, rows.num_rows
    with BatchLoader(rows, seq_len=T, global_batch=B, seed=3, prefetch=2) as loader:
        batches = [next(loader) for _ in range(2 * N // B)]
    seen = []
    for s, batch in enumerate(batches):
        idx = row_indices(N, B, 3, s)
        _assert_batch(batch, rows, idx)
        seen.append(idx)
    epoch0, epoch1 = np.concatenate(seen[:N // B]), np.concatenate(seen[N // B:])
    assert sorted(epoch0.tolist()) == sorted(epoch1.tolist()) == list(range(N))
    assert epoch0.tolist() != epoch1.tolist() and epoch0.tolist() != list(range(N))
    np.testing.assert_array_equal(epoch0, np.random.default_rng([3, 0]).permutation(N))
    # N < B: rows of the first epochs, in order
    few = dataclasses.replace(rows, arrays={k: v[:3] for k, v in rows.arrays.items()})
    with BatchLoader(few, seq_len=T, global_batch=8, seed=3, prefetch=0) as loader:
        want = np.concatenate([np.random.default_rng([3, e]).permutation(3) for e in range(6)])
        _assert_batch(next(loader), few, want[:8])
        _assert_batch(next(loader), few, want[8:16])


def test_row_batches_are_deterministic_and_resume_from_a_step(rows):
    """Two loaders with one seed give the same batches; another seed others; a loader started (or restored) at
    step 5 gives what an uninterrupted one gives from step 5."""
    kw = dict(seq_len=T, global_batch=4, prefetch=2)
    with BatchLoader(rows, seed=1, **kw) as a, BatchLoader(rows, seed=1, **kw) as b, \
            BatchLoader(rows, seed=2, **kw) as c:
        straight = [_host(next(a)) for _ in range(9)]
        again = [_host(next(b)) for _ in range(9)]
        other = [_host(next(c)) for _ in range(9)]
    for x, y in zip(straight, again):
        for k in sft.ROW_KEYS:
            np.testing.assert_array_equal(x[k], y[k])
    assert any(not np.array_equal(x["inputs"], z["inputs"]) for x, z in zip(straight, other))
    with BatchLoader(rows, seed=1, step=5, **kw) as resumed:
        for x in straight[5:]:
            np.testing.assert_array_equal(_host(next(resumed))["targets"], x["targets"])
    with BatchLoader(rows, seed=1, **kw) as restored:
        next(restored)
        restored.restore({"step": 5, "seed": 1})
        np.testing.assert_array_equal(_host(next(restored))["weights"], straight[5]["weights"])


def _eval_order(rows, seed: int, n: int) -> np.ndarray:
    """The rows eval_batches evaluates, by its documented rule (the loader's evaluation stream word)."""
    from msjax.data.loader import _EVAL_STREAM

    return np.random.default_rng([seed, _EVAL_STREAM]).permutation(rows.num_rows)[np.arange(n) % rows.num_rows]


def test_eval_batches_of_rows_and_errors(rows):
    """eval_batches takes the first batch * num_batches rows of one seeded permutation, cycling (every row before
    any repeats; not the packer's order, which starts with the longest examples); a seq_len other than the rows' T
    and empty rows are DataErrors."""
    got = eval_batches(rows, seq_len=T, batch=5, num_batches=3, seed=9)
    assert len(got) == 3
    order = _eval_order(rows, 9, 15)
    assert sorted(order[:rows.num_rows]) == list(range(rows.num_rows)) and list(order[:5]) != [0, 1, 2, 3, 4]
    for i, batch in enumerate(got):
        _assert_batch(batch, rows, order[5 * i:5 * i + 5])
    with pytest.raises(DataError, match=rf"seq_len={T + 1}, but the rows were packed to {T} positions"):
        eval_batches(rows, seq_len=T + 1, batch=2, num_batches=1)
    with pytest.raises(DataError, match=rf"seq_len={T // 2}, but the rows were packed to {T} positions"):
        BatchLoader(rows, seq_len=T // 2, global_batch=2, seed=0)
    empty = dataclasses.replace(rows, arrays={k: v[:0] for k, v in rows.arrays.items()})
    with pytest.raises(DataError, match="the packed rows are empty"):
        BatchLoader(empty, seq_len=T, global_batch=2, seed=0)


def test_sharded_row_batches_equal_the_unsharded_rows(rows):
    """On 8 CPU devices (tests/conftest.py), with the batch sharded over a (data, sequence) mesh in several
    ways, every key of every batch is a global array of that sharding equal to the unsharded rows."""
    assert jax.device_count() >= 8
    mesh = jax.make_mesh((4, 2), ("data", "sequence"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:8])
    for spec in (P("data", "sequence"), P("data"), P(("data", "sequence"))):
        sharding = NamedSharding(mesh, spec)
        with BatchLoader(rows, seq_len=T, global_batch=8, seed=4, sharding=sharding, prefetch=1) as loader:
            for step in range(3):
                batch = next(loader)
                assert all(v.sharding == sharding and v.shape == (8, T) for v in batch.values())
                _assert_batch(batch, rows, row_indices(rows.num_rows, 8, 4, step))
        ev = eval_batches(rows, seq_len=T, batch=8, num_batches=2, sharding=sharding)
        _assert_batch(ev[1], rows, _eval_order(rows, 0, 16)[8:16])


_MULTIPROCESS = """
import sys, numpy as np, jax
pid, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
from msjax.data import BatchLoader, PackedRows, loader, row_indices
with np.load(path) as f:
    rows = PackedRows({k: f[k] for k in f.files})
mesh = jax.make_mesh((2, 2), ("data", "sequence"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
B, T = 8, rows.seq_len
for spec in (P("data"), P(None, "data"), P("data", "sequence")):
    sharding = NamedSharding(mesh, spec)
    r, c = loader._local_indices(sharding, (B, T))
    assert len(r) * len(c) < B * T, (spec, r, c)  # each process really holds only part of the batch
    with BatchLoader(rows, seq_len=T, global_batch=B, seed=1, sharding=sharding) as it:
        for step in range(2):
            b = next(it)
            idx = row_indices(rows.num_rows, B, 1, step)
            for k, v in b.items():
                np.testing.assert_array_equal(multihost_utils.process_allgather(v, tiled=True), rows.arrays[k][idx])
print("OK", pid, jax.process_count(), jax.device_count())
"""


def test_multiprocess_row_batches_equal_the_rows(rows, tmp_path):
    """Two processes of 2 CPU devices each, each assembling only its own rows and columns: the global batch of
    every key equals the rows of the step."""
    path = tmp_path / "rows.npz"
    np.savez(path, **rows.arrays)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    for stdout in run_ranks(_MULTIPROCESS, [str(path)], env, REPO):
        assert "OK" in stdout and " 2 4" in stdout


# ---- prepare_chat_data ---------------------------------------------------------------------------------------

S = 512  # train.seq_len here: the random conversations are up to ~200 tokens


@pytest.fixture
def corpus(tmp_path) -> tuple[Path, list[list[dict]]]:
    """Two JSONL files (7 and 5 conversations) in a directory, and the conversations in file order."""
    rng = np.random.default_rng(7)
    convs = [_conversation(rng) for _ in range(12)]
    d = tmp_path / "chats"
    d.mkdir()
    _jsonl(d / "a.jsonl", [{"messages": m} for m in convs[:7]])
    _jsonl(d / "b.jsonl", [{"messages": m} for m in convs[7:]])
    return d, convs


def test_prepare_chat_data_end_to_end(corpus, tokenizer_json, tok, chat, tmp_path):
    """Reads the run's template beside data.tokenizer_path, holds out round(val_fraction * n) examples (at least
    1, at most n - 1), packs each split, and reports counts that add up to the examples read; same result on
    every call; another seed splits otherwise."""
    d, convs = corpus
    run = _run_dir(tmp_path / "run", tokenizer_json)
    cfg = DataConfig(paths=(str(d),), tokenizer_path=str(run / "tokenizer.json"), format="chat", val_fraction=0.25,
                     seed=0)
    data = prepare_chat_data(cfg, seq_len=S)
    assert data.chat.template == TEMPLATE and data.tokenizer.vocab_size == tok.vocab_size
    m = data.meta
    assert (m["num_files"], m["train_examples"], m["val_examples"]) == (2, 9, 3)
    examples = [ex for f in sorted(d.glob("*.jsonl")) for ex in read_chat_file(f, chat, tok)]
    assert len(examples) == len(convs)
    assert m["train_tokens"] + m["val_tokens"] == sum(len(ex.ids) - 1 for ex in examples)
    assert m["train_loss_tokens"] + m["val_loss_tokens"] == sum(int(ex.assistant[1:].sum()) for ex in examples)
    for name, split in (("train", data.train), ("val", data.val)):
        assert m[f"{name}_rows"] == split.num_rows and split.seq_len == S
        assert m[f"{name}_loss_tokens"] == int(split.arrays["weights"].sum())
        assert m[f"{name}_packing_efficiency"] == pytest.approx(split.num_tokens / (split.num_rows * S), abs=0)
        assert 0 < m[f"{name}_packing_efficiency"] <= 1
    again = prepare_chat_data(cfg, seq_len=S)
    for k in sft.ROW_KEYS:
        np.testing.assert_array_equal(again.train.arrays[k], data.train.arrays[k])
    other = prepare_chat_data(dataclasses.replace(cfg, seed=1), seq_len=S)
    assert other.meta["val_tokens"] != m["val_tokens"] or \
        not np.array_equal(other.val.arrays["inputs"], data.val.arrays["inputs"])
    assert prepare_chat_data(dataclasses.replace(cfg, val_fraction=0.0), S).meta["val_examples"] == 1
    assert prepare_chat_data(dataclasses.replace(cfg, val_fraction=1.0), S).meta["train_examples"] == 1
    unpacked = prepare_chat_data(dataclasses.replace(cfg, pack=False), S)
    assert unpacked.meta["train_rows"] == 9 and data.meta["train_rows"] < 9


def test_prepare_chat_data_errors(corpus, tokenizer_json, tmp_path):
    """No tokenizer_path; no template (names both keys), and data.chat_template supplying one; a non-.jsonl
    file; no paths; object storage; too few conversations."""
    d, _ = corpus
    bare = _run_dir(tmp_path / "bare", tokenizer_json, jinja=None)
    cfg = DataConfig(paths=(str(d),), tokenizer_path=str(bare / "tokenizer.json"), format="chat")
    with pytest.raises(DataError, match=r"data.format=chat needs a Hugging Face tokenizer: set data.tokenizer_path"):
        prepare_chat_data(dataclasses.replace(cfg, tokenizer_path=""), S)
    with pytest.raises(DataError, match=r"no chat template: .*data.tokenizer_path=.*set data.chat_template"):
        prepare_chat_data(cfg, S)
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    assert prepare_chat_data(dataclasses.replace(cfg, chat_template=str(tmp_path / "t.jinja")), S).chat.template \
        == TEMPLATE
    with pytest.raises(DataError, match=r"data.chat_template=.*allowed is an existing .jinja file"):
        prepare_chat_data(dataclasses.replace(cfg, chat_template=str(tmp_path / "missing.jinja")), S)
    cfg = dataclasses.replace(cfg, chat_template=str(tmp_path / "t.jinja"))
    (d / "notes.txt").write_text("hello")
    with pytest.raises(DataError, match=r"data.format=chat reads .jsonl files only; .*notes.txt"):
        prepare_chat_data(cfg, S)
    (d / "notes.txt").unlink()
    with pytest.raises(DataError, match="data.format=chat needs data.paths"):
        prepare_chat_data(dataclasses.replace(cfg, paths=()), S)
    with pytest.raises(DataError, match="must be local: chat files must be local for now"):
        prepare_chat_data(dataclasses.replace(cfg, paths=("gs://bucket/chats",)), S)
    one = _jsonl(tmp_path / "one.jsonl", [{"messages": [{"role": "user", "content": "a"},
                                                        {"role": "assistant", "content": "b"}]}])
    with pytest.raises(DataError, match=r"hold 1 conversation\(s\); a train and a validation split need at least 2"):
        prepare_chat_data(dataclasses.replace(cfg, paths=(str(one),)), S)
    own = tmp_path / "own.json"
    own.write_text(json.dumps({"msjax_tokenizer": "byte"}))
    with pytest.raises(DataError, match="msjax's own 'byte' tokenizer; data.format=chat needs a Hugging Face"):
        prepare_chat_data(dataclasses.replace(cfg, tokenizer_path=str(own)), S)
