"""Recovery benchmark: a supervised local run with K injected faults of each kind (kill -9, SIGSTOP, a failed
diagnostic), and what each cost.

    python scripts/bench_recovery.py [--faults_per_kind=1] [--kinds=kill,stop,diag] [--hosts=2]
        [--devices_per_host=2] [--steps=60] [--compile_cache=DIR] [--json=PATH] [--seed=N] [--backend=slurm]
        [--fault_every_s=S] [any config flag, e.g. --supervisor.heartbeat_period_s=1]

Faults go in this order, one per attempt, each a random 3-8 steps after the attempt resumed: K kills, K stops,
then K diagnostic failures (the first K-1 replaced by spare hosts, the last one re-planned onto the hosts left).
The supervisor runs in this process with a `FaultInjector` as its watcher: it signals a worker's process (its pid
from the heartbeat) once the worker reports the step; a diagnostic failure is SIGABRT (the way XLA's or a driver's
checks end a process on a faulty device) plus the host marked unhealthy for the site health check the run is
given (`supervisor.health_check`), so its self-checks fail.
Prints a table per fault (detection latency, in seconds and heartbeat periods; recovery time = fault to the
first kept step after restart; the restart's start-up and compile time; steps recomputed) and the run's
goodput ledger (msjax.goodput: where the wall time went, and the effective training time ratio ETTR =
productive / wall), plus its extrapolation to one fault every 5 minutes:
    ETTR(T) = 1 - (mean per-fault cost) / T,  per-fault cost = the ledger's restart + recomputed time, and the
    restarted attempts' start-up and compilation, divided by the number of faults,
which assumes the steady state between faults is pure training. A second table breaks each fault's recovery time
into phases (msjax.supervise.figures.recovery_phases: detect, stop, diagnose, backoff, then the restarted workers'
process start, imports, rendezvous, jax.distributed, data/program, restore, first step's compile, heartbeat lag).
`--json PATH` writes everything as JSON too, with the load average.

With `--fault_every_s=S` the faults come at a fixed rate instead: one per S seconds of training on average (a
Poisson process on the training time), of random kinds, until the run's steps are done; the run's ledger is then
held against the goodput model fed with the run's own failure rate, restart costs and checkpoint stall
(msjax.supervise.figures.run_projection; msjax.planner.goodput): both ETTRs and their difference in points are
printed and kept under "projection_check" in the JSON.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import re
import resource
import secrets
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

from msjax import cli, runtime
from msjax.cli import config_flags, flag_value
from msjax.config import Config, ConfigError, apply_overrides, load_preset

# An entry point: the process set-up of a run (malloc on CPU, compilation cache, XLA:CPU collective flags),
# before jax starts a backend; importing msjax itself changes nothing (msjax.runtime).
runtime.setup()

# Config flags under the user's (the user's win): a small model, a short supervised run.
DEFAULTS = {
    "config": "gpt_tiny", "model.num_layers": 2, "model.d_model": 64, "model.num_heads": 2, "model.max_seq_len": 64,
    "data.tokenizer": "char", "train.seq_len": 64, "train.global_batch": 8, "train.eval_every": 0,
    "train.sample_tokens": 0, "train.progress": False, "train.log_every": 5, "optimizer.warmup_steps": 5,
    "checkpoint.every": 5, "mesh.data": -1, "mesh.fsdp": 2, "mesh.tensor": 1,
    # timeout = 1.8 periods: a SIGSTOP is found 0.8-1.8 periods after it; 4.5 s also rides out the heartbeat gaps
    # seen on the shared 2-core machine while XLA compiles (up to 2.7 s)
    "supervisor.heartbeat_period_s": 2.5, "supervisor.heartbeat_timeout_s": 4.5, "supervisor.stop_grace_s": 3,
    "supervisor.backoff_s": 0.5, "supervisor.startup_timeout_s": 300,
    # a job-wide hang with live heartbeats (seen once here: both workers blocked in the checkpoint's
    # process_allgather) is found after this; above the first step's compile time under load (up to 60 s seen)
    "supervisor.stall_timeout_s": 120,
    # a kill -9 stands for a worker process failing on a healthy host (a diag fault stands for a bad host): two
    # kills on one host must not exclude it here
    "supervisor.exclude_after_deaths": 0,
}
KINDS = ("kill", "stop", "diag")


@dataclasses.dataclass(frozen=True)
class RecoveryBenchOptions:
    """bench_recovery.py's own flags; config flags (`--supervisor.heartbeat_period_s=1`) go to the run, over DEFAULTS.

    Attributes:
      faults_per_kind: faults of each kind (>= 1); the run gets faults_per_kind - 1 spare hosts.
      kinds: fault kinds to inject, in this order: any of kill (kill -9), stop (SIGSTOP), diag (a failed self-check).
      hosts: worker hosts (local processes; >= 2: a diagnostic failure excludes one).
      devices_per_host: CPU devices per host.
      steps: the run's train.steps (and optimizer.decay_steps).
      compile_cache: a persistent XLA compilation cache directory for the workers; empty: none.
      json: also write everything as JSON to this path.
      seed: seed of the faults' ranks and steps; -1: a random one (printed).
      backend: local: worker processes here; slurm: a SLURM cluster of hosts + 1 nodes brought up on this machine
        (tests/slurm_cluster.py; root and Debian's slurmctld, slurmd, slurm-client and munge needed), the job the
        launcher's script, faults from outside it: kill (kill -9), stop (SIGSTOP), node (everything on the node of a
        rank other than 0 killed, slurmd included), one each (--kinds: a subset of kill,stop,node; by default all
        three); the spare node takes the failed node's place.
      node_local_tier: (slurm) checkpoint.local_dir on each node's own tmpfs (tests/slurm_cluster.py: one path, a
        disk per node), so a node failure takes that node's local tier with it (what peer replicas,
        checkpoint.local_replicas, are for).
      fault_every_s: > 0: faults at a fixed rate instead, one per this many seconds of training on average, until
        the run's steps are done: each attempt's fault comes an exponentially distributed time after the attempt's
        first step was seen (a Poisson process on the training time), of a kind drawn at random from --kinds (on
        SLURM: kill, stop and node, at most NODE_SPARES node failures, a spare node each), into a random rank
        (node: other than 0). The run then gets a spare host per diag fault drawn and the projection check: the
        goodput model fed with the run's own rate and costs beside its measured ETTR. Checkpoints are then
        written synchronously (checkpoint.async_save=False): a save is complete when its stall ends, as the check
        assumes (the event log does not hold when an asynchronous save's background write ended).
    """

    faults_per_kind: int = 1
    kinds: tuple[str, ...] = KINDS
    hosts: int = 2
    devices_per_host: int = 2
    steps: int = 60
    compile_cache: str = ""
    json: str = ""
    seed: int = -1
    backend: Literal["local", "slurm"] = "local"
    fault_every_s: float = 0.0
    node_local_tier: bool = False


# Faults drawn for a run at a fixed rate (--fault_every_s): the restart budget; a run that needs more ends with a
# report. Node failures on the SLURM cluster at most, each taking one of its spare nodes.
RATE_FAULTS = 60
NODE_SPARES = 2


def main(argv: list[str]) -> int:
    def body() -> int:
        defaults = [f"--{key}={flag_value(value)}" for key, value in DEFAULTS.items()]
        # --help shows the preset's values as the config flags' defaults: say which ones this bench changes.
        description = f"{__doc__}\nConfig flags set here, under the user's: {' '.join(defaults)}"
        cfg, (common, own) = cli.parse([*defaults, *argv], RecoveryBenchOptions(), prog="bench_recovery.py",
                                       description=description, validate=False)
        cli.setup_logging(common)
        if own.backend == "slurm":
            return run_slurm(cfg, common, own)
        if not own.kinds or set(own.kinds) - set(KINDS):
            raise ConfigError(f"--kinds={','.join(own.kinds)!r}: allowed is a comma-separated subset of "
                              f"{','.join(KINDS)}")
        for flag, value, least in (("--faults_per_kind", own.faults_per_kind, 1), ("--hosts", own.hosts, 2),
                                   ("--devices_per_host", own.devices_per_host, 1), ("--steps", own.steps, 1),
                                   ("--fault_every_s", own.fault_every_s, 0)):
            if value < least:
                raise ConfigError(f"{flag}={value}: allowed is >= {least}"
                                  + (" (a diagnostic failure excludes a host)" if flag == "--hosts" else ""))
        if own.json:
            cli.check_writable(own.json, "--json")
        return run(cfg, common, own)

    return cli.main_guard(body)


@dataclasses.dataclass(frozen=True)
class Fault:
    """A fault to inject: `kind` into worker `rank` of attempt `attempt` (None: of every attempt, a fault loop),
    `after` steps past the step the attempt resumed from and `after_s` seconds after the attempt's first step was
    seen (every worker past its restore step). Kinds: kill (SIGKILL), stop (SIGSTOP, a hang), diag (SIGABRT and
    the host's health check failing), term (SIGTERM, a preemption notice: the job saves and stops)."""

    kind: str
    rank: int
    after: int
    attempt: int | None
    after_s: float = 0.0


SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "diag": signal.SIGABRT, "term": signal.SIGTERM}
# node: (SLURM) everything in the node's namespace killed, its slurmd included


class FaultInjector:
    """The supervisor's watcher (msjax.supervise.supervisor.Progress) that injects `faults` into local workers.

    Args:
      faults: what to inject, each once.
      unhealthy_dir: where a `diag` fault marks its host unhealthy (the file `unhealthy-HOST`, which the run's
        health check, `health_check_command(unhealthy_dir)`, looks for).
      last_step: the run's last step (train.steps): a worker that reached it is not faulted (the run's work is
        done; a fault then would cost nothing and end no attempt). None: no such limit.
    """

    def __init__(self, faults: list[Fault], unhealthy_dir: Path, last_step: int | None = None):
        self.last_step = last_step
        self.pending = list(faults)
        self.done: set = set()
        self.unhealthy_dir = Path(unhealthy_dir)
        self.training_since: dict[int, float] = {}  # attempt -> when every worker was seen past its restore step

    def __call__(self, progress) -> None:
        if progress.attempt not in self.training_since and len(progress.beats) == len(progress.workers) and all(
                b.get("step") is not None and b["step"] > (b.get("start_step") or 0) for b in progress.beats.values()):
            self.training_since[progress.attempt] = time.time()
        for f in list(self.pending):
            beat = progress.beats.get(f.rank)
            if f.attempt not in (None, progress.attempt) or beat is None or beat.get("step") is None:
                continue
            if (f, progress.attempt) in self.done:
                continue
            if f.rank >= len(progress.workers) or progress.workers[f.rank].proc.poll() is not None:
                continue
            if beat["step"] < (beat.get("start_step") or 0) + f.after:
                continue
            if self.last_step is not None and beat["step"] >= self.last_step:
                continue
            if f.after_s and time.time() - self.training_since.get(progress.attempt, math.inf) < f.after_s:
                continue
            self.done.add((f, progress.attempt))
            if f.attempt is not None:
                self.pending.remove(f)
            host = progress.workers[f.rank].host
            if f.kind == "diag":
                self.unhealthy_dir.mkdir(parents=True, exist_ok=True)
                (self.unhealthy_dir / f"unhealthy-{host}").touch()
                resource.prlimit(beat["pid"], resource.RLIMIT_CORE, (0, 0))  # an abort that leaves no core file
            os.kill(beat["pid"], SIGNALS[f.kind])
            progress.emit("fault_injected", fault=f.kind, rank=f.rank, host=host, step=beat["step"],
                          attempt=progress.attempt)
            print(f"[bench] injected {f.kind} into rank {f.rank} ({host}) at step {beat['step']}", flush=True)


def health_check_command(unhealthy_dir: Path) -> str:
    """A site health check that fails on a host marked unhealthy in `unhealthy_dir`."""
    return f'test ! -e {shlex.quote(str(unhealthy_dir))}/unhealthy-"$MSJAX_HOST"'


def supervised_run(cfg: Config, common: cli.CommonOptions, own: RecoveryBenchOptions
                   ) -> tuple[Config, list[str], list[Fault], int]:
    """The run to supervise, from `cfg` (DEFAULTS and the user's config flags) and the bench's flags.

    Returns:
      (the run's config, with train.run_dir, train.steps, the spares, the restart budget and the health check set;
      its train flags; the faults; the seed).
    Raises:
      ConfigError: the run's config does not validate.
    """
    preset = load_preset(common.config)
    k = own.faults_per_kind
    seed = own.seed if own.seed >= 0 else random.randrange(1 << 30)
    rng = random.Random(seed)
    if own.fault_every_s:
        faults = [Fault(rng.choice(own.kinds), rng.randrange(own.hosts), 1, attempt,
                        rng.expovariate(1.0 / own.fault_every_s)) for attempt in range(RATE_FAULTS)]
        spares, budget = sum(f.kind == "diag" for f in faults), RATE_FAULTS
    else:
        kinds = [kind for kind in KINDS if kind in own.kinds for _ in range(k)]
        faults = [Fault(kind, rng.randrange(own.hosts), rng.randint(3, 8), attempt)
                  for attempt, kind in enumerate(kinds)]
        spares, budget = k - 1, len(kinds) + 2
    given_run_dir = cfg.train.run_dir != preset.train.run_dir
    run_dir = Path(cfg.train.run_dir if given_run_dir else tempfile.mkdtemp(prefix="bench_recovery_")) / "run"
    overrides = {"train.run_dir": str(run_dir), "train.steps": own.steps, "supervisor.spares": spares,
                 "supervisor.restart_budget": budget, "optimizer.decay_steps": own.steps,
                 "supervisor.health_check": health_check_command(run_dir.parent / "health")}
    if own.fault_every_s:
        overrides["checkpoint.async_save"] = False
    cfg = apply_overrides(cfg, overrides).validate()
    logging_flags = [f"--{name}={flag_value(getattr(common, name))}" for name in ("log_level", "quiet", "verbose")
                     if getattr(common, name) != getattr(cli.CommonOptions(), name)]
    return cfg, [f"--config={common.config}", *config_flags(cfg, preset), *logging_flags], faults, seed


def run(cfg: Config, common: cli.CommonOptions, own: RecoveryBenchOptions) -> int:
    """The benchmark (see the module docstring) on `cfg` (DEFAULTS and the user's config flags); returns the exit
    status: 0 when the supervised run finished, 1 otherwise."""
    from msjax.launch.cli import new_run_id, run_supervised
    from msjax.launch.options import LaunchOptions
    from msjax.events import read_events

    cfg, train_flags, faults, seed = supervised_run(cfg, common, own)
    run_dir = Path(cfg.train.run_dir)
    if own.compile_cache:
        # jax reads its config from JAX_* variables; the workers inherit them.
        os.environ.update(JAX_COMPILATION_CACHE_DIR=own.compile_cache,
                          JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                          JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    shown = f"one per {own.fault_every_s:g} s of training" if own.fault_every_s else f"{faults}"
    print(f"bench_recovery: seed {seed}, faults {shown}, run dir {run_dir}", flush=True)
    opts = LaunchOptions(num_processes=own.hosts, devices_per_process=own.devices_per_host, supervise=True)
    t0 = time.time()
    code = run_supervised(opts, cfg, new_run_id("bench"), train_flags,
                          watchers=[FaultInjector(faults, run_dir.parent / "health", cfg.train.steps)])
    return report(read_events(run_dir), cfg, own, code, time.time() - t0, seed, "local")


def run_slurm(cfg: Config, common: cli.CommonOptions, own: RecoveryBenchOptions) -> int:
    """The benchmark on a SLURM cluster of `hosts` + 1 nodes brought up on this machine for it (see
    RecoveryBenchOptions.backend): the supervised job is the launcher's sbatch script; this process watches the
    job's Redis (it chose the password: MSJAX_REDIS_PASSWORD at submission) and injects, one per attempt, a kill -9
    and a SIGSTOP of a random worker and a node failure of a node other than the first (which holds the supervisor
    and Redis), each a random 3-8 steps after the attempt resumed. Returns 0 when the run finished."""
    import importlib.util
    import subprocess
    import sysconfig

    from msjax.control.store import Store, connect
    from msjax.events import read_events
    from msjax.launch.slurm import redis_address

    spec = importlib.util.spec_from_file_location("slurm_cluster", Path(__file__).resolve().parents[1] / "tests"
                                                  / "slurm_cluster.py")
    slurm_cluster = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = slurm_cluster
    spec.loader.exec_module(slurm_cluster)
    if slurm_cluster.missing_tools() or os.geteuid() != 0:
        raise ConfigError(f"--backend=slurm needs root and {', '.join(slurm_cluster.missing_tools())} (apt-get "
                          "install slurmctld slurmd slurm-client munge)")
    rate = own.fault_every_s > 0
    slurm_kinds = own.kinds if set(own.kinds) <= {"kill", "stop", "node"} else ("kill", "stop", "node")
    if own.node_local_tier:  # the run's directory fixed first: the nodes' tmpfs is under it (<root>/slurm)
        preset = load_preset(common.config)
        root = Path(cfg.train.run_dir if cfg.train.run_dir != preset.train.run_dir
                    else tempfile.mkdtemp(prefix="bench_recovery_"))
        cfg = apply_overrides(cfg, {"train.run_dir": str(root),
                                    "checkpoint.local_dir": str(root / "slurm" / "node-local" / "tier")})
    own = dataclasses.replace(own, faults_per_kind=1, kinds=("kill", "stop") if rate else
                              tuple(k for k in slurm_kinds if k != "node"))
    cfg, train_flags, local_faults, seed = supervised_run(cfg, common, own)
    rng = random.Random(seed)
    if rate:  # a node failure takes a spare node: past NODE_SPARES of them, the draw is a kill
        drawn = [rng.choice(("kill", "stop", "node")) for _ in local_faults]
        kinds = [k if k != "node" or drawn[:i].count("node") < NODE_SPARES else "kill" for i, k in enumerate(drawn)]
        faults = [dataclasses.replace(f, kind=k, rank=rng.randrange(1, own.hosts) if k == "node" else f.rank)
                  for f, k in zip(local_faults, kinds)]
        spares = min(NODE_SPARES, kinds.count("node"))
    else:
        node = [Fault("node", rng.randrange(1, own.hosts), rng.randint(3, 8), len(local_faults))]
        faults = [*local_faults, *(node if "node" in slurm_kinds else [])]
        spares = 1
    cfg = apply_overrides(cfg, {"supervisor.spares": spares})
    train_flags = [*train_flags, f"--supervisor.spares={spares}"]
    run_dir = Path(cfg.train.run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    shown = f"one per {own.fault_every_s:g} s of training" if rate else f"{faults}"
    print(f"bench_recovery (slurm): seed {seed}, faults {shown}, run dir {run_dir}", flush=True)
    cluster = slurm_cluster.SlurmCluster(run_dir.parent / "slurm", nodes=own.hosts + spares).up()
    password, run_id = secrets.token_hex(8), f"bench-{secrets.token_hex(3)}"
    env = {k: v for k, v in cluster.env.items() if not k.startswith(("XLA_", "MSJAX_"))}
    env["PATH"] = f"{sysconfig.get_paths()['scripts']}{os.pathsep}{env['PATH']}"  # msjax's commands, for sbatch
    env["MSJAX_REDIS_PASSWORD"] = password
    if own.compile_cache:
        env.update(JAX_COMPILATION_CACHE_DIR=own.compile_cache, JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    injected: list[dict] = []
    try:
        t0 = time.time()
        submitted = subprocess.run(
            [sys.executable, "-m", "msjax.launch", "--backend=slurm", f"--num_processes={own.hosts}",
             f"--devices_per_process={own.devices_per_host}", "--accelerator=none", "--cpus_per_process=1",
             "--time_limit=60:00", "--supervise", f"--run_id={run_id}", "--submit",
             f"--output={run_dir.parent / 'job.sbatch'}", "--", *train_flags],
            cwd=run_dir.parent, env=env, capture_output=True, text=True, timeout=120)
        if submitted.returncode != 0:
            raise ConfigError(f"the job was not submitted: {submitted.stderr.strip()}")
        job = submitted.stdout.strip()

        def job_state() -> str:
            out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True,
                                 timeout=60).stdout
            m = re.search(r"JobState=(\S+)", out)
            return m.group(1) if m else "?"

        store = None
        pending = list(faults)
        training_since: dict[int, float] = {}  # attempt -> when every worker was seen past its restore step
        while job_state() in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING") and time.time() - t0 < 3600:
            time.sleep(0.2)
            if store is None:
                output = run_dir.parent / f"msjax-{job}.out"
                address = redis_address(output.read_text(errors="replace")) if output.exists() else None
                if address is None:
                    continue
                try:
                    store = Store(connect(f"redis://:{password}@{cluster.addr(address[0])}:{address[1]}/0",
                                          retries=0), f"{run_id}-{job}")
                except Exception:  # noqa: BLE001 - not up yet
                    continue
            try:
                beats = store.heartbeats()
            except Exception:  # noqa: BLE001 - between attempts
                continue
            generations = {b.get("generation") for b in beats.values()}
            if len(beats) == own.hosts and len(generations) == 1 and all(
                    b.get("step") is not None and b["step"] > (b.get("start_step") or 0) for b in beats.values()):
                training_since.setdefault(generations.pop(), time.time())
            for f in list(pending):
                beat = beats.get(f.rank)
                if (beat is None or beat.get("generation") != f.attempt or beat.get("step") is None
                        or beat["step"] < (beat.get("start_step") or 0) + f.after or beat["step"] >= own.steps
                        or time.time() - training_since.get(f.attempt, math.inf) < f.after_s):
                    continue
                pending.remove(f)
                t = time.time()
                if f.kind == "node":
                    cluster.kill_node(beat["host"])
                else:
                    os.kill(beat["pid"], SIGNALS[f.kind])
                injected.append({"time": t, "kind": "fault_injected", "fault": f.kind, "rank": f.rank,
                                 "host": beat["host"], "step": beat["step"], "attempt": f.attempt})
                print(f"[bench] injected {f.kind} into rank {f.rank} ({beat['host']}) at step {beat['step']}",
                      flush=True)
        state = job_state()
        wall = time.time() - t0
    finally:
        left = cluster.down()
        if left:
            print(f"bench_recovery: the cluster left behind {left}", file=sys.stderr)
    events = sorted(read_events(run_dir) + injected, key=lambda e: e["time"])
    return report(events, cfg, own, 0 if state == "COMPLETED" else 1, wall, seed, "slurm")


def report(events: list[dict], cfg: Config, own: RecoveryBenchOptions, code: int, wall: float, seed: int,
           backend: str) -> int:
    """Prints the tables of a finished run's `events` (its faults' `fault_injected` events among them) and writes
    the JSON; returns 0 when the run finished, else 1."""
    from msjax.goodput import describe, run_ledger
    from msjax.supervise.figures import RECOVERY_PHASES, fault_figures, recovery_phases

    run_dir = Path(cfg.train.run_dir)
    figures = fault_figures(events)
    breakdown = recovery_phases(events)
    ledger = run_ledger(events)
    period = cfg.supervisor.heartbeat_period_s
    attempts = [e for e in events if e["kind"] == "attempt_end"]
    step_s = [a["step_s"] for a in attempts if a.get("step_s")]
    step_time = sorted(step_s)[len(step_s) // 2] if step_s else None
    starts = {}
    for e in events:  # start-up + compile of each attempt: launch -> its first step
        if e["kind"] == "launch":
            starts[e["attempt"]] = {"launch": e["time"]}
        elif e["kind"] == "first_step" and e["attempt"] in starts:
            starts[e["attempt"]]["first_step"] = e["time"]
    startup = {a: v["first_step"] - v["launch"] for a, v in starts.items() if "first_step" in v}
    rows = []
    for f in figures:
        nxt = f["attempt"] + 1
        cost = None
        if f["recovery_s"] is not None and f["recomputed_steps"] is not None and step_time:
            cost = f["recovery_s"] + f["recomputed_steps"] * step_time
        rows.append({**f, "detection_periods": None if f["detection_s"] is None else f["detection_s"] / period,
                     "restart_startup_s": startup.get(nxt), "cost_s": cost})
    # Per-fault cost from the ledger: everything a fault added to the run's wall time.
    restarted = [a["buckets"] for a in ledger["attempts"] if a["attempt"] > 0]
    fault_cost = (ledger["buckets"]["restart"] + ledger["buckets"]["recomputed"]
                  + sum(b["startup"] + b["compilation"] for b in restarted))
    mean_cost = fault_cost / len(rows) if rows else None
    extrapolated = 1 - mean_cost / 300.0 if mean_cost is not None else None
    print(f"\n{'fault':6} {'rank':>4} {'step':>5} {'detect s':>9} {'periods':>8} {'recover s':>10} "
          f"{'startup s':>10} {'recomp':>7} {'cost s':>7}")
    for r in rows:
        def f(x, fmt):
            return "-" if x is None else format(x, fmt)
        print(f"{r['kind']:6} {r['rank']:>4} {r['step']:>5} {f(r['detection_s'], '9.2f')} "
              f"{f(r['detection_periods'], '8.2f')} {f(r['recovery_s'], '10.2f')} {f(r['restart_startup_s'], '10.2f')} "
              f"{f(r['recomputed_steps'], '7d')} {f(r['cost_s'], '7.2f')}")
    names = [name for name, _ in RECOVERY_PHASES if any(name in b["phases"] for b in breakdown)]
    print("\nwhere the recovery time went (s; supervisor: detect..backoff; restarted workers, slowest: "
          "process_start..heartbeat_lag):")
    print(f"{'fault':6} " + " ".join(f"{n[:12]:>12}" for n in names) + f" {'sum':>8}")
    for b in breakdown:
        print(f"{b['kind']:6} " + " ".join(f"{b['phases'][n]:12.2f}" if n in b["phases"] else f"{'-':>12}"
                                          for n in names) + f" {sum(b['phases'].values()):8.2f}")
    # Each attempt's slowest worker: restore and first-step (compile) seconds. Attempt 0 compiles what the
    # persistent cache does not hold yet (and a re-planned attempt, its new mesh's programs); a same-mesh restart
    # loads them: the difference is what the cache saves per restart.
    per_attempt: dict[int, dict[str, float]] = {}
    for e in events:
        m = e.get("phases") or {}
        if e["kind"] == "worker_phases" and {"prepared", "restored", "first_step"} <= set(m):
            a = per_attempt.setdefault(e["attempt"], {"restore_s": 0.0, "first_step_s": 0.0})
            a["restore_s"] = max(a["restore_s"], m["restored"] - m["prepared"])
            a["first_step_s"] = max(a["first_step_s"], m["first_step"] - m["restored"])
    print("\nper attempt, slowest worker (s): " + "; ".join(
        f"attempt {a}: restore {v['restore_s']:.1f}, first step {v['first_step_s']:.1f}"
        for a, v in sorted(per_attempt.items())))
    print(f"\nstatus {code}; wall {wall:.1f} s; step time {step_time and round(step_time, 3)} s; heartbeat period "
          f"{period:g} s, timeout {cfg.supervisor.heartbeat_timeout_s:g} s")
    print(describe(ledger))
    if ledger["ettr"] is not None:
        print(f"effective training time of this run: {ledger['ettr']:.1%} ({ledger['buckets']['productive']:.1f} s "
              f"productive of {ledger['wall_s']:.1f} s, {len(rows)} faults in {ledger['wall_s'] / 60:.1f} min)")
    if extrapolated is not None:
        print(f"extrapolated to one fault every 5 minutes: ETTR(300 s) = 1 - (mean per-fault cost) / 300 s "
              f"= 1 - {mean_cost:.1f} / 300 = {extrapolated:.1%}; per-fault cost = (restart + recomputed + "
              "the restarted attempts' start-up and compilation) / faults, from the goodput ledger")
    check = None
    if own.fault_every_s and rows and step_time:
        from msjax.planner.goodput import projection_dict, projection_text
        from msjax.supervise.figures import run_projection

        projection, inputs = run_projection(events, ledger, cfg.checkpoint.every, step_time,
                                            own.hosts * own.devices_per_host)
        print("\n" + projection_text(projection, inputs, "the goodput model fed with this run's own failure rate "
                                     "and costs (msjax.supervise.figures.run_projection; faults strike training)"))
        difference = 100.0 * (projection.ettr - ledger["ettr"])
        print(f"projected ETTR {projection.ettr:.1%}, measured (the ledger) {ledger['ettr']:.1%}: "
              f"{difference:+.1f} points")
        check = {**projection_dict(projection, inputs), "measured_ettr": ledger["ettr"],
                 "difference_points": difference}
    out = {"backend": backend, "seed": seed, "fault_every_s": own.fault_every_s or None, "projection_check": check, "exit_code": code, "wall_s": wall, "faults": rows, "goodput": ledger,
           "step_s": step_time, "startup_s": startup, "attempt_compile": per_attempt, "heartbeat_period_s": period,
           "recovery_phases": breakdown,
           "load_avg": os.getloadavg(),
           "heartbeat_timeout_s": cfg.supervisor.heartbeat_timeout_s,
           "mean_fault_cost_s": mean_cost, "ettr_one_fault_per_5min": extrapolated,
           "compile_cache": own.compile_cache or None, "run_dir": str(run_dir)}
    print(json.dumps(out, default=str))  # the one JSON line every benchmark ends with (scripts/README.md)
    if own.json:
        Path(own.json).write_text(json.dumps(out, indent=2, default=str))
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
