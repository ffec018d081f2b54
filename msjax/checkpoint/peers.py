"""Peer replicas of the local tier: each host's part of a checkpoint also held by another host, so that losing a
host loses no local step (`checkpoint.local_replicas`).

MegaScale keeps each checkpoint's first stage in host memory and uploads in the background; a host that dies takes
its memory with it, so without peers the newest step that survives a host failure is the newest uploaded one.
Orbax's emergency checkpointer and MaxText's `enable_emergency_checkpoint` answer this with peer replication; here:

- Every process of a job with peer replicas serves its host's local tier (`<local_dir>`, read-only) over HTTP on a
  free port of the address it reaches the jax coordinator by, to requests that carry its token (a random secret
  per server, exchanged through jax's coordination service, never on a command line). Python's `http.server` and
  `http.client` are the library: the transfer is whole files between hosts of one job, which needs no more.
- After process `w` completes its local part of step `s` (`<local_dir>/process-<w>/<s>`, record last), each of
  the `r` processes after it (w+1, ..., w+r modulo the process count) pulls every file of it into its own
  `<local_dir>/replicas/process-<w>/<s>`, under a temporary name, fsynced, the record last, renamed into place;
  process `w`'s checkpoint completes once they say they hold it.
- At restore every process lists what its host holds (its own parts, parts it kept under any earlier process
  index, replicas) and publishes the list; a step whose every writer's part is held by a live host (the same
  record everywhere) is a local step for the whole job: a process that lacks chunks it reads fetches them from
  the holders (`PeerSet`, the same interface as an object-store tier: `files`, `fetch_files`).

Every wait is bounded (the HTTP client's timeout; the coordination service's key waits, by the caller).
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import http.server
import json
import os
import secrets
import shutil
import socket
import threading
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from msjax.checkpoint.integrity import RECORD_NAME, read_record
from msjax.checkpoint.shards import relative_files

REPLICAS_DIR = "replicas"  # <local_dir>/replicas/process-<w>/<step>: other processes' parts this host holds
_CHUNK = 8 << 20  # bytes per read while streaming a file


def writer_dir(writer: int) -> str:
    """The directory of process `writer`'s own part of every step, relative to a host's local tier root."""
    return f"process-{writer}"


def replica_dir(writer: int) -> str:
    """The directory of this host's copies of process `writer`'s parts, relative to the local tier root."""
    return f"{REPLICAS_DIR}/process-{writer}"


def sources(process: int, count: int, replicas: int) -> list[int]:
    """The processes whose parts `process` holds copies of: the `replicas` before it, modulo `count` (none in a
    one-process job; at most count - 1)."""
    return [(process - k) % count for k in range(1, min(replicas, count - 1) + 1)]


def holders(process: int, count: int, replicas: int) -> list[int]:
    """The processes that keep copies of `process`'s parts (those whose `sources` include it)."""
    return [(process + k) % count for k in range(1, min(replicas, count - 1) + 1)]


def route_address(coordinator: str) -> str:
    """This host's address on the route to `coordinator` ("host:port", the jax coordinator's): the interface the
    job's other processes reach this host by (a UDP connect sends nothing)."""
    host, _, port = coordinator.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host.strip("[]")), int(port or 1)))
        return s.getsockname()[0]


def record_digest(record: dict) -> str:
    """A short digest of a record's checksums and loader position: two hosts' copies of a step are parts of one
    checkpoint only when these agree."""
    text = json.dumps([record.get("checksums"), record.get("loader")], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def holdings(root: Path) -> list[dict]:
    """Every complete (recorded) part of a step under a host's local tier `root`: [{"step", "writer", "dir" (the
    step directory relative to `root`), "digest", "writers" (the job's process count at the save), "files"}].
    A part whose record lacks "writers" (written before peer replicas) or cannot be read is left out."""
    out = []
    if not root.is_dir():
        return out
    for parent in [root, root / REPLICAS_DIR]:
        if not parent.is_dir():
            continue
        for wdir in sorted(parent.iterdir()):
            if not (wdir.name.startswith("process-") and wdir.name[8:].isdigit() and wdir.is_dir()):
                continue
            for sdir in wdir.iterdir():
                if not sdir.name.isdigit():
                    continue
                try:
                    record = read_record(sdir)
                except ValueError:
                    continue
                if record is None or "writers" not in record:
                    continue
                out.append({"step": int(sdir.name), "writer": int(wdir.name[8:]),
                            "dir": sdir.relative_to(root).as_posix(), "digest": record_digest(record),
                            "writers": int(record["writers"]), "files": relative_files(sdir)})
    return out


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: one connection carries every file of a transfer
    root: Path
    token: str

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in two writes: with Nagle's algorithm the body waits for the client's delayed
        # ACK (40 ms a file here), so a step's hundreds of small files would take seconds.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if not hmac.compare_digest(self.headers.get("Authorization", ""), f"Bearer {self.token}"):
            return self._refuse(403)
        rel = urllib.parse.unquote(self.path.lstrip("/"))
        path = (self.root / rel).resolve()
        if rel.startswith("/") or not path.is_relative_to(self.root.resolve()) or not path.is_file():
            return self._refuse(404)
        size = path.stat().st_size
        self.send_response(200)
        self.send_header("Content-Length", str(size))
        self.end_headers()
        with open(path, "rb") as f:
            shutil.copyfileobj(f, self.wfile, _CHUNK)

    def _refuse(self, code: int) -> None:
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format, *args) -> None:  # noqa: A002 - http.server's signature; requests are not logged
        pass


