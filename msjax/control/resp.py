"""A minimal asyncio RESP2 client: one connection, AUTH, one command at a time. For the rendezvous benchmark only.

Why not redis-py's asyncio client: measured here, it costs the simulation about 1.4 ms of Python per simulated
worker (connection pool, parser and retry objects), so 12,288 simulated workers measured the simulator (30 s), not
Redis (shared/FIELD_NOTES.md). This client is a socket, an encoder and a recursive reply parser, enough to run
`msjax.control.rendezvous.join_protocol` from thousands of coroutines in one process. Real workers use redis-py.
"""

from __future__ import annotations

import asyncio
from typing import Any


class RespError(Exception):
    """An error reply from the server (`-ERR ...`, `-WRONGPASS ...`)."""


def encode(*args: Any) -> bytes:
    """RESP2 array of bulk strings for one command. Args: str, bytes or int."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


async def read_reply(reader: asyncio.StreamReader) -> Any:
    """One RESP2 reply: str for simple/bulk strings, int, list, None for nil; raises RespError for an error."""
    line = await reader.readline()
    if not line:
        raise ConnectionError("Redis closed the connection")
    kind, body = line[:1], line[1:-2]
    if kind == b"+":
        return body.decode()
    if kind == b"-":
        raise RespError(body.decode())
    if kind == b":":
        return int(body)
    if kind == b"$":
        n = int(body)
        if n < 0:
            return None
        return (await reader.readexactly(n + 2))[:-2].decode()
    if kind == b"*":
        n = int(body)
        if n < 0:
            return None
        return [await read_reply(reader) for _ in range(n)]
    raise ConnectionError(f"unexpected RESP reply {line[:40]!r}")


class RespConnection:
    """One connection to Redis. `await RespConnection.open(host, port, password)`, then `await conn.execute(...)`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, host: str, port: int, password: str | None = None) -> "RespConnection":
        reader, writer = await asyncio.open_connection(host, port)
        conn = cls(reader, writer)
        if password:
            await conn.execute("AUTH", password)
        return conn

    async def execute(self, *args: Any) -> Any:
        self.writer.write(encode(*args))
        return await read_reply(self.reader)

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionError, OSError):
            pass
