"""Corpus: which files make up the text, how documents are read from them, and the train/validation split.

A corpus is a list of files. `.txt` and `.py` files are one document each; `.jsonl` files hold one document per
line (field `text_field`); `.parquet` files one per row (column `text_field`). Nothing here writes to an input
file: files are opened read-only and read once.

The train/validation split is by file (Chinchilla/Pile style: no document straddles the two splits): a file goes
to validation when a stable hash of its path relative to its root is below `val_fraction`. The hash is SHA-256,
so the split is the same on every host and in every process. When that leaves a split empty (one file, as with
tinyshakespeare) the caller splits by position instead: the last `val_fraction` of the token stream is validation,
as nanoGPT's `data/shakespeare_char/prepare.py` does.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal, Sequence

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
    split, so moving the whole corpus to another directory or machine keeps every file in its split."""

    path: Path
    rel: str
    size: int
    mtime_ns: int


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


def resolve_sources(paths: Sequence[str]) -> list[SourceFile]:
    """Like `resolve_files`, with each file's root-relative path, size and mtime (used by the split and the
    cache fingerprint). A file named directly has its parent as root; a file under a directory, that directory."""
    if not paths:
        raise DataError("data.paths is empty; pass files or directories (or leave it empty for the stdlib corpus)")
    allowed = ", ".join(TEXT_SUFFIXES)
    found: dict[Path, SourceFile] = {}
    for raw in paths:
        path = Path(raw).expanduser()
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


def corpus_sources(paths: Sequence[str]) -> list[SourceFile]:
    """The corpus of a `DataConfig.paths`: those files, or the standard-library corpus when empty."""
    return resolve_sources(paths) if paths else _stdlib_sources()


def read_documents(path: str | os.PathLike, text_field: str = "text",
                   on_decode_error: Literal["error", "skip"] = "error") -> Iterator[str]:
    """Yields the documents of one corpus file, in file order, reading the file once.

    `.txt`/`.py`: the whole file is one document. `.jsonl`: field `text_field` of each non-blank line.
    `.parquet`: column `text_field` of each row (null rows are skipped).

    Args:
      path: the file.
      text_field: JSON field / parquet column holding the text.
      on_decode_error: 'error' raises on bytes that are not UTF-8; 'skip' skips the whole file with a DataWarning
        naming it (yielding nothing).
    Raises:
      DataError: undecodable bytes (names the file and byte offset); a jsonl line that is not JSON, lacks the
        field or holds a non-string (names file, line number and field); a parquet file without the column
        (lists its columns) or with a non-string column; an unsupported extension.
    """
    path = Path(path)
    suffix = path.suffix
    if suffix in (".txt", ".py"):
        text = _decode(path, path.read_bytes(), on_decode_error)
        if text:
            yield text
    elif suffix == ".jsonl":
        yield from _read_jsonl(path, text_field, on_decode_error)
    elif suffix == ".parquet":
        yield from _read_parquet(path, text_field)
    else:
        raise DataError(f"{path}: unsupported extension {suffix!r}; allowed: {', '.join(READABLE_SUFFIXES)}")


def _decode(path: Path, data: bytes, on_decode_error: str, line_start: int = 0) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        where = f"byte offset {line_start + e.start}"
        if on_decode_error == "skip":
            warnings.warn(f"skipping {path}: not valid UTF-8 at {where} ({e.reason}; data.on_decode_error='skip')",
                          DataWarning, stacklevel=3)
            return None
        raise DataError(f"{path}: not valid UTF-8 at {where} ({e.reason}); fix the file or set "
                        "data.on_decode_error=skip to leave such files out") from None


def _read_jsonl(path: Path, field: str, on_decode_error: str) -> Iterator[str]:
    data = path.read_bytes()
    # Decode the whole file first: a file with a bad byte is skipped whole, never half-read.
    text = _decode(path, data, on_decode_error)
    if text is None:
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
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
        if value:
            yield value


def _read_parquet(path: Path, column: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    if column not in names:
        raise DataError(f"{path}: no column {column!r} (data.text_field); columns: {names}")
    kind = pf.schema_arrow.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"{path}: column {column!r} has type {kind}, not string")
    for batch in pf.iter_batches(columns=[column], batch_size=8192):
        for value in batch.column(0).to_pylist():
            if value:
                yield value


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
