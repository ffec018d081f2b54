"""Start-up benchmark: N simulated workers rendezvous through a real Redis, beside torch's TCPStore pattern.

Redis side: N asyncio coroutines in this process, each with its own connection (`msjax.control.resp`, a minimal
RESP client: connect, AUTH), run `msjax.control.rendezvous.join_protocol`, the same generator real workers run
through redis-py: one EVAL (rank), one XREAD BLOCK (member count + coordinator). The clock runs from the first
connect to the last worker holding its assignment; the result is checked (ranks 0..N-1, one coordinator).

TCPStore side: `torch.distributed.TCPStore` (libuv server) when torch is installed, N client objects used from a
pool of threads (a TCPStore client is synchronous; its calls release the GIL) running the pattern torch's own
rendezvous runs for `init_process_group`: connect, rank = add("rank", 1) - 1 (as torchelastic assigns ranks),
rank 0 sets the coordinator key, then `_store_based_barrier` (add(key, 1); add(key, 0); the last worker sets
key:last_worker; everyone wait([key:last_worker])), then get(coordinator). Without torch (or with
`--tcpstore_impl=twin`), a twin of it runs instead (`tcpstore_twin`): a single-threaded store server in its own
process with TCPStore's semantics (set, blocking get, add, wait) and the same worker pattern, driven by the same
asyncio client machinery as the Redis rows; its rows say so in "client".
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import resource
import threading
import time
from datetime import timedelta
from typing import Literal

from msjax.control.rendezvous import join_protocol, run_protocol_async
from msjax.control.resp import RespConnection
from msjax.control.server import RedisServer


def raise_open_files_limit(needed: int) -> int:
    """Raises this process's open-files soft limit to min(hard, needed); returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(hard, max(soft, needed)) if hard != resource.RLIM_INFINITY else max(soft, needed)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


async def _redis_workers(port: int, password: str, n: int, ids: range, connect_concurrency: int,
                         timeout_s: float) -> list:
    """Simulated workers `ids` (of n) rendezvous through Redis at 127.0.0.1:port; returns their Assignments."""
    # A token queue, not asyncio.Semaphore: 3.11's Semaphore wakes waiters by scanning them all (O(n^2) over 12k
    # workers, measured at over a second of the simulation's own time).
    tokens: asyncio.Queue = asyncio.Queue()
    for _ in range(connect_concurrency):
        tokens.put_nowait(None)

    async def worker(i: int):
        await tokens.get()
        try:
            conn = await RespConnection.open("127.0.0.1", port, password)
        finally:
            tokens.put_nowait(None)
        try:
            return await run_protocol_async(
                join_protocol("bench", f"sim-{i}", n, f"10.0.{i // 256}.{i % 256}:8476", timeout_s=timeout_s),
                conn.execute)
        finally:
            await conn.close()

    return await asyncio.gather(*(worker(i) for i in ids))


def _redis_client_process(port, password, n, ids, connect_concurrency, timeout_s, go, out) -> None:
    """One simulation process: waits for `go`, runs its workers, puts (CPU seconds, [(rank, coordinator)])."""
    raise_open_files_limit(len(ids) + 1024)
    go.wait()
    cpu0 = time.process_time()
    got = _run(_redis_workers(port, password, n, ids, connect_concurrency, timeout_s))
    out.put((time.process_time() - cpu0, [(a.rank, a.coordinator) for a in got]))


