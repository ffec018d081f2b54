"""Tests of msjax.data: corpus reading and errors, tokenizer round trips, the token cache, and the batch loader
(determinism, resume, prefetch thread, sharded and multi-process assembly)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from msjax.config import DataConfig
from msjax.data import (BatchLoader, ByteTokenizer, CharTokenizer, DataError, DataWarning, HFTokenizer,
                        build_tokenizer, eval_batches, load_tokenizer, prepare_data, read_documents,
                        resolve_files, stdlib_corpus_files)
from msjax.data import loader as loader_mod
from msjax.data import tokens as tokens_mod
from msjax.data.corpus import is_validation
from tests.msjax.tiny_runs import run_ranks

REPO = Path(__file__).resolve().parents[2]

_WORDS = ["def", "return", "the", "of", "and", "value", "x", "données", "naïve", "über", "数据", "λ", "🎉", "if",
          "None", "(", ")", ":", "=", "+", "0", "42", "3.14", "'s'", "\"q\"", "#", "self", "import", "for", "in"]
_SEPS = [" ", " ", " ", " ", "\n", "\n    ", "\n\t", "  ", "\r\n", "\n\n"]


def random_text(rng: np.random.Generator, n_words: int) -> str:
    """Random text with code-like whitespace (indentation, tabs, CRLF, blank lines) and non-ASCII characters."""
    words = rng.choice(_WORDS, n_words)
    seps = rng.choice(_SEPS, n_words)
    return "".join(w + s for w, s in zip(words, seps))


def make_corpus(root: Path, n_files: int, words: int = 300, seed: int = 0) -> list[Path]:
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n_files):
        p = root / f"sub{i % 3}" / f"doc{i:03d}.txt"
        p.parent.mkdir(exist_ok=True)
        p.write_text(random_text(rng, words), encoding="utf-8")
        paths.append(p)
    return paths


def tree_digest(root: Path) -> dict[str, tuple[str, int]]:
    return {str(p): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def stdlib_texts() -> list[str]:
    files = stdlib_corpus_files()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert not any(part in ("test", "tests", "idlelib", "site-packages") for f in files for part in f.parts[-3:-1])
    # A slice of real Python source, every 12th file (~1 MB): enough for a BPE with real merges, fast to train.
    return [f.read_text(encoding="utf-8") for f in files[::12]]


# ---------------------------------------------------------------------------------------------------------------
# Tokenizers


def test_char_tokenizer_round_trip_and_vocab(tmp_path):
    text = random_text(np.random.default_rng(1), 2000)
    tok = CharTokenizer.fit([text])
    assert tok.chars == sorted(set(text)) and tok.vocab_size == len(set(text)) and tok.eot_id is None
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and len(ids) == len(text)
    assert tok.decode(ids) == text
    tok.save(tmp_path / "t.json")
    again = load_tokenizer(tmp_path / "t.json")
    assert isinstance(again, CharTokenizer) and again.chars == tok.chars
    np.testing.assert_array_equal(again.encode(text), ids)
    with pytest.raises(DataError, match="not in its vocabulary"):
        tok.encode("Z~")


def test_byte_tokenizer_round_trip(tmp_path):
    tok = ByteTokenizer()
    text = random_text(np.random.default_rng(2), 500)
    ids = tok.encode(text)
    assert ids.max() < 256 and tok.vocab_size == 257 and tok.eot_id == 256
    assert tok.decode(ids) == text
    assert tok.decode(np.concatenate([tok.encode("ab"), [256], tok.encode("é")])) == "ab<|endoftext|>é"
    tok.save(tmp_path / "b.json")
    assert isinstance(load_tokenizer(tmp_path / "b.json"), ByteTokenizer)


def test_bpe_round_trip_on_real_source(stdlib_texts, tmp_path):
    train, held_out = stdlib_texts[:-10], stdlib_texts[-10:]
    tok = HFTokenizer.train(iter(train), vocab_size=512)
    assert tok.vocab_size == 512 and tok.eot_id is not None and tok.name == "bpe-512"
    tricky = "  def f(x):\n\t\treturn x  \r\n\n\n    héllo 世界 🎉 <|endoftext|>  trailing   "
    for text in held_out + [tricky, random_text(np.random.default_rng(3), 400)]:
        assert tok.decode(tok.encode(text)) == text
    batch = tok.encode_batch(held_out)
    for text, ids in zip(held_out, batch):
        assert ids.dtype == np.int32
        np.testing.assert_array_equal(ids, tok.encode(text))
    assert sum(map(len, batch)) < 0.5 * sum(len(t.encode()) for t in held_out)  # the merges compress real code
    tok.save(tmp_path / "tokenizer.json")
    again = load_tokenizer(tmp_path / "tokenizer.json")
    np.testing.assert_array_equal(again.encode(tricky), tok.encode(tricky))
    assert again.eot_id == tok.eot_id and again.vocab_size == tok.vocab_size


def test_build_tokenizer_kinds_cache_and_user_file(tmp_path, stdlib_texts):
    cfg = DataConfig(tokenizer="bpe", bpe_vocab_size=300)
    tok = build_tokenizer(cfg, iter(stdlib_texts[:5]), tmp_path / "c")
    assert (tmp_path / "c" / "tokenizer.json").is_file()
    cached = build_tokenizer(cfg, iter(()), tmp_path / "c")  # nothing to train on: must come from the cache
    assert cached.vocab_size == tok.vocab_size
    user = build_tokenizer(replace(cfg, tokenizer_path=str(tmp_path / "c" / "tokenizer.json")), (), None)
    np.testing.assert_array_equal(user.encode("x = 1\n"), tok.encode("x = 1\n"))
    assert isinstance(build_tokenizer(replace(cfg, tokenizer="byte"), (), None), ByteTokenizer)
    with pytest.raises(DataError, match="tokenizer_path"):
        build_tokenizer(replace(cfg, tokenizer="char", tokenizer_path=str(tmp_path / "c" / "tokenizer.json")),
                        (), None)
    with pytest.raises(DataError, match="does not exist"):
        build_tokenizer(replace(cfg, tokenizer_path=str(tmp_path / "nope.json")), (), None)


# ---------------------------------------------------------------------------------------------------------------
# Corpus


def test_resolve_files_and_errors(tmp_path):
    files = make_corpus(tmp_path / "c", 5)
    (tmp_path / "c" / "notes.md").write_text("ignored")
    (tmp_path / "c" / ".hidden.txt").write_text("ignored")
    (tmp_path / "c" / "empty.txt").write_text("")
    single = tmp_path / "one.txt"
    single.write_text("hello")
    assert resolve_files([str(tmp_path / "c"), str(single)]) == sorted(files + [single])
    with pytest.raises(DataError, match="missing_dir"):
        resolve_files([str(tmp_path / "missing_dir")])
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError, match=r"empty_dir.*\.txt, \.jsonl, \.parquet"):
        resolve_files([str(tmp_path / "empty_dir")])
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    with pytest.raises(DataError, match=r"blank.*empty"):
        resolve_files([str(tmp_path / "blank")])
    with pytest.raises(DataError, match=r"notes\.md.*allowed"):
        resolve_files([str(tmp_path / "c" / "notes.md")])


def test_jsonl_and_parquet_documents(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(4)
    docs = [random_text(rng, 50) for _ in range(7)]
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps({"id": i, "body": d}) for i, d in enumerate(docs)) + "\n\n")
    assert list(read_documents(jl, "body")) == docs
    pqf = tmp_path / "d.parquet"
    pq.write_table(pa.table({"body": docs, "n": list(range(7))}), pqf, row_group_size=3)
    assert list(read_documents(pqf, "body")) == docs

    with pytest.raises(DataError, match=r"d\.jsonl:1: no field 'text'"):
        list(read_documents(jl, "text"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "a"}) + "\n" + json.dumps({"txt": "b"}) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:2: no field 'text'"):
        list(read_documents(bad, "text"))
    with pytest.raises(DataError, match=r"no column 'text'.*\['body', 'n'\]"):
        list(read_documents(pqf, "text"))
    with pytest.raises(DataError, match="not string"):
        list(read_documents(pqf, "n"))

    # Both formats through the pipeline: one document per line / row, eot after each.
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    jl.rename(mixed / "a.jsonl")
    pqf.rename(mixed / "b.parquet")
    ds = prepare_data(DataConfig(paths=(str(mixed),), text_field="body", tokenizer="byte",
                                 cache_dir=str(tmp_path / "cache")))
    stream = np.concatenate([np.asarray(ds.train), np.asarray(ds.val)])
    assert ds.meta["train_documents"] + ds.meta["val_documents"] == 14
    assert ByteTokenizer().decode(stream) == "".join(d + "<|endoftext|>" for d in docs + docs)


def test_undecodable_bytes_error_and_skip(tmp_path):
    corpus = tmp_path / "c"
    make_corpus(corpus, 4)
    bad = corpus / "sub0" / "latin1.txt"
    bad.write_bytes("caf".encode() + b"\xe9 au lait")
    with pytest.raises(DataError, match=r"latin1\.txt.*byte offset 3"):
        list(read_documents(bad))
    with pytest.warns(DataWarning, match=r"latin1\.txt"):
        assert list(read_documents(bad, on_decode_error="skip")) == []
    cfg = DataConfig(paths=(str(corpus),), tokenizer="byte", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=r"latin1\.txt"):
        prepare_data(cfg)
    with pytest.warns(DataWarning, match=r"latin1\.txt"):
        ds = prepare_data(replace(cfg, on_decode_error="skip"))
    assert ds.meta["train_documents"] + ds.meta["val_documents"] == 4


def test_split_by_file_is_stable_and_position_split_for_one_file(tmp_path):
    rels = [f"dir/file{i}.txt" for i in range(2000)]
    val = [r for r in rels if is_validation(r, 0.1)]
    assert 140 < len(val) < 260  # ~10%
    assert val == [r for r in rels if is_validation(r, 0.1)]

    text = random_text(np.random.default_rng(5), 3000)
    (tmp_path / "input.txt").write_text(text)
    cfg = DataConfig(paths=(str(tmp_path / "input.txt"),), tokenizer="char", val_fraction=0.1,
                     cache_dir=str(tmp_path / "cache"))
    ds = prepare_data(cfg)
    assert ds.meta["split"] == "position"
    n = len(text)
    assert len(ds.train) == int(n * 0.9) and len(ds.val) == n - int(n * 0.9)  # nanoGPT's shakespeare_char split
    assert ds.tokenizer.decode(ds.train) + ds.tokenizer.decode(ds.val) == text
    bpe = prepare_data(replace(cfg, tokenizer="bpe", bpe_vocab_size=300))
    assert bpe.meta["split"] == "position" and bpe.train.dtype == np.uint16
    assert bpe.tokenizer.decode(np.concatenate([bpe.train, bpe.val])) == text + "<|endoftext|>"


# ---------------------------------------------------------------------------------------------------------------
# Token cache


def test_prepare_data_bpe_file_split_cache_reuse_and_invalidation(tmp_path):
    corpus = tmp_path / "corpus"
    files = make_corpus(corpus, 40, words=200)
    before = tree_digest(corpus)
    cfg = DataConfig(paths=(str(corpus),), tokenizer="bpe", bpe_vocab_size=300, val_fraction=0.2,
                     cache_dir=str(tmp_path / "cache"))
    ds = prepare_data(cfg)
    m = ds.meta
    assert m["split"] == "file" and not m["cache_hit"] and m["train_files"] + m["val_files"] == 40
    assert m["val_files"] > 0 and ds.train.dtype == np.uint16 and isinstance(ds.train, np.memmap)
    assert m["train_tokens"] == len(ds.train) and m["val_tokens"] == len(ds.val)
    # The stream is the documents in path order, each followed by eot; decode recovers every train document.
    eot = ds.tokenizer.eot_id
    docs = np.split(np.asarray(ds.train), np.flatnonzero(np.asarray(ds.train) == eot) + 1)[:-1]
    train_files = [f for f in sorted(files) if not is_validation(f.relative_to(corpus).as_posix(), 0.2)]
    assert [ds.tokenizer.decode(d[:-1]) for d in docs] == [f.read_bytes().decode() for f in train_files]
    assert tree_digest(corpus) == before  # inputs untouched

    train_bin = Path(m["cache_path"]) / "train.bin"
    mtime = train_bin.stat().st_mtime_ns
    again = prepare_data(cfg)
    assert again.meta["cache_hit"] and again.meta["cache_path"] == m["cache_path"]
    assert train_bin.stat().st_mtime_ns == mtime
    np.testing.assert_array_equal(again.train, ds.train)
    assert again.tokenizer.encode("x = 1").tolist() == ds.tokenizer.encode("x = 1").tolist()

    files[0].write_text(files[0].read_text() + "\nchanged\n")
    changed = prepare_data(cfg)
    assert not changed.meta["cache_hit"] and changed.meta["cache_path"] != m["cache_path"]
    assert prepare_data(replace(cfg, val_fraction=0.3)).meta["cache_path"] not in (m["cache_path"],
                                                                                 changed.meta["cache_path"])


def test_interrupted_build_is_never_used(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus"
    make_corpus(corpus, 6)
    cache = tmp_path / "cache"
    cfg = DataConfig(paths=(str(corpus),), tokenizer="byte", cache_dir=str(cache))

    def killed(tmp, final):  # the process dies between writing and publishing
        raise KeyboardInterrupt

    monkeypatch.setattr(tokens_mod, "_publish", killed)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(cfg)
    monkeypatch.undo()
    assert list(cache.iterdir()) == []  # no published directory, temp directory removed

    # A build killed hard (SIGKILL) leaves its temp directory: a later build ignores it.
    fp = tokens_mod.fingerprint(cfg, tokens_mod.corpus_sources(cfg.paths))
    stale = cache / f"{fp}.tmp-deadbeef0000"
    stale.mkdir()
    (stale / "train.bin").write_bytes(b"\x01\x00" * 3)
    (stale / "meta.json").write_text(json.dumps({"train_tokens": 3}))
    ds = prepare_data(cfg)
    assert not ds.meta["cache_hit"] and Path(ds.meta["cache_path"]).name == fp
    assert len(ds.train) > 1000 and stale.exists()

    # A published directory that no longer matches its meta.json is moved aside and rebuilt.
    expected = np.array(ds.train)
    del ds  # truncating a file under a live mmap would SIGBUS its next read
    os.truncate(Path(fp_dir := cache / fp) / "train.bin", 10)
    rebuilt = prepare_data(cfg)
    assert not rebuilt.meta["cache_hit"] and Path(rebuilt.meta["cache_path"]) == fp_dir
    np.testing.assert_array_equal(rebuilt.train, expected)
    assert len(list(cache.glob(f"{fp}.bad-*"))) == 1


def test_concurrent_builds_publish_once(tmp_path, monkeypatch):
    make_corpus(tmp_path / "corpus", 8)
    cfg = DataConfig(paths=(str(tmp_path / "corpus"),), tokenizer="byte", cache_dir=str(tmp_path / "cache"))
    n = 3
    barrier = threading.Barrier(n)
    real_build = tokens_mod._build

    def build_then_wait(*args):  # every builder finishes before any publishes: the rename race, forced
        meta = real_build(*args)
        barrier.wait(timeout=30)
        return meta

    monkeypatch.setattr(tokens_mod, "_build", build_then_wait)
    results: list = [None] * n

    def run(i):
        results[i] = prepare_data(cfg)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(r is not None for r in results)
    assert len({r.meta["cache_path"] for r in results}) == 1
    for r in results[1:]:
        np.testing.assert_array_equal(r.train, results[0].train)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [Path(results[0].meta["cache_path"]).name]


def test_stdlib_corpus_subset(tmp_path, monkeypatch):
    # Empty data.paths means the stdlib corpus; keep this fast by taking every 40th file.
    from msjax.data import corpus as corpus_mod

    full = corpus_mod._stdlib_sources()
    monkeypatch.setattr(corpus_mod, "_stdlib_sources", lambda: full[::40])
    ds = prepare_data(DataConfig(tokenizer="byte", cache_dir=str(tmp_path)))
    assert ds.meta["num_files"] == len(full[::40]) and ds.meta["paths"] == ["<stdlib>"]
    assert len(ds.train) > 10_000


# ---------------------------------------------------------------------------------------------------------------
# Loader


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> np.ndarray:
    path = tmp_path_factory.mktemp("tok") / "train.bin"
    np.random.default_rng(6).integers(0, 50_000, 20_000).astype(np.uint16).tofile(path)
    return np.memmap(path, dtype=np.uint16, mode="r")


def _take(loader: BatchLoader, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(np.asarray(b["inputs"]), np.asarray(b["targets"])) for b in (next(loader) for _ in range(n))]


def test_loader_batches_are_shifted_windows_and_deterministic(token_file):
    T, B = 32, 8
    with BatchLoader(token_file, seq_len=T, global_batch=B, seed=3) as loader:
        got = _take(loader, 6)
        assert loader.state() == {"step": 6, "seed": 3}
    toks = np.asarray(token_file).astype(np.int32)
    for step, (x, y) in enumerate(got):
        assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == np.int32
        starts = loader_mod.window_starts(len(toks), T, B, 3, step)
        np.testing.assert_array_equal(x, toks[starts[:, None] + np.arange(T)])
        np.testing.assert_array_equal(y, toks[starts[:, None] + np.arange(1, T + 1)])
    with BatchLoader(token_file, seq_len=T, global_batch=B, seed=3, prefetch=0) as same:
        for a, b in zip(got, _take(same, 6)):
            np.testing.assert_array_equal(a[0], b[0])
    with BatchLoader(token_file, seq_len=T, global_batch=B, seed=4) as other:
        assert not np.array_equal(got[0][0], _take(other, 1)[0][0])
    # Windows reach the last token but never past it.
    starts = np.concatenate([loader_mod.window_starts(100, 98, 64, 0, s) for s in range(50)])
    assert starts.min() == 0 and starts.max() == 1


def test_loader_resume_matches_uninterrupted(token_file):
    kw = dict(seq_len=16, global_batch=4, seed=0, prefetch=3)
    with BatchLoader(token_file, **kw) as straight:
        full = _take(straight, 10)
    with BatchLoader(token_file, **kw) as first:
        _take(first, 4)
        state = json.loads(json.dumps(first.state()))
    with BatchLoader(token_file, **kw) as resumed:
        _take(resumed, 7)  # wander off, then restore
        resumed.restore(state)
        rest = _take(resumed, 6)
    with BatchLoader(token_file, step=state["step"], **kw) as constructed:
        rest2 = _take(constructed, 6)
    for (x, y), (x2, y2), (x3, _) in zip(full[4:], rest, rest2):
        np.testing.assert_array_equal(x, x2)
        np.testing.assert_array_equal(y, y2)
        np.testing.assert_array_equal(x, x3)
    with BatchLoader(token_file, **kw) as wrong_seed, pytest.raises(DataError, match="seed"):
        wrong_seed.restore({"step": 1, "seed": 9})


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("grain-thread-prefetch")]


def test_loader_prefetch_thread_stops_and_errors_propagate(token_file, monkeypatch):
    baseline = len(_prefetch_threads())
    loader = BatchLoader(token_file, seq_len=8, global_batch=2, seed=0, prefetch=2)
    next(loader)
    assert len(_prefetch_threads()) == baseline + 1
    loader.close()
    loader.close()
    assert len(_prefetch_threads()) == baseline
    with pytest.raises(RuntimeError, match="closed"):
        next(loader)

    real = loader_mod.window_starts

    def failing(num_tokens, seq_len, batch, seed, step):
        if step == 3:
            raise OSError("disk went away at step 3")
        return real(num_tokens, seq_len, batch, seed, step)

    monkeypatch.setattr(loader_mod, "window_starts", failing)
    with BatchLoader(token_file, seq_len=8, global_batch=2, seed=0) as bad:
        _take(bad, 3)
        with pytest.raises(OSError, match="step 3"):
            next(bad)


def test_split_too_small_names_the_split(tmp_path):
    (tmp_path / "in.txt").write_text(random_text(np.random.default_rng(7), 60))
    ds = prepare_data(DataConfig(paths=(str(tmp_path / "in.txt"),), tokenizer="char", val_fraction=0.1,
                                 cache_dir=str(tmp_path / "cache")))
    n_val = len(ds.val)
    with pytest.raises(DataError, match=rf"'val'.* holds {n_val} tokens.*seq_len=64"):
        BatchLoader(ds.val, seq_len=64, global_batch=2, seed=0)
    with pytest.raises(DataError, match=rf"'val'.* holds {n_val} tokens"):
        eval_batches(ds.val, seq_len=64, batch=2, num_batches=1, seed=0, sharding=None)
    BatchLoader(ds.train, seq_len=8, global_batch=2, seed=0).close()


def test_eval_batches_fixed_and_cover_the_split(token_file):
    a = eval_batches(token_file, seq_len=16, batch=4, num_batches=5, seed=1, sharding=None)
    b = eval_batches(token_file, seq_len=16, batch=4, num_batches=5, seed=1, sharding=None)
    assert len(a) == 5 and a[0]["inputs"].shape == (4, 16)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x["inputs"]), np.asarray(y["inputs"]))
    toks = np.asarray(token_file).astype(np.int32)
    firsts = sorted(int(np.flatnonzero((toks[:-16] == np.asarray(x["inputs"])[r, 0]))[0]) for x in a
                    for r in range(4))
    assert firsts[0] < 1000 and firsts[-1] > len(toks) - 2000  # spread over the whole split
    np.testing.assert_array_equal(np.asarray(a[0]["targets"])[:, :-1], np.asarray(a[0]["inputs"])[:, 1:])


# ---------------------------------------------------------------------------------------------------------------
# Sharded and multi-process assembly (subprocesses: the suite itself runs on one CPU device)

_SHARDED = """
import sys, numpy as np, jax
from jax.sharding import NamedSharding, PartitionSpec as P
from msjax.data import BatchLoader, eval_batches
toks = np.memmap(sys.argv[1], dtype=np.uint16, mode="r")
mesh = jax.make_mesh((4, 2), ("data", "sequence"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
kw = dict(seq_len=16, global_batch=8, seed=5)
with BatchLoader(toks, **kw) as ref:
    expect = [(np.asarray(b["inputs"]), np.asarray(b["targets"])) for b in (next(ref) for _ in range(3))]
for spec in (P("data"), P("data", "sequence"), P(None, "data"), P(("data", "sequence"))):
    sharding = NamedSharding(mesh, spec)
    with BatchLoader(toks, sharding=sharding, **kw) as loader:
        for x, y in expect:
            b = next(loader)
            assert b["inputs"].sharding == sharding, (b["inputs"].sharding, spec)
            np.testing.assert_array_equal(np.asarray(b["inputs"]), x)
            np.testing.assert_array_equal(np.asarray(b["targets"]), y)
    e1 = eval_batches(toks, seq_len=16, batch=8, num_batches=2, seed=0, sharding=sharding)
    e0 = eval_batches(toks, seq_len=16, batch=8, num_batches=2, seed=0, sharding=None)
    np.testing.assert_array_equal(np.asarray(e1[1]["targets"]), np.asarray(e0[1]["targets"]))
print("OK", jax.device_count())
"""

_MULTIPROCESS = """
import sys, numpy as np, jax
pid, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
from msjax.data import BatchLoader, loader
toks = np.memmap(path, dtype=np.uint16, mode="r")
mesh = jax.make_mesh((2, 2), ("data", "sequence"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
T, B = 16, 8
ref = np.asarray(toks).astype(np.int32)
for spec in (P("data"), P(None, "data"), P("data", "sequence")):
    sharding = NamedSharding(mesh, spec)
    rows, cols = loader._local_indices(sharding, (B, T))
    assert len(rows) * len(cols) < B * T, (spec, rows, cols)  # each process really holds only part of it
    with BatchLoader(toks, seq_len=T, global_batch=B, seed=1, sharding=sharding) as it:
        for step in range(2):
            b = next(it)
            x = multihost_utils.process_allgather(b["inputs"], tiled=True)
            s = loader.window_starts(len(ref), T, B, 1, step)
            np.testing.assert_array_equal(x, ref[s[:, None] + np.arange(T)])
print("OK", pid, jax.process_count(), jax.device_count())
"""


def _env(devices: int) -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def test_sharded_batches_equal_single_device_batches(token_file):
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_SHARDED), token_file.filename],
                         env=_env(8), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK 8" in out.stdout


def test_multiprocess_global_batch_equals_reference(token_file):
    for stdout in run_ranks(_MULTIPROCESS, [token_file.filename], _env(2), REPO):
        assert "OK" in stdout and " 2 4" in stdout


def test_row_shares_read_every_document_once_in_order(tmp_path):
    """`read_pieces(rows=(a, b))` over consecutive shares of a file, cut at random byte offsets (in a line, in a
    multi-byte character, on a row group's start), gives every document of the file exactly once and in order:
    what a multi-process build relies on (msjax.data.tokens._build_shared)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from msjax.data.corpus import read_documents, read_pieces

    rng = np.random.default_rng(7)
    words = ["naïve", "日本", "king", "\n", "x" * 30, "é"]
    docs = [" ".join(rng.choice(words, int(rng.integers(1, 40))).tolist()) for _ in range(60)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs),
                                      encoding="utf-8")
    pq.write_table(pa.table({"text": docs}), tmp_path / "b.parquet", row_group_size=7)
    (tmp_path / "c.txt").write_text(docs[0], encoding="utf-8")
    for name in ("a.jsonl", "b.parquet", "c.txt"):
        path = tmp_path / name
        whole = list(read_documents(path))
        size = path.stat().st_size
        for shares in (1, 2, 3, 7):
            cuts = [0, *sorted(rng.integers(1, size, shares - 1).tolist()), size]
            got = []
            for a, b in zip(cuts, cuts[1:]):
                parts = []
                for piece in read_pieces(path, rows=(a, b)):
                    parts.append(piece.text)
                    if piece.end:
                        got.append("".join(parts))
                        parts = []
            assert got == whole, (name, cuts)
