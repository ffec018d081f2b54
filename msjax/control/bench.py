"""Start-up benchmark: N simulated workers rendezvous through a real Redis, beside torch's TCPStore pattern.

Redis side: N asyncio coroutines in this process, each with its own connection (`msjax.control.resp`, a minimal
RESP client: connect, AUTH), run `msjax.control.rendezvous.join_protocol`, the same generator real workers run
through redis-py: one EVAL (rank), one XREAD BLOCK (member count + coordinator). The clock runs from the first
connect to the last worker holding its assignment; the result is checked (ranks 0..N-1, one coordinator).

TCPStore side: `torch.distributed.TCPStore` (libuv server) when torch is installed, N client objects used from a
pool of threads (a TCPStore client is synchronous; its calls release the GIL) running the pattern torch's own
rendezvous runs for `init_process_group`: connect, rank = add("rank", 1) - 1 (as torchelastic assigns ranks),
rank 0 sets the coordinator key, then `_store_based_barrier` (add(key, 1); add(key, 0); the last worker sets
key:last_worker; everyone wait([key:last_worker])), then get(coordinator). Without torch, the row is skipped
with a note (no re-implementation here: the real server is the baseline worth having).
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import sys
import threading
import time
from datetime import timedelta

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


def bench_redis(n: int, connect_concurrency: int = 1024, timeout_s: float = 120.0) -> dict:
    """N simulated workers rendezvous through a fresh private redis-server; returns a result row.

    Args:
      n: number of simulated workers (ranks).
      connect_concurrency: connections being opened at once (a real fleet does not SYN 12k sockets in the same
        millisecond; the kernel's listen backlog would drop the excess and TCP would retry after 1 s).
      timeout_s: the rendezvous wait of each worker.
    Returns: {"system": "redis", "ranks", "seconds", "client", "server"}.
    Raises: RuntimeError if the ranks or the coordinator come out wrong.
    """
    raise_open_files_limit(n + 1024)
    with RedisServer(maxclients=n + 256) as srv:
        version = _server_version(srv)

        async def main() -> list:
            # A token queue, not asyncio.Semaphore: 3.11's Semaphore wakes waiters by scanning them all (O(n^2)
            # over 12k workers, measured at over a second of the simulation's own time).
            tokens: asyncio.Queue = asyncio.Queue()
            for _ in range(connect_concurrency):
                tokens.put_nowait(None)

            async def worker(i: int):
                await tokens.get()
                try:
                    conn = await RespConnection.open("127.0.0.1", srv.port, srv.password)
                finally:
                    tokens.put_nowait(None)
                try:
                    return await run_protocol_async(
                        join_protocol("bench", f"sim-{i}", n, f"10.0.{i // 256}.{i % 256}:8476",
                                      timeout_s=timeout_s), conn.execute)
                finally:
                    await conn.close()

            return await asyncio.gather(*(worker(i) for i in range(n)))

        server_cpu0 = _redis_cpu_s(srv)
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        got = _run(main())
        seconds = time.perf_counter() - t0
        client_cpu = time.process_time() - cpu0
        server_cpu = _redis_cpu_s(srv) - server_cpu0
    _check(sorted(a.rank for a in got), {a.coordinator for a in got}, n)
    return {"system": "redis", "ranks": n, "seconds": round(seconds, 3), "client_cpu_s": round(client_cpu, 3),
            "server_cpu_s": round(server_cpu, 3),
            "client": f"msjax.control.resp ({_loop_name()}, 1 connection per worker)", "server": f"redis-server {version}"}


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


def main(argv: list[str]) -> int:
    """scripts/bench_init.py: prints a table and writes --json PATH (a list of rows). Returns the exit status."""
    import argparse

    p = argparse.ArgumentParser(prog="bench_init.py", description="Rendezvous of N simulated workers: Redis "
                                "(msjax's protocol) beside torch's TCPStore patterns.")
    p.add_argument("--ranks", default=",".join(map(str, RANKS)), help="comma-separated worker counts")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--tcpstore", default="wait,poll", help="TCPStore patterns to run: wait, poll, or none")
    p.add_argument("--limit_s", type=float, default=120.0, help="give up on a TCPStore row after this long")
    p.add_argument("--poll_max_ranks", type=int, default=2048,
                   help="run the polling pattern only up to this many ranks (it keeps every simulated worker "
                        "thread busy: thousands of runnable threads on a shared machine)")
    args = p.parse_args(argv)
    try:
        ranks = [int(x) for x in args.ranks.split(",") if x]
        if not ranks or min(ranks) < 1:
            raise ValueError
    except ValueError:
        print(f"error: --ranks={args.ranks!r}: expected positive integers separated by commas", file=sys.stderr)
        return 2
    patterns = [] if args.tcpstore == "none" else args.tcpstore.split(",")
    if any(pt not in TCPSTORE_PATTERNS for pt in patterns):
        print(f"error: --tcpstore={args.tcpstore!r}: allowed are wait, poll (comma-separated) or none",
              file=sys.stderr)
        return 2
    load = os.getloadavg()[0]
    print(f"# {os.cpu_count()} CPUs, load average {load:.1f} at start (timings are wall clock under that load; "
          "*_cpu_s are CPU seconds)")
    rows = []
    if patterns:  # warm-up, not recorded: the first TCPStore clients of a process paid a one-off ~10 s here
        bench_tcpstore(16, "wait", limit_s=60)
    header = f"{'system':<9} {'ranks':>6} {'seconds':>8}  details"
    print(header)
    print("-" * len(header))
    for n in ranks:
        todo = [("redis", None)] + [("tcpstore", pt) for pt in patterns
                                    if pt != "poll" or n <= args.poll_max_ranks]
        for system, pt in todo:
            row = bench_redis(n) if system == "redis" else bench_tcpstore(n, pt, args.limit_s)
            if row is None:
                print(f"{'tcpstore':<9} {n:>6} {'-':>8}  torch not installed: no TCPStore baseline")
                continue
            rows.append(row)
            secs = "-" if row["seconds"] is None else f"{row['seconds']:.3f}"
            details = row.get("pattern") or f"client {row['client_cpu_s']:.2f} s + server {row['server_cpu_s']:.2f} s CPU"
            print(f"{row['system']:<9} {n:>6} {secs:>8}  {details}{'; ' + row['note'] if 'note' in row else ''}",
                  flush=True)
    print(f"# redis rows: {rows[0]['client'] if rows else ''}, {rows[0]['server'] if rows else ''}; "
          f"load average {os.getloadavg()[0]:.1f} at end")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