def bench_redis(n: int, client_procs: int = 1, connect_concurrency: int = 1024, timeout_s: float = 120.0) -> dict:
    """N simulated workers rendezvous through a fresh private redis-server; returns a result row.

    Args:
      n: number of simulated workers (ranks).
      client_procs: processes the simulated workers are spread over (1: all in this process). The clock starts
        when every process is ready (spawned, imports done) and stops when the last worker has its assignment.
      connect_concurrency: connections being opened at once per process (a real fleet does not SYN 12k sockets in
        the same millisecond; the kernel's listen backlog would drop the excess and TCP would retry after 1 s).
      timeout_s: the rendezvous wait of each worker.
    Returns: {"system": "redis", "ranks", "seconds", "client_cpu_s", "server_cpu_s", "client", "server"}.
    Raises: RuntimeError if the ranks or the coordinator come out wrong.
    """
    import multiprocessing as mp

    raise_open_files_limit(n + 1024)
    with RedisServer(maxclients=n + 256) as srv:
        version = _server_version(srv)
        server_cpu0 = _redis_cpu_s(srv)
        if client_procs <= 1:
            cpu0 = time.process_time()
            t0 = time.perf_counter()
            got = [(a.rank, a.coordinator) for a in _run(_redis_workers(srv.port, srv.password, n, range(n),
                                                                        connect_concurrency, timeout_s))]
            seconds = time.perf_counter() - t0
            client_cpu = time.process_time() - cpu0
        else:
            ctx = mp.get_context("spawn")
            go, out = ctx.Event(), ctx.Queue()
            procs = [ctx.Process(target=_redis_client_process, daemon=True,
                                 args=(srv.port, srv.password, n, range(k, n, client_procs), connect_concurrency,
                                       timeout_s, go, out)) for k in range(client_procs)]
            for pr in procs:
                pr.start()
            time.sleep(3.0)  # let the children finish importing before the clock starts
            t0 = time.perf_counter()
            go.set()
            parts = [out.get(timeout=timeout_s + 60) for _ in procs]
            seconds = time.perf_counter() - t0
            for pr in procs:
                pr.join(10)
            client_cpu = sum(c for c, _ in parts)
            got = [g for _, part in parts for g in part]
        server_cpu = _redis_cpu_s(srv) - server_cpu0
    _check(sorted(r for r, _ in got), {c for _, c in got}, n)
    procs_note = f", {client_procs} processes" if client_procs > 1 else ""
    return {"system": "redis", "ranks": n, "seconds": round(seconds, 3), "client_cpu_s": round(client_cpu, 3),
            "server_cpu_s": round(server_cpu, 3),
            "client": f"msjax.control.resp ({_loop_name()}, 1 connection per worker{procs_note})",
            "server": f"redis-server {version}"}


TCPSTORE_PATTERNS = {
    # torch >= 2.1 `_store_based_barrier`: one add, one read, the last worker sets a key everyone wait()s on.
    "wait": "torch 2.x barrier: add + wait(last_worker)",
    # torch <= 2.0 `_store_based_barrier` (the one MegaScale measured): every worker polls add(key, 0) every 10 ms
    # until the count reaches the world size: O(n) requests per round, O(n^2) in all.
    "poll": "torch 1.x barrier: poll add(key, 0) every 10 ms",
}


