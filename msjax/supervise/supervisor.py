"""The supervisor loop: launch the workers, watch them, and on a failure stop, diagnose, exclude, re-plan and
restart from the newest complete checkpoint, within a restart budget (MegaScale sec. 5, fig. 8).

    launch -> watch (heartbeats, exit codes, reports; msjax.supervise.detect)
           -> failure: SIGTERM, then SIGKILL after supervisor.stop_grace_s
           -> diagnostics on every host (msjax.supervise.diagnostics); exclude the hosts that fail
           -> a spare replaces an excluded host, else re-plan the same global batch onto the devices left
              (msjax.supervise.replan), else stop with a report
           -> backoff, restart with --resume (Orbax restores onto the new mesh); a spent budget ends the run.
Every step of that is an event in `<run_dir>/events.jsonl` and in Redis (msjax.supervise.events).

Where and how workers run is a backend's only concern, behind a small interface (`WorkerBackend`: launch the
workers on given hosts, stop them, run the self-checks on given hosts, deliver an injected fault); every policy
above is this module's and is the same for all of them:
  `LocalBackend` runs each host as a local process group (`devices_per_host` CPU devices or the machine's
    accelerators);
  `msjax.supervise.slurm.SlurmBackend` runs the workers as one `srun` job step inside an allocation (one task per
    node, `--nodelist` the hosts kept, `--exclude` the excluded), the self-checks as another;
  `msjax.supervise.k8s.JobSetBackend` leaves starting the pods to a JobSet and restarts them through it.
Fault injection (`Fault`) is for tests and benchmarks: it kills (SIGKILL), stops (SIGSTOP) or
fails the diagnostics of a worker when its reported step reaches a given step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence

from msjax.config import Config, apply_overrides
from msjax.planner import PlanError
from msjax.supervise import detect
from msjax.supervise.diagnostics import TEST_FAIL_ENV, HostDiagnosis, diagnose_local
from msjax.supervise.exclusion import straggler_exclusions
from msjax.supervise.events import EventLog, effective_time, fault_figures, read_events
from msjax.supervise.policy import RestartBudgetExhausted, RestartPolicy
from msjax.supervise.replan import planner_hardware, replan
from msjax.supervise.store import HeartbeatStore

ROOT = Path(__file__).resolve().parents[2]
FAULT_KINDS = ("kill", "stop", "diag")
# Set per worker by `LocalBackend.launch`; any inherited value would join the wrong job.
_JAX_LAUNCH_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


@dataclass(frozen=True)
class Fault:
    """A fault to inject (tests and benchmarks only).

    Attributes:
      kind: "kill" (SIGKILL the worker), "stop" (SIGSTOP it: a hang), "diag" (SIGABRT it, the way XLA's or a
        driver's checks end a process on a faulty device, and make its host fail the matmul self-check).
      rank: which worker of the attempt.
      step: inject once the worker reports this step (0: at its first heartbeat).
      attempt: the attempt to inject in; None injects in every attempt (a fault loop).
      relative: `step` counts from the step the attempt resumed from.
    """

    kind: str
    rank: int
    step: int
    attempt: int | None = 0
    relative: bool = False

    @staticmethod
    def parse(spec: str) -> "Fault":
        """'KIND:RANK@STEP' (first attempt), '...#A' (attempt A) or '...#*' (every attempt); '@+N' is N steps
        after the attempt's resume step.

        Raises ValueError naming the spec and the allowed form."""
        m = re.fullmatch(r"(\w+):(\d+)@(\+?)(\d+)(?:#(\d+|\*))?", spec.strip())
        if not m or m.group(1) not in FAULT_KINDS:
            raise ValueError(f"fault {spec!r}: allowed is KIND:RANK@[+]STEP[#ATTEMPT|#*] with KIND one of "
                             f"{', '.join(FAULT_KINDS)}")
        attempt = m.group(5)
        return Fault(m.group(1), int(m.group(2)), int(m.group(4)),
                     None if attempt == "*" else int(attempt or 0), relative=bool(m.group(3)))


@dataclass
class Worker:
    """A launched worker (one per host).

    Attributes:
      rank: its slot in the attempt's host list.
      host: the host it runs on (a backend that cannot tell in advance may correct it from the worker's heartbeat).
      proc: anything with `poll()` (None while running, else the exit code; negative: killed by that signal) and
        `pid`: the worker's process for the local backend, a per-task view of the job step for SLURM.
      started_at: when it was launched (time.time()).
      log_path: where its output goes.
    """

    rank: int
    host: str
    proc: Any
    started_at: float
    log_path: Path


class WorkerBackend(Protocol):
    """How to start and stop workers on which hosts: the only part of supervision that differs between a local
    run, a SLURM allocation and a Kubernetes JobSet (see the module docstring)."""

    def launch(self, attempt: int, hosts: Sequence[str], overrides: dict, resume: bool, redis_url: str,
               run_id: str) -> list[Worker]:
        """Starts one worker per host (slot = position in `hosts`) running the job's train command with
        `--KEY=VALUE` for each override (and `--resume`), joined to the run `run_id` on `redis_url`."""

    def stop(self, workers: Sequence[Worker], grace_s: float) -> dict:
        """Asks every live worker to end (SIGTERM or the backend's equivalent), forces it after `grace_s`.
        Returns {"terminated": n, "killed": n}; nothing of the workers runs after it returns."""

    def diagnose(self, hosts: Sequence[str], timeout_s: float, min_flops: float,
                 failing: Sequence[str] = ()) -> list[HostDiagnosis] | None:
        """The self-checks (msjax.supervise.diagnostics) on `hosts`, one HostDiagnosis each in order; None when
        the backend cannot run them (they then run elsewhere, e.g. a Kubernetes initContainer). `failing`: hosts
        given the test-only failure setting."""

    def inject(self, worker: Worker, sig: int, pid: int | None) -> None:
        """Delivers `sig` to a worker (fault injection, tests and benchmarks); `pid` is the process id from its
        heartbeat."""


def worker_base_env(env: dict[str, str], devices_per_host: int) -> dict[str, str]:
    """A worker's environment before its MSJAX_* variables: `env` without inherited jax.distributed settings,
    with `devices_per_host` CPU devices forced through XLA_FLAGS (0: left alone), unbuffered output and this
    checkout on PYTHONPATH."""
    env = {k: v for k, v in env.items() if k not in _JAX_LAUNCH_VARS}
    if devices_per_host:
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices_per_host}".strip()
    env["PYTHONUNBUFFERED"] = "1"
    # jax's persistent compilation cache (on by default: msjax.runtime) keeps only executables that took over 1 s to
    # compile; a restart wants every one of them back (init, restore, eval, step), so keep them all.
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


class LocalBackend:
    """Runs each host of the job as a local process group: `scripts/train.py` with the job's flags.

    Args:
      train_flags: the training command line (`--config=... --train.steps=...`), passed to every worker.
      devices_per_host: CPU devices each worker gets (XLA_FLAGS); 0 leaves the device setup alone.
      log_dir: where each worker's output goes (attempt<k>_<host>.log).
      env: base environment of the workers (default: this process's).
      rdzv_timeout_s: how long workers wait for each other at the Redis rendezvous.
      standby: keep warm standby workers (msjax.supervise.standby) for restarts: `warm` starts them, `launch`
        hands restarted workers to them.
    """

    def __init__(self, train_flags: Sequence[str], devices_per_host: int, log_dir: Path,
                 env: dict[str, str] | None = None, rdzv_timeout_s: int = 300, standby: bool = False):
        self.standby = standby
        self._standbys: list[subprocess.Popen] = []
        self.standbys_used = 0
        self.train_flags = list(train_flags)
        self.rdzv_timeout_s = rdzv_timeout_s
        self.devices_per_host = devices_per_host
        self.log_dir = Path(log_dir)
        self.env = dict(os.environ if env is None else env)

    def host_env(self) -> dict[str, str]:
        return worker_base_env(self.env, self.devices_per_host)

    def launch(self, attempt: int, hosts: Sequence[str], overrides: dict, resume: bool, redis_url: str,
               run_id: str) -> list[Worker]:
        """Starts one worker per host (slot = position in `hosts`), each in a new session (process group) that
        dies with this process. Workers join the run through the control plane's Redis rendezvous
        (msjax.control.worker), which assigns their jax process ids."""
        from msjax.control.launch import worker_env
        from msjax.control.server import die_with_parent

        self.log_dir.mkdir(parents=True, exist_ok=True)
        flags = self.train_flags + [f"--{k}={v}" for k, v in overrides.items()] + (["--resume"] if resume else [])
        workers = []
        self.standbys_used = 0
        for slot, host in enumerate(hosts):
            env = worker_env(self.host_env(), redis_url=redis_url, run_id=run_id, num_processes=len(hosts),
                             worker_index=slot, devices_per_process=self.devices_per_host or None,
                             rdzv_timeout_s=self.rdzv_timeout_s)
            env.update(MSJAX_SUPERVISED="1", MSJAX_SLOT=str(slot), MSJAX_HOST=host, MSJAX_WORKER_ID=host)
            log_path = self.log_dir / f"attempt{attempt}_{host}.log"
            proc = self._take_standby(flags, env, log_path)
            if proc is not None:
                workers.append(Worker(slot, host, proc, time.time(), log_path))
                continue
            with log_path.open("w") as log:
                proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "train.py"), *flags], cwd=str(ROOT),
                                        env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True, preexec_fn=die_with_parent)
            workers.append(Worker(slot, host, proc, time.time(), log_path))
        return workers

    def _take_standby(self, flags: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen | None:
        """Hands a worker to a live standby (None when there is none)."""
        while self._standbys:
            proc = self._standbys.pop(0)
            if proc.poll() is not None:
                continue
            try:
                proc.stdin.write(json.dumps({"argv": flags, "env": env, "log": str(log_path)}) + "\n")
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
        from msjax.control.server import die_with_parent

        if not self.standby:
            return
        self._standbys = [p for p in self._standbys if p.poll() is None]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        while len(self._standbys) < count:
            log = (self.log_dir / f"standby_{time.time_ns()}.log").open("w")
            with log:
                self._standbys.append(subprocess.Popen(
                    [sys.executable, "-m", "msjax.supervise.standby"], cwd=str(ROOT), env=self.host_env(),
                    stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True,
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
        self._standbys = []

    @staticmethod
    def stop(workers: Sequence[Worker], grace_s: float) -> dict:
        """SIGTERM (and SIGCONT, so a stopped worker can act on it) to every live worker's process group, then
        SIGKILL to whatever is left after `grace_s`. Returns {"terminated": n, "killed": n}; reaps every worker."""
        live = [w for w in workers if w.proc.poll() is None]
        for w in live:
            _signal_group(w.proc, signal.SIGTERM)
            _signal_group(w.proc, signal.SIGCONT)
        deadline = time.monotonic() + grace_s
        for w in live:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        killed = 0
        for w in workers:
            if w.proc.poll() is None:
                killed += 1
            _signal_group(w.proc, signal.SIGKILL)  # also any child left in the group
            w.proc.wait()
        return {"terminated": len(live) - killed, "killed": killed}

    def diagnose(self, hosts: Sequence[str], timeout_s: float, min_flops: float,
                 failing: Sequence[str] = ()) -> list[HostDiagnosis]:
        """The self-checks on `hosts`; `failing` adds hosts to the test-only failure setting."""
        env = self.host_env()
        if failing:
            env[TEST_FAIL_ENV] = ",".join([x for x in env.get(TEST_FAIL_ENV, "").split(",") if x] + list(failing))
        return diagnose_local(hosts, env, timeout_s, min_flops, log_dir=self.log_dir)

    @staticmethod
    def inject(worker: Worker, sig: int, pid: int | None) -> None:
        """Sends `sig` to the worker's process (its own child: the heartbeat's pid is the same process)."""
        signal_local(worker.proc.pid, sig)


def signal_local(pid: int, sig: int) -> None:
    """Sends `sig` to process `pid` on this machine (fault injection); an abort is made to leave no core file."""
    if sig == signal.SIGABRT:
        import resource

        try:
            resource.prlimit(pid, resource.RLIMIT_CORE, (0, 0))
        except (OSError, ValueError):
            pass
    os.kill(pid, sig)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class _Seen:
    """Mutable per-worker observations of one attempt (detect.WorkerState is built from them)."""

    last_time: Any = None
    last_beat: float | None = None
    step: int | None = None
    step_changed_at: float | None = None
    start_step: int | None = None
    nonfinite: tuple[int, float] | None = None
    loop_done: bool = False
    pid: int | None = None
    boot: str | None = None
    replaced: bool = False
    phases_sent: bool = False


@dataclass
class SupervisorResult:
    """status: finished / budget_exhausted / no_layout / no_hosts; report: the closing text; exit_code: 0 when
    finished; figures: per-fault figures and the effective training time (msjax.supervise.events)."""

    status: str
    exit_code: int
    report: str
    events_path: Path
    figures: dict = field(default_factory=dict)


class Supervisor:
    """Runs a job of `num_hosts` workers to the end, healing it (see the module docstring).

    Args:
      cfg: the run's validated config (its `supervisor`, `train` and `checkpoint` sections are read).
      backend: starts/stops workers and runs diagnostics (a WorkerBackend: LocalBackend, SlurmBackend, ...).
      store_url: the Redis the workers send heartbeats to.
      num_hosts: hosts the job uses; `cfg.supervisor.spares` more are held back.
      devices_per_host: devices on each host (for re-planning).
      faults: faults to inject (tests and benchmarks).
      run_id: the run's namespace in Redis (default: a fresh id).
      out: where progress lines are printed.
      hosts: the host names, `num_hosts` + spares of them (default: host0, host1, ...; SLURM: the allocation's
        nodes). The password of `store_url` may also come from MSJAX_REDIS_PASSWORD.
    """

    def __init__(self, cfg: Config, backend: WorkerBackend, store_url: str, num_hosts: int, devices_per_host: int,
                 faults: Sequence[Fault] = (), run_id: str | None = None, out=sys.stdout,
                 hosts: Sequence[str] | None = None):
        self.cfg, self.backend, self.store_url = cfg, backend, store_url
        self.s = cfg.supervisor
        self.num_hosts, self.devices_per_host = num_hosts, devices_per_host
        self.faults = list(faults)
        self.run_id = run_id or f"sup-{uuid.uuid4().hex[:12]}"
        self.out = out
        self.run_dir = Path(cfg.train.run_dir)
        from msjax.control.store import Store, connect

        self.control = Store(connect(store_url, password=os.environ.get("MSJAX_REDIS_PASSWORD") or None), self.run_id)
        self.store = HeartbeatStore(self.control.client, self.run_id)
        self.events = EventLog(self.run_dir / "events.jsonl", sink=self._post_event)
        self.hosts = list(hosts) if hosts is not None else [f"host{i}" for i in range(num_hosts + self.s.spares)]
        if len(self.hosts) < num_hosts:
            raise ValueError(f"{len(self.hosts)} host(s) {self.hosts} for a job of {num_hosts}")
        self.excluded: dict[str, str] = {}
        self.policy = RestartPolicy(self.s.restart_budget, self.s.backoff_s, self.s.backoff_max_s)
        self._reports_read = 0
        self._diag_fail: set[str] = set()
        self._workers: list[Worker] = []

    def _post_event(self, event: dict) -> None:
        self.control.post_event(event["kind"], **{k: v for k, v in event.items() if k != "kind"})

    def _print(self, msg: str) -> None:
        print(f"[supervisor] {msg}", file=self.out, flush=True)

    # -- the loop ----------------------------------------------------------------------------------------------------
    def run(self) -> SupervisorResult:
        """Runs the job to its end. Returns the result; never leaves a worker running."""
        overrides: dict[str, Any] = {}
        n = self.num_hosts
        resume = self.cfg.checkpoint.resume
        attempt = 0
        self.events.emit("run_start", run_id=self.run_id, hosts=self.hosts[:n], spares=self.hosts[n:],
                         devices_per_host=self.devices_per_host, faults=[dataclasses.asdict(f) for f in self.faults])
        try:
            while True:
                hosts = [h for h in self.hosts if h not in self.excluded][:n]
                self.store.clear_heartbeats(range(len(self.hosts)))
                if attempt:
                    self.control.bump_restarts()  # a new rendezvous generation for the restarted workers
                self._workers = self.backend.launch(attempt, hosts, overrides, resume, self.store_url, self.run_id)
                self.events.emit("launch", attempt=attempt, hosts=hosts, pids=[w.proc.pid for w in self._workers],
                                 overrides=overrides, resume=resume,
                                 standbys_used=getattr(self.backend, "standbys_used", 0))
                self._print(f"attempt {attempt}: {len(hosts)} host(s) {hosts}" + (f", {overrides}" if overrides
                                                                                  else ""))
                failures, seen = self._watch(attempt, self._workers)
                self._attempt_end(attempt, seen, finished=not failures)
                if not failures:
                    return self._finish("finished", 0, f"run finished after {attempt} restart(s)")
                summary = "; ".join(f"rank {f.rank} ({f.host}): {f.kind}: {_stable(f.detail)}" for f in failures)
                self._print(f"attempt {attempt} failed: {summary}")
                grace = stop_grace(failures, self.s.stop_grace_s)
                stopped = self.backend.stop(self._workers, grace)
                self.events.emit("stopped", attempt=attempt, grace_s=grace, **stopped)
                codes = {w.rank: w.proc.poll() for w in self._workers}
                diagnose = self.s.diagnose and (self.s.diagnose_after_kill or detect.needs_diagnosis(failures, codes))
                if self.s.diagnose and not diagnose:
                    self.events.emit("diagnosis_skipped", reason="every failed worker was killed by a signal from "
                                                                 "outside (supervisor.diagnose_after_kill=false)")
                newly = self._diagnose(hosts) if diagnose else []
                newly += self._exclude_stragglers(hosts, n)
                if newly:
                    available = [h for h in self.hosts if h not in self.excluded]
                    if len(available) >= n:
                        self.events.emit("spare_used", replaced=newly, hosts=available[:n])
                        self._print(f"spare host(s) replace {newly}")
                    elif not available:
                        return self._finish("no_hosts", 3, "every host failed its diagnostics: nothing to run on")
                    elif self.s.replan:
                        try:
                            plan = self._replan(n, len(available), overrides)
                        except PlanError as e:
                            return self._finish("no_layout", 3, f"no layout fits the devices left: {e}")
                        overrides = {**overrides, **{k: str(v) for k, v in plan.overrides.items()}}
                        n = len(available)
                    else:
                        return self._finish("no_layout", 3, f"host(s) {newly} excluded, no spare left and "
                                                            "supervisor.replan is off")
                try:
                    delay = self.policy.next_restart(summary, trained=self._first_step_t is not None)
                except RestartBudgetExhausted as e:
                    return self._finish("budget_exhausted", 4, str(e))
                attempt += 1
                resume = True
                self.events.emit("restart", attempt=attempt, delay_s=delay, restarts=self.policy.restarts,
                                 newest_checkpoint=self.control.checkpoint("persistent"))
                self._print(f"restart {self.policy.restarts}/{self.s.restart_budget} in {delay:g} s")
                time.sleep(delay)
        except BaseException as e:
            self.events.emit("supervisor_error", error=repr(e))
            raise
        finally:
            if self._workers:  # an interrupted or failed supervisor: workers get the grace period to save
                self.backend.stop(self._workers, self.s.stop_grace_s)
            getattr(self.backend, "close", lambda: None)()
            self.events.close()
            self.control.client.close()

    def _watch(self, attempt: int, workers: list[Worker]) -> tuple[list[detect.Failure], dict[int, _Seen]]:
        """Polls until every worker exited 0 (returns no failures) or a failure is detected."""
        s = self.s
        poll = min(0.1, s.heartbeat_period_s / 4)
        seen = {w.rank: _Seen() for w in workers}
        pending = [f for f in self.faults if f.attempt is None or f.attempt == attempt]
        first_step_done = False
        self._first_step_t: float | None = None
        self._first_step: int | None = None
        while True:
            now = time.time()
            for rank, hb in self.store.heartbeats([w.rank for w in workers]).items():
                o = seen[rank]
                if hb.get("time") == o.last_time:
                    continue
                o.last_time, o.last_beat = hb.get("time"), now
                o.pid = hb.get("pid", o.pid)
                if hb.get("boot") and o.boot and hb["boot"] != o.boot:  # a new process in this slot
                    o.replaced = True
                o.boot = hb.get("boot") or o.boot
                marks = hb.get("phases") or {}
                if not o.phases_sent and "first_step" in marks:
                    o.phases_sent = True
                    self.events.emit("worker_phases", attempt=attempt, rank=rank, host=workers[rank].host,
                                     phases=marks)
                if hb.get("host"):  # where the worker really runs (a SLURM task's node is SLURM's choice)
                    workers[rank].host = hb["host"]
                o.loop_done = hb.get("state") in ("finished", "failed")
                if o.start_step is None and hb.get("start_step") is not None:
                    o.start_step = hb["start_step"]
                    self.events.emit("worker_start", attempt=attempt, rank=rank, host=workers[rank].host,
                                     start_step=o.start_step, pid=hb.get("pid"))
                if hb.get("step") != o.step:
                    o.step, o.step_changed_at = hb.get("step"), now
                    # The job's first step: every worker has dispatched one past its restore step (a worker's step is
                    # its host-side dispatch; a fast one runs ahead of a peer still compiling, and the step itself
                    # waits for that peer in its collectives).
                    if not first_step_done and all(x.step is not None and x.start_step is not None
                                                   and x.step > x.start_step for x in seen.values()):
                        first_step_done = True
                        self._first_step = min(x.step for x in seen.values())
                        self._first_step_t = now
                        self.events.emit("first_step", attempt=attempt, rank=rank, step=self._first_step)
                        # the next restart's workers import while this attempt trains (LocalBackend standby)
                        getattr(self.backend, "warm", lambda n: None)(len(workers))
            reports = self.store.reports(self._reports_read)
            self._reports_read += len(reports)
            for r in reports:
                if r.get("kind") == "nonfinite" and r.get("rank") in seen:
                    self.events.emit("nonfinite_reported", attempt=attempt, rank=r["rank"], step=r.get("step"),
                                     loss=r.get("loss"))
                    # With train.nonfinite=skip the loop skips the update itself and goes on: an observation,
                    # not a failure. Otherwise the run cannot go on from here: restart from the newest checkpoint.
                    if getattr(self.cfg.train, "nonfinite", "stop") != "skip":
                        seen[r["rank"]].nonfinite = (r.get("step"), r.get("loss"))
            for f in list(pending):
                w = workers[f.rank] if f.rank < len(workers) else None
                o = seen.get(f.rank)
                if w is None or o is None or o.last_beat is None or w.proc.poll() is not None:
                    continue
                if (o.step or 0) < f.step + ((o.start_step or 0) if f.relative else 0):
                    continue
                pending.remove(f)
                if f.kind == "diag":
                    self._diag_fail.add(w.host)
                self.backend.inject(w, {"stop": signal.SIGSTOP, "diag": signal.SIGABRT}.get(f.kind, signal.SIGKILL),
                                    o.pid)
                self.events.emit("fault_injected", fault=f.kind, rank=f.rank, host=w.host, step=o.step,
                                 attempt=attempt)
                self._print(f"injected {f.kind} into rank {f.rank} ({w.host}) at step {o.step}")
            states = [detect.WorkerState(w.rank, w.host, w.started_at, w.proc.poll(), seen[w.rank].last_beat,
                                         seen[w.rank].step, seen[w.rank].step_changed_at, seen[w.rank].nonfinite,
                                         seen[w.rank].loop_done)
                      for w in workers]
            failures = detect.detect_failures(states, now, heartbeat_timeout=s.heartbeat_timeout_s,
                                              startup_timeout=s.startup_timeout_s, stall_timeout=s.stall_timeout_s)
            # A slot beating from a new process: the cluster restarted the worker behind our back (a JobSet
            # restarts every pod once one fails); the attempt is over all the same.
            failures += [detect.Failure(w.rank, w.host, "exit", "restarted outside the supervisor (a new process "
                                        "in its slot)") for w in workers if seen[w.rank].replaced
                         and not any(f.rank == w.rank for f in failures)]
            if failures:
                self.events.emit("detected", attempt=attempt, failures=[f.to_dict() for f in failures])
                return failures, seen
            if detect.finished(states):
                return [], seen
            time.sleep(poll)

    def _attempt_end(self, attempt: int, seen: dict[int, _Seen], finished: bool) -> None:
        starts = [o.start_step for o in seen.values() if o.start_step is not None]
        steps = [o.step for o in seen.values() if o.step is not None]
        start = min(starts) if starts else None
        last = self.cfg.train.steps if finished else (max(steps) if steps else None)
        step_s = None
        if self._first_step_t is not None and last is not None and last > self._first_step:
            # The steady-state step time: from the first step (which carries the compilation) to the last seen.
            last_seen_t = max((o.step_changed_at for o in seen.values() if o.step_changed_at), default=None)
            last_seen = max(steps)
            if last_seen_t and last_seen > self._first_step:
                step_s = (last_seen_t - self._first_step_t) / (last_seen - self._first_step)
        self.events.emit("attempt_end", attempt=attempt, start_step=start, last_step=last, step_s=step_s,
                         finished=finished)

    def _diagnose(self, hosts: list[str]) -> list[str]:
        """Runs the self-checks on `hosts`; excludes the failing ones. Returns the hosts newly excluded."""
        t0 = time.time()
        results = self.backend.diagnose(hosts, self.s.diagnose_timeout_s, self.s.diag_min_matmul_flops,
                                        failing=sorted(self._diag_fail & set(hosts)))
        if results is None:  # they ran elsewhere (a Kubernetes initContainer) and reported failing hosts to Redis
            for host in sorted(self.control.excluded_hosts() - set(self.excluded)):
                self.excluded[host] = "failed its self-checks"
                note = getattr(self.backend, "exclusion_note", lambda h: "")(host)
                self.events.emit("excluded", host=host, reason=self.excluded[host], action=note)
                self._print(f"excluded {host}: failed its self-checks" + (f"; keep the job off it: {note}"
                                                                          if note else ""))
            return []  # the cluster places the restarted workers; nothing to re-plan here
        self.events.emit("diagnosed", seconds=time.time() - t0, hosts={r.host: r.to_dict() for r in results})
        self._device_kind = next((r.device_kind for r in results if r.device_kind), "")
        newly = []
        for r in results:
            if not r.ok:
                reason = "; ".join(r.reasons)
                self.excluded[r.host] = reason
                newly.append(r.host)
                self.events.emit("excluded", host=r.host, reason=reason)
                self.control.exclude_host(r.host, reason)
                self._print(f"excluded {r.host}: {reason}")
        if not newly:
            self._print(f"diagnostics passed on {len(results)} host(s) ({time.time() - t0:.1f} s)")
        return newly

    def _exclude_stragglers(self, hosts: list[str], n: int) -> list[str]:
        """With observe.exclude_stragglers: the straggler hosts the run recorded in Redis that this restart leaves
        out (msjax.supervise.exclusion: only when a spare or re-planning can replace them). Returns them."""
        if not self.cfg.observe.exclude_stragglers:
            return []
        decision = straggler_exclusions(self.control.excluded_hosts(), hosts, self.hosts, self.excluded, n,
                                        self.s.replan)
        for h in decision.exclude:
            self.excluded[h] = "straggler (observe.exclude_stragglers)"
            self.events.emit("excluded", host=h, reason=self.excluded[h])
            self._print(f"excluded {h}: persistently slow (a straggler)")
        for h in decision.keep:
            self.events.emit("straggler_kept", host=h)
            self._print(f"kept straggler {h}: no spare and supervisor.replan is off (or no other host)")
        return decision.exclude

    def _replan(self, old_hosts: int, new_hosts: int, overrides: dict) -> Any:
        cfg = apply_overrides(self.cfg, overrides)
        config_json = self.run_dir / "config.json"
        if config_json.exists():  # the run's own config has the tokenizer's vocabulary filled in
            vocab = json.loads(config_json.read_text())["model"]["vocab_size"]
            cfg = apply_overrides(cfg, {"model.vocab_size": vocab})
        hardware, note = planner_hardware(self.s.replan_hardware, getattr(self, "_device_kind", ""))
        plan = replan(cfg, old_hosts * self.devices_per_host, new_hosts * self.devices_per_host, hardware, note)
        self.events.emit("replanned", **plan.to_dict())
        self._print(plan.text())
        return plan

    def _finish(self, status: str, code: int, report: str) -> SupervisorResult:
        self.events.emit("run_end", status=status, report=report)
        events = read_events(self.events.path)
        figures = {"faults": fault_figures(events), "effective": effective_time(events)}
        eff = figures["effective"]
        lines = [report]
        for f in figures["faults"]:
            lines.append(f"  fault {f['kind']} rank {f['rank']} at step {f['step']}: detected in "
                         f"{_fmt_s(f['detection_s'])}, first kept step after {_fmt_s(f['recovery_s'])}, "
                         f"{f['recomputed_steps']} step(s) recomputed")
        if eff["ratio"] is not None:
            lines.append(f"effective training time: {eff['ratio']:.1%} ({eff['kept_s']:.1f} s of kept steps / "
                         f"{eff['total_s']:.1f} s wall; {eff['kept_steps']} steps kept, {eff['lost_steps']} "
                         "recomputed)")
        text = "\n".join(lines)
        self._print(text)
        return SupervisorResult(status, code, text, self.events.path, figures)


# Seconds a wedged job's workers get between SIGTERM and SIGKILL: enough to exit and flush their output.
WEDGED_GRACE_S = 1.0


def stop_grace(failures: Sequence[detect.Failure], grace_s: float) -> float:
    """The grace period for stopping a failed attempt: `grace_s` (supervisor.stop_grace_s) when every failure is
    a reported non-finite loss (every worker is alive and stepping, and can act on SIGTERM), else WEDGED_GRACE_S
    at most: with a worker dead, hung or stalled, the others block in the next collective and can neither finish
    a step nor commit a checkpoint (an Orbax save ends with a barrier across processes), so waiting longer only
    delays the restart, which resumes from the newest verified checkpoint either way."""
    if all(f.kind == "nonfinite" for f in failures):
        return grace_s
    return min(grace_s, WEDGED_GRACE_S)


def _stable(detail: str) -> str:
    """A failure's detail without its measured numbers, so the same fault reads the same at every attempt."""
    return re.sub(r"\d+\.\d+ s", "N s", detail)


def _fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"
