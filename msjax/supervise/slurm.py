"""The supervisor's SLURM backend: inside an allocation, the workers run as one `srun` job step and the
self-checks as another; the supervisor itself is the batch script's controller process on the allocation's
first node, beside Redis (msjax.supervise.cluster writes that script).

    worker step:  srun --nodes=N --ntasks=N --ntasks-per-node=1 --nodelist=HOSTS [--exclude=OTHERS] --label
                       --kill-on-bad-exit=1 bash -c TASK_WRAPPER _ python scripts/train.py <flags> [--resume]
    self-checks:  srun ... --nodelist=HOSTS --label bash -c 'exec python -m msjax.supervise.diagnostics ...'
    stop:         scancel --signal=TERM JOB.STEP (and CONT, for a stopped task), SIGKILL after the grace period

Each task runs under `TASK_WRAPPER`, which gives the worker its slot and rendezvous rank (SLURM_PROCID: rank 0,
JAX's coordinator, is the first node of the step's node list) and host (SLURMD_NODENAME)
and prints `MSJAX_TASK start RANK HOST JOB STEP` and `MSJAX_TASK exit RANK CODE`: srun returns one exit code
for the whole step, so the wrapper's line is how the supervisor tells which task failed first (a task killed by
signal S exits 128 + S, read back as -S, as Popen would give it). Tasks are numbered in node order (SLURM's block
distribution over the sorted node list), which is the order the supervisor keeps its hosts in; a worker's
heartbeat names its node, and the supervisor trusts that over its guess.

Excluding a host is leaving it out of the next step's --nodelist (and naming it in --exclude): the allocation
stays, so a spare node of the allocation (`#SBATCH --nodes` = hosts + supervisor.spares) can take its place, or
the planner re-plans onto the nodes left. Sources: srun(1) and scancel(1) of SLURM 23.x (--label,
--kill-on-bad-exit, --nodelist, --exclude; `scancel --signal=SIG JOBID.STEPID` signals every process of a step).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from msjax.supervise.diagnostics import TEST_FAIL_ENV, HostDiagnosis, diagnoses
from msjax.supervise.supervisor import ROOT, Worker, signal_local, worker_base_env

# Runs one worker task: "$@" is the worker command. The wrapper stays the task's main process so that it can print
# the worker's exit code; it forwards SIGTERM to the worker (scancel signals every process of the step, srun the
# wrapper: either way the worker gets it).
TASK_WRAPPER = r"""
export MSJAX_SLOT="$SLURM_PROCID" MSJAX_RANK="$SLURM_PROCID" MSJAX_HOST="${SLURMD_NODENAME:-$(hostname)}"
export MSJAX_WORKER_ID="$MSJAX_HOST" MSJAX_ADVERTISE_HOST="$MSJAX_HOST"
echo "MSJAX_TASK start $SLURM_PROCID $MSJAX_HOST ${SLURM_JOB_ID:-0} ${SLURM_STEP_ID:-0}"
"$@" & child=$!
trap 'kill -TERM $child 2>/dev/null' TERM
while :; do wait $child; rc=$?; kill -0 $child 2>/dev/null || break; done
echo "MSJAX_TASK exit $SLURM_PROCID $rc"
exit $rc
""".strip()
_TASK_LINE = re.compile(r"MSJAX_TASK (start|exit) (\d+) (\S+)(?: (\S+) (\S+))?")
_LABEL = re.compile(r"^\s*(\d+): ?(.*)$")


@dataclass
class _Step:
    """One srun job step: its process, its output, and what its tasks reported."""

    proc: subprocess.Popen
    log_path: Path
    offset: int = 0
    exits: dict[int, int] = field(default_factory=dict)
    job_step: str = ""  # "JOB.STEP" once a task has said it

    def read(self) -> None:
        """Reads the step's new output for task start/exit lines."""
        with self.log_path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a partial last line is read next time
        self.offset += end
        for line in data[:end].decode(errors="replace").splitlines():
            m = _TASK_LINE.search(line)
            if not m:
                continue
            if m.group(1) == "start" and m.group(4) and m.group(5):
                self.job_step = f"{m.group(4)}.{m.group(5)}"
            elif m.group(1) == "exit":
                code = int(m.group(3))
                self.exits.setdefault(int(m.group(2)), -(code - 128) if code > 128 else code)


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
        self.step.read()
        if self.rank in self.step.exits:
            return self.step.exits[self.rank]
        code = self.step.proc.poll()
        if code is None:
            return None
        self.step.read()  # the step's last lines may have arrived with its end
        return self.step.exits.get(self.rank, code)