def bench_tcpstore(n: int, pattern: str = "wait", limit_s: float = 120.0) -> dict | None:
    """N simulated workers run torch's TCPStore rendezvous pattern (module docstring); None without torch.

    Args:
      n: number of simulated workers (one thread each: a TCPStore client is synchronous; its calls release the
        GIL).
      pattern: "wait" (torch 2.x barrier) or "poll" (torch 1.x barrier): see TCPSTORE_PATTERNS.
      limit_s: give up after this many seconds; the row then has seconds None and a note.
    Returns: {"system": "tcpstore", "ranks", "seconds", "pattern", "client", "server"} or None.
    """
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d logs a warning per client socket otherwise
    try:
        import torch
        from torch.distributed import TCPStore
    except ImportError:
        return None
    raise_open_files_limit(2 * n + 1024)
    from msjax.control.server import free_port

    port = free_port()
    timeout = timedelta(seconds=limit_s)
    server = TCPStore("127.0.0.1", port, n, is_master=True, timeout=timeout, wait_for_workers=False,
                      use_libuv=True)
    key = "store_based_barrier_key:1"
    results: list = [None] * n
    give_up = threading.Event()

    def worker(i: int) -> None:
        try:
            store = TCPStore("127.0.0.1", port, n, is_master=False, timeout=timeout, use_libuv=True)
            rank = store.add("rank", 1) - 1  # torchelastic-style rank assignment
            if rank == 0:
                store.set("coordinator", f"10.0.{i // 256}.{i % 256}:8476")
            store.add(key, 1)
            count = store.add(key, 0)
            if pattern == "wait":
                if count == n:
                    store.set(f"{key}:last_worker", "1")
                store.wait([f"{key}:last_worker"], timeout)
            else:
                while count != n and not give_up.is_set():
                    time.sleep(0.01)
                    count = store.add(key, 0)
                if count != n:
                    return
            results[i] = (rank, store.get("coordinator").decode())
        except Exception:  # a timeout: counted as unfinished below
            return

    threading.stack_size(256 * 1024)
    try:
        t0 = time.perf_counter()
        ts = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
        for t in ts:
            t.start()
        deadline = t0 + limit_s
        for t in ts:
            t.join(max(0.0, deadline - time.perf_counter()))
        seconds = time.perf_counter() - t0
        give_up.set()
        for t in ts:
            t.join(limit_s + 10)
    finally:
        threading.stack_size(0)
    del server
    row = {"system": "tcpstore", "ranks": n, "seconds": round(seconds, 3), "pattern": TCPSTORE_PATTERNS[pattern],
           "client": f"torch {torch.__version__} TCPStore (1 thread per worker)", "server": "TCPStore (libuv)"}
    unfinished = sum(r is None for r in results)
    if unfinished:
        row.update(seconds=None, note=f"{unfinished} of {n} workers unfinished after {limit_s:g} s")
        return row
    _check(sorted(r for r, _ in results), {c for _, c in results}, n)
    return row


# -- a TCPStore twin, for machines without torch ---------------------------------------------------------------
def _twin_server(port_queue) -> None:
    """A store server with TCPStore's semantics (c10d/TCPStore.hpp: set, get blocks until the key exists, add,
    wait), single-threaded like TCPStore's libuv server; commands arrive RESP-encoded (msjax.control.resp)."""
    from msjax.control.resp import Incomplete, parse  # the twin reads RESP-encoded commands

    data: dict[str, str] = {}
    waiters: dict[str, list] = {}

    def reply(value) -> bytes:
        if isinstance(value, int):
            return b":%d\r\n" % value
        b = value.encode()
        return b"$%d\r\n%s\r\n" % (len(b), b)

    class Handler(asyncio.Protocol):
        def connection_made(self, transport):
            self.t, self.buf = transport, b""

        def data_received(self, chunk):
            self.buf += chunk
            pos = 0
            while True:
                try:
                    cmd, pos = parse(self.buf, pos)
                except Incomplete:
                    break
                self.handle(cmd)
            self.buf = self.buf[pos:]

        def handle(self, cmd):
            op, key = cmd[0], cmd[1]
            if op == "SET":
                data[key] = cmd[2]
                self.t.write(b"+OK\r\n")
                for t, what in waiters.pop(key, []):
                    t.write(reply(data[key]) if what == "GET" else b"+OK\r\n")
            elif op == "ADD":
                data[key] = str(int(data.get(key, "0")) + int(cmd[2]))
                self.t.write(reply(int(data[key])))
                for t, what in waiters.pop(key, []):
                    t.write(reply(data[key]) if what == "GET" else b"+OK\r\n")
            elif op in ("GET", "WAIT"):
                if key in data:
                    self.t.write(reply(data[key]) if op == "GET" else b"+OK\r\n")
                else:
                    waiters.setdefault(key, []).append((self.t, op))

    async def main():
        server = await asyncio.get_running_loop().create_server(Handler, "127.0.0.1", 0, backlog=4096)
        port_queue.put(server.sockets[0].getsockname()[1])
        await asyncio.Event().wait()

    asyncio.run(main())


