"""Paths: the one layer every path msjax takes goes through (checkpoint tiers, the run directory, data files,
tokenizer files): local paths, `gs://` (Google Cloud Storage) and `s3://` (Amazon S3, and S3-compatible stores
such as MinIO, Ceph or moto through `storage.s3_endpoint`).

    check("gs://bucket/run1", "checkpoint.dir")    # the path as msjax will use it, or PathError
    configure(cfg.storage)                          # endpoint, region, timeouts of the object stores
    with open_read("s3://bucket/corpus/a.jsonl") as f: ...

Rules (each violation is one `PathError` naming the config key, the path and what is allowed):
- A path with a scheme (`name://`) is a URL: `gs://` and `s3://` are served by fsspec's `gcsfs` and `s3fs`
  (extras `msjax[gcs]`, `msjax[s3]`), `file://` is a local path; any other scheme, or one whose package is not
  installed, is an error. A scheme with one slash (`gs:/bucket`) is an error, never a relative local directory
  `./gs:/bucket`.
- Keys that must stay local (the token cache, the local checkpoint tier, the run directory, whose metrics are
  appended as the run goes) refuse URLs with the reason.
The form of a value is msjax.config's (`check_path_value`, run whenever a config is validated, so no script
or launcher ever acts on a refused path); `check` adds whether the scheme's package is installed.

Why fsspec, not `etils.epath`: Orbax takes epath paths, and epath itself sends `gs://` and `s3://` to these same
fsspec filesystems (or to `tf.io.gfile` whenever TensorFlow is installed, which has no `s3://` since TF 2.6), but
it creates them with no arguments, so an endpoint, region or timeout can only reach them through process-wide
configuration. fsspec directly takes them per filesystem, streams reads in ranges (`open` with a block size),
and gives pyarrow a file object for parquet. TensorStore, Orbax's storage layer, has its own `gcs`/`s3` drivers:
its `s3` driver reaches an S3-compatible server only with an explicit `endpoint` (without one it looks the bucket
up at AWS and waits there with no timeout), and Orbax 0.12 builds TensorStore specs for local and `gs://` paths
only (`s3://` is refused as "Checkpoint path should be absolute"). So Orbax only ever sees local directories:
msjax.checkpoint writes there and copies whole checkpoints to and from object storage through this layer, with
the integrity record last (msjax.checkpoint.tiers).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterator, Sequence

from msjax.config import LOCAL_PATH_KEYS, ConfigError, StorageConfig, check_path_value, url_scheme


class PathError(ConfigError):
    """A path msjax cannot use: an unknown scheme, a scheme whose package is missing, a URL where only a local
    path is allowed. The message names the key and the path."""


@dataclass(frozen=True)
class Backend:
    """The package that serves a URL scheme."""

    module: str  # the fsspec implementation that serves the scheme
    extra: str  # msjax's pip extra that installs it
    protocol: str  # fsspec's protocol name


BACKENDS = {"gs": Backend("gcsfs", "gcs", "gcs"), "s3": Backend("s3fs", "s3", "s3")}

_storage = StorageConfig()


def configure(storage: StorageConfig) -> None:
    """Sets the object-store settings (endpoint, region, credentials, timeout; per path prefix with
    `storage.prefixes`) every later call in this process uses.

    Raises:
      ConfigError: a bad `storage.prefixes` entry (StorageConfig.prefix_settings), before anything is changed.
    """
    storage.prefix_settings()
    global _storage
    _storage = storage


def scheme(path: str | os.PathLike) -> str | None:
    """The URL scheme of `path` in lower case (`"gs"`, `"s3"`, `"file"`, ...), or None for a plain local path."""
    return url_scheme(os.fspath(path))


def is_remote(path: str | os.PathLike) -> bool:
    """Whether `path` names object storage (a `gs://` or `s3://` URL). Does not check the path (see `check`)."""
    return scheme(path) in BACKENDS


def check(path: str | os.PathLike, key: str, *, local_only: str = "") -> str:
    """The form of `path` msjax uses: an absolute local path (`~` expanded, `file://` removed), or a URL
    `scheme://bucket/key` without a trailing slash.

    Args:
      path: as the user gave it.
      key: the config key or argument it came from (named in errors); a key of msjax.config.LOCAL_PATH_KEYS
        refuses URLs with the reason given there.
      local_only: for other callers: when not empty, URLs are refused, and this text says why.
    Raises:
      PathError: an empty path, the forms msjax.config.check_path_value refuses (an unknown scheme, a URL for a
        local-only key or without a bucket, a one-slash URL), a URL where `local_only` refuses them, or a scheme
        whose package is not installed (names the extra to install).
    """
    raw = os.fspath(path)
    if not raw:
        raise PathError(f"{key} is empty: allowed is a local path, gs://bucket/... or s3://bucket/...")
    try:
        check_path_value(raw, key)
    except ConfigError as e:
        raise PathError(str(e)) from None
    name = scheme(raw)
    if name is None:
        return str(Path(raw).expanduser().absolute())
    rest = raw.split("://", 1)[1]
    if name == "file":
        return check(rest, key, local_only=local_only)
    if local_only:
        raise PathError(f"{key}={raw!r} must be a local path: {local_only}")
    backend = BACKENDS[name]
    if importlib.util.find_spec(backend.module) is None:
        raise PathError(f"{key}={raw!r}: {name}:// paths need the package {backend.module}, which is not "
                        f"installed; install it with: pip install 'msjax[{backend.extra}]'")
    return f"{name}://{rest.rstrip('/')}"


def local(path: str | os.PathLike, key: str) -> Path:
    """`check(path, key)` for a key of msjax.config.LOCAL_PATH_KEYS, as an absolute `Path`."""
    return Path(check(path, key, local_only=LOCAL_PATH_KEYS.get(key, "")))


def join(base: str | os.PathLike, *parts: str) -> str:
    """`base` joined with `parts` by '/' (URLs) or os.path.join (local paths)."""
    base = os.fspath(base)
    if scheme(base) is None:
        return os.path.join(base, *parts)
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])


def basename(path: str | os.PathLike) -> str:
    return os.fspath(path).rstrip("/").rsplit("/", 1)[-1]


# The object-storage packages' loggers. Their retry loops log every failed attempt, with a traceback, and gcsfs
# warns when it cannot tell a bucket's type; where msjax reports the failure itself, in one line that names the path
# and the storage error, those records would say the same thing several times over.
STORAGE_LOGGERS = ("gcsfs", "s3fs", "fsspec", "aiobotocore", "botocore", "google", "google_auth_httplib2")


@contextlib.contextmanager
def storage_logs_quiet() -> Iterator[None]:
    """Silences STORAGE_LOGGERS below CRITICAL for the block: for a probe whose failure the caller reports itself
    (the start-up check that a checkpoint directory can be written). Logger levels are process-wide: use it where no
    other thread does storage I/O (the checks before training)."""
    loggers = [logging.getLogger(name) for name in STORAGE_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def endpoint(url: str) -> str:
    """The endpoint setting that reaches the `gs://` or `s3://` URL `url` ("" for the backend's default: AWS,
    Google, or their environment variables). Raises ConfigError for a bad `storage.prefixes` entry."""
    s = _storage.for_path(url)
    return s.s3_endpoint if scheme(url) == "s3" else s.gcs_endpoint


def filesystem(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, the path inside it) for a `gs://` or `s3://` URL, with `configure`'s settings for that
    URL (those of the longest `storage.prefixes` entry that contains it, else the defaults).

    Credentials come from the settings (`s3_profile`, `gcs_credentials`), else from each package's own chain: for
    s3fs AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, ~/.aws or an instance role; for gcsfs Google's application
    default credentials. fsspec caches a filesystem per set of arguments, so URLs with the same settings share one.

    Raises:
      PathError: `url` is not a gs:// or s3:// URL, or its package is missing.
    """
    import fsspec

    name = scheme(url)
    if name not in BACKENDS:
        raise PathError(f"{url!r} is not an object-storage URL (gs:// or s3://)")
    check(url, "path")
    s = _storage.for_path(url)
    if name == "s3":
        client: dict[str, Any] = {}
        if s.s3_endpoint:
            client["endpoint_url"] = s.s3_endpoint
        if s.s3_region:
            client["region_name"] = s.s3_region
        # botocore's own bounds on every request (its defaults are 60 s and a retry policy of its own); s3fs adds
        # its retries of throttled and transient errors on top.
        options = {"client_kwargs": client, "config_kwargs": {
            "connect_timeout": s.timeout_s, "read_timeout": s.timeout_s,
            "retries": {"max_attempts": 3, "mode": "standard"}}}
        if s.s3_profile:
            options["profile"] = s.s3_profile
    elif s.gcs_endpoint:
        # A GCS-compatible server (an emulator) gets no credentials (token "anon": otherwise gcsfs looks for them,
        # the GCE metadata server included) and gcsfs's plain GCSFileSystem: the default one (gcsfs >= 2025.9)
        # first asks Google's storage-control gRPC API whether a bucket is zonal, which emulators do not serve
        # (a 60 s timeout per bucket).
        from gcsfs.core import GCSFileSystem

        fs = GCSFileSystem(endpoint_url=s.gcs_endpoint, token=s.gcs_credentials or "anon", timeout=s.timeout_s,
                           use_listings_cache=False)
        return fs, fs._strip_protocol(url)
    else:
        options = {"timeout": s.timeout_s}
        if s.gcs_credentials:
            options["token"] = s.gcs_credentials
    # No listings cache: a checkpoint tier is listed to find what another process (or a crash) left there, and a
    # cached listing would hide it.
    fs = fsspec.filesystem(BACKENDS[name].protocol, use_listings_cache=False, **options)
    return fs, fs._strip_protocol(url)


