"""Corpus: which files make up the text, how documents are read from them, and the train/validation split.

A corpus is a list of files. `.txt` and `.py` files are one document each; `.jsonl` files hold one document per
line (field `text_field`); `.parquet` files one per row (column `text_field`). Nothing here writes to an input
file: files are opened read-only and read once. Files may be local or in object storage (`gs://bucket/prefix`,
`s3://bucket/prefix`, through msjax.paths): they are streamed in ranges (a parquet file one row group at a time),
never downloaded whole.

The train/validation split is by file (Chinchilla/Pile style: no document straddles the two splits): a file goes
to validation when a stable hash of its path relative to its root is below `val_fraction`. The hash is SHA-256,
so the split is the same on every host and in every process. When that leaves a split empty (one file, as with
tinyshakespeare) the caller splits by position instead: the last `val_fraction` of the token stream is validation,
as nanoGPT's `data/shakespeare_char/prepare.py` does.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
import sysconfig
import warnings
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Iterator, Literal, NamedTuple, Sequence

from msjax import paths

# Extensions a data path (or a directory under one) may hold. `.py` is read too, but only the standard-library
# corpus uses it: a user's directory of code is more likely a mistake than a corpus.
TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
READABLE_SUFFIXES = TEXT_SUFFIXES + (".py",)
# Standard-library directories left out of the default corpus: test suites (~19 MB of fixtures, some of them
# deliberately undecodable), IDLE, and third-party packages that differ between machines.
STDLIB_EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "__pycache__"})


class DataError(ValueError):
    """Bad input data or data configuration; the message names the file, path or key at fault."""


class DataWarning(UserWarning):
    """Input that was skipped (e.g. an undecodable file with `on_decode_error='skip'`)."""


@dataclass(frozen=True)
class SourceFile:
    """One input file and the root it was found under; `rel` (its POSIX path relative to the root) decides its
    split, so moving the whole corpus to another directory or machine keeps every file in its split.

    path: a local `Path`, or a `gs://` / `s3://` URL (str). mtime_ns: a local file's modification time (0 for an
    object). version: an object's ETag or generation ("" for a local file); it changes when the object is
    replaced, as mtime_ns does for a file.
    """

    path: Path | str
    rel: str
    size: int
    mtime_ns: int
    version: str = ""


def stdlib_corpus_files() -> list[Path]:
    """The running interpreter's standard-library `.py` sources, sorted (~12 MB; real text wherever Python is).

    Leaves out the directories in `STDLIB_EXCLUDED_DIRS` and empty files.
    Raises DataError if the standard library cannot be found (e.g. a frozen interpreter).
    """
    return [s.path for s in _stdlib_sources()]


def _stdlib_sources() -> list[SourceFile]:
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise DataError(f"standard library not found at {root} (sysconfig stdlib path); set data.paths")
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in STDLIB_EXCLUDED_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                src = _source(Path(dirpath) / name, root)
                if src.size:
                    out.append(src)
    if not out:
        raise DataError(f"no .py files under the standard library {root}")
    return sorted(out, key=lambda s: s.rel)


def _source(path: Path, root: Path) -> SourceFile:
    st = path.stat()
    return SourceFile(path=path, rel=path.relative_to(root).as_posix(), size=st.st_size, mtime_ns=st.st_mtime_ns)


def resolve_files(paths: Sequence[str]) -> list[Path]:
    """Expands data paths (files, or directories searched recursively) to the sorted list of corpus files.

    Args:
      paths: file or directory paths; directories contribute their `.txt`, `.jsonl` and `.parquet` files
        (hidden files and directories, whose names start with '.', are left out).
    Returns:
      Absolute paths, sorted, without duplicates.
    Raises:
      DataError: a path does not exist; or yields no file with an allowed extension; or all its files are empty.
    """
    return sorted({s.path for s in resolve_sources(paths)})


def resolve_sources(data_paths: Sequence[str]) -> list[SourceFile]:
    """Like `resolve_files`, with each file's root-relative path, size and mtime (used by the split and the
    cache fingerprint). A file named directly has its parent as root; a file under a directory, that directory.
    A `gs://` or `s3://` URL names one object, or a prefix read like a directory.

    Raises:
      DataError: as `resolve_files`; or a URL whose scheme is not supported or whose package is missing (names the
        extra to install); or an object store that cannot be listed (names the URL and the store's error).
    """
    if not data_paths:
        raise DataError("data.paths is empty; pass files or directories (or leave it empty for the stdlib corpus)")
    allowed = ", ".join(TEXT_SUFFIXES)
    found: dict[Path | str, SourceFile] = {}
    for raw in data_paths:
        try:
            checked = paths.check(raw, "data.paths")
        except paths.PathError as e:
            raise DataError(str(e)) from None
        if paths.is_remote(checked):
            for s in _remote_sources(raw, checked, allowed):
                found.setdefault(s.path, s)
            continue
        path = Path(checked)
        if not path.exists():
            raise DataError(f"data path {raw!r} does not exist")
        path = path.resolve()
        if path.is_dir():
            candidates = []
            for dirpath, dirnames, filenames in os.walk(path, followlinks=True):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                candidates += [Path(dirpath) / f for f in filenames
                               if not f.startswith(".") and Path(f).suffix in TEXT_SUFFIXES]
            sources = [_source(p, path) for p in candidates]
            if not sources:
                raise DataError(f"data path {raw!r} holds no files with an allowed extension ({allowed})")
        else:
            if path.suffix not in TEXT_SUFFIXES:
                raise DataError(f"data path {raw!r} has extension {path.suffix!r}; allowed: {allowed}")
            sources = [_source(path, path.parent)]
        sources = [s for s in sources if s.size > 0]
        if not sources:
            raise DataError(f"data path {raw!r}: all its {allowed} files are empty")
        for s in sources:
            found.setdefault(s.path, s)
    return sorted(found.values(), key=lambda s: (str(s.path)))


def _remote_sources(raw: str, url: str, allowed: str) -> list[SourceFile]:
    """The corpus files of one object-storage URL (`raw` as given, `url` checked): the object itself, or every
    object under it as a prefix (names with a component starting with '.' left out, as hidden files are locally)."""
    try:
        objects = list(paths.walk_files(url))
    except FileNotFoundError:
        objects = []
    except Exception as e:  # noqa: BLE001 - connection, permission and bucket errors differ by backend
        raise DataError(f"data path {raw!r} cannot be listed: {type(e).__name__}: {e}") from None
    if not objects:
        raise DataError(f"data path {raw!r} does not exist (no object, and no objects under it as a prefix)")
    if len(objects) == 1 and objects[0].path == url:  # one object named directly
        suffix = PurePosixPath(url).suffix
        if suffix not in TEXT_SUFFIXES:
            raise DataError(f"data path {raw!r} has extension {suffix!r}; allowed: {allowed}")
        root = url.rsplit("/", 1)[0]
    else:
        root = url
        objects = [o for o in objects if PurePosixPath(o.path).suffix in TEXT_SUFFIXES
                   and not any(part.startswith(".") for part in o.path[len(root) + 1:].split("/"))]
        if not objects:
            raise DataError(f"data path {raw!r} holds no files with an allowed extension ({allowed})")
    sources = [SourceFile(path=o.path, rel=o.path[len(root) + 1:], size=o.size, mtime_ns=0, version=o.version)
               for o in objects if o.size > 0]
    if not sources:
        raise DataError(f"data path {raw!r}: all its {allowed} files are empty")
    return sources


def check_data_paths(data_cfg) -> None:
    """Checks the path keys of a `DataConfig` without reading anything: `data.paths` and `data.tokenizer_path`
    may be local or object storage, `data.cache_dir` must be local.

    Raises:
      msjax.paths.PathError: naming the key, the path and what is allowed (or the package to install).
    """
    for raw in data_cfg.paths:
        paths.check(raw, "data.paths")
    if data_cfg.tokenizer_path:
        paths.check(data_cfg.tokenizer_path, "data.tokenizer_path")
    if data_cfg.cache_dir:
        paths.local(data_cfg.cache_dir, "data.cache_dir")


def corpus_sources(paths: Sequence[str]) -> list[SourceFile]:
    """The corpus of a `DataConfig.paths`: those files, or the standard-library corpus when empty."""
    return resolve_sources(paths) if paths else _stdlib_sources()


class Piece(NamedTuple):
    """A slice of a document as read from a corpus file.

    text: the characters (at most about `PIECE_BYTES` of input, except a JSON/parquet field read whole).
    end: True on the last piece of a document (the tokenizer's eot goes after it).
    offset: bytes of the file consumed so far (for progress; parquet reports its row group's end).
    """

    text: str
    end: bool
    offset: int


# Bytes of a text file decoded at a time: large documents (a 200 MB corpus on one line) stream through in pieces
# of about this size, so tokenizing needs memory proportional to it, not to the file.
PIECE_BYTES = 1 << 20
# Where a long text is cut into pieces: after a newline that the next character does not continue as whitespace,
# else before a space between two non-space characters. GPT-2's byte-level pre-tokenizer (Radford et al. 2019)
# splits its input at both places anyway, so a BPE tokenizer encodes the pieces exactly as the whole text. A
# piece with neither (a single >1 MB word) is cut where it ends; char and byte tokenizers are exact at any cut.
_NEWLINE_CUT = re.compile(r"\n(?=\S)")
_SPACE_CUT = re.compile(r"(?<=\S) (?=\S)")


def _cut_point(text: str) -> int:
    """Index at which to end a piece of `text` (see `_NEWLINE_CUT`): the last safe place in its second half."""
    half = len(text) // 2
    for pattern, shift in ((_NEWLINE_CUT, 1), (_SPACE_CUT, 0)):
        last = None
        for last in pattern.finditer(text, half):
            pass
        if last is not None:
            return last.start() + shift
    return len(text)


def split_text(text: str, piece_chars: int = PIECE_BYTES) -> Iterator[str]:
    """`text` in consecutive pieces of at most ~`piece_chars` characters, cut where a BPE pre-tokenizer would cut
    anyway (see `_cut_point`). Concatenating the pieces gives `text` back."""
    while len(text) > piece_chars:
        cut = _cut_point(text[:piece_chars])
        yield text[:cut]
        text = text[cut:]
    if text:
        yield text


def read_pieces(path: str | os.PathLike, text_field: str = "text",
                on_decode_error: Literal["error", "skip"] = "error", piece_bytes: int = PIECE_BYTES,
                rows: tuple[int, int] | None = None) -> Iterator[Piece]:
    """Streams the documents of one corpus file as pieces (see `Piece`), in bounded memory for any line length.

    Same documents, errors and skipping as `read_documents` (which joins these pieces). With
    on_decode_error='skip' an undecodable file is first checked in a streaming pass, so it is skipped whole and
    never half-read. NUL bytes are valid UTF-8 and are kept as the character U+0000: they are text to every
    tokenizer (char gives them an id, byte and bpe encode the byte 0), never dropped or replaced.

    rows: (a, b) reads only the documents that start at a byte offset of the file in [a, b) (`row_start` says
    where each kind of document starts), and only the bytes they span: how a multi-process build has each process
    read its own share (msjax.data.tokens). With rows, on_decode_error='skip' checks only those bytes (the caller
    agrees with the other processes first, see `utf8_ok`).
    """
    path = path if isinstance(path, str) and paths.is_remote(path) else Path(path)
    suffix = PurePosixPath(path).suffix
    if suffix in (".txt", ".py", ".jsonl") and on_decode_error == "skip":
        if not utf8_ok(path, rows):
            return
    if suffix in (".txt", ".py"):
        if rows is None or rows[0] <= 0 < rows[1]:
            yield from _text_pieces(path, piece_bytes)
    elif suffix == ".jsonl":
        yield from _read_jsonl(path, text_field, piece_bytes, rows)
    elif suffix == ".parquet":
        yield from _read_parquet(path, text_field, piece_bytes, rows)
    else:
        raise DataError(f"{path}: unsupported extension {suffix!r}; allowed: {', '.join(READABLE_SUFFIXES)}")


def row_start(size: int, index: int, count: int) -> int:
    """The byte offset at which row group `index` of `count` of a parquet file of `size` bytes counts as starting
    (for `read_pieces(rows=...)`): evenly spread over the file, the same in every process."""
    return size * index // count


def _aligned_lines(f: IO[bytes], rows: tuple[int, int]) -> int:
    """Seeks `f` to the first line that starts at an offset >= rows[0] and returns that offset (a line that
    straddles rows[0] belongs to the share before)."""
    if rows[0] <= 0:
        f.seek(0)
        return 0
    f.seek(rows[0] - 1)
    if f.read(1) != b"\n":
        f.readline()
    return f.tell()


def read_documents(path: str | os.PathLike, text_field: str = "text",
                   on_decode_error: Literal["error", "skip"] = "error") -> Iterator[str]:
    """Yields the documents of one corpus file, in file order, each whole (use `read_pieces` to stream).

    `.txt`/`.py`: the whole file is one document. `.jsonl`: field `text_field` of each non-blank line.
    `.parquet`: column `text_field` of each row (null and empty rows are skipped).

    Args:
      path: the file.
      text_field: JSON field / parquet column holding the text.
      on_decode_error: 'error' raises on bytes that are not UTF-8; 'skip' skips the whole file with a DataWarning
        naming it (yielding nothing). NUL bytes are valid UTF-8 and kept (see `read_pieces`).
    Raises:
      DataError: undecodable bytes (names the file and byte offset); a jsonl line that is not JSON, lacks the
        field or holds a non-string (names file, line number and field); a parquet file without the column
        (lists its columns) or with a non-string column; an unsupported extension.
    """
    parts: list[str] = []
    for piece in read_pieces(path, text_field, on_decode_error):
        parts.append(piece.text)
        if piece.end:
            yield "".join(parts)
            parts = []


def _decode_error(path: Path | str, offset: int, reason: str) -> DataError:
    return DataError(f"{path}: not valid UTF-8 at byte offset {offset} ({reason}); fix the file or set "
                     "data.on_decode_error=skip to leave such files out")


def _open(path: Path | str) -> IO[bytes]:
    """A local file, or a streaming reader on an object (msjax.paths.open_read), opened read-only."""
    try:
        return paths.open_read(str(path))
    except (FileNotFoundError, PermissionError):
        raise
    except Exception as e:  # noqa: BLE001 - an object store's errors differ by backend
        raise DataError(f"{path}: cannot be opened: {type(e).__name__}: {e}") from None


def utf8_ok(path: Path | str, rows: tuple[int, int] | None = None) -> bool:
    """Streams `path` (with `rows`, only the bytes of those rows, as `read_pieces` reads them) through a UTF-8
    decoder; False (with a DataWarning naming the offset) if it fails."""
    dec = codecs.getincrementaldecoder("utf-8")("strict")
    suffix = PurePosixPath(path).suffix
    with _open(path) as f:
        offset, end = 0, None
        if rows is not None and suffix == ".jsonl":
            offset = _aligned_lines(f, rows)
            end = rows[1]
            if offset >= end:  # no line starts in the share
                return True
        elif rows is not None and not rows[0] <= 0 < rows[1]:  # a .txt document of another share
            return True
        while True:
            data = f.read(PIECE_BYTES)
            if end is not None and offset + len(data) >= end:  # up to the end of the line that starts before `end`
                cut = data.find(b"\n", max(0, end - offset - 1))
                data = data if cut < 0 else data[:cut + 1]
            pending = len(dec.getstate()[0])
            try:
                dec.decode(data, final=not data)
            except UnicodeDecodeError as e:
                warnings.warn(f"skipping {path}: not valid UTF-8 at byte offset {offset - pending + e.start} "
                              f"({e.reason}; data.on_decode_error='skip')", DataWarning, stacklevel=4)
                return False
            if not data:
                return True
            offset += len(data)
            if end is not None and offset >= end and data.endswith(b"\n"):
                return True


def _text_pieces(path: Path | str, piece_bytes: int) -> Iterator[Piece]:
    """A .txt/.py file as one document, decoded incrementally (a multi-byte character split between two reads
    is held back by the decoder) and cut by `_cut_point`."""
    dec = codecs.getincrementaldecoder("utf-8")("strict")
    offset, carry, any_text = 0, "", False
    with _open(path) as f:
        while True:
            data = f.read(piece_bytes)
            pending = len(dec.getstate()[0])
            try:
                text = dec.decode(data, final=not data)
            except UnicodeDecodeError as e:
                raise _decode_error(path, offset - pending + e.start, e.reason) from None
            offset += len(data)
            buf = carry + text
            if not data:
                if buf or any_text:
                    yield Piece(buf, True, offset)
                return
            cut = _cut_point(buf) if len(buf) >= piece_bytes else 0
            if cut:
                any_text = True
                yield Piece(buf[:cut], False, offset)
            carry = buf[cut:]


def _read_jsonl(path: Path | str, field: str, piece_bytes: int, rows: tuple[int, int] | None = None
                ) -> Iterator[Piece]:
    with _open(path) as f:
        offset = _aligned_lines(f, rows) if rows is not None else 0
        # Line numbers are known when reading from the file's start; a share that starts inside the file names
        # its lines by byte offset instead.
        first = 1 if offset == 0 else None
        for i, raw in enumerate(_lines(f)):
            if rows is not None and offset >= rows[1]:
                return
            start, offset = offset, offset + len(raw)
            lineno = first + i if first else f"(the line at byte {start})"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _decode_error(path, start + e.start, e.reason) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict) or field not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise DataError(f"{path}:{lineno}: no field {field!r} (data.text_field); the line has {keys}")
            value = record[field]
            if not isinstance(value, str):
                raise DataError(f"{path}:{lineno}: field {field!r} is a {type(value).__name__}, not a string")
            yield from _document_pieces(value, offset, piece_bytes)


def _lines(f: IO[bytes]) -> Iterator[bytes]:
    """The lines of `f` from its position (each with its newline, the last maybe without), read in pieces of
    PIECE_BYTES. Why not `for line in f`: fsspec's remote files implement readline as a read of a whole block
    (8 MiB) and a seek back, per line; and a line longer than a piece is joined once, not grown piece by piece."""
    parts: list[bytes] = []
    while True:
        data = f.read(PIECE_BYTES)
        if not data:
            if parts:
                yield b"".join(parts)
            return
        start = 0
        while True:
            nl = data.find(b"\n", start)
            if nl < 0:
                parts.append(data[start:])
                break
            parts.append(data[start:nl + 1])
            yield b"".join(parts)
            parts = []
            start = nl + 1


def _document_pieces(text: str, offset: int, piece_chars: int) -> Iterator[Piece]:
    pieces = list(split_text(text, piece_chars)) if len(text) > piece_chars else ([text] if text else [])
    for i, p in enumerate(pieces):
        yield Piece(p, i == len(pieces) - 1, offset)


def _read_parquet(path: Path | str, column: str, piece_bytes: int, rows: tuple[int, int] | None = None
                  ) -> Iterator[Piece]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    size = paths.info(str(path)).size
    # pyarrow reads a file object by ranges: the footer, then one row group's column chunk at a time.
    with _open(path) as f:
        pf = pq.ParquetFile(f)
        names = pf.schema_arrow.names
        if column not in names:
            raise DataError(f"{path}: no column {column!r} (data.text_field); columns: {names}")
        kind = pf.schema_arrow.field(column).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise DataError(f"{path}: column {column!r} has type {kind}, not string")
        groups = [g for g in range(pf.num_row_groups)
                  if rows is None or rows[0] <= row_start(size, g, pf.num_row_groups) < rows[1]]
        if not groups:
            return
        done, total = 0, max(pf.metadata.num_rows, 1)
        for batch in pf.iter_batches(columns=[column], batch_size=8192, row_groups=groups):
            done += batch.num_rows
            for value in batch.column(0).to_pylist():
                if value:
                    yield from _document_pieces(value, size * done // total, piece_bytes)


def is_validation(rel: str, val_fraction: float) -> bool:
    """Whether the file at root-relative path `rel` belongs to the validation split: the first 8 bytes of
    SHA-256(rel), read as a fraction of 2**64, are below `val_fraction`. Same answer in every process."""
    h = int.from_bytes(hashlib.sha256(rel.encode("utf-8")).digest()[:8], "big")
    return h / 2.0**64 < val_fraction


def split_by_file(sources: Sequence[SourceFile], val_fraction: float
                  ) -> tuple[list[SourceFile], list[SourceFile]] | None:
    """(train, val) files by `is_validation`, or None when that leaves either split empty (then the caller
    splits the token stream by position)."""
    train = [s for s in sources if not is_validation(s.rel, val_fraction)]
    val = [s for s in sources if is_validation(s.rel, val_fraction)]
    if not train or not val:
        return None
    return train, val
