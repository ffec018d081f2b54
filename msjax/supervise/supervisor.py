"""The supervisor loop: launch the workers, watch them, and on a failure stop, diagnose, exclude, re-plan and
restart from the newest complete checkpoint, within a restart budget (MegaScale sec. 5, fig. 8).

    launch -> watch (heartbeats, exit codes, reports; msjax.supervise.detect)
           -> failure: blame the worker that failed (not the ones that left because it died: detect.blame), ask
              every live worker to leave (Store.request_exit: each says why in one line), end what is left
              (SIGTERM, then SIGKILL after supervisor.stop_grace_s)
           -> diagnostics on every host (msjax.supervise.diagnostics); exclude the hosts that fail
           -> a spare replaces an excluded host, else re-plan the same global batch onto the devices left
              (msjax.supervise.replan), else stop with a report
           -> backoff, restart with --resume (Orbax restores onto the new mesh) from the newest verified
              checkpoint (msjax.checkpoint.latest_verified: the restart event names that step); a spent budget
              ends the run.
Every step of that is an event in `<run_dir>/events.jsonl` and in Redis (msjax.events); at the end,
`<run_dir>/goodput.json` holds where the run's wall time went over all attempts (msjax.goodput).

Where and how workers run is a backend's only concern, behind a small interface (`WorkerBackend`: launch the
workers on given hosts, stop them, run the self-checks on given hosts); every policy above is this module's and
is the same for all of them. The backends are the launcher's (msjax.launch: a local process group, a SLURM srun
step, a Kubernetes JobSet); this package imports none of them. A worker's rank is its place in the attempt's host
list, and the same number is its control-plane rank and `jax.process_index()` (the launchers fix it).

Anything that wants to act while the job runs (a benchmark's or a test's fault injector) is passed in as a
watcher: a callable given a `Progress` at every poll.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from msjax.config import Config, apply_overrides
from msjax.events import EventLog, read_events
from msjax.goodput import run_ledger, write_ledger
from msjax.planner import PlanError
from msjax.supervise import detect
from msjax.supervise.diagnostics import Checks, HostDiagnosis
from msjax.supervise.exclusion import straggler_exclusions
from msjax.supervise.figures import fault_figures
from msjax.supervise.policy import RestartBudgetExhausted, RestartPolicy
from msjax.supervise.replan import planner_hardware, replan


@dataclass
class Worker:
    """A launched worker (one per host).

    Attributes:
      rank: its place in the attempt's host list: its control-plane rank and jax process index too.
      host: the host it runs on (a backend that cannot tell in advance may correct it from the worker's heartbeat).
      proc: anything with `poll()` (None while running, else the exit code; negative: killed by that signal) and
        `pid`: the worker's process for the local backend, a per-task view of the job step for SLURM.
      started_at: when it was launched (time.time()).
      log_path: where its output goes.
      peer_lost: tells whether its output shows jax's distributed runtime ended it because another task died
        (msjax.launch.output.lost_distributed_service); None when the backend cannot tell.
    """

    rank: int
    host: str
    proc: Any
    started_at: float
    log_path: Path
    peer_lost: Callable[[], bool] | None = None


class WorkerBackend:
    """How to start and stop workers on which hosts: the only part of supervision that differs between a local
    run, a SLURM allocation and a Kubernetes JobSet (see the module docstring). Every method the supervisor calls
    is declared here; a backend overrides `launch`, `stop` and `diagnose`, and the others where it has something
    to do (the defaults do nothing).

    Attributes:
      standbys_used: workers of the last `launch` that started from a warm standby process (0 without standbys).
    """

    standbys_used: int = 0

    def launch(self, attempt: int, hosts: Sequence[str], overrides: dict, resume: bool, redis_url: str,
               run_id: str) -> list[Worker]:
        """Starts one worker per host (rank = position in `hosts`) running the job's train command with the
        typed `overrides` (dotted key -> value, `msjax.launch.env.worker_flags`) and `--resume`, joined to the run
        `run_id` on `redis_url`."""
        raise NotImplementedError

    def stop(self, workers: Sequence[Worker], grace_s: float) -> dict:
        """Asks every live worker to end (SIGTERM or the backend's equivalent), forces it after `grace_s`.
        Returns {"terminated": n, "killed": n}; nothing of the workers runs after it returns."""
        raise NotImplementedError

    def diagnose(self, hosts: Sequence[str], checks: Checks) -> list[HostDiagnosis] | None:
        """The self-checks (msjax.supervise.diagnostics) on `hosts`, one HostDiagnosis each in order; None when
        the backend cannot run them (they then run elsewhere, e.g. a Kubernetes initContainer)."""
        raise NotImplementedError

    def warm(self, count: int) -> None:
        """Prepares `count` workers for the next restart while this attempt trains (the local backend's standby
        processes import jax and the stack ahead); nothing by default."""

    def exclusion_note(self, host: str) -> str:
        """What keeps a restarted job off an excluded `host` where the cluster, not this backend, places workers
        (a Kubernetes node taint, say); "" by default."""
        return ""

    def close(self) -> None:
        """Ends whatever the backend still runs when the supervisor ends (standbys, its Redis step); nothing by
        default."""


@dataclass(frozen=True)
class Progress:
    """What a watcher sees at each poll of an attempt.

    Attributes:
      attempt: the attempt (0 first).
      workers: the attempt's workers, by rank.
      beats: rank -> its newest heartbeat (msjax.control.hook: step, start_step, pid, host, state, ...).
      emit: writes an event to the run's event log (kind, **fields).
    """

    attempt: int
    workers: Sequence[Worker]
    beats: Mapping[int, dict]
    emit: Callable[..., dict]


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
    exit_code: int | None = None


@dataclass
class SupervisorResult:
    """status: finished / budget_exhausted / no_layout / no_hosts; report: the closing text; exit_code: 0 when
    finished; figures: per-fault figures (msjax.supervise.figures) and the goodput ledger
    (msjax.goodput, also written to `<run_dir>/goodput.json`)."""

    status: str
    exit_code: int
    report: str
    events_path: Path
    figures: dict = field(default_factory=dict)


class Supervisor:
    """Runs a job of `num_hosts` workers to the end, healing it (see the module docstring).

    Args:
      cfg: the run's validated config (its `supervisor`, `train` and `checkpoint` sections are read).
      backend: starts/stops workers and runs diagnostics (a WorkerBackend: msjax.launch's local, SLURM, JobSet).
      store_url: the Redis the workers report to (its password may also come from MSJAX_REDIS_PASSWORD).
      num_hosts: hosts the job uses; `cfg.supervisor.spares` more are held back.
      devices_per_host: devices on each host (for re-planning).
      run_id: the run's namespace in Redis (default: a fresh id).
      out: where progress lines are printed.
      hosts: the host names, `num_hosts` + spares of them (default: host0, host1, ...; SLURM: the allocation's
        nodes).
      watchers: callables given a `Progress` at every poll of an attempt (a benchmark's fault injector).
    """

    def __init__(self, cfg: Config, backend: WorkerBackend, store_url: str, num_hosts: int, devices_per_host: int,
                 run_id: str | None = None, out=sys.stdout, hosts: Sequence[str] | None = None,
                 watchers: Sequence[Callable[[Progress], None]] = ()):
        self.cfg, self.backend, self.store_url = cfg, backend, store_url
        self.s = cfg.supervisor
        self.num_hosts, self.devices_per_host = num_hosts, devices_per_host
        self.watchers = list(watchers)
        self.run_id = run_id or f"sup-{uuid.uuid4().hex[:12]}"
        self.out = out
        self.run_dir = Path(cfg.train.run_dir)
        from msjax.control.store import Store, connect

        self.control = Store(connect(store_url, password=os.environ.get("MSJAX_REDIS_PASSWORD") or None), self.run_id)
        self.events = EventLog(self.run_dir, sink=self._post_event)
        self.hosts = list(hosts) if hosts is not None else [f"host{i}" for i in range(num_hosts + self.s.spares)]
        if len(self.hosts) < num_hosts:
            raise ValueError(f"{len(self.hosts)} host(s) {self.hosts} for a job of {num_hosts}")
        self.excluded: dict[str, str] = {}
        self._deaths: dict[str, int] = {}  # host -> workers that died on it (detect.died), over the run
        self.policy = RestartPolicy(self.s.restart_budget, self.s.backoff_s, self.s.backoff_max_s)
        self._reports_read = 0
        self._generation = 0  # the rendezvous generation of the attempt being watched
        self._workers: list[Worker] = []
        self._device_kind = ""  # the accelerator the self-checks found (a re-plan prices it), "" until they ran
        self._beats: dict[int, dict] = {}

    def _post_event(self, event: dict) -> None:
        self.control.post_event(event["kind"], **{k: v for k, v in event.items() if k != "kind"})

    def _print(self, msg: str) -> None:
        self.out.write(f"[supervisor] {msg}\n")  # one write: other threads' lines never land inside it
        self.out.flush()

    @property
    def checks(self) -> Checks:
        return Checks(self.s.diagnose_timeout_s, self.s.diag_min_matmul_flops, self.s.health_check)

    # -- the loop ----------------------------------------------------------------------------------------------------
    def run(self) -> SupervisorResult:
        """Runs the job to its end. Returns the result; never leaves a worker running."""
        overrides: dict[str, Any] = {}
        n = self.num_hosts
        resume = self.cfg.checkpoint.resume
        attempt = 0
        self.events.emit("run_start", run_id=self.run_id, hosts=self.hosts[:n], spares=self.hosts[n:],
                         devices_per_host=self.devices_per_host)
        try:
            while True:
                hosts = [h for h in self.hosts if h not in self.excluded][:n]
                self.control.clear_heartbeats(range(len(self.hosts)))
                # a new rendezvous generation for the restarted workers
                self._generation = self.control.bump_restarts() if attempt else self.control.restart_count()
                self._workers = self.backend.launch(attempt, hosts, overrides, resume, self.store_url, self.run_id)
                self.events.emit("launch", attempt=attempt, hosts=hosts, pids=[w.proc.pid for w in self._workers],
                                 overrides=overrides, resume=resume,
                                 standbys_used=self.backend.standbys_used)
                self._print(f"attempt {attempt}: {len(hosts)} host(s) {hosts}" + (f", {overrides}" if overrides
                                                                                  else ""))
                failures, seen = self._watch(attempt, self._workers)
                self._attempt_end(attempt, seen, finished=not failures)
                if not failures:
                    return self._finish("finished", 0, f"run finished after {attempt} restart(s)")
                summary = "; ".join(f"rank {f.rank} ({f.host}): {f.kind}: {_stable(f.detail)}" for f in failures)
                self._print(f"attempt {attempt} failed: {summary}")
                grace = stop_grace(failures, self.s.stop_grace_s, self.s.heartbeat_period_s)
                self._ask_to_leave(failures)
                stopped = self.backend.stop(self._workers, grace)
                self._workers = []
                self.events.emit("stopped", attempt=attempt, grace_s=grace, **stopped)
                codes = {f.rank: seen[f.rank].exit_code for f in failures}
                diagnose = self.s.diagnose and detect.needs_diagnosis(failures, codes)
                if self.s.diagnose and not diagnose:
                    self.events.emit("diagnosis_skipped", reason="every failed worker was stopped by SIGTERM or "
                                                                 "SIGINT, or saved and stopped")
                newly = self._diagnose(hosts) if diagnose else []
                newly += self._exclude_repeated_deaths(failures, codes)
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
                        overrides = {**overrides, **plan.overrides}
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
                resume_step = self._resume_step()
                self.events.emit("restart", attempt=attempt, delay_s=delay, restarts=self.policy.restarts,
                                 resume_step=resume_step)
                self._print(f"restart {self.policy.restarts}/{self.s.restart_budget} in {delay:g} s, from "
                            + (f"checkpoint {resume_step}" if resume_step is not None else "step 0 (no verified "
                               "checkpoint)"))
                time.sleep(delay)
        except BaseException as e:
            self.events.emit("supervisor_error", error=repr(e))
            raise
        finally:
            if self._workers:  # an interrupted or failed supervisor: workers get the grace period to save
                self.backend.stop(self._workers, self.s.stop_grace_s)
            self.backend.close()
            self.events.close()
            self.control.client.close()

    def _resume_step(self) -> int | None:
        """The step the restarted workers resume from: `msjax.checkpoint.latest_verified` of the run's checkpoint
        tiers, the same record the restore trusts, read after every worker was stopped (so no record can still
        arrive). None: no verified checkpoint (they start from step 0), or the directory could not be read (said in
        one line). A local tier (`checkpoint.local_dir`) is read as this host sees it: where it is node-local
        storage on other nodes, the persistent tier's answer is what this host can know."""
        from msjax import paths
        from msjax.checkpoint import checkpoint_dir, latest_verified, local_checkpoint_dir

        c = self.cfg.checkpoint
        try:
            paths.configure(self.cfg.storage)  # the run's endpoint and credentials, as its workers use them
            return latest_verified(checkpoint_dir(c, str(self.run_dir)), local_checkpoint_dir(c))
        except Exception as e:  # noqa: BLE001 - an unreachable bucket must not end the supervisor; the restart says
            self._print(f"could not read the checkpoint directory ({type(e).__name__}: {e})")
            return None

    def _ask_to_leave(self, failures: Sequence[detect.Failure]) -> None:
        """Asks every worker still beating to leave at once (Store.request_exit), naming what failed, so each
        survivor says why it stops in one line instead of failing in a collective its dead peer never joins."""
        first = failures[0]
        reason = f"rank {first.rank} ({first.host}) failed: {first.kind}: {_stable(first.detail)}; the supervisor " \
                 "restarts the job"
        boots = [hb.get("boot") for hb in self.control.heartbeats(range(len(self._workers))).values()]
        try:
            self.control.request_exit(boots, reason)
        except Exception as e:  # noqa: BLE001 - the backend's stop ends them all the same
            self._print(f"could not ask the workers to leave ({e!r}); stopping them")

    def _read_reports(self, attempt: int, seen: dict[int, _Seen]) -> None:
        """Reads the workers' reports posted since the last call into `seen`. Only this attempt's generation
        counts: a worker of the stopped job may report (its non-finite loss, at its loop's end) after the
        supervisor stopped reading for that job, and that report must not fail the restarted one."""
        reports = self.control.reports(self._reports_read)
        self._reports_read += len(reports)
        for r in reports:
            if r.get("kind") != "nonfinite" or r.get("rank") not in seen or r.get("generation") != self._generation:
                continue
            self.events.emit("nonfinite_reported", attempt=attempt, rank=r["rank"], step=r.get("step"),
                             loss=r.get("loss"))
            # With train.nonfinite=skip the loop skips the update itself and goes on: an observation, not a
            # failure. Otherwise the run cannot go on from here: restart from the newest checkpoint.
            if self.cfg.train.nonfinite != "skip":
                seen[r["rank"]].nonfinite = (r.get("step"), r.get("loss"))

    def _watch(self, attempt: int, workers: list[Worker]) -> tuple[list[detect.Failure], dict[int, _Seen]]:
        """Polls until every worker exited 0 (returns no failures) or a failure is blamed (detect.blame): a worker
        that left because a peer died is not blamed while the peer's own failure can still show (up to one
        heartbeat timeout)."""
        s = self.s
        poll = min(0.1, s.heartbeat_period_s / 4)
        seen = {w.rank: _Seen() for w in workers}
        first_step_done = False
        self._first_step_t: float | None = None
        self._first_step: int | None = None
        collateral_since: float | None = None
        while True:
            now = time.time()
            beats = self.control.heartbeats([w.rank for w in workers])
            for rank, hb in beats.items():
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
                        # the next restart's workers import while this attempt trains (the local backend's standby)
                        self.backend.warm(len(workers))
            self._read_reports(attempt, seen)
            for watch in self.watchers:
                watch(Progress(attempt, workers, beats, self.events.emit))
            states = []
            for w in workers:
                o, code = seen[w.rank], w.proc.poll()
                o.exit_code = code
                states.append(detect.WorkerState(
                    w.rank, w.host, w.started_at, code, o.last_beat, o.step, o.step_changed_at, o.nonfinite,
                    o.loop_done, peer_lost=code not in (None, 0) and w.peer_lost is not None and w.peer_lost()))
            failures = detect.detect_failures(states, now, heartbeat_timeout=s.heartbeat_timeout_s,
                                              startup_timeout=s.startup_timeout_s, stall_timeout=s.stall_timeout_s)
            # A slot beating from a new process: the cluster restarted the worker behind our back (a JobSet
            # restarts every pod once one fails); the attempt is over all the same.
            failures += [detect.Failure(w.rank, w.host, "exit", "restarted outside the supervisor (a new process "
                                        "in its slot)") for w in workers if seen[w.rank].replaced
                         and not any(f.rank == w.rank for f in failures)]
            blamed = detect.blame(failures)
            if failures and not blamed:
                # Only workers that left because a peer died: the dead one's exit status or expired heartbeat is
                # still to come. Past one heartbeat timeout, the leavers are all there is to go on.
                collateral_since = collateral_since or now
                if now - collateral_since > s.heartbeat_timeout_s + s.heartbeat_period_s:
                    blamed = failures
            if blamed:
                self.events.emit("detected", attempt=attempt, failures=[f.to_dict() for f in blamed],
                                 collateral=[f.to_dict() for f in failures if f not in blamed])
                return blamed, seen
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
        results = self.backend.diagnose(hosts, self.checks)
        if results is None:  # they ran elsewhere (a Kubernetes initContainer) and reported failing hosts to Redis
            for host in sorted(self.control.excluded_hosts() - set(self.excluded)):
                self._exclude(host, "failed its self-checks", record=False)
            return []  # the cluster places the restarted workers; nothing to re-plan here
        self.events.emit("diagnosed", seconds=time.time() - t0, hosts={r.host: r.to_dict() for r in results})
        self._device_kind = next((r.device_kind for r in results if r.device_kind), "")
        newly = [r.host for r in results if not r.ok and self._exclude(r.host, "; ".join(r.reasons))]
        if not newly:
            self._print(f"diagnostics passed on {len(results)} host(s) ({time.time() - t0:.1f} s)")
        return newly

    def _exclude_repeated_deaths(self, failures: Sequence[detect.Failure], codes: dict[int, int | None]
                                 ) -> list[str]:
        """Counts the workers that died on each host (detect.died) and excludes a host at
        supervisor.exclude_after_deaths deaths. Returns the hosts newly excluded that this backend places workers
        on (`_exclude`)."""
        newly = []
        for f in failures:
            if not detect.died(f, codes.get(f.rank)) or f.host in self.excluded:
                continue
            self._deaths[f.host] = self._deaths.get(f.host, 0) + 1
            if (self.s.exclude_after_deaths and self._deaths[f.host] >= self.s.exclude_after_deaths
                    and self._exclude(f.host, f"its workers died {self._deaths[f.host]} times (the last: "
                                              f"{_stable(f.detail)})")):
                newly.append(f.host)
        return newly

    def _exclude(self, host: str, reason: str, record: bool = True) -> bool:
        """Leaves `host` out of every later attempt for `reason`: remembered, an `excluded` event, one line, and
        (`record`) the run's record of excluded hosts in Redis. Returns whether this backend places the workers
        itself (the caller then takes a spare or re-plans); where the cluster places them, the event and the line
        carry what keeps the job off the host (`WorkerBackend.exclusion_note`)."""
        note = self.backend.exclusion_note(host)
        self.excluded[host] = reason
        self.events.emit("excluded", host=host, reason=reason, **({"action": note} if note else {}))
        if record:
            self.control.exclude_host(host, reason)
        self._print(f"excluded {host}: {reason}" + (f"; keep the job off it: {note}" if note else ""))
        return not note

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
        hardware, note = planner_hardware(self.s.replan_hardware, self._device_kind)
        plan = replan(cfg, old_hosts * self.devices_per_host, new_hosts * self.devices_per_host, hardware, note)
        self.events.emit("replanned", **plan.to_dict())
        self._print(plan.text())
        return plan

    def _finish(self, status: str, code: int, report: str) -> SupervisorResult:
        self.events.emit("run_end", status=status, report=report)
        events = read_events(self.events.path)
        figures = {"faults": fault_figures(events), "goodput": run_ledger(events)}
        ledger = figures["goodput"]
        write_ledger(self.run_dir, ledger)
        lines = [report]
        for f in figures["faults"]:
            lines.append(f"  fault {f['kind']} rank {f['rank']} at step {f['step']}: detected in "
                         f"{_fmt_s(f['detection_s'])}, first kept step after {_fmt_s(f['recovery_s'])}, "
                         f"{f['recomputed_steps']} step(s) recomputed")
        if ledger["ettr"] is not None:
            b = ledger["buckets"]
            lines.append(f"effective training time: {ledger['ettr']:.1%} ({b['productive']:.1f} s of productive "
                         f"steps / {ledger['wall_s']:.1f} s wall; {b['restart']:.1f} s restarting, "
                         f"{b['recomputed']:.1f} s recomputed, {b['startup'] + b['compilation']:.1f} s start-up "
                         f"and compilation; {self.run_dir / 'goodput.json'})")
        text = "\n".join(lines)
        self._print(text)
        return SupervisorResult(status, code, text, self.events.path, figures)


# Seconds a wedged job's workers get to leave after they were asked to (they read the request at their next
# heartbeat, one period away at most) before SIGKILL: enough to exit and flush their output.
WEDGED_GRACE_S = 0.5


def stop_grace(failures: Sequence[detect.Failure], grace_s: float, period_s: float) -> float:
    """The grace period for stopping a failed attempt: `grace_s` (supervisor.stop_grace_s) when every failure is
    a reported non-finite loss (every worker is alive and stepping, and can act on SIGTERM), else one heartbeat
    period (`period_s`) plus WEDGED_GRACE_S at most: with a worker dead, hung or stalled, the others block in the
    next collective and can neither finish a step nor commit a checkpoint (an Orbax save ends with a barrier
    across processes); they only read the request to leave at their next heartbeat, so waiting longer only delays
    the restart, which resumes from the newest verified checkpoint either way."""
    if all(f.kind == "nonfinite" for f in failures):
        return grace_s
    return min(grace_s, period_s + WEDGED_GRACE_S)


def _stable(detail: str) -> str:
    """A failure's detail without its measured numbers, so the same fault reads the same at every attempt."""
    return re.sub(r"\d+\.\d+ s", "N s", detail)


def _fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"