def _fs(path: str) -> tuple[Any, str]:
    if is_remote(path):
        return filesystem(path)
    from fsspec.implementations.local import LocalFileSystem

    return LocalFileSystem(), check(path, "path")


def _url(fs: Any, inner: str, like: str) -> str:
    """The URL of `inner` (a path inside `fs`) in the scheme of `like`."""
    name = scheme(like)
    return f"{name}://{inner}" if name in BACKENDS else inner


def exists(path: str) -> bool:
    fs, p = _fs(path)
    return fs.exists(p)


def is_dir(path: str) -> bool:
    """Whether `path` is a directory (a local one, or an object-store prefix that holds objects)."""
    fs, p = _fs(path)
    return fs.isdir(p)


def listdir(path: str) -> list[str]:
    """The names directly under `path` (files and directories), or [] when it does not exist."""
    fs, p = _fs(path)
    try:
        entries = fs.ls(p, detail=False)
    except FileNotFoundError:
        return []
    return sorted({basename(e) for e in entries if e.rstrip("/") != p.rstrip("/")})


@dataclass(frozen=True)
class FileInfo:
    """One file: its path (URL or absolute local path), size in bytes and a version token that changes when its
    content is replaced (local: mtime in ns; object stores: the ETag / generation and last-modified time)."""

    path: str
    size: int
    version: str


