"""Minimal asyncio clients of two stores' wire protocols, for scripts/bench_init.py's simulated workers.

`RespConnection` speaks Redis' RESP2 and `TCPStoreConnection` speaks torch's TCPStore protocol (c10d), built the
same way so that a start-up comparison measures the stores and not two different clients: one `asyncio.Protocol`
per connection (no StreamReader/StreamWriter pair), a hand-written encoder and an incremental reply parser, the
connection's handshake (Redis AUTH; TCPStore's VALIDATE and PING) written together with the first command (no
extra round trip), then one command at a time, each awaited before the next.

Why not the stores' own clients in the simulation: redis-py's asyncio client costs about 1.4 ms of Python per
simulated worker (connection pool, parser and retry objects), so 12,288 simulated workers measured the simulator
(30 s), not Redis; torch's TCPStore client is synchronous C++, one thread per worker. Real workers use redis-py.
"""

from __future__ import annotations

import asyncio
import os
import struct
from collections import deque
from typing import Any, Callable, Generator, Sequence


class RespError(Exception):
    """An error reply from the server (`-ERR ...`, `-WRONGPASS ...`)."""


class Incomplete(Exception):
    """A reader reached the end of the buffer in the middle of a reply: wait for more bytes."""


# ---------------------------------------------------------------------------------------------------------------
# Redis (RESP2).


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


Reader = Callable[[bytes, int], tuple[Any, int]]


