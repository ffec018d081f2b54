"""The supervisor loop: launch the workers, watch them, and on a failure stop, diagnose, exclude, re-plan and
restart from the newest complete checkpoint, within a restart budget (MegaScale sec. 5, fig. 8).

    launch -> watch (heartbeats, exit codes, reports; msjax.supervise.detect)
           -> failure: SIGTERM, then SIGKILL after supervisor.stop_grace_s
           -> diagnostics on every host (msjax.supervise.diagnostics); exclude the hosts that fail
           -> a spare replaces an excluded host, else re-plan the same global batch onto the devices left
              (msjax.supervise.replan), else stop with a report
           -> backoff, restart with --resume (Orbax restores onto the new mesh); a spent budget ends the run.
Every step of that is an event in `<run_dir>/events.jsonl` and in Redis (msjax.supervise.events).

`LocalBackend` runs each host as a local process group (`devices_per_host` CPU devices or the machine's
accelerators). Fault injection (`Fault`) is for tests and benchmarks: it kills (SIGKILL), stops (SIGSTOP) or
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
from typing import Any, Sequence

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
      kind: "kill" (SIGKILL the worker), "stop" (SIGSTOP it: a hang), "diag" (SIGKILL it and make its host fail
        the matmul self-check, as a host with a faulty device would).
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
    """A launched worker process (one per host)."""

    rank: int
    host: str
    proc: subprocess.Popen
    started_at: float
    log_path: Path


class LocalBackend:
    """Runs each host of the job as a local process group: `scripts/train.py` with the job's flags.

    Args:
      train_flags: the training command line (`--config=... --train.steps=...`), passed to every worker.
      devices_per_host: CPU devices each worker gets (XLA_FLAGS); 0 leaves the device setup alone.
      log_dir: where each worker's output goes (attempt<k>_<host>.log).
      env: base environment of the workers (default: this process's).
      rdzv_timeout_s: how long workers wait for each other at the Redis rendezvous.
    """

    def __init__(self, train_flags: Sequence[str], devices_per_host: int, log_dir: Path,
                 env: dict[str, str] | None = None, rdzv_timeout_s: int = 300):
        self.train_flags = list(train_flags)
        self.rdzv_timeout_s = rdzv_timeout_s
        self.devices_per_host = devices_per_host
        self.log_dir = Path(log_dir)
        self.env = dict(os.environ if env is None else env)

    def host_env(self) -> dict[str, str]:
        env = {k: v for k, v in self.env.items() if k not in _JAX_LAUNCH_VARS}
        if self.devices_per_host:
            flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
            env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={self.devices_per_host}".strip()
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        return env

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
        for slot, host in enumerate(hosts):
            env = worker_env(self.host_env(), redis_url=redis_url, run_id=run_id, num_processes=len(hosts),
                             worker_index=slot, devices_per_process=self.devices_per_host or None,
                             rdzv_timeout_s=self.rdzv_timeout_s)
            env.update(MSJAX_SUPERVISED="1", MSJAX_SLOT=str(slot), MSJAX_HOST=host, MSJAX_WORKER_ID=host)
            log_path = self.log_dir / f"attempt{attempt}_{host}.log"
            with log_path.open("w") as log:
                proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "train.py"), *flags], cwd=str(ROOT),
                                        env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True, preexec_fn=die_with_parent)
            workers.append(Worker(slot, host, proc, time.time(), log_path))
        return workers

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
      backend: starts/stops workers and runs diagnostics (LocalBackend).
      store_url: the Redis the workers send heartbeats to.
      num_hosts: hosts the job uses; `cfg.supervisor.spares` more are held back.
      devices_per_host: devices on each host (for re-planning).
      faults: faults to inject (tests and benchmarks).
      run_id: the run's namespace in Redis (default: a fresh id).
      out: where progress lines are printed.
    """

    def __init__(self, cfg: Config, backend: LocalBackend, store_url: str, num_hosts: int, devices_per_host: int,
                 faults: Sequence[Fault] = (), run_id: str | None = None, out=sys.stdout):
        self.cfg, self.backend, self.store_url = cfg, backend, store_url
        self.s = cfg.supervisor
        self.num_hosts, self.devices_per_host = num_hosts, devices_per_host
        self.faults = list(faults)
        self.run_id = run_id or f"sup-{uuid.uuid4().hex[:12]}"
        self.out = out
        self.run_dir = Path(cfg.train.run_dir)
        from msjax.control.store import Store, connect

        self.control = Store(connect(store_url), self.run_id)
        self.store = HeartbeatStore(self.control.client, self.run_id)
        self.events = EventLog(self.run_dir / "events.jsonl", sink=self._post_event)
        self.hosts = [f"host{i}" for i in range(num_hosts + self.s.spares)]
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
                                 overrides=overrides, resume=resume)
                self._print(f"attempt {attempt}: {len(hosts)} host(s) {hosts}" + (f", {overrides}" if overrides
                                                                                  else ""))
                failures, seen = self._watch(attempt, self._workers)
                self._attempt_end(attempt, seen, finished=not failures)
                if not failures:
                    return self._finish("finished", 0, f"run finished after {attempt} restart(s)")
                summary = "; ".join(f"rank {f.rank} ({f.host}): {f.kind}: {_stable(f.detail)}" for f in failures)
                self._print(f"attempt {attempt} failed: {summary}")
                stopped = self.backend.stop(self._workers, self.s.stop_grace_s)
                self.events.emit("stopped", attempt=attempt, **stopped)
                newly = self._diagnose(hosts) if self.s.diagnose else []
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
                    delay = self.policy.next_restart(summary)
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
                o.loop_done = hb.get("state") in ("finished", "failed")
                if o.start_step is None and hb.get("start_step") is not None:
                    o.start_step = hb["start_step"]
                    self.events.emit("worker_start", attempt=attempt, rank=rank, host=workers[rank].host,
                                     start_step=o.start_step, pid=hb.get("pid"))
                if hb.get("step") != o.step:
                    o.step, o.step_changed_at = hb.get("step"), now
                    if (not first_step_done and o.step is not None and o.start_step is not None
                            and o.step > o.start_step):
                        first_step_done = True
                        self._first_step_t, self._first_step = now, o.step
                        self.events.emit("first_step", attempt=attempt, rank=rank, step=o.step)
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
                os.kill(w.proc.pid, signal.SIGSTOP if f.kind == "stop" else signal.SIGKILL)
                self.events.emit("fault_injected", fault=f.kind, rank=f.rank, host=w.host, step=o.step,
                                 attempt=attempt)
                self._print(f"injected {f.kind} into rank {f.rank} ({w.host}) at step {o.step}")
            states = [detect.WorkerState(w.rank, w.host, w.started_at, w.proc.poll(), seen[w.rank].last_beat,
                                         seen[w.rank].step, seen[w.rank].step_changed_at, seen[w.rank].nonfinite,
                                         seen[w.rank].loop_done)
                      for w in workers]
            failures = detect.detect_failures(states, now, heartbeat_timeout=s.heartbeat_timeout_s,
                                              startup_timeout=s.startup_timeout_s, stall_timeout=s.stall_timeout_s)
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


def _stable(detail: str) -> str:
    """A failure's detail without its measured numbers, so the same fault reads the same at every attempt."""
    return re.sub(r"\d+\.\d+ s", "N s", detail)


def _fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"
