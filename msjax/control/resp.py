"""A minimal asyncio RESP2 client: one connection, AUTH, commands answered in order. For the rendezvous benchmark.

Why not redis-py's asyncio client: measured here, it costs the simulation about 1.4 ms of Python per simulated
worker (connection pool, parser and retry objects), so 12,288 simulated workers measured the simulator (30 s), not
Redis (shared/FIELD_NOTES.md). This client is an `asyncio.Protocol` (no StreamReader/StreamWriter pair per
connection), an encoder and an incremental reply parser: enough to run `msjax.control.rendezvous.join_protocol`
from thousands of coroutines in one process. AUTH is pipelined with the first command (no extra round trip).
Real workers use redis-py.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any


class RespError(Exception):
    """An error reply from the server (`-ERR ...`, `-WRONGPASS ...`)."""


class Incomplete(Exception):
    """`parse` reached the end of the buffer in the middle of a reply: wait for more bytes."""


def encode(*args: Any) -> bytes:
    """RESP2 array of bulk strings for one command. Args: str, bytes or int."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def parse(buf: bytes, pos: int = 0) -> tuple[Any, int]:
    """One RESP2 reply from buf[pos:]: (value, position after it). Strings come back as str, nil as None, an
    error reply as a RespError instance (returned, not raised). Raises Incomplete when buf ends mid-reply."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        raise Incomplete
    kind, body = buf[pos:pos + 1], buf[pos + 1:end]
    pos = end + 2
    if kind == b"+":
        return body.decode(), pos
    if kind == b"-":
        return RespError(body.decode()), pos
    if kind == b":":
        return int(body), pos
    if kind == b"$":
        n = int(body)
        if n < 0:
            return None, pos
        if len(buf) < pos + n + 2:
            raise Incomplete
        return buf[pos:pos + n].decode(), pos + n + 2
    if kind == b"*":
        n = int(body)
        if n < 0:
            return None, pos
        items = []
        for _ in range(n):
            item, pos = parse(buf, pos)
            items.append(item)
        return items, pos
    raise ConnectionError(f"unexpected RESP reply {buf[pos - len(body) - 3:pos][:40]!r}")


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.waiting: deque[asyncio.Future] = deque()
        self.lost: Exception | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        pos = 0
        while self.waiting:
            try:
                value, pos = parse(self.buf, pos)
            except Incomplete:
                break
            fut = self.waiting.popleft()
            if not fut.done():
                (fut.set_exception if isinstance(value, RespError) else fut.set_result)(value)
        self.buf = self.buf[pos:]

    def connection_lost(self, exc) -> None:
        self.lost = exc or ConnectionError("Redis closed the connection")
        while self.waiting:
            fut = self.waiting.popleft()
            if not fut.done():
                fut.set_exception(self.lost)


class RespConnection:
    """One connection to Redis: `await RespConnection.open(host, port, password)`, then `await conn.execute(...)`.

    `execute` raises RespError for an error reply (a wrong password surfaces at the first command) and
    ConnectionError when the connection is gone."""

    def __init__(self, protocol: _Protocol):
        self._p = protocol
        self._auth: asyncio.Future | None = None

    @classmethod
    async def open(cls, host: str, port: int, password: str | None = None) -> "RespConnection":
        _, protocol = await asyncio.get_running_loop().create_connection(_Protocol, host, port)
        conn = cls(protocol)
        if password:
            conn._auth = conn._send("AUTH", password, flush=False)  # goes out with the first command
        return conn

    def _send(self, *args: Any, flush: bool = True) -> asyncio.Future:
        if self._p.lost is not None:
            raise ConnectionError(f"connection to Redis lost: {self._p.lost}")
        fut = asyncio.get_running_loop().create_future()
        self._p.waiting.append(fut)
        self._held = getattr(self, "_held", b"") + encode(*args)
        if flush:
            data, self._held = self._held, b""
            self._p.transport.write(data)  # one write (one send syscall) for AUTH + the first command
        return fut

    async def execute(self, *args: Any) -> Any:
        fut = self._send(*args)
        if self._auth is not None:
            auth, self._auth = self._auth, None
            try:
                await auth
            except BaseException:
                fut.cancel()
                raise
        return await fut

    async def close(self) -> None:
        if self._p.transport is not None:
            self._p.transport.close()
