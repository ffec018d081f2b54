"""`scripts/launch.py`: start a multi-process training run, or write the spec that a cluster runs.

  python scripts/launch.py --backend=local --num_processes=2 --devices_per_process=4 -- --config=... --mesh.data=2
  python scripts/launch.py --backend=k8s --num_processes=16 --image=IMAGE [--output job.yaml] -- <train flags>
  python scripts/launch.py --backend=slurm --num_processes=16 [--output job.sbatch] -- <train flags>

Local backend: starts a private Redis (loopback, generated password, free port; or uses --redis_url), then N
worker processes of `scripts/train.py <train flags>` with MSJAX_* variables (msjax.control.worker), each with
`--devices_per_process` CPU devices (XLA_FLAGS) when given. Worker output is streamed with a `[rank R]` prefix
(`[worker i]` until the worker has its rank). Everything stops when the run ends, fails or is interrupted:

  - a worker exits non-zero: the others are sent SIGTERM, then SIGKILL after --kill_grace_s; exit status 1.
  - Ctrl-C / SIGTERM to the launcher: a `stop` command goes on the command channel (every worker stops after the
    same step and saves: see msjax.control.hook), SIGTERM is forwarded to the workers after --term_grace_s if they
    are still running (a second Ctrl-C forwards it at once), SIGKILL after --kill_grace_s more; exit status
    128 + signal number.
  - a private Redis that dies mid-run is started again on the same port and password (workers reconnect);
  - Redis is stopped last, always; workers and Redis die with the launcher even if it is SIGKILLed
    (PR_SET_PDEATHSIG), and each runs in its own process group so that nothing of theirs is left behind.
Exit status 0 only if every worker exited 0. Bad flags are `error: ...` and exit status 2, before anything starts.

The launcher's own flags (`LaunchOptions`, before `--`) and the train flags (after it) are parsed by msjax.cli:
`launch.py --help` lists the former, `launch.py -- --help` the latter.
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Literal

from msjax import cli
from msjax.config import Config, ConfigError
from msjax.control.errors import ControlError

ROOT = Path(__file__).resolve().parents[2]
TRAIN_SCRIPT = ROOT / "scripts" / "train.py"
_RANK_LINE = re.compile(r"msjax\.control: rank (\d+) of (\d+)")


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """launch.py's own flags, before `--` (the train.py flags come after it). Times are seconds.

    Attributes:
      backend: local: a private Redis + worker processes here; k8s: print a JobSet manifest; slurm: an sbatch script.
      num_processes: worker processes (local) or nodes, one worker process per node (k8s, slurm); required, >= 1.
      run_id: run id for the Redis keys; empty: generated (NAME-DATE-TIME-RANDOM).
      output: k8s, slurm: write the spec to this path instead of printing it.
      devices_per_process: local: CPU devices per worker (XLA_FLAGS); 0 leaves the device setup alone.
      redis_url: local: use this Redis instead of starting a private one.
      redis_port: local: port of the private Redis; 0: a free one.
      rdzv_timeout_s: local: how long workers wait for each other at the rendezvous.
      term_grace_s: local: after Ctrl-C/SIGTERM, time between the stop command and forwarding SIGTERM.
      kill_grace_s: local: time between SIGTERM and SIGKILL.
      supervise: run under the supervisor (msjax.supervise); also on with the train flag --supervisor.enabled=true.
      name: k8s, slurm: job name (k8s objects, slurm job).
      image: k8s: container image holding msjax (required for k8s).
      accelerator: k8s, slurm: the accelerator each node requests.
      accelerators_per_node: k8s, slurm: accelerators each node requests.
      tpu_type: k8s: cloud.google.com/gke-tpu-accelerator.
      tpu_topology: k8s: cloud.google.com/gke-tpu-topology.
      cpus_per_node: k8s, slurm: CPUs each node requests.
      memory_per_node: k8s: memory each node requests (a Kubernetes quantity, e.g. 256Gi).
      max_restarts: k8s: JobSet failurePolicy.maxRestarts.
      namespace: k8s: the namespace of every object.
      redis_secret: k8s: Secret holding the Redis password; empty: NAME-redis, created by the manifest.
      partition: slurm: the partition; empty: the cluster's default.
      time_limit: slurm: the job's time limit (sbatch --time).
      workdir: k8s, slurm: the repository's path on the nodes.
    """

    backend: Literal["local", "k8s", "slurm"] = "local"
    num_processes: int = 0
    run_id: str = ""
    output: str = ""
    devices_per_process: int = 0
    redis_url: str = ""
    redis_port: int = 0
    rdzv_timeout_s: int = 300
    term_grace_s: float = 10.0
    kill_grace_s: float = 20.0
    supervise: bool = False
    name: str = "msjax"
    image: str = ""
    accelerator: Literal["gpu", "tpu", "none"] = "gpu"
    accelerators_per_node: int = 8
    tpu_type: str = "tpu-v5p-slice"
    tpu_topology: str = "2x2x1"
    cpus_per_node: int = 32
    memory_per_node: str = "256Gi"
    max_restarts: int = 3
    namespace: str = "default"
    redis_secret: str = ""
    partition: str = ""
    time_limit: str = "24:00:00"
    workdir: str = "/workspace/msjax"


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(launcher flags, train.py flags): everything after the first `--` goes to train.py."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def parse(argv: list[str]) -> tuple[cli.LoggingOptions, LaunchOptions, Config, list[str]]:
    """Parses launch.py's command line: (logging options, launch options, the workers' config, train.py flags).
    Raises ConfigError naming a bad flag (train.py's prefixed "train.py flags: "); SystemExit after `--help`."""
    own, train_flags = split_argv(list(argv))
    common, args = cli.parse_options(own, LaunchOptions(), prog="launch.py", description=__doc__)
    if args.num_processes < 1:
        raise ConfigError(f"--num_processes={args.num_processes}: must be >= 1 (worker processes or nodes; "
                          "required)")
    if args.devices_per_process < 0:
        raise ConfigError(f"--devices_per_process={args.devices_per_process}: must be >= 0 (0: leave it alone)")
    try:  # a bad train flag fails here, before any process starts
        cfg, _ = cli.parse(train_flags, prog="launch.py [OPTIONS] --")
    except ConfigError as e:
        raise ConfigError(f"train.py flags: {e}") from None
    return common, args, cfg, train_flags


def main(argv: list[str]) -> int:
    """Entry point of scripts/launch.py; returns the exit status (see the module docstring)."""
    try:
        common, args, cfg, train_flags = parse(argv)
    except ConfigError as e:
        return _error(str(e))
    cli.setup_logging(common)
    run_id = args.run_id or f"{args.name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
    if args.backend in ("k8s", "slurm"):
        from msjax.control import specs

        try:
            text = (specs.k8s_jobset(args, run_id, train_flags) if args.backend == "k8s"
                    else specs.slurm_sbatch(args, run_id, train_flags))
            if args.supervise or cfg.supervisor.enabled:
                from msjax.supervise.cluster import supervise_spec

                text = supervise_spec(args.backend, text, cfg, train_flags)
        except ValueError as e:
            return _error(str(e))
        if args.output:
            Path(args.output).write_text(text)
            print(f"wrote {args.output}", file=sys.stderr)
        else:
            sys.stdout.write(text)
        return 0
    if args.supervise or cfg.supervisor.enabled:
        from msjax.supervise.cli import supervise_local

        return supervise_local(train_flags, args.num_processes, args.devices_per_process, args.redis_url or None,
                               run_id, rdzv_timeout_s=args.rdzv_timeout_s)
    try:
        return LocalLauncher(args, run_id, train_flags).run()
    except ControlError as e:
        return _error(str(e))


def _error(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def worker_env(base: dict[str, str], *, redis_url: str, run_id: str, num_processes: int, worker_index: int,
               devices_per_process: int | None, rdzv_timeout_s: int) -> dict[str, str]:
    """The environment of local worker `worker_index`: the launcher's, minus JAX_* (the rendezvous decides
    those), plus MSJAX_* and, when `devices_per_process` is given, XLA_FLAGS forcing that many CPU devices."""
    env = {k: v for k, v in base.items() if not k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROCESSES",
                                                              "JAX_PROCESS_ID", "MSJAX_"))}
    env.update(MSJAX_REDIS_URL=redis_url, MSJAX_RUN_ID=run_id, MSJAX_NUM_PROCESSES=str(num_processes),
               MSJAX_WORKER_ID=f"local-{worker_index}", MSJAX_ADVERTISE_HOST="127.0.0.1",
               MSJAX_RDZV_TIMEOUT_S=str(rdzv_timeout_s), PYTHONUNBUFFERED="1")
    if devices_per_process is not None:
        flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).split()
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices_per_process}"])
    return env