def _version(entry: dict) -> str:
    for key in ("ETag", "etag", "generation", "md5Hash", "crc32c"):
        if entry.get(key):
            return f"{key}={str(entry[key]).strip(chr(34))}"
    for key in ("LastModified", "updated", "mtime"):
        if entry.get(key):
            return f"{key}={entry[key]}"
    return ""


def info(path: str) -> FileInfo:
    """Size and version of one file. Raises FileNotFoundError when it does not exist."""
    if not is_remote(path):
        st = os.stat(path)
        return FileInfo(path, st.st_size, str(st.st_mtime_ns))
    fs, p = filesystem(path)
    entry = fs.info(p)
    if entry.get("type") == "directory":
        raise IsADirectoryError(path)
    return FileInfo(path, int(entry["size"]), _version(entry))


def walk_files(url: str) -> Iterator[FileInfo]:
    """Every object under the prefix `url` (recursively), sorted by path. Object stores only."""
    fs, p = filesystem(url)
    for inner, entry in sorted(fs.find(p, detail=True, withdirs=False).items()):
        yield FileInfo(_url(fs, inner, url), int(entry["size"]), _version(entry))


def open_read(path: str, block_size: int = 8 << 20) -> IO[bytes]:
    """A binary file object on `path` that streams: object stores are read in ranges of `block_size` bytes, read
    ahead, never downloaded whole."""
    if not is_remote(path):
        return open(path, "rb")
    fs, p = filesystem(path)
    return fs.open(p, "rb", block_size=block_size, cache_type="readahead")


def read_bytes(path: str) -> bytes:
    if not is_remote(path):
        return Path(path).read_bytes()
    fs, p = filesystem(path)
    return fs.cat_file(p)


def _write_checks(url: str) -> dict[str, str]:
    """The keyword arguments that make an object-store write verify what the server stored.

    gcsfs sends an object under 5 MiB as one multipart/related request whose part delimiters end in a bare LF, so
    content ending in a carriage return reads, to a server that accepts CRLF delimiters, as one byte shorter (a
    GCS emulator stores it so). With `consistency="md5"` gcsfs compares the MD5 the server reports with the bytes
    sent and raises `gcsfs.retry.ChecksumError`: a checkpoint file stored short fails its save, never its restore.
    Only writes are checked: a download's MD5 check raises for composite objects, which GCS gives no MD5. S3's
    PUT sends the body raw, with nothing to misread.
    """
    return {"consistency": "md5"} if url_scheme(url) == "gs" else {}