class SlurmBackend:
    """Runs the supervised job's workers on the nodes of a SLURM allocation (see the module docstring).

    Args:
      train_flags: the training command line, passed to every worker.
      nodes: the allocation's nodes in SLURM's order (`scontrol show hostnames $SLURM_JOB_NODELIST`).
      log_dir: where each step's output goes (attempt<k>_step.log, diag_<k>.log).
      devices_per_host: CPU devices each worker gets (XLA_FLAGS); 0 leaves the device setup alone (GPU nodes).
      env: base environment of the steps (default: this process's); srun passes it to every task.
      rdzv_timeout_s: how long workers wait for each other at the Redis rendezvous.
      srun, scancel: the commands (a path or a name on PATH).
    """

    def __init__(self, train_flags: Sequence[str], nodes: Sequence[str], log_dir: Path, devices_per_host: int = 0,
                 env: dict[str, str] | None = None, rdzv_timeout_s: int = 300, srun: str = "srun",
                 scancel: str = "scancel"):
        if not nodes:
            raise ValueError("SlurmBackend needs the allocation's nodes (scontrol show hostnames "
                             "$SLURM_JOB_NODELIST); none were given")
        self.train_flags, self.nodes = list(train_flags), list(nodes)
        self.log_dir, self.devices_per_host = Path(log_dir), devices_per_host
        self.env = dict(os.environ if env is None else env)
        self.rdzv_timeout_s, self.srun, self.scancel = rdzv_timeout_s, srun, scancel
        self._diag_runs = 0

    def _srun(self, hosts: Sequence[str], kill_on_bad_exit: bool) -> list[str]:
        n = len(hosts)
        others = [x for x in self.nodes if x not in hosts]
        return [self.srun, f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", f"--nodelist={','.join(hosts)}",
                *([f"--exclude={','.join(others)}"] if others else []), "--label",
                f"--kill-on-bad-exit={int(kill_on_bad_exit)}"]

    def launch(self, attempt: int, hosts: Sequence[str], overrides: dict, resume: bool, redis_url: str,
               run_id: str) -> list[Worker]:
        """Starts the worker step on `hosts` (one task per node); returns one Worker per task."""
        from msjax.control.server import die_with_parent

        self.log_dir.mkdir(parents=True, exist_ok=True)
        flags = self.train_flags + [f"--{k}={v}" for k, v in overrides.items()] + (["--resume"] if resume else [])
        env = worker_base_env(self.env, self.devices_per_host)
        env.update(MSJAX_REDIS_URL=redis_url, MSJAX_RUN_ID=run_id, MSJAX_NUM_PROCESSES=str(len(hosts)),
                   MSJAX_RDZV_TIMEOUT_S=str(self.rdzv_timeout_s), MSJAX_SUPERVISED="1")
        log_path = self.log_dir / f"attempt{attempt}_step.log"
        cmd = [*self._srun(hosts, True), "bash", "-c", TASK_WRAPPER, "_", sys.executable,
               str(ROOT / "scripts" / "train.py"), *flags]
        with log_path.open("w") as log:
            proc = subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent)
        step = _Step(proc, log_path)
        now = time.time()
        return [Worker(rank, host, _StepTask(step, rank), now, log_path) for rank, host in enumerate(hosts)]

    def _scancel(self, job_step: str, sig: str) -> None:
        try:
            subprocess.run([self.scancel, f"--signal={sig}", job_step], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            pass

    def stop(self, workers: Sequence[Worker], grace_s: float) -> dict:
        """Ends the worker step: SIGTERM (and SIGCONT) to every process of it through scancel (to srun, which
        forwards it, while no task has said its step id), SIGKILL after `grace_s`. Returns {"terminated",
        "killed"} counted in tasks."""
        steps = list({id(w.proc.step): w.proc.step for w in workers}.values())
        live = {id(s): [w for w in workers if w.proc.step is s and w.proc.poll() is None] for s in steps}
        for s in steps:
            s.read()
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
                s.read()
                if s.job_step:
                    self._scancel(s.job_step, "KILL")
                _signal(s.proc, signal.SIGKILL)
                try:
                    os.killpg(s.proc.pid, signal.SIGKILL)  # srun's own helpers, if any
                except (ProcessLookupError, PermissionError):
                    pass
                s.proc.wait()
        return {"terminated": sum(len(v) for v in live.values()) - killed, "killed": killed}

    def diagnose(self, hosts: Sequence[str], timeout_s: float, min_flops: float,
                 failing: Sequence[str] = ()) -> list[HostDiagnosis]:
        """The self-checks as one srun step over `hosts` (rank i on hosts[i]; rank 0's node hosts the all-reduce's
        coordinator); a step still running at `timeout_s` is killed and its silent hosts fail."""
        from msjax.control.server import die_with_parent, free_port

        env = worker_base_env(self.env, self.devices_per_host)
        if failing:
            env[TEST_FAIL_ENV] = ",".join([x for x in env.get(TEST_FAIL_ENV, "").split(",") if x] + list(failing))
        check = (f'exec {sys.executable} -m msjax.supervise.diagnostics --host "${{SLURMD_NODENAME:-$(hostname)}}" '
                 f'--rank "$SLURM_PROCID" --num {len(hosts)} --coordinator {hosts[0]}:{free_port("")} '
                 f"--min_flops {min_flops} --timeout {max(1.0, timeout_s - 5)}")
        self._diag_runs += 1
        t0 = time.monotonic()
        proc = subprocess.Popen([*self._srun(hosts, False), "bash", "-c", check], cwd=str(ROOT), env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                text=True, start_new_session=True, preexec_fn=die_with_parent)
        chunks: list[str] = []
        reader = threading.Thread(target=lambda: chunks.extend(proc.stdout), daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _signal(proc, signal.SIGTERM)  # srun forwards it to the step's tasks
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                _signal(proc, signal.SIGKILL)
                proc.wait()
        reader.join(timeout=5)
        per_rank: dict[int, list[str]] = {}
        for line in "".join(chunks).splitlines():
            m = _LABEL.match(line)
            if m:
                per_rank.setdefault(int(m.group(1)), []).append(m.group(2))
        (self.log_dir / f"diag_{self._diag_runs}.log").parent.mkdir(parents=True, exist_ok=True)
        (self.log_dir / f"diag_{self._diag_runs}.log").write_text("".join(chunks))
        outputs = ["\n".join(per_rank.get(rank, [])) for rank in range(len(hosts))]
        return diagnoses(hosts, outputs, timeout_s, time.monotonic() - t0)

    @staticmethod
    def inject(worker: Worker, sig: int, pid: int | None) -> None:
        """Sends `sig` to the worker process `pid` (its heartbeat's): only where the tasks run on this machine
        (tests with a stand-in srun); on a cluster, inject with `srun --overlap -w NODE kill -SIG PID`."""
        if pid is None:
            raise ValueError(f"rank {worker.rank} has sent no heartbeat with its pid yet")
        signal_local(pid, sig)


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
        raise ValueError("SLURM_JOB_NODELIST is not set: --backend=slurm runs inside an allocation (sbatch/salloc), "
                         "or pass --nodes=NODE,NODE,...")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    return out.split()
