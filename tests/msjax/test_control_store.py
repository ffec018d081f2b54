"""The control plane against a real redis-server: rendezvous outcomes through redis-py (the start-up benchmark's
asyncio client runs the same protocol: tests/scripts/test_bench_init.py), run-state keys, the command channel into
LoopControl, reconnection after a Redis restart, and one clear error for each bad URL, password or port, with
nothing left running."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from msjax.control import ControlError, RendezvousError
from msjax.control.rendezvous import Assignment, rendezvous
from msjax.control.server import RedisServer
from msjax.control.store import Store, connect
from msjax.control.worker import WorkerContext
from msjax.events import read_events

ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie still answers kill(0): read its state
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _wait_dead(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def server():
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def client(server):
    c = connect(server.url)
    yield c
    c.close()


def _join_threads(url: str, run_id: str, ids: list[str], world: int, timeout_s: float = 10.0) -> dict:
    out, errors = {}, {}

    def worker(wid):
        try:
            out[wid] = rendezvous(connect(url), run_id, wid, world, f"host-{wid}:1234", timeout_s=timeout_s)
        except Exception as e:  # collected and asserted on below
            errors[wid] = e

    threads = [threading.Thread(target=worker, args=(w,)) for w in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 5)
    return out, errors


def test_rendezvous_assigns_distinct_ranks_and_rank0s_coordinator(server, client):
    ids = [f"w{i}" for i in range(16)]
    got, errors = _join_threads(server.url, "rdzv-ok", ids, 16)
    assert not errors
    ranks = sorted(a.rank for a in got.values())
    assert ranks == list(range(16))
    rank0 = next(w for w, a in got.items() if a.rank == 0)
    assert {a.coordinator for a in got.values()} == {f"host-{rank0}:1234"}
    assert {(a.world_size, a.generation) for a in got.values()} == {(16, 0)}
    members = Store(client, "rdzv-ok").members()
    assert {m["worker_id"] for m in members.values()} == set(ids)
    assert {r: m["worker_id"] for r, m in members.items()} == {a.rank: w for w, a in got.items()}


def test_late_duplicate_rejoin_mismatch_and_timeout(server, client):
    got, errors = _join_threads(server.url, "rdzv-late", ["a", "b"], 2)
    assert not errors and sorted(a.rank for a in got.values()) == [0, 1]
    with pytest.raises(RendezvousError, match=r"worker 'c' arrived late: run 'rdzv-late' generation 0 is already "
                                              r"complete with 2 of 2"):
        rendezvous(client, "rdzv-late", "c", 2, "c:1", timeout_s=1)
    with pytest.raises(RendezvousError, match=r"worker 'a' already joined run 'rdzv-late' generation 0 as rank "
                                              f"{got['a'].rank}"):
        rendezvous(client, "rdzv-late", "a", 2, "a:1", timeout_s=1)
    with pytest.raises(RendezvousError, match="expects 3 processes but run 'rdzv-late' generation 0 was started "
                                              "with 2"):
        rendezvous(client, "rdzv-late", "d", 3, "d:1", timeout_s=1)

    # A new generation (the job restarted): everyone joins afresh, also the worker that was late.
    store = Store(client, "rdzv-late")
    assert store.bump_restarts() == 1
    got2, errors2 = _join_threads(server.url, "rdzv-late", ["a", "c"], 2)
    assert not errors2 and {a.generation for a in got2.values()} == {1}
    assert sorted(a.rank for a in got2.values()) == [0, 1]

    # Re-admission: a worker that crashes and comes back before the generation is complete keeps its rank.
    t0 = time.monotonic()
    with pytest.raises(RendezvousError, match=r"worker 'x' \(rank 0\) timed out after 0.5 s waiting for all 2 "
                                              r"members of run 'rdzv-re' generation 0: 1 had arrived"):
        rendezvous(client, "rdzv-re", "x", 2, "x-first:1", timeout_s=0.5)
    assert time.monotonic() - t0 < 5
    got3, errors3 = {}, {}
    rejoin = threading.Thread(target=lambda: got3.setdefault("x", rendezvous(
        connect(server.url), "rdzv-re", "x", 2, "host-x:1234", timeout_s=10)))
    rejoin.start()
    deadline = time.monotonic() + 10  # x must be back (its record rewritten) before y completes the generation
    while "host-x:1234" not in (client.hget("msjax:rdzv-re:members", 0) or "") and time.monotonic() < deadline:
        time.sleep(0.01)
    got3["y"] = rendezvous(client, "rdzv-re", "y", 2, "host-y:1234", timeout_s=10)
    rejoin.join(15)
    assert got3["x"] == Assignment(rank=0, world_size=2, coordinator="host-x:1234", generation=0, rejoined=True)
    assert got3["y"].rank == 1 and got3["y"].coordinator == "host-x:1234" and not got3["y"].rejoined


def test_fixed_ranks_put_the_coordinator_on_rank_0_whatever_the_arrival_order(server, client):
    """MSJAX_RANK (SLURM_PROCID, a Job's completion index): each worker gets the rank it asked for and the
    coordinator is rank 0's address, here with rank 0 arriving last; bad requests are one clear error each."""
    got, errors = {}, {}

    def join(wid, rank):
        try:
            got[wid] = rendezvous(connect(server.url), "rdzv-fixed", wid, 3, f"host-{wid}:1234", timeout_s=10,
                                  requested_rank=rank)
        except Exception as e:  # collected and asserted on below
            errors[wid] = e

    threads = {}
    for wid, rank in (("node-c", 2), ("node-b", 1), ("node-a", 0)):
        threads[wid] = threading.Thread(target=join, args=(wid, rank))
        threads[wid].start()
        deadline = time.monotonic() + 10  # strictly in this order: wait until this one is recorded
        while client.hget("msjax:rdzv-fixed:g0:ranks", rank) is None and time.monotonic() < deadline:
            time.sleep(0.01)
    for th in threads.values():
        th.join(15)
    assert not errors, errors
    assert {w: a.rank for w, a in got.items()} == {"node-a": 0, "node-b": 1, "node-c": 2}
    assert {a.coordinator for a in got.values()} == {"host-node-a:1234"}

    with pytest.raises(RendezvousError, match=r"worker 'x' requested rank 3, outside \[0, 2\)"):
        rendezvous(client, "rdzv-fixed-bad", "x", 2, "x:1", timeout_s=1, requested_rank=3)
    with pytest.raises(RendezvousError, match=r"worker 'y' \(rank 1\) timed out after 0.2 s"):
        rendezvous(client, "rdzv-fixed-bad", "y", 2, "y:1", timeout_s=0.2, requested_rank=1)
    with pytest.raises(RendezvousError, match=r"worker 'z' requested rank 1 in run 'rdzv-fixed-bad' generation 0, "
                                              r"already held by worker 'y'"):
        rendezvous(client, "rdzv-fixed-bad", "z", 2, "z:1", timeout_s=1, requested_rank=1)
    with pytest.raises(RendezvousError, match="worker 'w' joined by arrival order, but run 'rdzv-fixed-bad' "
                                              "generation 0 was started the other way"):
        rendezvous(client, "rdzv-fixed-bad", "w", 2, "w:1", timeout_s=1)


def test_the_supervisor_takes_only_its_own_attempts_reports(server, client, tmp_path):
    """A worker of a stopped job can report its non-finite loss (at its loop's end) after the supervisor stopped
    reading for that job; the restarted job's watch must not take it for its own failure. The supervisor reads the
    reports of the generation it launched: here a generation-0 report posted late, then the restarted job's own."""
    from msjax.config import Config, apply_overrides
    from msjax.events import EventLog
    from msjax.supervise.supervisor import Supervisor, _Seen

    store = Store(client, "reports-by-generation")
    sup = Supervisor.__new__(Supervisor)  # the parts `_read_reports` uses, on a real Redis
    sup.cfg = apply_overrides(Config(), {"train.nonfinite": "stop"})  # a report is a failure, not a note
    sup.control, sup.events, sup._reports_read = store, EventLog(tmp_path), 0
    sup._generation = store.bump_restarts()  # the first restart: generation 1
    store.report(1, "nonfinite", 0, step=7, loss="nan")  # attempt 0's rank 1, late
    seen = {0: _Seen(), 1: _Seen()}
    sup._read_reports(1, seen)
    assert seen[1].nonfinite is None and seen[0].nonfinite is None
    store.report(0, "nonfinite", 1, step=9, loss="inf")
    sup._read_reports(1, seen)
    sup.events.close()
    assert seen[0].nonfinite == (9, "inf") and seen[1].nonfinite is None
    assert [(e["rank"], e["step"]) for e in read_events(tmp_path / "events.jsonl")
            if e["kind"] == "nonfinite_reported"] == [(0, 9)]


def test_store_run_state(server, client):
    store = Store(client, "state")
    assert store.restart_count() == 0
    assert store.heartbeat(3, 0.3, {"step": 17, "boot": "b3"}) == (False, None)
    assert store.heartbeats()[3]["step"] == 17 and store.heartbeats([3, 4]) == {3: {"step": 17, "boot": "b3"}}
    time.sleep(0.5)
    assert 3 not in store.heartbeats()  # expired: a dead rank
    # one heartbeat carries the exit request of its process (boot token), and re-creates a lost members record
    store.request_exit(["b3", ""], "rank 0 (host0) failed")
    assert store.heartbeat(3, 5, {"step": 18, "boot": "b3"}, member={"host": "h3"}) == (True, "rank 0 (host0) failed")
    assert store.heartbeat(3, 5, {"step": 19, "boot": "other"}, member={"host": "h3"}) == (False, None)
    store.clear_heartbeats([3])
    assert store.heartbeats() == {}
    store.report(1, "nonfinite", 0, step=4, loss="nan")
    assert [(r["rank"], r["kind"], r["generation"], r["step"]) for r in store.reports()] == [(1, "nonfinite", 0, 4)]
    assert store.reports(1) == []
    store.set_checkpoint("persistent", 20, "/ckpt/20")
    store.set_checkpoint("persistent", 10, "/ckpt/10")  # older: ignored
    store.set_checkpoint("local", 30, "/local/30")
    assert store.checkpoint("persistent")["step"] == 20 and store.checkpoints()["local"]["path"] == "/local/30"
    store.exclude_host("node-7", reason="ECC errors")
    assert store.excluded_hosts() == {"node-7"}
    store.post_event("custom", value=3)
    kinds = [e["kind"] for e in store.events()]
    assert kinds[-2:] == ["host_excluded", "custom"]
    first = store.send_command("checkpoint")
    store.send_command("profile", first_step=5, num_steps=2)
    cmds = store.read_commands()
    assert [c["kind"] for _, c in cmds] == ["checkpoint", "profile"] and cmds[0][0] == first
    assert store.read_commands(cmds[-1][0], block_s=0.05) == []
    with pytest.raises(ValueError, match="command 'pause': allowed are stop, checkpoint, profile"):
        store.send_command("pause")
    with pytest.raises(ValueError, match="profile command needs"):
        store.send_command("profile", first_step=1)
    with pytest.raises(ValueError, match="run id"):
        Store(client, "bad id")
    # Values are JSON, readable by any tool: never pickle.
    raw = client.hget(store.key("ckpt"), "persistent")
    assert raw.startswith("{") and '"step": 20' in raw


def test_command_channel_reaches_loop_control(server, client):
    """A single-process ControlPlaneHook: stop / checkpoint / profile commands arrive in LoopControl."""
    from msjax.control.hook import ControlPlaneHook
    from msjax.config import Config
    from msjax.hooks import LoopControl, RunContext

    store = Store(client, "hook")
    worker = WorkerContext(store=store, assignment=Assignment(0, 1, "h:1", 0), commands_after="0-0",
                           worker_id="w0", host="h0")
    hook = ControlPlaneHook(worker, period_s=0.1, ttl_s=5)
    ctx = RunContext(config=Config(name="t"), run_dir=Path("/nonexistent"), mesh=None, program=None,
                     start_step=0, control=LoopControl())
    hook.on_start(ctx)
    try:
        hook.on_step_end(ctx, 7, {})
        store.send_command("checkpoint")
        store.send_command("profile", first_step=9, num_steps=3)
        store.client.xadd(store.key("cmd"), {"json": '{"kind": "stop", "generation": 5}'})  # another generation
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and ctx.control.profile_request is None:
            time.sleep(0.02)
        assert ctx.control.take_checkpoint_request() and ctx.control.take_profile_request() == (9, 3)
        time.sleep(0.3)
        assert ctx.control.stop_reason is None
        store.send_command("stop")
        while time.monotonic() < deadline and ctx.control.stop_reason is None:
            time.sleep(0.02)
        assert ctx.control.stop_reason == "control plane: stop command" and ctx.control.stop_signal is None
        beat = store.heartbeats()[0]
        assert (beat["step"], beat["start_step"], beat["state"], beat["host"]) == (7, 0, "running", "h0")
    finally:
        hook.on_end(ctx, None)
    assert store.heartbeats()[0]["state"] == "finished"  # beating on until the process exits (close)
    hook.close()
    assert [e["kind"] for e in store.events()][-2:] == ["loop_start", "loop_end"]


def test_client_survives_a_redis_restart():
    """Kill Redis, start it again on the same port: the next command waits through the backoff and succeeds."""
    with RedisServer() as srv:
        store = Store(connect(srv.url), "restart")
        store.heartbeat(0, 10, {"step": 1})
        srv.kill()
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("id", store.post_event("after_restart")))
        t.start()
        time.sleep(1.0)
        srv.start()
        t.join(30)
        assert "id" in result
        assert [e["kind"] for e in store.events()] == ["after_restart"]  # a fresh (empty) server