def bench_tcpstore_twin(n: int, pattern: str = "wait", limit_s: float = 120.0,
                        connect_concurrency: int = 1024) -> dict:
    """Like bench_tcpstore, against the TCPStore twin (module docstring); same row format."""
    import multiprocessing as mp

    raise_open_files_limit(n + 1024)
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    server = ctx.Process(target=_twin_server, args=(ports,), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=30)
        key = "store_based_barrier_key:1"

        async def main():
            tokens: asyncio.Queue = asyncio.Queue()
            for _ in range(connect_concurrency):
                tokens.put_nowait(None)

            async def worker(i: int):
                await tokens.get()
                try:
                    conn = await RespConnection.open("127.0.0.1", port)
                finally:
                    tokens.put_nowait(None)
                try:
                    rank = await conn.execute("ADD", "rank", 1) - 1
                    if rank == 0:
                        await conn.execute("SET", "coordinator", f"10.0.{i // 256}.{i % 256}:8476")
                    await conn.execute("ADD", key, 1)
                    count = await conn.execute("ADD", key, 0)
                    if pattern == "wait":
                        if count == n:
                            await conn.execute("SET", f"{key}:last_worker", "1")
                        await conn.execute("WAIT", f"{key}:last_worker")
                    else:
                        while count != n:
                            await asyncio.sleep(0.01)
                            count = await conn.execute("ADD", key, 0)
                    return rank, await conn.execute("GET", "coordinator")
                finally:
                    await conn.close()

            return await asyncio.wait_for(asyncio.gather(*(worker(i) for i in range(n))), limit_s)

        t0 = time.perf_counter()
        row = {"system": "tcpstore", "ranks": n, "pattern": TCPSTORE_PATTERNS[pattern],
               "client": f"TCPStore twin (torch not installed): {_loop_name()} clients, 1 connection per worker",
               "server": "TCPStore twin (Python asyncio, own process)"}
        try:
            got = _run(main())
        except asyncio.TimeoutError:
            return {**row, "seconds": None, "note": f"unfinished after {limit_s:g} s"}
        row["seconds"] = round(time.perf_counter() - t0, 3)
    finally:
        server.kill()
        server.join(10)
    _check(sorted(r for r, _ in got), {c for _, c in got}, n)
    return {"system": row.pop("system"), "ranks": row.pop("ranks"), "seconds": row.pop("seconds"), **row}


def _loop_name() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "asyncio+uvloop"