class PeerServer:
    """Serves the files under `root` (a host's local tier), read-only, to requests bearing `token`, on a free
    port of `host`, from a daemon thread until `close`.

    Attributes:
      address: "host:port" it listens on.
      token: the secret a request must carry (`Authorization: Bearer <token>`).
    """

    def __init__(self, root: Path, host: str, timeout_s: float):
        self.token = secrets.token_hex(16)
        handler = type("Handler", (_Handler,), {"root": Path(root), "token": self.token, "timeout": timeout_s})
        self._httpd = http.server.ThreadingHTTPServer((host, 0), handler)
        self._httpd.daemon_threads = True
        self.address = f"{host}:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="msjax-peer-server", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stops serving (requests in progress end with their connection) and joins the thread."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout_s)


def fetch(address: str, token: str, pairs: list[tuple[str, Path]], timeout_s: float, durable: bool = False) -> int:
    """Downloads files from a `PeerServer`: each (path relative to its root, destination) in `pairs`, over one
    connection; `durable` fsyncs each file. Returns the bytes received.

    Raises:
      OSError: a refused or lost connection, a file the peer does not have (FileNotFoundError), a short read, or
        no answer within `timeout_s` seconds (socket.timeout).
    """
    host, _, port = address.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    total = 0
    try:
        for rel, dest in pairs:
            conn.request("GET", "/" + urllib.parse.quote(rel), headers={"Authorization": f"Bearer {token}"})
            resp = conn.getresponse()
            if resp.status != 200:
                resp.read()
                raise FileNotFoundError(f"peer {address} answered {resp.status} for {rel}")
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(dest, "wb") as f:
                while chunk := resp.read(_CHUNK):
                    f.write(chunk)
                    total += len(chunk)
                if f.tell() != int(resp.headers["Content-Length"]):
                    raise OSError(f"peer {address}: {rel} arrived short ({f.tell()} bytes)")
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
    except http.client.HTTPException as e:
        raise OSError(f"peer {address}: {type(e).__name__}: {e}") from None
    finally:
        conn.close()
    return total


@dataclass
class PeerSet:
    """The job's local tiers as one source of steps (the interface of an object-store tier: `files`,
    `fetch_files`): for each step whose every writer's part some live host holds (one record digest), which host
    holds which file.

    Attributes:
      me: this process's index.
      servers: {process: (address, token)} of every process's PeerServer.
      root: this host's local tier root (files held here are copied, not fetched).
      timeout_s: bound on each HTTP wait, seconds.
      steps: {step: {file relative to the step: [(process, path relative to that host's root), ...]}}.
    """

    me: int
    servers: dict[int, tuple[str, str]]
    root: Path
    timeout_s: float
    steps: dict[int, dict[str, list[tuple[int, str]]]] = field(default_factory=dict)

    name = "peers"
    remote = True

    @classmethod
    def from_inventories(cls, me: int, servers: dict[int, tuple[str, str]], root: Path, timeout_s: float,
                         inventories: dict[int, list[dict]]) -> "PeerSet":
        """The steps that the job's hosts hold whole between them, from every process's `holdings` (identical on
        every process, given the same inventories)."""
        peers = cls(me, servers, root, timeout_s)
        by_version: dict[tuple[int, str], dict] = {}
        for process in sorted(inventories):
            for part in inventories[process]:
                v = by_version.setdefault((part["step"], part["digest"]), {"writers": part["writers"], "parts": {}})
                v["parts"].setdefault(part["writer"], []).append((process, part["dir"], part["files"]))
        for (step, _), v in sorted(by_version.items()):
            if step in peers.steps or set(v["parts"]) != set(range(v["writers"])):
                continue
            where: dict[str, list[tuple[int, str]]] = {}
            for holders in v["parts"].values():
                for process, d, files in holders:
                    for rel in files:
                        where.setdefault(rel, []).append((process, f"{d}/{rel}"))
            peers.steps[step] = where
        return peers

    def path(self, step: int) -> str:
        return f"step {step} on the job's hosts (peer replicas)"

    def files(self, step: int) -> list[str]:
        """Every file of the step that some host holds, relative to the step, sorted."""
        return sorted(self.steps[step])

    def fetch_files(self, step: int, rels: list[str], dest: Path) -> None:
        """Copies the files `rels` of the step into `dest`: from this host's own copy where it holds one, else from
        a host that does (spread over the holders by file). Raises OSError (FileNotFoundError: no host holds one;
        a failed transfer)."""
        by_holder: dict[int, list[tuple[str, Path]]] = {}
        for rel in rels:
            holders = self.steps[step].get(rel)
            if not holders:
                raise FileNotFoundError(f"no host holds {rel} of step {step}")
            mine = [h for h in holders if h[0] == self.me]
            process, src = mine[0] if mine else holders[_spread(rel, len(holders))]
            by_holder.setdefault(process, []).append((src, dest / rel))
        for process, pairs in sorted(by_holder.items()):
            if process == self.me:
                for src, dst in pairs:
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(self.root / src, dst)
            else:
                address, token = self.servers[process]
                fetch(address, token, pairs, self.timeout_s)


def _spread(rel: str, n: int) -> int:
    """A holder index for `rel` among `n`, the same on every process: files spread over the holders."""
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % n


def pull(address: str, token: str, src_dir: str, files: list[str], dest: Path, timeout_s: float) -> int:
    """Copies one part of a step (`files` under `src_dir` on the host at `address`) into `dest`, each file
    fsynced, the record last; returns the bytes received. Raises OSError."""
    body = [(f"{src_dir}/{r}", dest / r) for r in files if r != RECORD_NAME]
    return (fetch(address, token, body, timeout_s, durable=True)
            + fetch(address, token, [(f"{src_dir}/{RECORD_NAME}", dest / RECORD_NAME)], timeout_s, durable=True))
