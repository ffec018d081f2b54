"""Start-up benchmark: `python scripts/bench_init.py [--ranks=256,1024,2048,4096,12288] [--json=init.json]`.

What a job's start-up costs in its store, like with like, in one run. N simulated workers, each an asyncio
coroutine with its own TCP connection, talk to a real server in its own process through the same client machinery
(store_clients.py: the handshake written with the first command, one command at a time, uvloop when installed),
spread over `--client_procs` processes; the clock runs from the moment every client process is ready until the
last worker is done. Rows, per N:

  redis  join     msjax's rendezvous (`msjax.control.rendezvous.join_protocol`) against redis-server: one EVAL
                  (rank, member, coordinator; the last arriver XADDs to a stream) and one XREAD BLOCK that every
                  waiter wakes from: 2 round trips per worker.
  tcpstore join   the same rendezvous the way torch does it over its store, against torch's own TCPStore server
                  (`torch.distributed.TCPStore`, libuv backend, as torchrun and `init_process_group` start it):
                  rank = add("rank", 1) - 1, rank 0 sets the coordinator, torch's store-based barrier
                  (`_store_based_barrier`: add(key, 1), add(key, 0), the worker that counts N sets key:last_worker,
                  everyone waits on it), then get(coordinator) (a wait and a get, as torch's client does it).
  tcpstore barrier  what an O(N^2) init adds: after the join, `--barriers` more store-based barriers over all N
                  workers, timed from the last worker's join to the last worker's last barrier; the row gives the
                  seconds per barrier. torch < 2.1, and later torch with TORCH_DIST_INIT_BARRIER=1, runs one after
                  EVERY `new_group`, and every rank calls `new_group` for every group: a Megatron-style layout
                  creates N/tp tensor, N/pp pipeline and N/(tp pp) data-parallel groups (`--tp`, `--pp`), so the
                  row also gives that group count times the measured barrier: the barriers' total, derived from the
                  measurement, not timed end to end. Pattern `wait` is torch 2.x's barrier (above); `poll` is torch
                  1.x's (MegaScale's era): every worker polls add(key, 0) every 10 ms until the count reaches N, O(N)
                  requests per round (up to `--poll_max_ranks`). msjax's start-up runs no such barriers: its join,
                  then `jax.distributed.initialize`, whose coordination service has one barrier of its own.

Each run checks its outcome (ranks 0..N-1, one coordinator, every barrier passed) and reports the client and
server CPU seconds (`/proc/<pid>/stat`) beside the wall clock. torch comes with the `bench` extra
(`pip install -e ".[bench]"`, a CPU build of torch==2.13.0).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import multiprocessing as mp
import os
import platform
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from msjax import cli, runtime
from msjax.config import ConfigError
from msjax.control.rendezvous import join_protocol
from msjax.control.server import RedisServer
from msjax.hardware import cpu_model

sys.path.insert(0, str(Path(__file__).resolve().parent))  # store_clients.py beside this script, however loaded
from store_clients import RespConnection, TCPStoreConnection, run_protocol_async  # noqa: E402

# An entry point: the process set-up of a run (malloc on CPU, compilation cache, XLA:CPU collective flags),
# before jax starts a backend; importing msjax itself changes nothing (msjax.runtime).
runtime.setup()

RANKS = (256, 1024, 2048, 4096, 12288)
PATTERNS = ("wait", "poll")
POLL_INTERVAL_S = 0.01  # torch 1.x's store-based barrier sleeps 10 ms between polls
BARRIER_KEY = "store_based_barrier_key"  # torch's STORE_BASED_BARRIER_PREFIX
# Simulated workers in a child process start when the parent sets the go event; the parent waits this long for
# every child to be ready (spawned, imports done, open-files limit raised).
READY_TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True)
class InitBenchOptions:
    """bench_init.py's flags.

    Attributes:
      ranks: simulated worker counts, one set of rows each (comma-separated positive integers).
      json: also write the machine, the command and the rows as JSON to this path.
      barriers: store-based barriers timed after the TCPStore join (the row reports their mean); 0: none.
      patterns: the barrier patterns to time: wait (torch 2.x), poll (torch 1.x), comma-separated, or none.
      poll_max_ranks: time the polling barrier only up to this many ranks (every worker polls every 10 ms).
      tp: tensor-parallel size of the layout whose process groups the barrier rows count.
      pp: pipeline-parallel size of that layout.
      client_procs: processes the simulated workers are spread over.
      connect_concurrency: connections each client process opens at once (a fleet does not open 12k sockets in
        the same millisecond; past the listen backlog the kernel drops SYNs and TCP retries after 1 s).
      limit_s: give up on a run after this many seconds (its row then has no time and says how far it got).
    """

    ranks: str = ",".join(map(str, RANKS))
    json: str = ""
    barriers: int = 3
    patterns: str = ",".join(PATTERNS)
    poll_max_ranks: int = 2048
    tp: int = 8
    pp: int = 8
    client_procs: int = 1
    connect_concurrency: int = 1024
    limit_s: float = 300.0

    def checked(self) -> tuple[list[int], list[str]]:
        """(ranks, barrier patterns). Raises ConfigError naming a bad flag and what is allowed."""
        parts = self.ranks.split(",")
        if not all(r.isdigit() and int(r) >= 1 for r in parts):
            raise ConfigError(f"--ranks={self.ranks!r}: allowed is positive integers separated by commas")
        patterns = [] if self.patterns == "none" else self.patterns.split(",")
        if any(p not in PATTERNS for p in patterns):
            raise ConfigError(f"--patterns={self.patterns!r}: allowed is wait, poll (comma-separated) or none")
        for name, low in (("barriers", 0), ("poll_max_ranks", 0), ("tp", 1),
                          ("pp", 1), ("client_procs", 1), ("connect_concurrency", 1)):
            if getattr(self, name) < low:
                raise ConfigError(f"--{name}={getattr(self, name)}: allowed is an integer >= {low}")
        if self.limit_s <= 0:
            raise ConfigError(f"--limit_s={self.limit_s}: allowed is a number of seconds > 0")
        return [int(r) for r in parts], patterns


def groups(n: int, tp: int, pp: int) -> int:
    """Process groups a Megatron-style init creates on N ranks: N/tp tensor, N/pp pipeline and N/(tp pp)
    data-parallel groups (every rank calls `new_group` for each), at least one of each."""
    return max(1, n // tp) + max(1, n // pp) + max(1, n // (tp * pp))


# ---------------------------------------------------------------------------------------------------------------
# Machine, processes, servers.


def raise_open_files_limit(needed: int) -> int:
    """Raises this process's open-files soft limit to min(hard, needed); returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(hard, max(soft, needed)) if hard != resource.RLIM_INFINITY else max(soft, needed)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process `pid` has used so far (/proc/<pid>/stat, Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine() -> dict[str, Any]:
    """What the figures were measured on: CPU model, cores, load, versions, date."""
    model = cpu_model()
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    return {"cpu": model, "cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(), "torch": torch_version, "event_loop": loop_name()}


def loop_name() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "asyncio+uvloop"


def _run(coro):
    """asyncio.run, on uvloop when it is installed: libuv's event loop runs the simulation's thousands of
    connections with several times less Python per socket event. The rows say which loop ran."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


# A TCPStore server in a process of its own (like redis-server): it prints its port, then serves until its stdin
# closes, which also happens when the benchmark dies. It listens on an IPv4 socket made here and handed over
# (`master_listen_fd`), as redis-server listens on 127.0.0.1: the libuv server looks up every accepted client's
# host name (getnameinfo, for its log lines) on its one thread, and on its default "::" socket a client is
# ::ffff:127.0.0.1, which /etc/hosts does not name, so each lookup goes to DNS; with 127.0.0.1 /etc/hosts
# answers at once. (Where DNS does not answer, as in a sandbox, a burst of those lookups stalls the whole server
# for the resolver's timeout, 5 s: a cost of the machine's DNS, not of the store.)
_TCPSTORE_SERVER = """
import resource, socket, sys
from datetime import timedelta
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
from torch.distributed import TCPStore
sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
sock.bind(("127.0.0.1", 0))
sock.listen(socket.SOMAXCONN)
port = sock.getsockname()[1]
store = TCPStore("127.0.0.1", port, None, is_master=True, wait_for_workers=False, use_libuv=True,
                 master_listen_fd=sock.detach(), timeout=timedelta(seconds=float(sys.argv[1])))
print(store.port, flush=True)
sys.stdin.read()
"""


class TCPStoreServer:
    """torch's TCPStore server (libuv) in a child process; a context manager. Attributes: port, pid.

    Raises ConfigError when torch is not installed (it comes with the `bench` extra), RuntimeError when the server
    does not report its port within 60 s."""

    def __init__(self, timeout_s: float):
        try:
            import torch.distributed  # noqa: F401
        except ImportError:
            raise ConfigError('the TCPStore rows need torch, the comparison\'s other side: pip install -e '
                              '".[bench]" (a CPU build of torch==2.13.0)') from None
        env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}  # c10d logs a line per client socket otherwise
        self.proc = subprocess.Popen([sys.executable, "-c", _TCPSTORE_SERVER, str(timeout_s)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, text=True)
        self.pid = self.proc.pid
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(60)
        if not line or not line[0].strip().isdigit():
            self.close()
            raise RuntimeError(f"the TCPStore server (pid {self.pid}) did not report its port within 60 s")
        self.port = int(line[0])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def __enter__(self) -> "TCPStoreServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------------------------
# The simulated workers (run in client processes).


def _address(i: int) -> str:
    return f"10.0.{i // 256}.{i % 256}:8476"


async def _tcpstore_barrier(conn: TCPStoreConnection, name: str, n: int, pattern: str) -> None:
    """torch's `_store_based_barrier` over `n` workers: `wait` as torch 2.x, `poll` as torch 1.x."""
    key = f"{BARRIER_KEY}:{name}"
    await conn.add(key, 1)
    count = await conn.add(key, 0)
    if pattern == "wait":
        if count == n:
            await conn.set(f"{key}:last_worker", "1")
        await conn.wait([f"{key}:last_worker"])
    else:
        while count < n:
            await asyncio.sleep(POLL_INTERVAL_S)
            count = await conn.add(key, 0)


async def _worker(job: dict, i: int, tokens: asyncio.Queue) -> tuple[int, str, float, float]:
    """One simulated worker: connect, join, then the barriers. Returns (rank, coordinator, time joined, time done),
    times on the machine's monotonic clock (comparable across processes)."""
    await tokens.get()
    try:
        if job["store"] == "redis":
            conn = await RespConnection.open("127.0.0.1", job["port"], job["password"])
        else:
            conn = await TCPStoreConnection.open("127.0.0.1", job["port"])
    finally:
        tokens.put_nowait(None)
    n = job["n"]
    try:
        if job["store"] == "redis":
            got = await run_protocol_async(join_protocol("bench", f"sim-{i}", n, _address(i),
                                                         timeout_s=job["limit_s"]), conn.execute)
            rank, coordinator = got.rank, got.coordinator
        else:
            rank = await conn.add("rank", 1) - 1  # rank by arrival, as torchelastic hands them out
            if rank == 0:
                await conn.set("coordinator", _address(i))
            await _tcpstore_barrier(conn, "init", n, "wait")
            coordinator = (await conn.get("coordinator")).decode()
        joined = time.monotonic()
        for b in range(job["barriers"]):
            await _tcpstore_barrier(conn, f"group{b}", n, job["pattern"])
        return rank, coordinator, joined, time.monotonic()
    finally:
        await conn.close()


async def _workers(job: dict, ids: range) -> list:
    # A token queue, not asyncio.Semaphore: 3.11's Semaphore wakes waiters by scanning them all (O(n^2) over 12k
    # workers, measured at over a second of the simulation's own time).
    tokens: asyncio.Queue = asyncio.Queue()
    for _ in range(job["connect_concurrency"]):
        tokens.put_nowait(None)
    results = [asyncio.ensure_future(_worker(job, i, tokens)) for i in ids]
    done, pending = await asyncio.wait(results, timeout=job["limit_s"])
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    errors = [t.exception() for t in done if t.exception() is not None]
    if errors:
        raise errors[0]
    return [t.result() for t in done]


def _client_process(job: dict, ids: range, ready, go, out) -> None:
    """One client process: raises its open-files limit, says ready, waits for `go`, runs workers `ids`, puts
    (CPU seconds, results, unfinished count) or (None, error text)."""
    try:
        raise_open_files_limit(len(ids) + 1024)
        ready.put(os.getpid())
        go.wait()
        cpu0 = time.process_time()
        got = _run(_workers(job, ids))
        out.put((time.process_time() - cpu0, got, len(ids) - len(got)))
    except BaseException as e:  # reported by the parent, with the row it belongs to
        out.put((None, f"{type(e).__name__}: {e}", len(ids)))


def simulate(job: dict, procs: int) -> dict:
    """Runs `job["n"]` simulated workers in `procs` child processes; the clock starts when all are ready.

    Returns {"t0", "results": [(rank, coordinator, joined, done)], "client_cpu_s", "unfinished", "error"}.
    """
    ctx = mp.get_context("spawn")
    ready, go, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    children = [ctx.Process(target=_client_process, args=(job, range(k, job["n"], procs), ready, go, out),
                            daemon=True) for k in range(procs)]
    for child in children:
        child.start()
    try:
        for _ in children:
            ready.get(timeout=READY_TIMEOUT_S)
        t0 = time.monotonic()
        go.set()
        parts = [out.get(timeout=job["limit_s"] + 60) for _ in children]
    finally:
        for child in children:
            child.join(10)
            if child.is_alive():
                child.kill()
                child.join(10)
    errors = [p[1] for p in parts if p[0] is None]
    return {"t0": t0, "results": [r for p in parts if p[0] is not None for r in p[1]],
            "client_cpu_s": sum(p[0] for p in parts if p[0] is not None), "unfinished": sum(p[2] for p in parts),
            "error": errors[0] if errors else None}


def _checked(run: dict, n: int) -> str | None:
    """Why the run's outcome is wrong (unfinished workers, bad ranks, several coordinators), or None."""
    if run["error"]:
        return run["error"]
    if run["unfinished"]:
        return f"{run['unfinished']} of {n} workers unfinished"
    ranks = sorted(r for r, *_ in run["results"])
    coordinators = {c for _, c, *_ in run["results"]}
    if ranks != list(range(n)) or len(coordinators) != 1:
        return f"{len(set(ranks))} distinct ranks, {len(coordinators)} coordinators"
    return None


# ---------------------------------------------------------------------------------------------------------------
# One run per store.


def bench_redis(n: int, opts: InitBenchOptions) -> dict:
    """msjax's join of `n` simulated workers against a fresh private redis-server; one result row."""
    raise_open_files_limit(n + 1024)
    with RedisServer(maxclients=n + 256) as srv:
        from msjax.control.store import connect

        c = connect(srv.url)
        version = c.info("server").get("redis_version", "?")
        c.close()
        job = dict(store="redis", port=srv.port, password=srv.password, n=n, barriers=0, pattern="wait",
                   connect_concurrency=opts.connect_concurrency, limit_s=opts.limit_s)
        server_cpu0 = cpu_seconds(srv.pid)
        run = simulate(job, opts.client_procs)
        server_cpu = cpu_seconds(srv.pid) - server_cpu0
    wrong = _checked(run, n)
    return {"store": "redis", "what": "join", "ranks": n,
            "seconds": None if wrong else round(max(j for *_, j, _ in run["results"]) - run["t0"], 3),
            "client_cpu_s": round(run["client_cpu_s"], 3), "server_cpu_s": round(server_cpu, 3),
            "client": _client_note(opts), "server": f"redis-server {version}", **({"note": wrong} if wrong else {})}


def bench_tcpstore(n: int, opts: InitBenchOptions, pattern: str, barriers: int, with_join: bool) -> list[dict]:
    """The TCPStore join of `n` simulated workers and `barriers` store-based barriers of `pattern` after it,
    against a fresh TCPStore server; the join row (if `with_join`) and the barrier row (if `barriers`)."""
    import torch

    raise_open_files_limit(n + 1024)
    with TCPStoreServer(opts.limit_s) as srv:
        job = dict(store="tcpstore", port=srv.port, password=None, n=n, barriers=barriers, pattern=pattern,
                   connect_concurrency=opts.connect_concurrency, limit_s=opts.limit_s)
        server_cpu0 = cpu_seconds(srv.pid)
        run = simulate(job, opts.client_procs)
        server_cpu = cpu_seconds(srv.pid) - server_cpu0
    wrong = _checked(run, n)
    common = {"store": "tcpstore", "ranks": n, "client_cpu_s": round(run["client_cpu_s"], 3),
              "server_cpu_s": round(server_cpu, 3), "client": _client_note(opts),
              "server": f"torch {torch.__version__} TCPStore (libuv)", **({"note": wrong} if wrong else {})}
    rows = []
    joined = None if wrong else max(j for *_, j, _ in run["results"])
    if with_join:
        rows.append({"what": "join", "seconds": None if wrong else round(joined - run["t0"], 3), **common})
    if barriers:
        per = None if wrong else (max(d for *_, d in run["results"]) - joined) / barriers
        g = groups(n, opts.tp, opts.pp)
        rows.append({"what": f"barrier ({pattern})", "seconds": None if per is None else round(per, 4),
                     "barriers_timed": barriers, "groups": g, "layout": f"tp {opts.tp} x pp {opts.pp}",
                     "groups_total_s": None if per is None else round(per * g, 1), **common})
    return rows


def _client_note(opts: InitBenchOptions) -> str:
    procs = f"{opts.client_procs} process{'es' if opts.client_procs > 1 else ''}"
    return f"store_clients.py on {loop_name()}, 1 connection per worker, {procs}"


# ---------------------------------------------------------------------------------------------------------------


def _print_row(row: dict) -> None:
    secs = "-" if row["seconds"] is None else f"{row['seconds']:.4f}" if "barrier" in row["what"] else \
        f"{row['seconds']:.3f}"
    detail = f"client {row['client_cpu_s']:.2f} s + server {row['server_cpu_s']:.2f} s CPU"
    if "groups" in row and row["groups_total_s"] is not None:
        detail = f"x {row['groups']} groups ({row['layout']}) = {row['groups_total_s']:.1f} s; " + detail
    if "note" in row:
        detail += f"; {row['note']}"
    print(f"{row['store']:<9} {row['what']:<20} {row['ranks']:>6} {secs:>9}  {detail}", flush=True)


def run(opts: InitBenchOptions) -> int:
    """Runs the rows (module docstring), prints a table and writes `opts.json` when set. Returns the exit status.
    Raises ConfigError on a bad flag, or when torch is missing."""
    ranks, patterns = opts.checked()
    info = machine()
    print(f"# {info['cpu']}, {info['cpus']} CPUs, load average {info['load_avg_1m']} at start; {info['date']}; "
          f"python {info['python']}, torch {info['torch']}, {info['event_loop']}")
    header = f"{'store':<9} {'what':<20} {'ranks':>6} {'seconds':>9}  details"
    print(header)
    print("-" * len(header))
    rows: list[dict] = []
    for n in ranks:
        todo = [("redis", None)]
        wanted = [p for p in patterns if p != "poll" or n <= opts.poll_max_ranks]
        todo += [("tcpstore", p) for p in (wanted or ["wait"])]
        for k, (kind, pattern) in enumerate(todo):
            if kind == "redis":
                new = [bench_redis(n, opts)]
            else:
                first = k == 1  # the join is reported from the first TCPStore run
                new = bench_tcpstore(n, opts, pattern, opts.barriers if wanted else 0, with_join=first)
            for row in new:
                _print_row(row)
            rows += new
    info["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    print(f"# load average {info['load_avg_1m_end']} at end; seconds of barrier rows are per barrier")
    result = {"machine": info, "command": " ".join(["scripts/bench_init.py", *sys.argv[1:]]), "rows": rows}
    print(json.dumps(result))  # the one JSON line every benchmark ends with (scripts/README.md)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def main(argv: list[str]) -> int:
    def body() -> int:
        common, opts = cli.parse_options(argv, InitBenchOptions(), prog="bench_init.py", description=__doc__)
        cli.setup_logging(common)
        opts.checked()
        if opts.json:
            cli.check_writable(opts.json, "--json")
        return run(opts)

    return cli.main_guard(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
