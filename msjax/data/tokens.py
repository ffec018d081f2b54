"""Token cache: the corpus tokenized once into memory-mapped files.

The cache is local (the loader memory-maps it) whatever the corpus' storage: a corpus on object storage is
streamed from there once, tokenized, and never read again while its objects keep their versions (ETags).

Layout: `<cache_dir>/<fingerprint>/{train.bin, val.bin, meta.json, tokenizer.json}`. The .bin files are flat
little-endian token ids (uint16 when the vocabulary fits, else uint32), documents concatenated with the
tokenizer's `eot_id` after each (nanoGPT's `train.bin`/`val.bin`). The fingerprint hashes everything the tokens
depend on (resolved file paths, sizes, mtimes; tokenizer kind, vocabulary size and file; val_fraction;
text_field; on_decode_error; `FORMAT_VERSION`), so changing any input builds a new cache beside the old one.

Atomicity: a build writes into `<fingerprint>.tmp-<random>/` and renames the whole directory onto
`<fingerprint>/` at the end. rename(2) of a directory onto a non-empty one fails, so the first of two concurrent
builders wins and the other discards its copy; a build killed before the rename leaves only a temp directory,
which is never read (and is removed after `_STALE_TMP_S`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import shutil
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Iterable, Iterator

import numpy as np

from msjax import paths
from msjax.data.corpus import (DataError, Piece, SourceFile, corpus_sources, read_pieces, split_by_file,
                                split_text, utf8_ok)
from msjax.data.tokenizer import TOKENIZER_FILE, Tokenizer, build_tokenizer, load_tokenizer
from msjax.runtime import cache_home

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
META_FILE = "meta.json"
_STALE_TMP_S = 24 * 3600
# Characters of text handed to one encode_batch call, in sub-pieces of `_ENCODE_PIECE_CHARS` (16 of them, enough to
# keep 16 cores busy). Measured: HF `tokenizers` holds ~230 bytes per token of Encoding objects until a call returns
# (6.7M chars of Shakespeare: 444 MB), so a call's text is kept to 256K characters (~18 MB): tokenizing a 48 MiB
# one-line corpus with BPE grew the resident set by 46 MiB, against 132 MiB with 1M-character calls, in the same
# time (46.5 against 50.3 s on 2 cores).
_ENCODE_CHUNK_CHARS = 1 << 18
_ENCODE_PIECE_CHARS = 1 << 14
# Strings handed to the BPE trainer: its iterator buffers hundreds of items, so they must be small (measured:
# 4 MiB strings cost 270 MB on 6.7 MB of text, 64 KiB strings 39 MB).
_FIT_PIECE_CHARS = 1 << 16
# Corpora at least this large show a progress bar while they are read (when stderr is a terminal).
_PROGRESS_MIN_BYTES = 64 << 20


@dataclass
class Datasets:
    """A tokenized corpus.

    tokenizer: the tokenizer that produced the ids (save it next to a run to sample from it).
    train, val: 1-D token ids, np.memmap (uint16 or uint32), read-only.
    meta: contents of meta.json (token and document counts, split mode, tokenizer name, fingerprint, ...) plus
      `cache_path` (the cache directory) and `cache_hit` (True when nothing was tokenized this time).
    """

    tokenizer: Tokenizer
    train: np.ndarray
    val: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)


def fingerprint(data_cfg, sources: list[SourceFile]) -> str:
    """`<tokenizer>-<16 hex digits>`: a SHA-256 over the inputs the cached tokens depend on."""
    h = hashlib.sha256()

    def add(*parts: Any) -> None:
        h.update(json.dumps(parts, sort_keys=True).encode("utf-8"))
        h.update(b"\0")

    add("msjax-tokens", FORMAT_VERSION)
    add(data_cfg.tokenizer, data_cfg.bpe_vocab_size if data_cfg.tokenizer == "bpe" else 0)
    if data_cfg.tokenizer_path:
        # The file's bytes, not its mtime: copying the same tokenizer elsewhere keeps the cache.
        tp = Path(data_cfg.tokenizer_path).expanduser()
        add("tokenizer_file", hashlib.sha256(tp.read_bytes()).hexdigest() if tp.is_file() else str(tp))
    add(float(data_cfg.val_fraction), data_cfg.text_field, data_cfg.on_decode_error)
    for s in sources:
        # An object's version (ETag, generation) stands where a file's mtime does; local fingerprints are unchanged.
        add(str(s.path), s.rel, s.size, s.mtime_ns, *([s.version] if s.version else []))
    kind = "hf" if data_cfg.tokenizer_path else data_cfg.tokenizer
    if kind == "bpe":
        kind = f"bpe{data_cfg.bpe_vocab_size}"
    return f"{kind}-{h.hexdigest()[:16]}"


def prepare_data(data_cfg) -> Datasets:
    """Tokenizes the corpus of `data_cfg` into the token cache (once), and opens the cached splits.

    Runs on every host/process; each reads its input files at most once, and not at all on a cache hit. In a
    multi-process run (jax.distributed initialised) every process must call it at the same point: unless all of
    them have the cache, they build it together, each reading only its own rows of the corpus (a contiguous
    1/process_count of its bytes, aligned to documents, `_build_shared`), and exchange the token ids, so every
    process's cache is byte for byte what one process would write. Empty `data.paths` means the standard-library
    corpus. The split is by file (`corpus.split_by_file`) or, when that leaves a split empty, by position: the
    last `val_fraction` of the token stream is validation.

    Args:
      data_cfg: `DataConfig`.
    Returns:
      Datasets with memory-mapped train/val token arrays.
    Raises:
      DataError: bad paths, undecodable files, missing fields/columns, a bad tokenizer file (see
        `corpus.read_documents`, `tokenizer.build_tokenizer`), or a corpus that yields no tokens.
    """
    sources = corpus_sources(data_cfg.paths)
    try:
        cache_root = (paths.local(data_cfg.cache_dir, "data.cache_dir") if data_cfg.cache_dir
                      else cache_home() / "tokens")
    except paths.PathError as e:
        raise DataError(str(e)) from None
    data_cfg = _local_tokenizer_file(data_cfg, cache_root)
    fp = fingerprint(data_cfg, sources)
    final = cache_root / fp
    opened = _open_cache(final, cache_hit=True)
    group = _Group.current(fp)
    # Several processes build together (each reading its own rows) unless every one of them has the cache; every
    # process takes part in this agreement, hit or not.
    hits = [opened is not None] if group is None else group.gather(b"1" if opened is not None else b"", "hit")
    if opened is not None and all(hits):
        return opened
    try:
        cache_root.mkdir(parents=True, exist_ok=True)
        tmp = cache_root / f"{fp}.tmp-{uuid.uuid4().hex[:12]}"
        tmp.mkdir()
    except OSError as e:
        raise DataError(f"data.cache_dir={str(cache_root)!r} is not writable ({e.strerror}); set data.cache_dir "
                        "to a writable directory") from None
    _remove_stale_tmp(cache_root)
    try:
        with _sigterm_as_interrupt():
            t0 = time.perf_counter()
            meta = _build(data_cfg, sources, tmp) if group is None else _build_shared(data_cfg, sources, tmp, group)
            meta.update(fingerprint=fp, build_seconds=round(time.perf_counter() - t0, 3))
            (tmp / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True))
            _publish(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    opened = _open_cache(final, cache_hit=False)
    if opened is None:
        raise DataError(f"token cache {final} was written but does not read back; is {cache_root} shared with a "
                        "process that deletes it?")
    m = opened.meta
    log.info("tokenized %d files in %.1f s: %d train + %d val tokens (%s, %s split) -> %s", m["num_files"],
             m["build_seconds"], m["train_tokens"], m["val_tokens"], m["tokenizer"], m["split"], final)
    return opened


def _local_tokenizer_file(data_cfg, cache_root: Path):
    """`data_cfg` with a `gs://` / `s3://` `tokenizer_path` (a tokenizer.json, or a directory holding one)
    replaced by a local copy under the token cache (msjax.paths.local_copy: refetched when the object changed),
    so the tokenizer is loaded and fingerprinted from its bytes as a local file is.

    Raises:
      DataError: the URL is not supported, or nothing can be read there (names it and the store's error).
    """
    raw = data_cfg.tokenizer_path
    if not raw or paths.scheme(raw) is None:
        return data_cfg
    try:
        url = paths.check(raw, "data.tokenizer_path")
    except paths.PathError as e:
        raise DataError(str(e)) from None
    if not paths.is_remote(url):  # file://
        return dataclasses.replace(data_cfg, tokenizer_path=url)
    try:
        local = paths.local_copy(url, cache_root / "tokenizers")
    except OSError as e:
        if isinstance(e, FileNotFoundError):
            raise DataError(f"data.tokenizer_path={raw!r} does not exist") from None
        raise DataError(f"data.tokenizer_path={raw!r} cannot be copied to {cache_root} ({e})") from None
    except Exception as e:  # noqa: BLE001 - refused connection, denied: one line naming the URL
        raise DataError(f"data.tokenizer_path={raw!r} cannot be read: {type(e).__name__}: {e}") from None
    if local.is_dir():
        local = local / TOKENIZER_FILE
    return dataclasses.replace(data_cfg, tokenizer_path=str(local))


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """While building, SIGTERM (what `kill` and job schedulers send) raises KeyboardInterrupt like Ctrl-C does, so
    the build's `finally` removes its temporary directory. Main thread only (Python delivers signals there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum} while tokenizing")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _publish(tmp: Path, final: Path) -> None:
    """Moves a finished build into place; if another process got there first, keeps theirs."""
    try:
        os.rename(tmp, final)
    except OSError:
        if not (final / META_FILE).is_file():
            raise


def _remove_stale_tmp(cache_root: Path) -> None:
    now = time.time()
    for p in cache_root.glob("*.tmp-*"):
        try:
            if now - p.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def _open_cache(path: Path, cache_hit: bool) -> Datasets | None:
    meta_path = path / META_FILE
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        dtype = np.dtype(meta["dtype"])
        sizes_ok = all((path / f"{s}.bin").stat().st_size == meta[f"{s}_tokens"] * dtype.itemsize
                       for s in ("train", "val"))
        ok = sizes_ok and meta.get("format_version") == FORMAT_VERSION
    except (OSError, ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        # A complete-looking directory that does not match its own meta.json: someone edited it. Move it aside
        # (never delete what we did not write this run) so a fresh build can take its name.
        aside = path.with_name(f"{path.name}.bad-{uuid.uuid4().hex[:8]}")
        log.warning("token cache %s is inconsistent with its %s; moving it to %s and rebuilding", path, META_FILE,
                    aside)
        try:
            os.rename(path, aside)
        except OSError:
            pass
        return None
    tokenizer = load_tokenizer(path / TOKENIZER_FILE)
    meta.update(cache_path=str(path), cache_hit=cache_hit)
    return Datasets(tokenizer=tokenizer, train=_memmap(path / "train.bin", dtype),
                    val=_memmap(path / "val.bin", dtype), meta=meta)


def _memmap(path: Path, dtype: np.dtype) -> np.ndarray:
    if path.stat().st_size == 0:  # mmap(2) refuses empty files; the loader reports the empty split by name
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def _pieces(sources: Iterable[SourceFile], data_cfg, progress: "_Progress | None" = None) -> Iterator[Piece]:
    for s in sources:
        last = 0
        for piece in read_pieces(s.path, data_cfg.text_field, data_cfg.on_decode_error):
            if progress is not None:
                progress.update(piece.offset - last)
                last = piece.offset
            yield piece
        if progress is not None:
            progress.update(s.size - last)


class _Progress:
    """Bytes of corpus read, on a tqdm bar (stderr) once a corpus is large enough for it to matter, and in the
    log when the pass ends."""

    def __init__(self, what: str, total: int):
        from tqdm import tqdm

        self.what = what
        self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=what, leave=False,
                        disable=True if total < _PROGRESS_MIN_BYTES else None)

    def update(self, n: int) -> None:
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


def _needs_fitting(data_cfg) -> bool:
    return not data_cfg.tokenizer_path and data_cfg.tokenizer in ("bpe", "char")


def _chunks(pieces: Iterable[Piece]) -> Iterator[list[Piece]]:
    chunk, chars = [], 0
    for piece in _subpieces(pieces):
        chunk.append(piece)
        chars += len(piece.text)
        if chars >= _ENCODE_CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _subpieces(pieces: Iterable[Piece]) -> Iterator[Piece]:
    for piece in pieces:
        if len(piece.text) <= _ENCODE_PIECE_CHARS:
            yield piece
            continue
        parts = list(split_text(piece.text, _ENCODE_PIECE_CHARS))
        for i, part in enumerate(parts):
            yield Piece(part, piece.end and i == len(parts) - 1, piece.offset)


def _write_tokens(tokenizer: Tokenizer, pieces: Iterable[Piece], path: Path, dtype: np.dtype) -> tuple[int, int]:
    """Encodes `pieces` (eot after each document's last piece) into the flat file `path`. Returns (tokens,
    documents)."""
    eot = None if tokenizer.eot_id is None else np.array([tokenizer.eot_id], dtype)
    n_tokens = n_docs = 0
    with open(path, "wb") as f:
        for chunk in _chunks(pieces):
            for piece, ids in zip(chunk, tokenizer.encode_batch([p.text for p in chunk])):
                parts = [ids.astype(dtype)] if eot is None or not piece.end else [ids.astype(dtype), eot]
                for p in parts:
                    f.write(p.tobytes())
                    n_tokens += p.size
                n_docs += piece.end
    return n_tokens, n_docs


def _fit_texts(sources: Iterable[SourceFile], data_cfg, progress: _Progress, byte_budget: int | None
               ) -> Iterator[str]:
    """The text of `sources` for fitting a tokenizer; with `byte_budget`, only about the first that many bytes of
    input (the last piece cut in proportion: exact for one-piece ASCII files, as tinyshakespeare)."""
    used = 0
    for s in sources:
        last = 0
        for piece in read_pieces(s.path, data_cfg.text_field, data_cfg.on_decode_error):
            n, last = piece.offset - last, piece.offset
            progress.update(n)
            if byte_budget is not None and used + n >= byte_budget:
                yield from split_text(piece.text[:int(len(piece.text) * (byte_budget - used) / max(n, 1))],
                                      _FIT_PIECE_CHARS)
                return
            used += n
            yield from split_text(piece.text, _FIT_PIECE_CHARS)


def _fit_tokenizer(data_cfg, sources: list[SourceFile], split, out: Path, skipped: frozenset = frozenset()
                   ) -> Tokenizer:
    """Fits the char or bpe tokenizer on the text a single process fits it on (all of it for char; the train
    files, or about the first (1 - val_fraction) of the bytes in a position split, for bpe), leaving out the
    files in `skipped` (undecodable, with on_decode_error='skip')."""
    train_src = split[0] if split is not None else sources
    if data_cfg.tokenizer == "char":
        # The char vocabulary must cover every character we encode (nanoGPT builds it from all the text).
        fit_src, budget = sources, None
    elif split is not None:
        fit_src, budget = train_src, None
    else:
        # A position split: fit on about the first (1 - val_fraction) of the text, so that validation text
        # never shapes the vocabulary (measured in bytes of the file, cut at a piece boundary).
        fit_src, budget = sources, int(sum(s.size for s in sources) * (1.0 - data_cfg.val_fraction))
    fit_src = [s for s in fit_src if str(s.path) not in skipped]
    bar = _Progress("fitting tokenizer", sum(s.size for s in fit_src))
    try:
        return build_tokenizer(data_cfg, _fit_texts(fit_src, data_cfg, bar, budget), out)
    finally:
        bar.close()


def _build(data_cfg, sources: list[SourceFile], out: Path) -> dict[str, Any]:
    """Tokenizes `sources` into `out`. Streams: every pass reads the files piece by piece (`corpus.read_pieces`),
    so memory stays bounded by the piece size whatever the corpus' size or line length; a tokenizer that needs
    fitting costs one more read of the text."""
    split = split_by_file(sources, data_cfg.val_fraction)
    mode = "file" if split is not None else "position"
    total = sum(s.size for s in sources)
    train_src, val_src = (split[0], split[1]) if split else (sources, [])
    if _needs_fitting(data_cfg):
        tokenizer = _fit_tokenizer(data_cfg, sources, split, out)
    else:
        tokenizer = build_tokenizer(data_cfg, (), out)
    tokenizer.save(out / TOKENIZER_FILE)
    dtype = token_dtype(tokenizer.vocab_size)
    bar = _Progress("tokenizing", total)
    try:
        n_train, d_train = _write_tokens(tokenizer, _pieces(train_src, data_cfg, bar), out / "train.bin", dtype)
        n_val, d_val = _write_tokens(tokenizer, _pieces(val_src, data_cfg, bar), out / "val.bin", dtype)
    finally:
        bar.close()
    if mode == "position":
        n_train, n_val = _split_tail(out / "train.bin", out / "val.bin", n_train, data_cfg.val_fraction, dtype)
    if n_train + n_val == 0:
        raise DataError(f"data.paths={list(data_cfg.paths)!r}: the corpus holds no text (all documents empty "
                        "or skipped)")
    return _meta(data_cfg, tokenizer, dtype, mode, sources, split, (n_train, d_train, n_val, d_val), total)


def _meta(data_cfg, tokenizer: Tokenizer, dtype: np.dtype, mode: str, sources: list[SourceFile], split,
          counts: tuple[int, int, int, int], total: int, shared_by: int = 1) -> dict[str, Any]:
    """meta.json of a build; counts: (train tokens, train documents, val tokens, val documents)."""
    n_train, d_train, n_val, d_val = counts
    return {
        "format_version": FORMAT_VERSION,
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "eot_id": tokenizer.eot_id,
        "dtype": dtype.name,
        "split": mode,
        "val_fraction": data_cfg.val_fraction,
        "num_files": len(sources),
        "train_files": len(split[0]) if split else len(sources),
        "val_files": len(split[1]) if split else 0,
        "train_documents": d_train,
        "val_documents": d_val,
        "train_tokens": n_train,
        "val_tokens": n_val,
        "corpus_bytes": total,
        "paths": list(data_cfg.paths) or ["<stdlib>"],
        "processes": shared_by,  # how many processes shared the reading (each its own rows)
    }


# ---- a build shared by the processes of a multi-process run ------------------------------------------------------

# The longest wait for the other processes at one point of a shared build (seconds): a process may tokenize its
# share for hours on a large corpus, so the bound is generous; the coordination service's error names the point.
_SHARE_WAIT_S = 12 * 3600
# Bytes of token ids each process sends per exchange round (one all-gather of this many bytes per process).
_EXCHANGE_BYTES = 64 << 20
_rounds = itertools.count()  # names of the coordination barriers: unique within a jax.distributed session


class _Group:
    """The processes of a multi-process run (jax.distributed), sharing one build: each reads its own share of
    the corpus, and the token ids are exchanged so that every process ends with the same cache.

    Every method is collective: each process calls it at the same point. Before every all-gather the processes
    meet at a coordination-service barrier (a long, named wait) so that none enters the collective while another
    still reads; a CPU collective gives up on a peer that is late by more than its own short timeout."""

    def __init__(self, fingerprint: str):
        import jax

        self.index, self.count, self.fp = jax.process_index(), jax.process_count(), fingerprint

    @staticmethod
    def current(fingerprint: str) -> "_Group | None":
        """The group of a multi-process run, or None in a single process (jax.distributed not initialised, or one
        process)."""
        import jax

        if not jax.distributed.is_initialized() or jax.process_count() == 1:
            return None
        return _Group(fingerprint)

    def _meet(self, what: str) -> None:
        from msjax.compat import jax_distributed  # jax has no public barrier outside collectives

        jax_distributed.global_state.client.wait_at_barrier(f"msjax_tokens_{self.fp}_{next(_rounds)}_{what}",
                                                            int(_SHARE_WAIT_S * 1000))

    def gather(self, data: bytes, what: str) -> list[bytes]:
        """Every process's `data`, in process order."""
        import numpy as np
        from jax.experimental import multihost_utils

        self._meet(what)
        sizes = np.asarray(multihost_utils.process_allgather(np.array([len(data)], np.int32))).reshape(-1)
        width = max(int(sizes.max()), 1)
        buf = np.zeros(width, np.uint8)
        buf[:len(data)] = np.frombuffer(data, np.uint8)
        got = np.asarray(multihost_utils.process_allgather(buf)).reshape(self.count, width)
        return [got[q, :int(sizes[q])].tobytes() for q in range(self.count)]

    def agree(self, error: DataError | None, what: str) -> None:
        """Raises on every process when `error` is set on any (the first one's message, naming its process)."""
        messages = self.gather(str(error).encode() if error is not None else b"", what)
        for q, m in enumerate(messages):
            if m:
                if error is not None and q == self.index:
                    raise error
                raise DataError(f"process {q} of the shared tokenization failed: {m.decode()}")

    def exchange(self, part: Path, out: Path) -> int:
        """Writes every process's `part` (raw bytes), in process order, into `out`; returns this process's byte
        offset in it. Rounds of at most `_EXCHANGE_BYTES` per process, so memory stays bounded."""
        import numpy as np
        from jax.experimental import multihost_utils

        sizes = [int.from_bytes(b, "little") for b in self.gather(part.stat().st_size.to_bytes(8, "little"),
                                                                    f"{out.stem}_sizes")]
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        rounds = -(-max(sizes) // _EXCHANGE_BYTES)
        with open(part, "rb") as src, open(out, "wb") as dst:
            dst.truncate(int(starts[-1]))
            for r in range(rounds):
                mine = np.zeros(_EXCHANGE_BYTES, np.uint8)
                chunk = src.read(_EXCHANGE_BYTES)
                mine[:len(chunk)] = np.frombuffer(chunk, np.uint8)
                self._meet(f"{out.stem}_round{r}")
                got = np.asarray(multihost_utils.process_allgather(mine)).reshape(self.count, _EXCHANGE_BYTES)
                for q in range(self.count):
                    valid = min(max(sizes[q] - r * _EXCHANGE_BYTES, 0), _EXCHANGE_BYTES)
                    if valid:
                        dst.seek(int(starts[q]) + r * _EXCHANGE_BYTES)
                        dst.write(got[q, :valid].tobytes())
        return int(starts[self.index])


def _share(files: list[SourceFile], index: int, count: int) -> dict[Path | str, tuple[int, int]]:
    """Process `index` of `count`'s rows: with the files laid end to end in order, the byte range
    [index * total / count, (index + 1) * total / count); per file that range intersects, the file offsets
    (a, b) of the rows it owns (`corpus.read_pieces(rows=...)`: those that start there)."""
    total = sum(s.size for s in files)
    lo, hi = total * index // count, total * (index + 1) // count
    out, base = {}, 0
    for s in files:
        a, b = max(lo - base, 0), min(hi - base, s.size)
        if a < b:
            out[s.path] = (a, b)
        base += s.size
    return out


def _build_shared(data_cfg, sources: list[SourceFile], out: Path, group: _Group) -> dict[str, Any]:
    """`_build` shared by the processes of `group`: the same files, split and tokenizer, but each process reads
    only its own rows (`_share`), tokenizes them into part files, and the parts are exchanged so that every
    process writes the same train.bin / val.bin as a single process would, byte for byte.

    A tokenizer fitted on the corpus: `char` from the union of every process's characters (each reads its own
    rows); `bpe` by process 0 alone, on exactly the text a single process fits on (HF's BPE trainer cannot merge
    partial fits), sent to the others. Every error on any process is raised on all of them."""
    split = split_by_file(sources, data_cfg.val_fraction)
    mode = "file" if split is not None else "position"
    train_src, val_src = (split[0], split[1]) if split else (sources, [])
    rows = _share(train_src + val_src, group.index, group.count)
    error: DataError | None = None
    bad: set[str] = set()
    if data_cfg.on_decode_error == "skip":  # a file is skipped whole when any process finds bad bytes in its rows
        try:
            bad = {str(p) for p, r in rows.items() if PurePosixPath(str(p)).suffix != ".parquet"
                   and not utf8_ok(p, r)}
        except DataError as e:
            error = e
        bad = set().union(*(json.loads(b) for b in group.gather(json.dumps(sorted(bad)).encode(), "utf8")))
    train_src = [s for s in train_src if str(s.path) not in bad]
    val_src = [s for s in val_src if str(s.path) not in bad]
    mine = [s for s in train_src + val_src if s.path in rows]
    own = dataclasses.replace(data_cfg, on_decode_error="error")

    def own_pieces(files: list[SourceFile], progress: _Progress | None = None) -> Iterator[Piece]:
        for s in files:
            if s.path in rows:
                last = 0
                for piece in read_pieces(s.path, own.text_field, "error", rows=rows[s.path]):
                    if progress is not None:
                        progress.update(max(piece.offset - last, 0))
                        last = piece.offset
                    yield piece

    tokenizer, encoded = None, b""
    if error is None:
        try:
            if _needs_fitting(data_cfg) and data_cfg.tokenizer == "char":
                chars: set[str] = set()
                for piece in own_pieces(mine):
                    chars.update(piece.text)
                encoded = "".join(sorted(chars)).encode("utf-8", "surrogatepass")
            elif _needs_fitting(data_cfg) and group.index == 0:
                tokenizer = _fit_tokenizer(data_cfg, sources, split, out, frozenset(bad))
        except DataError as e:
            error = e
    group.agree(error, "fit")
    if _needs_fitting(data_cfg) and data_cfg.tokenizer == "char":
        every = "".join(b.decode("utf-8", "surrogatepass") for b in group.gather(encoded, "chars"))
        tokenizer = build_tokenizer(data_cfg, [every], out)  # sorted(set(...)): the single process' vocabulary
    elif _needs_fitting(data_cfg):
        if group.index == 0:
            tokenizer.save(out / TOKENIZER_FILE)
        fitted = group.gather((out / TOKENIZER_FILE).read_bytes() if group.index == 0 else b"", "bpe")[0]
        (out / TOKENIZER_FILE).write_bytes(fitted)
        tokenizer = load_tokenizer(out / TOKENIZER_FILE)
    else:
        tokenizer = build_tokenizer(data_cfg, (), out)
    tokenizer.save(out / TOKENIZER_FILE)
    dtype = token_dtype(tokenizer.vocab_size)
    counts = [0, 0, 0, 0]
    bar = _Progress("tokenizing (this process' share)", sum(b - a for a, b in rows.values()))
    try:
        counts[0], counts[1] = _write_tokens(tokenizer, own_pieces(train_src, bar), out / "part-train.bin", dtype)
        counts[2], counts[3] = _write_tokens(tokenizer, own_pieces(val_src, bar), out / "part-val.bin", dtype)
    except DataError as e:
        error = e
    finally:
        bar.close()
    group.agree(error, "tokenize")
    totals = [sum(c) for c in zip(*(json.loads(b) for b in group.gather(json.dumps(counts).encode(), "counts")))]
    n_train, d_train, n_val, d_val = totals
    for name in ("train", "val"):
        group.exchange(out / f"part-{name}.bin", out / f"{name}.bin")
        (out / f"part-{name}.bin").unlink()
    if mode == "position":
        n_train, n_val = _split_tail(out / "train.bin", out / "val.bin", n_train, data_cfg.val_fraction, dtype)
    if n_train + n_val == 0:
        raise DataError(f"data.paths={list(data_cfg.paths)!r}: the corpus holds no text (all documents empty "
                        "or skipped)")
    return _meta(data_cfg, tokenizer, dtype, mode, sources, split, (n_train, d_train, n_val, d_val),
                 sum(s.size for s in sources), shared_by=group.count)


def _split_tail(train: Path, val: Path, n: int, val_fraction: float, dtype: np.dtype) -> tuple[int, int]:
    """Moves the last `val_fraction` of the token file `train` into `val`; n_train = int(n * (1 - val_fraction))
    as in nanoGPT's prepare.py."""
    n_train = int(n * (1.0 - val_fraction))
    with open(train, "rb") as src, open(val, "wb") as dst:
        src.seek(n_train * dtype.itemsize)
        shutil.copyfileobj(src, dst, 16 << 20)
    os.truncate(train, n_train * dtype.itemsize)
    return n_train, n - n_train
