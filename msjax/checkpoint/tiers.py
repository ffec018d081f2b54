"""Checkpoint tiers: a local directory or an object-store prefix holding step checkpoints `<root>/<step>/`.

Orbax reads and writes only local directories (msjax.paths explains why); a tier on object storage receives
complete checkpoints from the local tier and gives them back as local copies. Every tier keeps one invariant:
a step's integrity record (`msjax_integrity.json`, msjax.checkpoint.integrity) is the last thing to appear and
the first thing to go.

- `put` (copy in): a local tier copies to a temporary name, fsyncs every file and renames (the record arrives
  with the rest, atomically); an object store receives every other object first, then the record object. An
  object-store PUT is atomic (an object appears whole or not at all), so a record object exists only after
  every object before it was written: a copy cut short leaves a prefix without a record, which is never taken
  for a checkpoint and is deleted when the next Checkpointer opens.
- `delete` and `reject` (move aside) remove the record first, so a deletion cut short never leaves a
  checkpoint that looks complete but lacks files.
- `local_copy` gives a local directory holding the step: the step's own directory for a local tier; for an
  object store a download into `dest`, the record last, then a rename onto `dest`.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

from msjax import paths
from msjax.checkpoint.integrity import RECORD_NAME, parse_record, read_record

REJECTED_DIR = "rejected"
_TMP_COPY = ".msjax-copy-tmp-"


def _fsync_tree(root: Path) -> None:
    """fsyncs every file and directory under `root`, then `root` itself: the copy is on disk before its rename."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(dirpath, os.O_RDONLY)
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

    def put(self, step: int, src: Path) -> None:
        """Copies the complete checkpoint `src` (record included) in as `<root>/<step>`: temporary name, fsync,
        rename. Raises OSError."""
        dst = self.root / str(step)
        tmp = self.root / f"{step}{_TMP_COPY}{uuid.uuid4().hex[:8]}"
        try:
            shutil.copytree(src, tmp)
            _fsync_tree(tmp)
            if dst.exists():  # an interrupted write of the same step (no record): replaced
                self.delete(step)
            os.replace(tmp, dst)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def local_copy(self, step: int, dest: Path) -> Path:
        return self.root / str(step)

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

    def put(self, step: int, src: Path) -> None:
        """Uploads the complete checkpoint `src` as `<root>/<step>/`: what an earlier copy of the step left is
        deleted first, then every file but the record is written, then the record. Raises OSError."""
        self.delete(step)
        files = sorted(p for p in src.rglob("*") if p.is_file())
        dst = self.path(step)
        body = [(p, paths.join(dst, p.relative_to(src).as_posix())) for p in files if p.name != RECORD_NAME]
        paths.upload(body)
        paths.upload([(src / RECORD_NAME, paths.join(dst, RECORD_NAME))])

    def local_copy(self, step: int, dest: Path) -> Path:
        """Downloads the step into the local directory `dest` (which must not exist): every other object first,
        the record last, into a temporary name renamed onto `dest` at the end. Raises OSError."""
        src = self.path(step)
        tmp = dest.with_name(f"{dest.name}{_TMP_COPY}{uuid.uuid4().hex[:8]}")
        try:
            objects = list(paths.walk_files(src))
            rel = [(o.path, tmp / o.path[len(src):].lstrip("/")) for o in objects]
            paths.download([r for r in rel if r[1].name != RECORD_NAME])
            paths.download([r for r in rel if r[1].name == RECORD_NAME])
            os.replace(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return dest

    def remove_leftovers(self) -> None:
        """Nothing: an object-store copy has no temporary name (a copy cut short is a step without a record)."""


def make_tier(name: str, root: str | Path) -> LocalTier | ObjectTier:
    root_s = os.fspath(root)
    return ObjectTier(name, root_s) if paths.is_remote(root_s) else LocalTier(name, Path(root_s))
