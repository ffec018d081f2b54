"""The local backend: a job's workers as processes on this machine, unsupervised or under the supervisor.

    msjax-launch --backend=local --num_processes=2 --devices_per_process=4 [--supervise] -- --config=... --mesh.data=2

`ProcessGroup` is the one local process-group runner both kinds of run use: each worker is `python -m msjax.train
<train flags>` in a session (process group) of its own that dies with the launcher (PR_SET_PDEATHSIG), with the
MSJAX_* variables of msjax.launch.env (its fixed rank: the launcher's, the control plane's and jax's numbering is
one) and `devices_per_process` CPU devices. Its output goes to `<run_dir>/logs/` (rank<R>.log, or
attempt<K>.rank<R>.log under the supervisor), and to the terminal as msjax.launch.output says: rank 0's lines
and every rank's warnings and errors, `[rank R] `-prefixed.

Unsupervised (`run`): a private Redis (loopback, generated password, free port; or --redis_url), the workers,
and until they end:
  - a worker exits non-zero: the others are asked to leave (each says why in one line), then SIGTERM, then
    SIGKILL after --kill_grace_s; exit status 1.
  - Ctrl-C / SIGTERM to the launcher: a `stop` command naming the signal goes on the command channel (every worker
    stops after the same step, saves and exits 128 + the signal: see msjax.control.hook), SIGTERM is forwarded to
    the workers after --term_grace_s if they are still running (a second Ctrl-C forwards it at once), SIGKILL
    after --kill_grace_s more; exit status 128 + signal number.
  - a private Redis that dies mid-run is started again on the same port and password (workers reconnect);
  - Redis is stopped last, always; workers and Redis die with the launcher even if it is SIGKILLed.
Exit status 0 only if every worker finished (0); when every worker stopped resumably (75, or 128 + a signal)
that status; else 1.

Supervised (`LocalBackend`): the supervisor's WorkerBackend (msjax.supervise.supervisor) on logical hosts host0,
host1, ... (spares included), with warm standby workers (msjax.launch.standby) for restarts and the self-checks
as local subprocesses.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

from msjax.config import Config
from msjax.control.server import die_with_parent
from msjax.control.store import EXIT_REQUESTED
from msjax.launch.env import job_env, worker_env, worker_flags
from msjax.launch.options import LaunchOptions
from msjax.launch.output import Router, log_shows_lost_service
from msjax.supervise.detect import STOPPED_EXITS, describe_exit
from msjax.supervise.diagnostics import Checks, HostDiagnosis, command, diagnoses, passed_local
from msjax.supervise.supervisor import Worker, WorkerBackend


def train_command(train_flags: Sequence[str], python: str = sys.executable) -> list[str]:
    """The worker command: the installed package's train command, run by this interpreter."""
    return [python, "-m", "msjax.train", *train_flags]


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class ProcessGroup:
    """Worker processes on this machine (see the module docstring): started, their output routed, signalled,
    stopped. Every process it started is gone after `stop` or `kill`.

    Args:
      router: where the workers' output goes (msjax.launch.output.Router).
    """

    def __init__(self, router: Router):
        self.router = router
        self.procs: dict[int, subprocess.Popen] = {}
        self._pumps: list[threading.Thread] = []

    def start(self, rank: int, argv: Sequence[str], env: dict[str, str], log_path: Path,
              proc: subprocess.Popen | None = None) -> subprocess.Popen:
        """Starts worker `rank` as `argv` (or adopts `proc`, a standby already running with its output on a pipe);
        its output goes to `log_path` and the terminal. Returns the process."""
        if proc is None:
            # Own session: the launcher decides what a terminal's Ctrl-C means for the job; dies with the launcher.
            proc = subprocess.Popen(list(argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent)
        self.procs[rank] = proc
        self._pumps.append(self.router.pump(rank, proc.stdout, log_path))
        return proc

    def signal(self, sig: int) -> None:
        """Sends `sig` to the process group of every live worker."""
        for p in self.procs.values():
            if p.poll() is None:
                _signal_group(p, sig)

    def codes(self) -> dict[int, int | None]:
        return {rank: p.poll() for rank, p in self.procs.items()}

    def stop(self, grace_s: float) -> dict:
        """SIGTERM (and SIGCONT, so a stopped worker can act on it) to every live worker's group, then SIGKILL to
        whatever is left after `grace_s`; reaps every worker and waits for its output. Returns {"terminated": n,
        "killed": n}."""
        live = [p for p in self.procs.values() if p.poll() is None]
        for p in live:
            _signal_group(p, signal.SIGTERM)
            _signal_group(p, signal.SIGCONT)
        deadline = time.monotonic() + grace_s
        for p in live:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        killed = sum(1 for p in live if p.poll() is None)
        self.kill()
        return {"terminated": len(live) - killed, "killed": killed}

    def kill(self) -> None:
        """SIGKILL to every worker's group (any child left in it too); reaps them and waits for their output."""
        for p in self.procs.values():
            _signal_group(p, signal.SIGKILL)
        for p in self.procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:  # in the kernel's hands (D state); nothing more to send
                pass
        for t in self._pumps:
            t.join(timeout=5)
        self._pumps = []


# -- unsupervised ------------------------------------------------------------------------------------------------

class _Signals:
    """SIGINT/SIGTERM to the launcher, recorded for its watch loop (installed for the duration of a `with`)."""

    def __init__(self):
        self.first: int | None = None
        self.count = 0

    def _on(self, signum, frame) -> None:
        self.first = self.first or signum
        self.count += 1

    def __enter__(self) -> "_Signals":
        self._old = {s: signal.signal(s, self._on) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def run(opts: LaunchOptions, cfg: Config, run_id: str, train_flags: Sequence[str], out=sys.stdout) -> int:
    """Runs one unsupervised local job to its end (see the module docstring); returns the exit status.

    Raises ControlError when the private Redis cannot start or --redis_url cannot be reached."""
    from msjax.control.server import RedisServer
    from msjax.control.store import Store, connect

    router = Router(out)
    group = ProcessGroup(router)
    server = None
    log_dir = Path(cfg.train.run_dir) / "logs"
    with _Signals() as signals:
        try:
            if opts.redis_url:
                url = opts.redis_url
            else:
                server = RedisServer(port=opts.redis_port or None).start()
                url = server.url
                router.say(f"[launch] Redis {server.bind}:{server.port} (pid {server.pid}), run {run_id}")
            store = Store(connect(url), run_id)
            job = job_env(dict(os.environ), redis_url=url, run_id=run_id, num_processes=opts.num_processes,
                          rdzv_timeout_s=opts.rdzv_timeout_s, cpu_devices=opts.devices_per_process)
            for rank in range(opts.num_processes):
                # every worker runs on this machine: its host is the machine's (the supervisor's local backend
                # names logical hosts instead, host0, host1, ..., which it can exclude and replace)
                env = worker_env(job, rank=rank, host=socket.gethostname(), advertise_host="127.0.0.1",
                                 worker_id=f"local-{rank}")
                group.start(rank, train_command(train_flags), env, log_dir / f"rank{rank}.log")
            router.say(f"[launch] {opts.num_processes} workers started; their logs: {log_dir}/rank*.log")
            return _watch(opts, cfg, group, store, server, router, signals)
        finally:
            group.kill()
            if server is not None:
                server.close()


def _watch(opts: LaunchOptions, cfg: Config, group: ProcessGroup, store, server, router: Router,
           signals: _Signals) -> int:
    asked_at = stop_sent_at = term_sent_at = None  # monotonic times: survivors asked to leave, stop, SIGTERM
    killed = False
    leave_s = cfg.supervisor.heartbeat_period_s + 1.0  # asked to leave, a worker goes at its next heartbeat
    while True:
        codes = group.codes()
        if all(c is not None for c in codes.values()):
            break
        now = time.monotonic()
        if server is not None and server.proc is not None and server.proc.poll() is not None:
            # Our Redis died (OOM killer, a crash): bring it back on the same port and password; the workers
            # reconnect on their own and re-register (msjax.control.hook).
            router.say(f"[launch] Redis exited with status {server.proc.returncode}: restarting it")
            server.proc = None
            server.start()
            router.say(f"[launch] Redis {server.bind}:{server.port} (pid {server.pid})")
        # After our stop command, a worker that saved and left with a stopped status did what it was asked; its
        # peers are leaving by the same command and must not be signalled for it (a SIGTERM that reaches one after
        # its loop ended kills it, with its handler gone). A peer that hangs gets the SIGTERM of term_grace_s.
        bad = [(r, c) for r, c in codes.items() if c not in (None, 0)
               and not (stop_sent_at is not None and c in STOPPED_EXITS)]
        if bad and asked_at is None:
            reason = f"rank {bad[0][0]} exited: {describe_exit(bad[0][1])}"
            router.say(f"[launch] {reason}: stopping the others")
            try:  # each survivor leaves at its next heartbeat, saying why in one line
                beats = store.heartbeats(range(opts.num_processes))
                store.request_exit([hb.get("boot") for hb in beats.values()], reason)
            except Exception as e:  # noqa: BLE001 - SIGTERM and SIGKILL below end them all the same
                router.say(f"[launch] could not ask the workers to leave ({e}); relying on signals")
            asked_at = now
        if signals.first is not None and stop_sent_at is None:
            name = signal.Signals(signals.first).name
            router.say(f"[launch] {name}: stop command sent; SIGTERM to workers in {opts.term_grace_s:g} s if they "
                       "are still running")
            try:
                store.send_command("stop", source="launcher", signal=int(signals.first))
            except Exception as e:  # Redis down: SIGTERM after the grace period still stops the workers
                router.say(f"[launch] could not send the stop command ({e}); relying on SIGTERM")
            stop_sent_at = now
        if term_sent_at is None and ((asked_at is not None and now - asked_at >= leave_s) or (
                stop_sent_at is not None and (now - stop_sent_at >= opts.term_grace_s or signals.count > 1))):
            router.say("[launch] forwarding SIGTERM to the workers")
            group.signal(signal.SIGTERM)
            term_sent_at = now
        if term_sent_at is not None and not killed and now - term_sent_at >= opts.kill_grace_s:
            router.say("[launch] workers still running: SIGKILL")
            group.signal(signal.SIGKILL)
            killed = True
        time.sleep(0.1)
    codes = [c for _, c in sorted(group.codes().items())]
    if signals.first is not None:
        router.say(f"[launch] interrupted ({signal.Signals(signals.first).name}); worker exit statuses {codes}")
        return 128 + signals.first
    if not any(codes):
        router.say(f"[launch] all {len(codes)} workers finished")
        return 0
    if all(c == EXIT_REQUESTED or c in STOPPED_EXITS for c in codes):
        router.say(f"[launch] stopped before the end, resumable with --resume; worker exit statuses {codes}")
        return max(codes)
    router.say(f"[launch] failed: worker exit statuses {codes}")
    return 1


# -- supervised --------------------------------------------------------------------------------------------------

class LocalBackend(WorkerBackend):
    """The supervisor's backend for local processes (see the module docstring).

    Args:
      train_flags: the training command line, passed to every worker.
      devices_per_host: CPU devices each worker gets (XLA_FLAGS).
      log_dir: where each worker's output goes (attempt<K>.rank<R>.log) and the self-checks' (diag_<host>.log).
      router: where output reaches the terminal.
      env: base environment of the workers (default: this process's).
      rdzv_timeout_s: how long workers wait for each other at the Redis rendezvous.
      standby: keep warm standby workers for restarts: `warm` starts them, `launch` hands restarted workers to them.
    """

    def __init__(self, train_flags: Sequence[str], devices_per_host: int, log_dir: Path, router: Router,
                 env: dict[str, str] | None = None, rdzv_timeout_s: int = 300, standby: bool = False):
        self.train_flags = list(train_flags)
        self.devices_per_host = devices_per_host
        self.log_dir = Path(log_dir)
        self.router = router
        self.env = dict(os.environ if env is None else env)
        self.rdzv_timeout_s = rdzv_timeout_s
        self.standby = standby
        self.standbys_used = 0
        self._standbys: list[subprocess.Popen] = []
        self._group: ProcessGroup | None = None

    def _base_env(self) -> dict[str, str]:
        """What a standby must share with the workers it will become (what is read at import)."""
        from msjax.launch.env import cpu_devices_flag

        env = dict(self.env, PYTHONUNBUFFERED="1")
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        env["XLA_FLAGS"] = cpu_devices_flag(env.get("XLA_FLAGS", ""), self.devices_per_host)
        return env

    def launch(self, attempt: int, hosts: Sequence[str], overrides: dict, resume: bool, redis_url: str,
               run_id: str) -> list[Worker]:
        """Starts one worker per host (rank = position in `hosts`); a live standby takes a worker's place."""
        flags = worker_flags(self.train_flags, overrides, resume)
        job = job_env(self.env, redis_url=redis_url, run_id=run_id, num_processes=len(hosts),
                      rdzv_timeout_s=self.rdzv_timeout_s, cpu_devices=self.devices_per_host)
        self._group = ProcessGroup(self.router)
        self.standbys_used = 0
        workers = []
        for rank, host in enumerate(hosts):
            env = worker_env(job, rank=rank, host=host, advertise_host="127.0.0.1")
            log_path = self.log_dir / f"attempt{attempt}.rank{rank}.log"
            proc = self._group.start(rank, train_command(flags), env, log_path, proc=self._take_standby(flags, env))
            workers.append(Worker(rank, host, proc, time.time(), log_path,
                                  peer_lost=lambda p=log_path: log_shows_lost_service(p)))
        return workers

    def _take_standby(self, flags: list[str], env: dict[str, str]) -> subprocess.Popen | None:
        """Hands a worker to a live standby (None when there is none)."""
        while self._standbys:
            proc = self._standbys.pop(0)
            if proc.poll() is not None:
                continue
            try:
                proc.stdin.write(json.dumps({"argv": flags, "env": env}).encode() + b"\n")
                proc.stdin.close()
            except (BrokenPipeError, OSError):
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
                continue
            self.standbys_used += 1
            return proc
        return None

    def warm(self, count: int) -> None:
        """Starts standbys until `count` are alive (with `standby` on; the supervisor calls it once an attempt has
        taken its first step, so their imports do not slow the attempt's start-up)."""
        if not self.standby:
            return
        self._standbys = [p for p in self._standbys if p.poll() is None]
        while len(self._standbys) < count:
            self._standbys.append(subprocess.Popen(
                [sys.executable, "-m", "msjax.launch.standby"], env=self._base_env(), stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=die_with_parent))

    def close(self) -> None:
        """Ends the standbys (end of input, then SIGKILL to whatever is left after 5 s)."""
        for proc in self._standbys:
            try:
                proc.stdin.close()
            except OSError:
                pass
        for proc in self._standbys:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
            proc.stdout.close()
        self._standbys = []

    def stop(self, workers: Sequence[Worker], grace_s: float) -> dict:
        """Ends the attempt's workers (ProcessGroup.stop). Returns {"terminated": n, "killed": n}."""
        if self._group is None:
            return {"terminated": 0, "killed": 0}
        result, self._group = self._group.stop(grace_s), None
        return result

    def diagnose(self, hosts: Sequence[str], checks: Checks) -> list[HostDiagnosis]:
        """The self-checks of `hosts` as local subprocesses (one per host, each with this backend's devices),
        their all-reduce coordinated on loopback; each host's output is saved as diag_<host>.log."""
        from msjax.control.server import free_port

        env = {k: v for k, v in self._base_env().items() if not k.startswith("JAX_")}
        t0 = time.monotonic()
        outputs = self_checks(hosts, checks, env, lambda argv, host: argv, lambda host: f"127.0.0.1:{free_port()}")
        return diagnoses(hosts, outputs, checks.timeout_s, time.monotonic() - t0, self.log_dir)


def self_checks(hosts: Sequence[str], checks: Checks, env: dict[str, str],
                on_host: Callable[[list[str], str], list[str]], coordinator: Callable[[str], str]) -> list[str]:
    """The self-checks of `hosts` in two rounds; returns each host's output (both rounds).

    Round 1: every host's local checks alone (the site health check, matmul correctness and speed): a host whose
    check cannot even start (a dead node) is found at once and holds no one else back. Round 2: the cross-host
    all-reduce among the hosts that passed round 1, in the time left. `on_host(argv, host)` turns a check's command
    into the one that runs it on `host` (srun on SLURM, itself here); `coordinator(host)` gives the host:port of the
    all-reduce's service on `host`."""
    t0 = time.monotonic()
    outputs = run_checks([on_host(command(checks, host), host) for host in hosts], env, checks.timeout_s)
    passed = [i for i, out in enumerate(outputs) if passed_local(out)]
    if len(passed) > 1:
        address = coordinator(hosts[passed[0]])
        group = run_checks([on_host(command(checks, hosts[i], rank, len(passed), address, allreduce_only=True),
                                    hosts[i]) for rank, i in enumerate(passed)],
                           env, max(1.0, checks.timeout_s - (time.monotonic() - t0)))
        for i, out in zip(passed, group):
            outputs[i] += out
    return outputs


def run_checks(argvs: Sequence[Sequence[str]], env: dict[str, str], timeout_s: float) -> list[str]:
    """Runs one self-check process per host (`argvs`, in order; each `python -m msjax.supervise.diagnostics ...`,
    directly or through srun) and returns each one's output, once all have ended or `timeout_s` has passed (then
    what is left is killed, its whole process group)."""
    t0 = time.monotonic()
    procs = [subprocess.Popen(list(argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, text=True, start_new_session=True, preexec_fn=die_with_parent)
             for argv in argvs]
    outputs: list[list[str]] = [[] for _ in procs]
    readers = [threading.Thread(target=lambda p=p, out=out: out.extend(iter(p.stdout.readline, "")), daemon=True)
               for p, out in zip(procs, outputs)]
    for t in readers:
        t.start()

    while any(p.poll() is None for p in procs) and time.monotonic() - t0 < timeout_s:
        time.sleep(0.05)
    for p in procs:  # past the timeout, or a hung peer still holding its group open
        _signal_group(p, signal.SIGKILL)
        p.wait()
    for t in readers:
        t.join(timeout=5)
    return ["".join(out) for out in outputs]