class _Protocol(asyncio.Protocol):
    """Replies answered in order: each waiting future comes with the reader of its reply."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.waiting: deque[tuple[asyncio.Future, Reader]] = deque()
        self.lost: Exception | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        pos = 0
        while self.waiting:
            fut, read = self.waiting[0]
            try:
                value, pos = read(self.buf, pos)
            except Incomplete:
                break
            self.waiting.popleft()
            if not fut.done():
                (fut.set_exception if isinstance(value, Exception) else fut.set_result)(value)
        self.buf = self.buf[pos:]

    def connection_lost(self, exc) -> None:
        self.lost = exc or ConnectionError(f"{self.name} closed the connection")
        while self.waiting:
            fut, _ = self.waiting.popleft()
            if not fut.done():
                fut.set_exception(self.lost)


class _Connection:
    """What both clients share: a handshake held back and written with the first command, one write per command,
    replies matched to commands in order."""

    name = "server"

    def __init__(self, protocol: _Protocol):
        self._p = protocol
        self._held = b""
        self._handshake: asyncio.Future | None = None

    def _send(self, data: bytes, read: Reader | None) -> asyncio.Future | None:
        """Queues `data` (with anything held) and, when the command has a reply, a future for it."""
        if self._p.lost is not None:
            raise ConnectionError(f"connection to {self.name} lost: {self._p.lost}")
        fut = None
        if read is not None:
            fut = asyncio.get_running_loop().create_future()
            self._p.waiting.append((fut, read))
        data, self._held = self._held + data, b""
        self._p.transport.write(data)  # one write (one send syscall) for the handshake + the first command
        return fut

    def _hold(self, data: bytes, read: Reader) -> None:
        """The handshake: its bytes wait for the first command; its reply is checked when that command is awaited."""
        self._handshake = asyncio.get_running_loop().create_future()
        self._p.waiting.append((self._handshake, read))
        self._held += data

    async def _reply(self, fut: asyncio.Future | None) -> Any:
        if self._handshake is not None:
            handshake, self._handshake = self._handshake, None
            try:
                await handshake
            except BaseException:
                if fut is not None:
                    fut.cancel()
                raise
        return None if fut is None else await fut

    async def close(self) -> None:
        if self._p.transport is not None:
            self._p.transport.close()


class RespConnection(_Connection):
    """One connection to Redis: `await RespConnection.open(host, port, password)`, then `await conn.execute(...)`.

    `execute` raises RespError for an error reply (a wrong password surfaces at the first command) and
    ConnectionError when the connection is gone."""

    name = "Redis"

    @classmethod
    async def open(cls, host: str, port: int, password: str | None = None) -> "RespConnection":
        _, protocol = await asyncio.get_running_loop().create_connection(lambda: _Protocol(cls.name), host, port)
        conn = cls(protocol)
        if password:
            conn._hold(encode("AUTH", password), parse)
        return conn

    async def execute(self, *args: Any) -> Any:
        return await self._reply(self._send(encode(*args), parse))


async def run_protocol_async(gen: Generator[Any, Any, Any], execute) -> Any:
    """Drives a sans-IO protocol generator (`msjax.control.rendezvous.join_protocol`) with an async
    `await execute(*command) -> reply`; returns its value."""
    reply = None
    try:
        while True:
            reply = await execute(*gen.send(reply))
    except StopIteration as stop:
        return stop.value


# ---------------------------------------------------------------------------------------------------------------
# torch's TCPStore.

# c10d's QueryType (torch/csrc/distributed/c10d/TCPStoreBackend.hpp): the first byte of every command.
VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT = range(7)
PING = 13
# Sent with VALIDATE by every new connection (c10d::detail::validationMagicNumber); the server answers nothing to
# it and drops a connection whose first command is anything else.
VALIDATION_MAGIC = 0x3C85F7CE
STOP_WAITING = 0  # WaitResponseType: the keys a WAIT named all exist
READY = 0  # CheckResponseType
KEY_PREFIX = "/"  # torch's TCPStore client puts this before every key


def _fixed(fmt: str) -> Reader:
    size = struct.calcsize(fmt)

    def read(buf: bytes, pos: int) -> tuple[Any, int]:
        if len(buf) < pos + size:
            raise Incomplete
        return struct.unpack_from(fmt, buf, pos)[0], pos + size

    return read


_read_i64, _read_u32, _read_u8 = _fixed("<q"), _fixed("<I"), _fixed("<B")


def _read_bytes(buf: bytes, pos: int) -> tuple[bytes, int]:
    n, start = _read_i64(buf, pos)
    if len(buf) < start + n:
        raise Incomplete
    return buf[start:start + n], start + n


def _string(s: str | bytes) -> bytes:
    b = s if isinstance(s, bytes) else s.encode()
    return struct.pack("<Q", len(b)) + b


def _keys(keys: Sequence[str]) -> bytes:
    return struct.pack("<Q", len(keys)) + b"".join(_string(KEY_PREFIX + k) for k in keys)


class TCPStoreConnection(_Connection):
    """One connection to a torch TCPStore server: `await TCPStoreConnection.open(host, port)`, then the store's
    calls as torch's own client makes them (`torch.distributed.TCPStore`: add, set, get, wait, check).

    Wire format, as the torch 2.x client writes it and the libuv server reads it (torch/csrc/distributed/c10d/
    TCPStore.cpp, TCPStoreLibUvBackend.cpp; checked byte for byte against torch 2.13's client by
    tests/scripts/test_bench_init.py): a command is its QueryType byte and its arguments, little-endian;
    a string or payload is a uint64 length and the bytes, a key list a uint64 count and the keys, ADD's delta an
    int64. Replies carry no type, so each command knows its reply's shape: ADD an int64, GET a uint64 length and
    the bytes, WAIT and CHECK one byte, PING the uint32 nonce it sent; SET has none. A connection starts with
    VALIDATE (the magic number) and PING.

    Raises ConnectionError when the connection is gone (the server closes a connection on a malformed command),
    RuntimeError for a reply that is not what the command expects.
    """

    name = "TCPStore"

    @classmethod
    async def open(cls, host: str, port: int) -> "TCPStoreConnection":
        _, protocol = await asyncio.get_running_loop().create_connection(lambda: _Protocol(cls.name), host, port)
        conn = cls(protocol)
        nonce = int.from_bytes(os.urandom(4), "little")

        def pong(buf: bytes, pos: int) -> tuple[Any, int]:
            value, pos = _read_u32(buf, pos)
            ok = value == nonce
            return (None if ok else RuntimeError(f"TCPStore answered PING {nonce} with {value}")), pos

        conn._hold(struct.pack("<BI", VALIDATE, VALIDATION_MAGIC) + struct.pack("<BI", PING, nonce), pong)
        return conn

    async def add(self, key: str, delta: int) -> int:
        """The key's integer value after adding `delta` (a missing key counts as 0)."""
        return await self._reply(self._send(struct.pack("<B", ADD) + _string(KEY_PREFIX + key) +
                                            struct.pack("<q", delta), _read_i64))

    async def set(self, key: str, value: str | bytes) -> None:
        """Sets the key (no reply: the next command's reply follows it in order)."""
        await self._reply(self._send(struct.pack("<B", SET) + _string(KEY_PREFIX + key) + _string(value), None))

    async def wait(self, keys: Sequence[str]) -> None:
        """Returns once every key exists (the server answers when the last one is set)."""
        answer = await self._reply(self._send(struct.pack("<B", WAIT) + _keys(keys), _read_u8))
        if answer != STOP_WAITING:
            raise RuntimeError(f"TCPStore answered WAIT {list(keys)} with {answer}, not STOP_WAITING")

    async def get(self, key: str) -> bytes:
        """The key's value, waiting for it to exist: WAIT then GET, as torch's client does."""
        await self.wait([key])
        return await self._reply(self._send(struct.pack("<B", GET) + _string(KEY_PREFIX + key), _read_bytes))

    async def check(self, keys: Sequence[str]) -> bool:
        """Whether every key exists now (no wait)."""
        return await self._reply(self._send(struct.pack("<B", CHECK) + _keys(keys), _read_u8)) == READY
