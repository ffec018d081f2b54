"""Checkpoint tiers: a local directory or an object-store prefix holding step checkpoints `<root>/<step>/`.

Orbax reads and writes only local directories (msjax.paths explains why); a tier on object storage receives each
process's part of a checkpoint from its local tier and gives back the parts a process reads. Every tier keeps one
invariant: a step's integrity record (`msjax_integrity.json`, msjax.checkpoint.integrity) is the last thing to
appear and the first thing to go.

- `put_files` then `put_record` (copy in, by one process or several, each its own files): a local tier copies into
  a temporary name, fsyncs, and `put_record` writes the record there and renames it into place (the record
  arrives with the rest, atomically); an object store receives every other object first, then the record object.
  An object-store PUT is atomic (an object appears whole or not at all), so a record object exists only after
  every object before it was written: a copy cut short leaves a prefix without a record, which is never taken
  for a checkpoint and is deleted when the next Checkpointer opens.
- `delete` and `reject` (move aside) remove the record first, so a deletion cut short never leaves a
  checkpoint that looks complete but lacks files.
- `files` and `fetch_files` (object store): a step's objects, and a download of some of them (what one process
  reads, msjax.checkpoint.shards).
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

from msjax import paths
from msjax.checkpoint.integrity import RECORD_NAME, parse_record, read_record
from msjax.checkpoint.shards import relative_files

REJECTED_DIR = "rejected"
_TMP_COPY = ".msjax-copy-tmp-"


def _fsync_tree(root: Path) -> None:
    """fsyncs every file and directory under `root`, then `root` itself: the copy is on disk before its rename."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalTier:
    """Step checkpoints in a local directory `root` (Orbax's own layout: `<root>/<step>/`)."""

    remote = False

    def __init__(self, name: str, root: Path):
        self.name, self.root = name, root

    def __repr__(self) -> str:
        return f"LocalTier({self.name!r}, {str(self.root)!r})"

    def path(self, step: int) -> str:
        return str(self.root / str(step))

    def steps(self) -> list[int]:
        """Step directories (committed by Orbax: it names them by the step number only when its write is
        renamed into place), newest first; with or without a record."""
        if not self.root.is_dir():
            return []
        return sorted((int(p.name) for p in self.root.iterdir() if p.name.isdigit() and p.is_dir()), reverse=True)

    def record(self, step: int) -> dict | None:
        """The step's integrity record, None when it has none. Raises ValueError when it is unreadable."""
        return read_record(self.root / str(step))

    def delete(self, step: int) -> None:
        step_dir = self.root / str(step)
        (step_dir / RECORD_NAME).unlink(missing_ok=True)
        shutil.rmtree(step_dir, ignore_errors=True)

    def reject(self, step: int) -> str:
        """Moves the step to `<root>/rejected/<step>-<time>` (one rename: it stops being a candidate at once)."""
        dest = self.root / REJECTED_DIR / f"{step}-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:4]}"
        dest.parent.mkdir(exist_ok=True)
        os.replace(self.root / str(step), dest)
        return str(dest)

    def scratch(self, step: int, token: str) -> Path:
        """A directory beside the steps for a copy of `step` in the making (`remove_leftovers` deletes it after a
        crash; never listed as a step)."""
        return self.root / f"{step}{_TMP_COPY}{token}"

    def files(self, step: int) -> list[str]:
        """The step's files as POSIX paths relative to its directory, sorted."""
        return relative_files(self.root / str(step))

    def put_files(self, step: int, src: Path, rels: list[str], token: str) -> None:
        """Copies the files `rels` of the step directory `src` into `<root>/<step><tmp><token>/` and fsyncs them:
        one process's part of a step that several processes copy in (`token` is the same for all of them);
        `put_record` completes it. Raises OSError."""
        tmp = self.scratch(step, token)
        for rel in rels:
            dst = tmp / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / rel, dst)
            _fsync_path(dst)
        for d in {(tmp / rel).parent for rel in rels}:
            _fsync_path(d)

    def put_record(self, step: int, record: Path, token: str) -> None:
        """Completes a step copied in by `put_files` (every part durable): writes the record into it, fsyncs and
        renames it onto `<root>/<step>` (replacing an interrupted write of the same step). Raises OSError."""
        tmp = self.scratch(step, token)
        tmp.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(record, tmp / RECORD_NAME)
        _fsync_path(tmp / RECORD_NAME)
        self.commit(step, token)

    def commit(self, step: int, token: str) -> None:
        """Renames `scratch(step, token)`, whose files, the record last, are written and fsynced, onto
        `<root>/<step>` (replacing an interrupted write of the same step), fsyncing the directories. Raises
        OSError."""
        tmp = self.scratch(step, token)
        _fsync_path(tmp)
        if (self.root / str(step)).exists():
            self.delete(step)
        os.replace(tmp, self.root / str(step))
        _fsync_path(self.root)

    def remove_leftovers(self) -> None:
        """Copies into this tier cut short by a crash (`<step>.msjax-copy-tmp-*`)."""
        for leftover in self.root.glob(f"*{_TMP_COPY}*"):
            shutil.rmtree(leftover, ignore_errors=True)


