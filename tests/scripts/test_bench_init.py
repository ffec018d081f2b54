"""The start-up benchmark (scripts/bench_init.py) and its store clients (scripts/store_clients.py), against real
servers: redis-server, and torch's own TCPStore server and client.

The TCPStore client is checked byte for byte against torch's: a relay between a client and the server records
what each client writes for the same calls, and the two recordings must be identical (PING's nonce aside); the
values each client writes are read by the other. The benchmark's rows are checked for their outcome and shape,
never for a speed (a benchmark reports, it does not pass or fail on a timing)."""

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from msjax.control.rendezvous import join_protocol
from msjax.control.server import RedisServer
from tests.scripts.loader import load_script

ROOT = Path(__file__).resolve().parents[2]


store_clients = load_script("store_clients")
bench_init = load_script("bench_init")


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as srv:
        yield srv


@pytest.fixture(scope="module")
def tcpstore_server():
    with bench_init.TCPStoreServer(timeout_s=60) as srv:
        yield srv


class Relay:
    """A TCP relay to `port` that records, per connection, the bytes the client sent, as (phase, bytes) pairs:
    `mark(phase)` labels what comes next. One connection at a time."""

    def __init__(self, port: int):
        self.port, self.sent, self.phase = port, [], "connect"
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listen_port = self.listener.getsockname()[1]
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def mark(self, phase: str) -> None:
        self.phase = phase

    def _accept(self) -> None:
        try:
            client, _ = self.listener.accept()
        except OSError:
            return
        server = socket.create_connection(("127.0.0.1", self.port))
        for src, dst, record in ((client, server, True), (server, client, False)):
            t = threading.Thread(target=self._pump, args=(src, dst, record), daemon=True)
            t.start()
            self.threads.append(t)

    def _pump(self, src, dst, record: bool) -> None:
        try:
            while data := src.recv(65536):
                if record:
                    self.sent.append((self.phase, data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def by_phase(self) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        for phase, data in self.sent:
            out[phase] = out.get(phase, b"") + data
        return out

    def recorded(self) -> int:
        return sum(len(d) for _, d in self.sent)

    def wait_for_more(self, than: int) -> int:
        """Waits (10 s at most) until more than `than` bytes are recorded: a call without a reply (SET) is only
        known to have left once the relay saw it. Returns the bytes recorded."""
        deadline = time.monotonic() + 10
        while self.recorded() <= than and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.recorded()

    def close(self) -> None:
        self.listener.close()
        for t in self.threads:
            t.join(10)



CALLS = [("add", ("rank", 5)), ("set", ("coordinator", "10.0.0.1:8476")), ("get", ("coordinator",)),
         ("wait", (["coordinator"],)), ("check", (["coordinator", "missing"],)), ("add", ("rank", -2))]


def test_tcpstore_client_writes_what_torchs_client_writes(tcpstore_server):
    """The same calls through torch's TCPStore client and through store_clients.TCPStoreConnection, each through a
    recording relay to the same real server: identical bytes per call (the connection's VALIDATE and PING aside,
    whose nonce is random, and which ours writes together with its first command), the same answers, and each
    client reads what the other wrote."""
    from torch.distributed import TCPStore

    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    torch_relay = Relay(tcpstore_server.port)
    theirs = TCPStore("127.0.0.1", torch_relay.listen_port, None, is_master=False, timeout=timedelta(seconds=30),
                      use_libuv=True)
    torch_answers = []
    for k, (name, args) in enumerate(CALLS):
        before = torch_relay.recorded()
        torch_relay.mark(f"{k}:{name}")
        answer = getattr(theirs, name)(*args)
        torch_answers.append(answer.decode() if isinstance(answer, bytes) else answer)
        torch_relay.wait_for_more(before)
    del theirs
    torch_relay.close()

    ours_relay = Relay(tcpstore_server.port)

    async def ours_calls():
        conn = await store_clients.TCPStoreConnection.open("127.0.0.1", ours_relay.listen_port)
        answers = []
        try:
            for k, (name, args) in enumerate(CALLS):
                before = ours_relay.recorded()
                ours_relay.mark(f"{k}:{name}")
                answer = await getattr(conn, name)(*args)
                answers.append(answer.decode() if isinstance(answer, bytes) else answer)
                await asyncio.to_thread(ours_relay.wait_for_more, before)
        finally:
            await conn.close()
        return answers

    our_answers = asyncio.run(ours_calls())
    ours_relay.close()
    # the second client continued the first one's counter and read its coordinator
    assert torch_answers == [5, None, "10.0.0.1:8476", None, False, 3]
    assert our_answers == [8, None, "10.0.0.1:8476", None, False, 6]

    theirs_sent, ours_sent = torch_relay.by_phase(), ours_relay.by_phase()
    handshake = bytes([store_clients.VALIDATE]) + (store_clients.VALIDATION_MAGIC).to_bytes(4, "little")
    assert theirs_sent["connect"][:5] == handshake and theirs_sent["connect"][5] == store_clients.PING
    assert len(theirs_sent["connect"]) == 10
    first = ours_sent["0:add"]
    assert first[:6] == theirs_sent["connect"][:6] and len(first) == 10 + len(theirs_sent["0:add"])
    assert first[10:] == theirs_sent["0:add"]
    for k, (name, _) in enumerate(CALLS[1:], start=1):
        assert ours_sent[f"{k}:{name}"] == theirs_sent[f"{k}:{name}"], name

    async def read_back():  # what torch's client set, ours reads; and the other way round
        conn = await store_clients.TCPStoreConnection.open("127.0.0.1", tcpstore_server.port)
        try:
            await conn.set("from_ours", "ours")
            return await conn.get("coordinator")
        finally:
            await conn.close()

    assert asyncio.run(read_back()) == b"10.0.0.1:8476"
    again = TCPStore("127.0.0.1", tcpstore_server.port, None, is_master=False, timeout=timedelta(seconds=30),
                     use_libuv=True)
    assert again.get("from_ours") == b"ours"


def test_resp_client_runs_the_rendezvous_protocol(redis_server):
    """64 asyncio workers through store_clients.RespConnection: msjax's rendezvous generator, the outcome redis-py
    gives (ranks 0..63, one coordinator); a wrong password is the server's WRONGPASS at the first command."""

    async def main():
        async def one(i):
            conn = await store_clients.RespConnection.open("127.0.0.1", redis_server.port, redis_server.password)
            try:
                return await store_clients.run_protocol_async(join_protocol("rdzv-resp", f"a{i}", 64, f"h{i}:1"),
                                                              conn.execute)
            finally:
                await conn.close()

        return await asyncio.gather(*(one(i) for i in range(64)))

    got = asyncio.run(main())
    assert sorted(a.rank for a in got) == list(range(64))
    assert len({a.coordinator for a in got}) == 1

    async def wrong_password():
        conn = await store_clients.RespConnection.open("127.0.0.1", redis_server.port, "wrong")
        try:
            await conn.execute("PING")
        finally:
            await conn.close()

    with pytest.raises(store_clients.RespError, match="WRONGPASS"):
        asyncio.run(wrong_password())


@pytest.mark.slow
def test_bench_init_runs_both_stores_and_the_barriers(tmp_path):
    """One small run of the whole benchmark: Redis and TCPStore joins of the same N workers, the TCPStore barriers
    of both patterns, every outcome checked by the script (no row has a note), the barrier rows' group count the
    layout's, and the machine the figures came from in the JSON."""
    out = tmp_path / "init.json"
    proc = subprocess.run([sys.executable, "scripts/bench_init.py", "--ranks=64,128", "--barriers=2", "--tp=4",
                           "--pp=2", "--poll_max_ranks=64", f"--json={out}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["store"], r["what"], r["ranks"]) for r in rows] == [
        ("redis", "join", 64), ("tcpstore", "join", 64), ("tcpstore", "barrier (wait)", 64),
        ("tcpstore", "barrier (poll)", 64),
        ("redis", "join", 128), ("tcpstore", "join", 128), ("tcpstore", "barrier (wait)", 128)]
    assert not [r for r in rows if "note" in r]
    assert all(r["seconds"] > 0 and r["client_cpu_s"] > 0 and r["server_cpu_s"] >= 0 for r in rows)
    barriers = [r for r in rows if "barrier" in r["what"]]
    assert [r["groups"] for r in barriers] == [64 // 4 + 64 // 2 + 64 // 8] * 2 + [128 // 4 + 128 // 2 + 128 // 8]
    assert all(r["groups_total_s"] == pytest.approx(r["seconds"] * r["groups"], abs=0.1) for r in barriers)
    assert result["machine"]["cpu"] and result["machine"]["torch"].startswith("2.13.0")
    assert "scripts/bench_init.py --ranks=64,128" in result["command"]
    assert re.search(r"^redis +join +64 +[0-9.]+ ", proc.stdout, re.M)
    assert re.search(r"^tcpstore +barrier \(wait\) +128 +[0-9.]+ +x 112 groups", proc.stdout, re.M)


def test_bench_init_flags_are_checked():
    for flag, message in (("--ranks=0", "error: --ranks='0'"), ("--patterns=spin", "error: --patterns='spin'"),
                          ("--tp=0", "error: --tp=0")):
        bad = subprocess.run([sys.executable, "scripts/bench_init.py", flag], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
        assert bad.returncode == 2 and bad.stderr.startswith(message), (flag, bad.stderr)