def _run(coro):
    """asyncio.run, on uvloop when it is installed: libuv's event loop (the loop Node.js uses) runs the
    simulation's thousands of connections with several times less Python per socket event. Optional: the bench
    says which loop ran."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _check(ranks: list[int], coordinators: set[str], n: int) -> None:
    if ranks != list(range(n)) or len(coordinators) != 1:
        raise RuntimeError(f"rendezvous of {n} workers went wrong: {len(set(ranks))} distinct ranks, "
                           f"{len(coordinators)} coordinators")


def _redis_cpu_s(srv: RedisServer) -> float:
    """CPU seconds (user + system) the server has used so far, from INFO cpu."""
    from msjax.control.store import connect

    c = connect(srv.url)
    try:
        info = c.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    finally:
        c.close()


def _server_version(srv: RedisServer) -> str:
    from msjax.control.store import connect

    c = connect(srv.url)
    try:
        return c.info("server").get("redis_version", "?")
    finally:
        c.close()


RANKS = (256, 1024, 2048, 4096, 12288)


@dataclasses.dataclass(frozen=True)
class InitBenchOptions:
    """scripts/bench_init.py's flags (parsed by msjax.cli).

    Attributes:
      ranks: simulated worker counts, one row each (comma-separated positive integers).
      json: also write the rows as JSON to this path.
      tcpstore: TCPStore patterns to run beside Redis: wait, poll (comma-separated), or none.
      client_procs: processes the simulated Redis workers are spread over (the clients are the bottleneck).
      tcpstore_impl: torch: torch.distributed.TCPStore; twin: msjax's stand-in; auto: torch if installed, else twin.
      limit_s: give up on a TCPStore row after this long, in seconds.
      poll_max_ranks: run the polling pattern only up to this many ranks (every simulated worker polls: busy threads).
    """

    ranks: str = ",".join(map(str, RANKS))
    json: str = ""
    tcpstore: str = "wait,poll"
    client_procs: int = 1
    tcpstore_impl: Literal["auto", "torch", "twin"] = "auto"
    limit_s: float = 120.0
    poll_max_ranks: int = 2048

    def checked(self) -> tuple[list[int], list[str]]:
        """(ranks, TCPStore patterns) from the flags. Raises ConfigError naming a bad flag and what is allowed."""
        from msjax.config import ConfigError

        parts = self.ranks.split(",")
        if not all(r.isdigit() and int(r) >= 1 for r in parts):
            raise ConfigError(f"--ranks={self.ranks!r}: allowed is positive integers separated by commas")
        patterns = [] if self.tcpstore == "none" else self.tcpstore.split(",")
        if any(pt not in TCPSTORE_PATTERNS for pt in patterns):
            raise ConfigError(f"--tcpstore={self.tcpstore!r}: allowed is wait, poll (comma-separated) or none")
        for name, value, low in (("client_procs", self.client_procs, 1), ("poll_max_ranks", self.poll_max_ranks, 0)):
            if value < low:
                raise ConfigError(f"--{name}={value}: allowed is an integer >= {low}")
        if self.limit_s <= 0:
            raise ConfigError(f"--limit_s={self.limit_s}: allowed is a number of seconds > 0")
        return [int(r) for r in parts], patterns


def run(opts: InitBenchOptions) -> int:
    """scripts/bench_init.py: prints a table and writes `opts.json` (a list of rows) when set. Returns the exit
    status. Raises ConfigError on a bad flag (`InitBenchOptions.checked`)."""
    ranks, patterns = opts.checked()
    load = os.getloadavg()[0]
    print(f"# {os.cpu_count()} CPUs, load average {load:.1f} at start (timings are wall clock under that load; "
          "*_cpu_s are CPU seconds)")
    rows = []
    if patterns and opts.tcpstore_impl != "twin":  # warm-up, not recorded
        bench_tcpstore(16, "wait", limit_s=60)
    header = f"{'system':<9} {'ranks':>6} {'seconds':>8}  details"
    print(header)
    print("-" * len(header))
    for n in ranks:
        todo = [("redis", None)] + [("tcpstore", pt) for pt in patterns
                                    if pt != "poll" or n <= opts.poll_max_ranks]
        for system, pt in todo:
            if system == "redis":
                row = bench_redis(n, client_procs=opts.client_procs)
            else:
                row = None if opts.tcpstore_impl == "twin" else bench_tcpstore(n, pt, opts.limit_s)
                if row is None and opts.tcpstore_impl == "torch":
                    from msjax.config import ConfigError

                    raise ConfigError("--tcpstore_impl=torch: torch is not installed; allowed here: auto, twin")
                if row is None:
                    row = bench_tcpstore_twin(n, pt, opts.limit_s)
            rows.append(row)
            secs = "-" if row["seconds"] is None else f"{row['seconds']:.3f}"
            if "pattern" in row:
                details = row["pattern"] + (" (twin)" if "twin" in row["client"] else "")
            else:
                details = f"client {row['client_cpu_s']:.2f} s + server {row['server_cpu_s']:.2f} s CPU"
            print(f"{row['system']:<9} {n:>6} {secs:>8}  {details}{'; ' + row['note'] if 'note' in row else ''}",
                  flush=True)
    print(f"# redis rows: {rows[0]['client'] if rows else ''}, {rows[0]['server'] if rows else ''}; "
          f"load average {os.getloadavg()[0]:.1f} at end")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