def write_bytes(path: str, data: bytes) -> None:
    """Writes `data` to `path` whole or not at all: an object store's PUT is atomic (the object appears complete
    or not at all); a local file is written to a temporary name, fsynced and renamed.

    Raises:
      OSError: the write was refused (the object store's own error types besides).
      gcsfs.retry.ChecksumError: GCS stored other bytes than `data` (see `_write_checks`).
    """
    if is_remote(path):
        fs, p = filesystem(path)
        fs.pipe_file(p, data, **_write_checks(path))
        return
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def remove(path: str) -> None:
    """Deletes one file or object; absent is fine."""
    fs, p = _fs(path)
    try:
        fs.rm_file(p)
    except FileNotFoundError:
        pass


def remove_tree(path: str) -> None:
    """Deletes `path` and everything under it; absent is fine."""
    fs, p = _fs(path)
    try:
        fs.rm(p, recursive=True)
    except FileNotFoundError:
        pass


def _by_filesystem(urls: Sequence[str]) -> dict[int, tuple[Any, str, list[int]]]:
    """The positions of `urls` grouped by the filesystem that serves them: {id: (filesystem, one of its URLs,
    positions)}. URLs under different `storage.prefixes` settings need different filesystems."""
    groups: dict[int, tuple[Any, str, list[int]]] = {}
    for i, url in enumerate(urls):
        fs, _ = filesystem(url)
        groups.setdefault(id(fs), (fs, url, []))[2].append(i)
    return groups


def upload(files: Sequence[tuple[Path, str]]) -> None:
    """Copies local files to object-store URLs, several at a time; returns when every object is written.

    Raises:
      OSError: a write was refused (the object store's own error types besides).
      gcsfs.retry.ChecksumError: GCS stored other bytes than a file's (see `_write_checks`).
    """
    for fs, url, at in _by_filesystem([dst for _, dst in files]).values():
        fs.put([str(files[i][0]) for i in at], [filesystem(files[i][1])[1] for i in at], **_write_checks(url))


def download(files: Sequence[tuple[str, Path]]) -> None:
    """Copies object-store URLs to local files (directories made as needed), several at a time."""
    for _, dst in files:
        dst.parent.mkdir(parents=True, exist_ok=True)
    for fs, _, at in _by_filesystem([src for src, _ in files]).values():
        fs.get([filesystem(files[i][0])[1] for i in at], [str(files[i][1]) for i in at])


def local_copy(path: str, dest_root: Path) -> Path:
    """A local path with the content of `path`: `path` itself when it is local; for an object or a prefix
    (a directory, e.g. a Hugging Face model directory or a tokenizer.json), a copy under
    `dest_root/<hash of the URL>/`, where only objects whose version changed since the last copy are fetched.

    Raises:
      FileNotFoundError: nothing exists at `path`.
    """
    import hashlib
    import json

    if not is_remote(path):
        if not os.path.exists(path):
            raise FileNotFoundError(path)
        return Path(path)
    objects = list(walk_files(path))
    if not objects:
        raise FileNotFoundError(path)
    single = len(objects) == 1 and objects[0].path == path
    root = dest_root / hashlib.sha256(path.encode()).hexdigest()[:16]
    versions_file = root / ".versions.json"
    try:
        versions = json.loads(versions_file.read_text())
    except (OSError, ValueError):
        versions = {}
    wanted = {o.path: (root / basename(o.path) if single else root / o.path[len(path) + 1:]) for o in objects}
    stale = [(o.path, wanted[o.path]) for o in objects
             if versions.get(o.path) != o.version or not wanted[o.path].exists()]
    download(stale)
    root.mkdir(parents=True, exist_ok=True)
    write_bytes(str(versions_file), json.dumps({o.path: o.version for o in objects}).encode())
    return wanted[path] if single else root


def copy(src: str, dst: str) -> None:
    """Copies one object within the same object store (server side).

    Raises:
      ValueError: `src` and `dst` are reached with different settings (`storage.prefixes`): two stores.
    """
    fs, p = filesystem(src)
    fs_dst, p_dst = filesystem(dst)
    if fs_dst is not fs:
        raise ValueError(f"cannot copy {src} to {dst} on the server: storage.prefixes puts them on different stores")
    fs.copy(p, p_dst)
