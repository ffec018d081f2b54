"""SLURM: the sbatch script a job runs (`sbatch_script`), and the supervisor's backend inside its allocation
(`SlurmBackend`).

What the site must provide: slurmctld/slurmd with munge (any recent SLURM; tested with Debian's 22.05), msjax
installed where every node can run it (a shared virtualenv, a module, a container), and the nodes able to reach
each other by their SLURM node names (the workers' coordinator and Redis are addressed that way).

The script, built from `LaunchOptions` as data (`SlurmScript`), never patched after rendering:
  #SBATCH --nodes=N (+ supervisor.spares when supervised) --ntasks-per-node=1, --cpus-per-task, --time, and
  --gpus-per-node (accelerator gpu), --partition, --account, --qos, --chdir, the user's extra lines; --requeue,
  and --no-kill when supervised (a node failure must not end the allocation: the supervisor excludes the node and
  goes on, on a spare or on the nodes left);
  the setup block (--setup, --setup_file: a virtualenv, `module load`, a container's environment; every srun task
  inherits the environment it leaves, srun's default --export=ALL);
  Redis on the first node of the allocation (`msjax-redis` as an srun step, on a port free there, listening on
  that node's address; its password generated at job start and passed in the environment, never on a command
  line; the script prints `msjax: Redis at NODE:PORT`, `redis_address`);
  then either the worker step, `srun ... msjax-train <train flags>` with one task per node, each task's rank its
  SLURM_PROCID (rank 0, JAX's coordinator, on the first node), its output split per rank into
  `<run_dir>/logs/rank<R>.log` and shown as a supervised run's (`msjax-output`, msjax.launch.output), or the
  supervisor (`msjax-supervise
  --backend=slurm`, the job's controller on the first node beside Redis), which starts worker steps itself;
  a requeued job (SLURM_RESTART_COUNT > 0) runs with --resume, so it resumes from its own newest verified
  checkpoint instead of refusing to overwrite them; and a job whose step or supervisor stopped resumably (exit
  75, or 128 + SIGTERM/SIGINT: preempted, signalled) requeues itself (`scontrol requeue`): never taken for done.
  Its `scontrol` calls are retried (6 tries, 5 s apart), as a busy controller fails them.

`SlurmBackend` (the supervisor's WorkerBackend inside the allocation):
    worker step:  srun --nodes=N --ntasks=N --ntasks-per-node=1 --nodelist=HOSTS [--exclude=OTHERS] --label
                       --overlap --kill-on-bad-exit=0 [srun_args] bash -c TASK_WRAPPER _ PYTHON -m msjax.train <flags>
    self-checks:  one srun step per node (-w NODE), so a node whose slurmd is gone fails alone
    stop:         scancel --signal=TERM JOB.STEP (and CONT, for a stopped task), SIGKILL after the grace period
Each task runs under `TASK_WRAPPER`, which gives the worker its rank (SLURM_PROCID) and host (SLURMD_NODENAME)
and prints `MSJAX_TASK start RANK HOST JOB STEP` and `MSJAX_TASK exit RANK CODE`: srun returns one exit code
for the whole step, so the wrapper's line is how the supervisor tells which task failed first (a task killed by
signal S exits 128 + S, read back as -S, as Popen would give it; 128 + SIGTERM/SIGINT, a worker's own status
for "stopped by that signal", stays as it is). Tasks are numbered in node order (SLURM's block distribution over
the node list), the order the supervisor keeps its hosts in; a worker's heartbeat names its node, and the
supervisor trusts that over its guess. The step's output (srun --label) is split per task into
`<run_dir>/logs/attempt<K>.rank<R>.log`, and reaches the supervisor's output as a local run's does
(msjax.launch.output).

Excluding a host is leaving it out of the next step's --nodelist (and naming it in --exclude): the allocation
stays, so a spare node of the allocation can take its place, or the planner re-plans onto the nodes left.
Sources: sbatch(1), srun(1), scancel(1) and scontrol(1) of SLURM 22.05 (--no-kill, --requeue, --label,
--kill-on-bad-exit, --nodelist, --exclude, `scancel --signal=SIG JOBID.STEPID` signals every process of a step,
`scontrol requeue`).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from msjax.control.server import die_with_parent
from msjax.control.store import EXIT_REQUESTED
from msjax.launch.env import job_env, worker_flags
from msjax.launch.local import self_checks
from msjax.launch.options import LaunchOptions
from msjax.launch.output import Router, log_shows_lost_service
from msjax.supervise.detect import STOPPED_EXITS
from msjax.supervise.diagnostics import Checks, HostDiagnosis, diagnoses
from msjax.supervise.supervisor import Worker, WorkerBackend

# The line the job script prints once its Redis is chosen (`redis_address` reads it back from the job's output).
_REDIS_LINE = re.compile(r"^msjax: Redis at (\S+):(\d+)$", re.M)
# Exported in each task: its rank and host, the worker's identity and the address its peers reach it on.
TASK_ENV = ('export MSJAX_RANK="$SLURM_PROCID" MSJAX_HOST="${SLURMD_NODENAME:-$(hostname)}"; '
            'export MSJAX_WORKER_ID="$MSJAX_HOST" MSJAX_ADVERTISE_HOST="$MSJAX_HOST"')
# Runs one worker task: "$@" is the worker command. The wrapper stays the task's main process so that it can print
# the worker's exit code; it forwards SIGTERM to the worker (scancel signals every process of the step, srun the
# wrapper: either way the worker gets it).
# With MSJAX_TASK_STATUS set (a folder every node sees), it also writes its exit status there (rank<R>): srun's
# own status is the largest of its tasks' and a task srun killed reads like one stopped by a signal, so only the
# tasks' own statuses tell a job that stopped resumably from one that failed.
TASK_WRAPPER = TASK_ENV + r"""
echo "MSJAX_TASK start $SLURM_PROCID $MSJAX_HOST ${SLURM_JOB_ID:-0} ${SLURM_STEP_ID:-0}"
"$@" & child=$!
trap 'kill -TERM $child 2>/dev/null' TERM
while :; do wait $child; rc=$?; kill -0 $child 2>/dev/null || break; done
echo "MSJAX_TASK exit $SLURM_PROCID $rc"
if [ -n "${MSJAX_TASK_STATUS:-}" ]; then echo "$rc" > "$MSJAX_TASK_STATUS/rank$SLURM_PROCID"; fi
exit $rc
"""
_TASK_LINE = re.compile(r"MSJAX_TASK (start|exit) (\d+) (\S+)(?: (\S+) (\S+))?")
# Statuses after which a job is requeued to resume: stopped by a signal after saving, or asked to leave.
RESUMABLE = (EXIT_REQUESTED, *STOPPED_EXITS)


# -- the sbatch script -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SlurmScript:
    """An sbatch script as data: its directives, its setup block and what its body runs (`render` writes it).

    Attributes:
      run_id: the run's id (the job appends its SLURM_JOB_ID).
      nodes: nodes the allocation asks for.
      directives: the #SBATCH options, in order.
      setup: shell text run first (the user's setup block).
      body: the commands after Redis is up: the worker step or the supervisor; they leave the job's exit status in
        `status` and whether it stopped resumably (1) or not (0) in `resumable`, for the requeue rule.
    """

    run_id: str
    nodes: int
    directives: tuple[str, ...]
    setup: str
    body: tuple[str, ...]

    def render(self) -> str:
        lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in self.directives),
                 f"# msjax run {self.run_id}: one worker per node; Redis on the first node of the allocation.",
                 "set -euo pipefail"]
        if self.setup.strip():
            lines += ["# -- setup (msjax-launch --setup / --setup_file) --", self.setup.rstrip("\n"),
                      "# -- end of setup --"]
        lines += [
            'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            "# No fixed port: jobs whose first nodes coincide, or a site's own Redis, must not collide. This script",
            "# runs on the first node, so a port free here now is Redis's (JAX's coordinator, rank 0, takes a free",
            "# port of its own node and publishes it through Redis).",
            "REDIS_PORT=$(msjax-redis --free-port)",
            "# Redis listens on the address the other nodes reach the first node by, not on every interface; where",
            "# the node's name resolves to loopback here (Debian's 127.0.1.1), on all of them.",
            "REDIS_BIND=$(getent ahostsv4 \"$HEAD_NODE\" | awk 'NR == 1 {print $1}')",
            'case "$REDIS_BIND" in ""|127.*) REDIS_BIND=0.0.0.0 ;; esac',
            "# The password: the submitter's MSJAX_REDIS_PASSWORD (to watch the run's Redis), else a fresh one; it",
            "# reaches Redis and the workers through the environment (readable by this job's user alone), never a",
            "# command line.",
            "export MSJAX_REDIS_PASSWORD=\"${MSJAX_REDIS_PASSWORD:-$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \\n')}\"",
            "# Redis lives as long as the job: started on the first node (deaf to SIGTERM: a preemption notice goes",
            "# to every step, and the workers stop through Redis), killed on exit.",
            'srun --nodes=1 --ntasks=1 -w "$HEAD_NODE" --overlap msjax-redis --port "$REDIS_PORT" --bind "$REDIS_BIND" '
            '--save "" --appendonly no --maxclients 20000 --tcp-backlog 4096 &',
            "REDIS_PID=$!",
            "trap 'kill -KILL $REDIS_PID 2>/dev/null || true' EXIT",
            'export MSJAX_REDIS_URL="redis://${HEAD_NODE}:${REDIS_PORT}/0"',
            'echo "msjax: Redis at ${HEAD_NODE}:${REDIS_PORT}"',
            f'export MSJAX_RUN_ID="{self.run_id}-${{SLURM_JOB_ID}}"',
            "export PYTHONUNBUFFERED=1",
            "# Wait (at most 60 s) until Redis accepts connections, so no worker starts against an absent server.",
            "for _ in $(seq 600); do",
            '  (exec 3<>"/dev/tcp/$HEAD_NODE/$REDIS_PORT") 2>/dev/null && break',
            "  sleep 0.1",
            "done",
            "# A requeued job resumes from its own newest verified checkpoint.",
            'RESUME=(); if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then RESUME=(--resume); fi',
            "# SIGTERM to this script (preemption, scancel --full): the step below gets it too, saves and exits;",
            "# the status decides below. Trapped so that bash waits for the step instead of dying first.",
            "trap 'echo \"msjax: SIGTERM: waiting for the step to save\"' TERM",
            "set +e",
            *self.body,
            "set -e",
            "# ... and only while the job runs on: a job being cancelled (scancel) or out of time is not requeued.",
            "# scontrol is retried: a controller busy past its MessageTimeout fails the call, and a state read as",
            "# not RUNNING for that would end a preempted job for good (seen on a loaded test cluster).",
            'JOB_STATE=""',
            'if [ "$resumable" = 1 ]; then',
            "  for _ in 1 2 3 4 5 6; do",
            '    JOB_STATE=$(scontrol show job "$SLURM_JOB_ID") && break',
            "    sleep 5",
            "  done",
            '  [ -n "$JOB_STATE" ] || echo "msjax: job $SLURM_JOB_ID: no state from slurmctld; not requeueing"',
            "fi",
            'if grep -q "JobState=RUNNING" <<<"$JOB_STATE"; then',
            '  echo "msjax: stopped before the end (status $status), resumable: requeueing job $SLURM_JOB_ID"',
            "  for _ in 1 2 3 4 5 6; do",
            '    scontrol requeue "$SLURM_JOB_ID" && break',
            "    sleep 5",
            "  done",
            "fi",
            'exit "$status"',
        ]
        return "\n".join(lines) + "\n"


def sbatch_script(opts: LaunchOptions, run_id: str, train_flags: Sequence[str], run_dir: str, spares: int = 0,
                  supervisor: Sequence[str] = ()) -> SlurmScript:
    """The job's script as data (see the module docstring).

    Args:
      opts: the launch options (num_processes nodes, devices_per_process each, the slurm flags).
      run_id: the run's id.
      train_flags: the workers' train flags.
      run_dir: the run's directory (train.run_dir; the tasks' exit statuses go to its logs/ folder).
      spares: extra nodes the allocation holds for the supervisor (supervisor.spares).
      supervisor: the supervisor's own flags (`msjax-supervise` options) when the job is supervised; empty: the
        script runs the worker step itself.
    Raises:
      ValueError: --setup_file cannot be read.
    """
    nodes = opts.num_processes + (spares if supervisor else 0)
    d = [f"--job-name={opts.name}", f"--nodes={nodes}", "--ntasks-per-node=1",
         f"--cpus-per-task={opts.cpus_per_process}", f"--time={opts.time_limit}", f"--output={opts.name}-%j.out",
         "--open-mode=append", "--requeue"]  # append: a requeued job's output follows its first run's
    if supervisor:
        d.append("--no-kill")
    if opts.accelerator == "gpu":
        d.append(f"--gpus-per-node={opts.devices_per_process}")
    for flag, value in (("partition", opts.partition), ("account", opts.account), ("qos", opts.qos),
                        ("chdir", opts.workdir)):
        if value:
            d.append(f"--{flag}={value}")
    d += list(opts.sbatch)
    setup = opts.setup
    if opts.setup_file:
        try:
            setup += "\n" + Path(opts.setup_file).read_text()
        except OSError as e:
            raise ValueError(f"--setup_file={opts.setup_file!r} cannot be read: {e.strerror}") from None
    flags = " ".join(shlex.quote(a) for a in train_flags)
    if opts.accelerator == "none":
        cpu = f"--xla_force_host_platform_device_count={opts.devices_per_process}"
        d_env = [f'export XLA_FLAGS="${{XLA_FLAGS:-}} {cpu}"']
    else:
        d_env = []
    srun_extra = "".join(f" {shlex.quote(a)}" for a in opts.srun_args)
    resumable = " ".join(map(str, RESUMABLE))
    if supervisor:
        body = [
            *d_env,
            "# The supervisor (msjax.supervise) is this job's controller, here on the first node beside Redis: it",
            "# starts the workers as an srun step (one task per node), watches their heartbeats in Redis, and on a",
            "# failure ends the step, runs the self-checks as srun steps, excludes the nodes that fail (--exclude),",
            "# re-plans onto the nodes left (or takes a spare) and restarts from the newest verified checkpoint.",
            'NODES=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd, -)',
            "msjax-supervise --backend=slurm --nodes=\"$NODES\" --run_id=\"$MSJAX_RUN_ID\" "
            + " ".join(shlex.quote(a) for a in supervisor) + f" -- {flags} \"${{RESUME[@]}}\"",
            "status=$?",
            f'resumable=0; if [[ " {resumable} " == *" $status "* ]]; then resumable=1; fi',
        ]
    else:
        logs = shlex.quote(str(Path(run_dir) / "logs"))
        status_dir = logs + '/"slurm-$SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}"'
        body = [
            *d_env,
            'export MSJAX_NUM_PROCESSES="$SLURM_NNODES"',
            f"export MSJAX_TASK_STATUS={status_dir}",
            'mkdir -p "$MSJAX_TASK_STATUS"',
            "# One task per node, each under this wrapper: its rank is the task's SLURM_PROCID (srun numbers tasks in",
            "# node order), so rank 0 and JAX's coordinator run on the first node of the allocation, beside Redis.",
            f"TASK_WRAPPER={shlex.quote(TASK_WRAPPER)}",
            "# The step's output, labelled by srun, is split per rank into the run's logs/ folder by msjax-output,",
            "# which shows rank 0's lines and every rank's warnings and errors as `[rank R] ...` (as a supervised",
            "# or local run does).",
            f'srun --nodes="$SLURM_NNODES" --ntasks="$SLURM_NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 '
            f'--label{srun_extra} bash -c "$TASK_WRAPPER" msjax-worker msjax-train {flags} "${{RESUME[@]}}" 2>&1 '
            f'| msjax-output --log_dir={logs} --step_log="$MSJAX_TASK_STATUS/step.log"',
            "status=${PIPESTATUS[0]}",
            "# Stopped resumably only when every task said so itself (MSJAX_TASK_STATUS: srun's status cannot tell).",
            "resumable=0",
            'if [ "$status" != 0 ]; then',
            "  resumable=1",
            '  for ((r = 0; r < SLURM_NNODES; r++)); do',
            f'    [[ " {resumable} " == *" $(cat "$MSJAX_TASK_STATUS/rank$r" 2>/dev/null) "* ]] || resumable=0',
            "  done",
            "fi",
        ]
    return SlurmScript(run_id, nodes, tuple(d), setup, tuple(body))


def redis_address(job_output: str) -> tuple[str, int] | None:
    """(node, port) of a job's Redis, from the line its script prints (`msjax: Redis at NODE:PORT`) in the job's
    output (sbatch --output); None before the line is there. For watching a run from outside its job; the job's
    own processes get it as MSJAX_REDIS_URL."""
    m = _REDIS_LINE.search(job_output)
    return (m.group(1), int(m.group(2))) if m else None


def submit(script: str, path: Path, sbatch: str = "sbatch") -> str:
    """Writes `script` to `path` and submits it (`sbatch --parsable`); returns the job id.

    Raises ValueError with sbatch's own message when the submission is refused."""
    path.write_text(script)
    done = subprocess.run([sbatch, "--parsable", str(path)], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise ValueError(f"sbatch refused {path}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip().split(";")[0]


# -- the supervisor's backend ------------------------------------------------------------------------------------

@dataclass
class _Step:
    """One srun job step: its process and what its tasks reported."""

    proc: subprocess.Popen
    exits: dict[int, int] = field(default_factory=dict)
    job_step: str = ""  # "JOB.STEP" once a task has said it
    pump: threading.Thread | None = None

    def on_line(self, line: str) -> None:
        m = _TASK_LINE.search(line)
        if not m:
            return
        if m.group(1) == "start" and m.group(4) and m.group(5):
            self.job_step = f"{m.group(4)}.{m.group(5)}"
        elif m.group(1) == "exit":
            code = int(m.group(3))
            # the shell's 128 + S of a task killed by signal S, as Popen's -S; a worker's own "stopped by
            # SIGTERM/SIGINT" status (it caught the signal, saved and exited with it) stays as it is
            self.exits.setdefault(int(m.group(2)), -(code - 128) if code > 128 and code not in STOPPED_EXITS
                                  else code)


class _StepTask:
    """Task `rank` of a step, seen as a process (`poll()`, `pid`) by the supervisor."""

    def __init__(self, step: _Step, rank: int):
        self.step, self.rank = step, rank

    @property
    def pid(self) -> int:
        return self.step.proc.pid

    def poll(self) -> int | None:
        """The task's exit code from its wrapper's line; once the step has ended without one (the step was killed
        around it), the step's exit code."""
        if self.rank in self.step.exits:
            return self.step.exits[self.rank]
        code = self.step.proc.poll()
        if code is None:
            return None
        if self.step.pump is not None:
            self.step.pump.join(timeout=5)  # the step's last lines may have come with its end
        return self.step.exits.get(self.rank, code)


class SlurmBackend(WorkerBackend):
    """Runs the supervised job's workers on the nodes of a SLURM allocation (see the module docstring).

    Args:
      train_flags: the training command line, passed to every worker.
      nodes: the allocation's nodes in SLURM's order (`scontrol show hostnames $SLURM_JOB_NODELIST`).
      log_dir: where each step's output goes (attempt<K>.step.log, its srun command line first, split into
        attempt<K>.rank<R>.log; diag_<host>.log).
      router: where the workers' output reaches the supervisor's own output.
      cpu_devices: CPU devices each worker gets (XLA_FLAGS); 0 leaves the device setup alone (GPU nodes).
      env: base environment of the steps (default: this process's); srun passes it to every task.
      rdzv_timeout_s: how long workers wait for each other at the Redis rendezvous.
      srun_args: extra options of every srun step (a container image, ...).
      srun, scancel: the commands (a path or a name on PATH).
    """

    def __init__(self, train_flags: Sequence[str], nodes: Sequence[str], log_dir: Path, router: Router,
                 cpu_devices: int = 0, env: dict[str, str] | None = None, rdzv_timeout_s: int = 300,
                 srun_args: Sequence[str] = (), srun: str = "srun", scancel: str = "scancel"):
        if not nodes:
            raise ValueError("SlurmBackend needs the allocation's nodes (scontrol show hostnames "
                             "$SLURM_JOB_NODELIST); none were given")
        self.train_flags, self.nodes = list(train_flags), list(nodes)
        self.log_dir, self.router, self.cpu_devices = Path(log_dir), router, cpu_devices
        self.env = dict(os.environ if env is None else env)
        self.rdzv_timeout_s, self.srun_args = rdzv_timeout_s, list(srun_args)
        self.srun, self.scancel = srun, scancel
        self._steps: list[_Step] = []
        self._scancels: list[subprocess.Popen] = []

    def _srun(self, hosts: Sequence[str], kill_on_bad_exit: bool) -> list[str]:
        n = len(hosts)
        others = [x for x in self.nodes if x not in hosts]
        # --overlap: a failed attempt's step may still be completing (until SLURM marks a dead node down) and hold
        # the CPUs of the live nodes, whose tasks are gone; the next attempt must not wait for it
        return [self.srun, f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", f"--nodelist={','.join(hosts)}",
                *([f"--exclude={','.join(others)}"] if others else []), "--label", "--overlap",
                f"--kill-on-bad-exit={int(kill_on_bad_exit)}", *self.srun_args]

    def launch(self, attempt: int, hosts: Sequence[str], overrides: dict, resume: bool, redis_url: str,
               run_id: str) -> list[Worker]:
        """Starts the worker step on `hosts` (one task per node); returns one Worker per task."""
        flags = worker_flags(self.train_flags, overrides, resume)
        env = job_env(self.env, redis_url=redis_url, run_id=run_id, num_processes=len(hosts),
                      rdzv_timeout_s=self.rdzv_timeout_s, cpu_devices=self.cpu_devices)
        # --kill-on-bad-exit=0: when a worker dies, the supervisor itself asks the others to leave (each says why
        # in one line and exits 75, read as "left because a peer died"); srun killing them would make them look
        # stopped by a signal of their own
        cmd = [*self._srun(hosts, False), "bash", "-c", TASK_WRAPPER, "_", sys.executable, "-m", "msjax.train",
               *flags]
        step_log = self.log_dir / f"attempt{attempt}.step.log"
        step_log.parent.mkdir(parents=True, exist_ok=True)
        step_log.write_text("# " + " ".join(shlex.quote(a) for a in cmd[:cmd.index("bash")]) + " ...\n")
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent)
        step = _Step(proc)
        logs = {rank: self.log_dir / f"attempt{attempt}.rank{rank}.log" for rank in range(len(hosts))}
        step.pump = self.router.pump_labelled(proc.stdout, step_log, lambda rank: logs[rank], step.on_line)
        self._steps.append(step)
        now = time.time()
        return [Worker(rank, host, _StepTask(step, rank), now, logs[rank],
                       peer_lost=lambda p=logs[rank]: log_shows_lost_service(p)) for rank, host in enumerate(hosts)]

    def _scancel(self, job_step: str, sig: str) -> None:
        """`scancel --signal=SIG JOB.STEP`, not waited for: with a node down, slurmctld may take seconds to answer,
        and the stop goes on (its SIGKILL to srun) whatever scancel does. Reaped by `stop`."""
        try:
            self._scancels.append(subprocess.Popen([self.scancel, f"--signal={sig}", job_step],
                                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                                   start_new_session=True))
        except OSError:
            pass

    def stop(self, workers: Sequence[Worker], grace_s: float) -> dict:
        """Ends the worker step: SIGTERM (and SIGCONT) to every process of it through scancel (to srun, which
        forwards it, while no task has said its step id), SIGKILL after `grace_s`. Returns {"terminated",
        "killed"} counted in tasks."""
        steps = list({id(w.proc.step): w.proc.step for w in workers}.values())
        live = {id(s): [w for w in workers if w.proc.step is s and w.proc.poll() is None] for s in steps}
        for s in steps:
            if s.proc.poll() is None:
                if s.job_step:
                    self._scancel(s.job_step, "TERM")
                    self._scancel(s.job_step, "CONT")
                else:
                    _signal(s.proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        killed = 0
        for s in steps:
            try:
                s.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                killed += len([w for w in live[id(s)] if w.proc.poll() is None])
                if s.job_step:
                    self._scancel(s.job_step, "KILL")
                _signal(s.proc, signal.SIGKILL)
                try:
                    os.killpg(s.proc.pid, signal.SIGKILL)  # srun's own helpers, if any
                except (ProcessLookupError, PermissionError):
                    pass
                s.proc.wait()
            if s.pump is not None:
                s.pump.join(timeout=5)
        self._steps = [s for s in self._steps if s not in steps]
        self._scancels = [p for p in self._scancels if p.poll() is None]  # the others reaped
        return {"terminated": sum(len(v) for v in live.values()) - killed, "killed": killed}

    def close(self) -> None:
        """Waits for the scancel commands still running (at most 30 s each), so none is left behind."""
        for p in self._scancels:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._scancels = []

    def diagnose(self, hosts: Sequence[str], checks: Checks) -> list[HostDiagnosis]:
        """The self-checks as srun steps, one per node and round (msjax.launch.local.self_checks): a node SLURM
        cannot start a task on (its slurmd gone) fails alone, with srun's error as its output, and the others
        still answer. A step still running at the timeout is killed."""
        from msjax.control.server import free_port

        env = job_env(self.env, redis_url=self.env.get("MSJAX_REDIS_URL", ""), run_id="diagnostics",
                      num_processes=len(hosts), rdzv_timeout_s=self.rdzv_timeout_s, cpu_devices=self.cpu_devices)
        env = {k: v for k, v in env.items() if not k.startswith(("JAX_", "MSJAX_RUN", "MSJAX_NUM"))}
        t0 = time.monotonic()

        def on_host(argv: list[str], host: str) -> list[str]:
            # --overlap: the failed step may still be completing (a dead node's task is only given up once SLURM
            # marks the node down) and hold the live nodes' CPUs; --immediate: a node SLURM cannot give a step
            # fails at once instead of srun waiting for it
            return [self.srun, "--nodes=1", "--ntasks=1", f"--nodelist={host}", "--overlap", "--immediate=10",
                    "--kill-on-bad-exit=0", *self.srun_args, *argv]

        outputs = self_checks(hosts, checks, env, on_host, lambda host: f"{host}:{free_port('')}")
        return diagnoses(hosts, outputs, checks.timeout_s, time.monotonic() - t0, self.log_dir)


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


def allocation_nodes(env: dict[str, str] | None = None) -> list[str]:
    """The nodes of the current allocation, in SLURM's order (`scontrol show hostnames $SLURM_JOB_NODELIST`).
    Raises ValueError outside an allocation."""
    env = dict(os.environ if env is None else env)
    nodelist = env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise ValueError("SLURM_JOB_NODELIST is not set: --backend=slurm supervises inside an allocation "
                         "(sbatch/salloc), or pass --nodes=NODE,NODE,...")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    return out.split()