def test_bad_url_password_and_port_are_one_clear_error(server):
    bad_pw = server.url.replace(server.password, "not-the-password")
    with pytest.raises(ControlError, match=r"refused the password") as e:
        connect(bad_pw)
    assert "not-the-password" not in str(e.value)  # the password is redacted
    with pytest.raises(ControlError, match="requires a password and none was given"):
        connect(f"redis://127.0.0.1:{server.port}/0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(ControlError, match=f"cannot reach Redis at redis://:\\*\\*\\*@127.0.0.1:{dead_port}/0"):
        connect(f"redis://:pw@127.0.0.1:{dead_port}/0")
    assert time.monotonic() - t0 < 10  # one error, not a retry loop
    with pytest.raises(ControlError, match="malformed"):
        connect("http://127.0.0.1:6379")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        srv = RedisServer(port=taken)
        with pytest.raises(ControlError, match=f"port {taken} on 127.0.0.1 is already in use"):
            srv.start()
        assert srv.proc is None
        srv.close()


def test_server_dies_with_its_owner():
    """SIGKILL the process that started Redis: the kernel (PR_SET_PDEATHSIG) ends the server too; a normal exit
    stops it through atexit."""
    # The owner holds the server until its stdin closes, so the server is seen alive before either ending.
    code = ("import sys; from msjax.control.server import RedisServer; s = RedisServer().start(); "
            "print(s.pid, flush=True); sys.stdin.readline()")
    for kill in (True, False):
        owner = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        pid = int(owner.stdout.readline())
        assert _alive(pid)
        if kill:
            owner.send_signal(signal.SIGKILL)
        owner.stdin.close()
        owner.wait(30)
        assert _wait_dead(pid), f"redis-server {pid} outlived its owner (kill={kill})"


def test_the_password_reaches_redis_on_stdin_never_on_a_command_line(tmp_path, monkeypatch):
    """Any user of a machine reads every process's command line (ps): RedisServer and `msjax-redis` (a cluster
    job's Redis, its password in MSJAX_REDIS_PASSWORD) hand the password over as configuration on stdin. The
    server is the real redis-server behind a wrapper (MSJAX_REDIS_SERVER) that records the command line it was
    started with (redis-server retitles itself once up, so its /proc cmdline would not show what ps showed at
    first). A password with a space, quotes and a backslash authenticates as given; a wrong one is refused."""
    from msjax.control.server import redis_server_binary

    argv_log = tmp_path / "argv.log"
    wrapper = tmp_path / "redis-server"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> {argv_log}\nexec {redis_server_binary()} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("MSJAX_REDIS_SERVER", str(wrapper))
    password = 'pa ss"wo\\rd-' + os.urandom(4).hex()
    with RedisServer(password=password) as srv:
        url = f"redis://127.0.0.1:{srv.port}/0"
        assert connect(url, password=password).ping()
        with pytest.raises(ControlError):
            connect(url, password="wrong", retries=0)
    port = subprocess.run([sys.executable, "-m", "msjax.control.server", "--free-port"], capture_output=True,
                          text=True, timeout=60, check=True).stdout.strip()
    assert port.isdigit() and 0 < int(port) < 65536
    proc = subprocess.Popen([sys.executable, "-m", "msjax.control.server", "--port", port, "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                            env={**os.environ, "MSJAX_REDIS_PASSWORD": password}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        client = None
        for _ in range(100):
            try:
                client = connect(f"redis://127.0.0.1:{port}/0", password=password, retries=0)
                break
            except ControlError:
                time.sleep(0.1)
        assert client is not None and client.ping()
    finally:
        proc.kill()
        proc.wait(30)
    started = argv_log.read_text().splitlines()
    assert len(started) == 2 and all(line.startswith("- ") for line in started), started
    assert not any(password in line or "requirepass" in line for line in started), started


def test_tls_options_reach_redis_py():
    import redis

    c = connect("rediss://:pw@redis.example:6380/0", ssl_ca_certs="/etc/ca.pem", ssl_certfile="/etc/c.pem",
                ssl_keyfile="/etc/k.pem", check=False)
    kw = c.connection_pool.connection_kwargs
    assert c.connection_pool.connection_class is redis.SSLConnection
    assert (kw["ssl_ca_certs"], kw["ssl_certfile"], kw["ssl_keyfile"]) == ("/etc/ca.pem", "/etc/c.pem", "/etc/k.pem")
    assert (kw["host"], kw["port"], kw["password"]) == ("redis.example", 6380, "pw")
    with pytest.raises(ControlError, match="TLS files were given for 'redis://:\\*\\*\\*@h:1/0', a plain redis:// URL"):
        connect("redis://:pw@h:1/0", ssl_ca_certs="/etc/ca.pem", check=False)


def test_metrics_sink_buffers_sends_json_rows_and_survives_an_outage():
    """Rows published go to the run's metrics stream as JSON, equal to what was published; with Redis away a flush
    fails, memory stays within capacity (oldest dropped, counted) and the kept rows go out once Redis is back."""
    import redis

    from msjax.control.metrics import RedisMetricsSink

    rng = np.random.default_rng(0)
    rows = [{"rank": int(r), "step": s, "loss": float(rng.standard_normal()), "step_s": float(rng.random()),
             "compile": s == 1} for s in range(1, 6) for r in range(3)]
    with RedisServer() as srv:
        store = Store(connect(srv.url, retries=0), "metrics")
        sink = RedisMetricsSink(store, capacity=4)
        for row in rows[:4]:
            sink.publish(row["rank"], row["step"], {k: v for k, v in row.items() if k not in ("rank", "step")})
        assert sink.flush() == 4 and sink.pending == 0
        got = store.metrics()
        assert [r for _, r in got] == rows[:4]
        raw = store.client.xrange(store.key("metrics"))[0][1]["json"]
        assert raw.startswith("{") and json.loads(raw) == rows[0]  # JSON, readable by any tool: never pickle
        assert {r: v["step"] for r, v in store.latest_metrics().items()} == {0: 2, 1: 1, 2: 1}
        srv.kill()
        for row in rows[4:]:  # 11 rows into a buffer of 4 while Redis is away
            sink.publish(row["rank"], row["step"], {k: v for k, v in row.items() if k not in ("rank", "step")})
        with pytest.raises((redis.ConnectionError, redis.TimeoutError)):
            sink.flush()
        assert sink.pending == 4 and sink.dropped == 7
        srv.start()  # a fresh, empty server on the same port
        sink.exclude_host("host3", "straggler")
        sink.close()
        assert [r for _, r in store.metrics()] == rows[-4:]  # the newest 4, in order
        assert store.metrics(after_id=store.metrics()[1][0]) == store.metrics()[2:]
        assert store.excluded_hosts() == {"host3"}
        store.client.close()
    with pytest.raises(ValueError, match="capacity=0"):
        RedisMetricsSink(None, capacity=0)