class ObjectTier:
    """Step checkpoints under an object-store prefix `root` (`gs://bucket/run1`, `s3://bucket/run1`)."""

    remote = True

    def __init__(self, name: str, root: str):
        self.name, self.root = name, root

    def __repr__(self) -> str:
        return f"ObjectTier({self.name!r}, {self.root!r})"

    def path(self, step: int) -> str:
        return paths.join(self.root, str(step))

    def steps(self) -> list[int]:
        """Step prefixes that hold objects, newest first; with or without a record."""
        return sorted((int(n) for n in paths.listdir(self.root) if n.isdigit()), reverse=True)

    def record(self, step: int) -> dict | None:
        where = paths.join(self.path(step), RECORD_NAME)
        try:
            text = paths.read_bytes(where).decode("utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"integrity record {where} is unreadable: {e}") from None
        return parse_record(text, where)

    def delete(self, step: int) -> None:
        paths.remove(paths.join(self.path(step), RECORD_NAME))
        paths.remove_tree(self.path(step))

    def reject(self, step: int) -> str:
        """Copies the step to `<root>/rejected/<step>-<time>/` and deletes it (record first: it stops being a
        candidate before anything else moves)."""
        src = self.path(step)
        dest = paths.join(self.root, REJECTED_DIR, f"{step}-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:4]}")
        objects = list(paths.walk_files(src))
        record = [o for o in objects if paths.basename(o.path) == RECORD_NAME]
        for o in record:
            paths.copy(o.path, dest + o.path[len(src):])
        paths.remove(paths.join(src, RECORD_NAME))
        for o in objects:
            if o not in record:
                paths.copy(o.path, dest + o.path[len(src):])
        paths.remove_tree(src)
        return dest

    def files(self, step: int) -> list[str]:
        """The step's objects as paths relative to its prefix, sorted."""
        src = self.path(step)
        return sorted(o.path[len(src):].lstrip("/") for o in paths.walk_files(src))

    def put_files(self, step: int, src: Path, rels: list[str], token: str) -> None:
        """Uploads the files `rels` of the step directory `src` to `<root>/<step>/`: one process's part of a step
        that several processes upload (`token` is unused: an object appears whole or not at all); `put_record`
        completes it. Raises OSError (or the object store's error)."""
        dst = self.path(step)
        paths.upload([(src / rel, paths.join(dst, rel)) for rel in rels])

    def put_record(self, step: int, record: Path, token: str) -> None:
        """Completes a step uploaded by `put_files` (every part durable): uploads its record object, last."""
        paths.upload([(record, paths.join(self.path(step), RECORD_NAME))])

    def fetch_files(self, step: int, rels: list[str], dest: Path) -> None:
        """Downloads the objects `rels` of the step into the local directory `dest`. Raises OSError."""
        src = self.path(step)
        paths.download([(paths.join(src, rel), dest / rel) for rel in rels])

    def remove_leftovers(self) -> None:
        """Nothing: an object-store copy has no temporary name (a copy cut short is a step without a record)."""


def make_tier(name: str, root: str | Path) -> LocalTier | ObjectTier:
    root_s = os.fspath(root)
    return ObjectTier(name, root_s) if paths.is_remote(root_s) else LocalTier(name, Path(root_s))