class LocalLauncher:
    """Runs one local multi-process job (see the module docstring). `run()` returns the exit status."""

    def __init__(self, args: LaunchOptions, run_id: str, train_flags: list[str]):
        self.args, self.run_id, self.train_flags = args, run_id, train_flags
        self.procs: list[subprocess.Popen] = []
        self.server = None
        self.store = None
        self._print_lock = threading.Lock()
        self._signal: int | None = None
        self._signal_count = 0

    def _on_signal(self, signum, frame) -> None:
        self._signal = self._signal or signum
        self._signal_count += 1

    def _out(self, line: str) -> None:
        with self._print_lock:
            sys.stdout.write(line)
            sys.stdout.flush()

    def _pump(self, index: int, proc: subprocess.Popen) -> None:
        prefix = f"[worker {index}] "
        for line in proc.stdout:
            m = _RANK_LINE.search(line)
            if m:
                prefix = f"[rank {m.group(1)}] "
            self._out(prefix + line)

    def _signal_workers(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass

    def _send_stop(self) -> None:
        try:
            self.store.send_command("stop", source="launcher")
        except Exception as e:  # Redis down: SIGTERM after the grace period still stops the workers
            self._out(f"[launch] could not send the stop command ({e}); relying on SIGTERM\n")

    def run(self) -> int:
        from msjax.control.server import RedisServer, die_with_parent
        from msjax.control.store import Store, connect

        a = self.args
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        pumps: list[threading.Thread] = []
        try:
            if a.redis_url:
                url = a.redis_url
            else:
                self.server = RedisServer(port=a.redis_port or None).start()
                url = self.server.url
                self._out(f"[launch] Redis {self.server.bind}:{self.server.port} (pid {self.server.pid}), "
                          f"run {self.run_id}\n")
            self.store = Store(connect(url), self.run_id)
            cmd = [sys.executable, str(TRAIN_SCRIPT), *self.train_flags]
            for i in range(a.num_processes):
                env = worker_env(dict(os.environ), redis_url=url, run_id=self.run_id,
                                 num_processes=a.num_processes, worker_index=i,
                                 devices_per_process=a.devices_per_process or None,
                                 rdzv_timeout_s=a.rdzv_timeout_s)
                # Own process group (the launcher decides what a Ctrl-C means for it); dies with the launcher.
                p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, text=True, bufsize=1, start_new_session=True,
                                     preexec_fn=die_with_parent)
                self.procs.append(p)
                t = threading.Thread(target=self._pump, args=(i, p), daemon=True)
                t.start()
                pumps.append(t)
            return self._supervise()
        finally:
            self._signal_workers(signal.SIGKILL)
            for p in self.procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            for t in pumps:
                t.join(timeout=2)
            if self.server is not None:
                self.server.close()
            for s, h in old.items():
                signal.signal(s, h)

    def _supervise(self) -> int:
        a = self.args
        stop_sent_at = term_sent_at = None
        failed: tuple[int, int] | None = None
        while True:
            codes = [p.poll() for p in self.procs]
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if self.server is not None and self.server.proc is not None and self.server.proc.poll() is not None:
                # Our Redis died (OOM killer, a crash): bring it back on the same port and password; the workers
                # reconnect on their own and re-register (msjax.control.hook).
                self._out(f"[launch] Redis exited with status {self.server.proc.returncode}: restarting it\n")
                self.server.proc = None
                self.server.start()
                self._out(f"[launch] Redis {self.server.bind}:{self.server.port} (pid {self.server.pid})\n")
            bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if bad and failed is None:
                failed = bad[0]
                self._out(f"[launch] worker {failed[0]} exited with status {failed[1]}: stopping the others\n")
                self._signal_workers(signal.SIGTERM)
                term_sent_at = now
            if self._signal is not None and stop_sent_at is None:
                self._out(f"[launch] {signal.Signals(self._signal).name}: stop command sent; SIGTERM to workers "
                          f"in {a.term_grace_s:g} s if they are still running\n")
                self._send_stop()
                stop_sent_at = now
            if stop_sent_at is not None and term_sent_at is None and (
                    now - stop_sent_at >= a.term_grace_s or self._signal_count > 1):
                self._out("[launch] forwarding SIGTERM to the workers\n")
                self._signal_workers(signal.SIGTERM)
                term_sent_at = now
            if term_sent_at is not None and now - term_sent_at >= a.kill_grace_s:
                self._out("[launch] workers still running: SIGKILL\n")
                self._signal_workers(signal.SIGKILL)
                term_sent_at = float("inf")
            time.sleep(0.1)
        codes = [p.returncode for p in self.procs]
        if self._signal is not None:
            self._out(f"[launch] interrupted ({signal.Signals(self._signal).name}); worker exit statuses {codes}\n")
            return 128 + self._signal
        if any(codes):
            self._out(f"[launch] failed: worker exit statuses {codes}\n")
            return 1
        self._out(f"[launch] all {len(codes)} workers finished\n")
        return 0
