"""msjax on a real SLURM cluster of 3 nodes on this machine (tests/slurm_cluster.py: Debian's slurmctld, one slurmd
per node in its own network namespace with its own host name and address, munge), one cluster for the module,
torn down to nothing at its end. Jobs are the scripts `msjax-launch --backend=slurm --submit` writes, with the
Redis control plane on the allocation's first node reached across the nodes' network (the test watches it too:
it chose the job's Redis password at submission, MSJAX_REDIS_PASSWORD). Faults come from the test, from outside
the job, as they would on a cluster: kill -9 or SIGSTOP of a worker process, everything in a node's namespace
killed (its slurmd included, so SLURM marks the node down), a site health check that fails on a node, scancel.

- unsupervised, 2 nodes: the job trains across them (jax.distributed over the namespaces' network); `scancel
  --signal=TERM` of its step stops every worker after the same step (they save and exit 143), the script requeues
  the job, the requeued job resumes from its own checkpoint, and the run ends with the parameters of the same run
  on one process with the same 4 devices. Its output shows what a supervised run's does: rank 0's lines and every
  rank's warnings and errors as `[rank R] ` lines, every rank's whole output in `<run_dir>/logs/rank<R>.log`.
- supervised, 2 nodes + 1 spare: kill -9 of the worker on node2 (whose health check fails: a faulty node) is
  detected, node2 blamed, diagnosed and excluded (the next step's --exclude), the spare node3 takes its place;
  SIGSTOP of the worker on node3 (failing too) is detected by its missed heartbeats, node3 excluded, and with no
  spare left the run is re-planned onto node1 alone; the run ends with the uninterrupted run's final loss.
- supervised, node failure: everything on node2 killed; the job survives (--no-kill), node2 (not the survivor) is
  blamed, found unreachable by its self-checks and excluded, the spare takes its place within 60 s of detection,
  and the run ends with the uninterrupted run's final loss.
- nodes that share only a bucket: each node's local tier is its own tmpfs at one path; a supervised job saves
  to the bucket (each process uploads its own part), node2 dies, the spare resumes from what survives (node1's
  own tier, the bucket for the rest), and the run ends with the uninterrupted run's parameters.
- scancel of a supervised job ends every process of it on every node.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import jax
import numpy as np
import psutil
import pytest

from msjax.control.store import Store, connect
from msjax.events import read_events
from msjax.launch.slurm import redis_address
from tests.slurm_cluster import SlurmCluster, missing_tools

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "msjax-cluster-test"
STEPS, EVERY = 16, 2
TOL = 1e-5

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    bool(missing_tools()) or os.geteuid() != 0,
    reason=f"needs root and {', '.join(missing_tools())} (.ci/run installs slurmctld slurmd slurm-client munge)")]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=3).up()
    try:
        yield c
    finally:
        left = c.down()
        assert not left, f"the cluster left behind: {left}"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    for name in ("textwrap.py", "fnmatch.py", "glob.py", "shlex.py", "bisect.py", "colorsys.py"):
        shutil.copy(Path(sysconfig.get_paths()["stdlib"]) / name, d / f"{name}.txt")
    return d


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory) -> Path:
    """One persistent compilation cache for every job (the workers inherit it through sbatch's environment)."""
    return tmp_path_factory.mktemp("jax_cache")


def _flags(corpus: Path, run_dir: Path, **extra) -> list[str]:
    flags = {
        "config": "gpt_tiny", "model.num_layers": 2, "model.d_model": 32, "model.num_heads": 2,
        "model.max_seq_len": 32, "data.paths": corpus, "data.tokenizer": "char", "data.val_fraction": 0.2,
        "data.cache_dir": run_dir.parent / "tokens", "train.seq_len": 32, "train.global_batch": 8,
        "train.steps": STEPS, "train.eval_every": 0, "train.eval_batches": 2, "train.sample_tokens": 0,
        "train.progress": False, "train.log_every": 1, "train.run_dir": run_dir, "optimizer.warmup_steps": 2,
        "optimizer.decay_steps": STEPS, "checkpoint.every": EVERY, "checkpoint.async_save": False,
        "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 1, "supervisor.heartbeat_period_s": 1,
        "supervisor.heartbeat_timeout_s": 6, "supervisor.stop_grace_s": 2, "supervisor.backoff_s": 0.1,
        "supervisor.startup_timeout_s": 240, "supervisor.diagnose_timeout_s": 60, "supervisor.standby": False,
        **extra}
    return [f"--{k}={v}" for k, v in flags.items()]


class Job:
    """A job submitted with `msjax-launch --backend=slurm --submit`, and what the test reads of it."""

    def __init__(self, cluster: SlurmCluster, tmp: Path, flags: list[str], cache: Path, *launch: str,
                 password: str = PASSWORD, env: dict | None = None):
        self.cluster, self.tmp, self.password = cluster, tmp, password
        self.run_id = f"t{time.monotonic_ns() % 10**8}"
        env = {k: v for k, v in cluster.env.items() if not k.startswith(("XLA_", "JAX_", "MSJAX_"))}
        # msjax's commands first on PATH, as an activated virtualenv has them (sbatch passes the environment on)
        env["PATH"] = f"{sysconfig.get_paths()['scripts']}{os.pathsep}{env['PATH']}"
        env = {**env, "MSJAX_REDIS_PASSWORD": password, "JAX_COMPILATION_CACHE_DIR": str(cache),
               "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1", "PYTHONUNBUFFERED": "1", **(env or {})}
        done = subprocess.run([sys.executable, "-m", "msjax.launch", "--backend=slurm", "--num_processes=2",
                               "--devices_per_process=2", "--accelerator=none", "--cpus_per_process=1",
                               "--time_limit=15:00", f"--run_id={self.run_id}", "--submit",
                               f"--output={tmp / 'job.sbatch'}", *launch, "--", *flags],
                              cwd=tmp, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        self.id = done.stdout.strip()
        self.t0 = time.time()
        self._store = None

    def sh(self, *cmd: str) -> str:
        return subprocess.run(list(cmd), env=self.cluster.env, capture_output=True, text=True, timeout=60).stdout

    def state(self) -> str:
        out = self.sh("scontrol", "show", "job", self.id)
        m = re.search(r"JobState=(\S+)", out)
        return m.group(1) if m else ""

    def info(self, key: str) -> str:
        m = re.search(rf"\b{key}=(\S+)", self.sh("scontrol", "show", "job", self.id))
        return m.group(1) if m else ""

    def output(self) -> str:
        path = self.tmp / f"msjax-{self.id}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait(self, what, timeout_s: float, desc: str):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = what()
            if got:
                return got
            time.sleep(0.2)
        raise AssertionError(f"job {self.id}: timed out after {timeout_s:g} s waiting for {desc}; state "
                             f"{self.state()}; output:\n{self.output()[-5000:]}")

    def finish(self, timeout_s: float = 600) -> str:
        return self.wait(lambda: (s := self.state()) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                          "NODE_FAIL") and s, timeout_s, "the job's end")

    @property
    def store(self) -> Store:
        """The job's control plane, on the first node of its allocation."""
        if self._store is None:
            head, port = self.wait(lambda: redis_address(self.output()), 120, "the job's Redis address in its output")
            url = f"redis://:{self.password}@{self.cluster.addr(head)}:{port}/0"
            self._store = Store(self.wait(lambda: _try_connect(url), 120, "the job's Redis"),
                                f"{self.run_id}-{self.id}")
        return self._store

    def beats(self) -> dict[int, dict]:
        try:
            return self.store.heartbeats()
        except Exception:  # noqa: BLE001 - Redis between attempts or gone: no beats
            return {}

    def wait_step(self, rank: int, step: int, timeout_s: float = 300) -> dict:
        """The heartbeat of `rank` once it reports `step` or later."""
        return self.wait(lambda: (b := self.beats().get(rank)) and (b.get("step") or 0) >= step and b, timeout_s,
                         f"rank {rank} at step {step}")

    def cancel(self) -> None:
        self.sh("scancel", self.id)


def _try_connect(url: str):
    try:
        return connect(url, retries=0)
    except Exception:  # noqa: BLE001 - not up yet
        return None


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus, compile_cache) -> Path:
    """The same run on one process with the same 4 devices, uninterrupted: its run directory."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MSJAX_", "JAX_"))}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_COMPILATION_CACHE_DIR=str(compile_cache))
    done = subprocess.run([sys.executable, "-m", "msjax.train", *_flags(corpus, run_dir)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


def _final_params(run_dir: Path, directory: str | None = None) -> list[np.ndarray]:
    """The parameters of the run's newest checkpoint (which must be the last step), restored onto one device, from
    `<run_dir>/checkpoints` or the checkpoint directory `directory` (a bucket's URL)."""
    from msjax.checkpoint import Checkpointer
    from msjax.config import config_from_flags
    from msjax.mesh import make_mesh
    from msjax.train_step import build_train_program

    saved = json.loads((run_dir / "config.json").read_text())
    cfg = config_from_flags([("model.num_layers", "2"), ("model.d_model", "32"), ("model.num_heads", "2"),
                             ("model.max_seq_len", "32"), ("train.seq_len", "32"), ("train.global_batch", "8"),
                             ("train.steps", str(STEPS)), ("optimizer.warmup_steps", "2"),
                             ("optimizer.decay_steps", str(STEPS)), ("mesh.data", "1"),
                             ("model.vocab_size", str(saved["model"]["vocab_size"]))])
    program = build_train_program(cfg, make_mesh(cfg.mesh, jax.devices()[:1]))
    ckpt = Checkpointer(cfg.checkpoint, directory or run_dir / "checkpoints")
    try:
        step, state, _ = ckpt.restore(program.abstract_state)
    finally:
        ckpt.close()
    assert step == STEPS
    return jax.tree.leaves(jax.device_get(state["params"]))


def _no_job_process_left(cluster: SlurmCluster, job_id: str) -> list[str]:
    """Processes on any node that belong to the job (SLURM_JOB_ID in their environment), zombies aside."""
    left = []
    for node in cluster.nodes:
        for pid in cluster.node_pids(node):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            if f"SLURM_JOB_ID={job_id}".encode() in env and stat.rsplit(")", 1)[1].split()[0] != "Z":
                left.append(f"{node}: {pid} {Path(f'/proc/{pid}/cmdline').read_bytes()[:100]!r}")
    return left


def test_sbatch_trains_across_two_nodes_and_a_requeued_job_resumes(cluster, tmp_path, corpus, compile_cache,
                                                                   reference):
    job = Job(cluster, tmp_path, _flags(corpus, tmp_path / "run"), compile_cache)
    beat = job.wait_step(1, STEPS // 2)
    assert {b["host"] for b in job.beats().values()} == {"node1", "node2"}, job.beats()
    assert beat["pid"] in cluster.node_pids("node2")  # rank 1 runs in node2's namespace
    # a preemption notice to the job's step: every worker saves after the same step, exits 143; the script requeues
    job.sh("scancel", "--signal=TERM", job.id)
    job.wait(lambda: job.info("Restarts") == "1" and job.state() == "PENDING", 120, "the requeue")

    def started() -> bool:  # SLURM holds a requeued job about 2 minutes (its BeginTime): start it now
        if job.state() == "PENDING":
            job.sh("scontrol", "update", f"JobId={job.id}", "StartTime=now")
            return False
        return True

    job.wait(started, 120, "the requeued job to start")
    assert job.finish() == "COMPLETED", job.output()[-5000:]
    out = job.output()
    assert "msjax: stopped before the end (status 143), resumable: requeueing job" in out, out[-5000:]
    stopped = sorted(int(s) for s in re.findall(r"stopping after step (\d+)", out))
    resumed = re.findall(r"resumed from step (\d+)", out)
    assert stopped and resumed == [str(stopped[0])], (stopped, resumed)
    # the job's terminal reads as a supervised run's: rank 0's lines and other ranks' warnings and errors, each
    # `[rank R] `, no srun `R: ` labels; every line of every rank in its log in the run directory
    shown = {}
    for m in re.finditer(r"^\[rank (\d+)\] (.*)$", out, re.M):
        shown.setdefault(int(m.group(1)), []).append(m.group(2))
    assert not re.search(r"^ *\d+: ", out, re.M), out[-5000:]
    assert any(line.startswith("resumed from step") for line in shown[0]), out[-5000:]
    alert = re.compile(r"^(error: |warning: |msjax: rank \d+ stopping: |stopping: lost the JAX|[WEF]\d{4} |"
                       r"Traceback|\S.*Warning: |  )")
    assert all(alert.match(line) for line in shown.get(1, [])), shown.get(1)
    logs = tmp_path / "run" / "logs"
    assert "resumed from step" in (logs / "rank0.log").read_text()
    assert "msjax: rank 1: SIGTERM received" in (logs / "rank1.log").read_text()  # logged, not shown
    for x, y in zip(_final_params(reference), _final_params(tmp_path / "run")):
        np.testing.assert_allclose(y, x, atol=TOL, rtol=0)


def test_two_jobs_on_the_same_nodes_at_once_both_complete_and_no_password_is_on_a_command_line(
        cluster, tmp_path, corpus, compile_cache, reference):
    """Two jobs on node1 and node2 at the same time (each node has a CPU for each), each with its own Redis
    password: each job's Redis and JAX coordinator take ports free on node1 (fixed ports collided: the second
    Redis could not bind, and its workers met the first job's Redis with the wrong password), both complete with
    the uninterrupted run's parameters, and no process of either job carries a password on its command line
    (ps shows every process's to every user)."""
    jobs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        jobs.append(Job(cluster, tmp_path / name, _flags(corpus, tmp_path / name / "run"), compile_cache,
                        "--sbatch=--nodelist=node1,node2", password=f"{PASSWORD}-{name}"))
    for job in jobs:
        job.wait_step(1, 1)  # both train at once
    addresses = [redis_address(job.output()) for job in jobs]
    assert addresses[0][0] == addresses[1][0] == "node1" and addresses[0][1] != addresses[1][1], addresses
    for p in psutil.process_iter():
        try:
            line = " ".join(p.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        assert PASSWORD not in line, f"a password on the command line of pid {p.pid}: {line[:200]}"
    for job in jobs:
        assert job.finish() == "COMPLETED", job.output()[-5000:]
    for name in ("a", "b"):
        for x, y in zip(_final_params(reference), _final_params(tmp_path / name / "run")):
            np.testing.assert_allclose(y, x, atol=TOL, rtol=0)


def _events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in read_events(run_dir / "events.jsonl") if e["kind"] == kind]


def _step_log(run_dir: Path, attempt: int) -> str:
    return (run_dir / "logs" / f"attempt{attempt}.step.log").read_text(errors="replace")


def test_supervised_job_excludes_failing_nodes_takes_the_spare_then_replans(cluster, tmp_path, corpus,
                                                                          compile_cache, reference):
    unhealthy = tmp_path / "unhealthy"
    unhealthy.mkdir()
    run_dir = tmp_path / "run"
    # a site health check that fails on a node marked unhealthy: with it, a kill -9 or a hang on that node is
    # that node's fault (a SIGKILL, the OOM killer's and a dying node's signal, is reason enough for the self-checks)
    flags = _flags(corpus, run_dir, **{"supervisor.spares": 1,
                                       "supervisor.health_check": f'test ! -e {unhealthy}/"$MSJAX_HOST"'})
    job = Job(cluster, tmp_path, flags, compile_cache, "--supervise")
    beat = job.wait_step(1, 4)
    assert beat["host"] == "node2", beat
    (unhealthy / "node2").touch()
    os.kill(beat["pid"], signal.SIGKILL)
    # the restarted job: rank 1 on the spare, node3, two steps past its restore step
    beat = job.wait(lambda: (b := job.beats().get(1)) and b["host"] == "node3" and b.get("start_step") is not None
                    and b["step"] >= b["start_step"] + 2 and b, 400, "rank 1 training on node3")
    (unhealthy / "node3").touch()
    os.kill(beat["pid"], signal.SIGSTOP)
    assert job.finish() == "COMPLETED", job.output()[-5000:]
    detected = _events(run_dir, "detected")
    assert [(f["rank"], f["host"], f["kind"]) for f in detected[0]["failures"]] == [(1, "node2", "exit")]
    assert "SIGKILL" in detected[0]["failures"][0]["detail"]
    assert [(f["rank"], f["host"], f["kind"]) for f in detected[1]["failures"]] == [(1, "node3", "heartbeat")]
    excluded = _events(run_dir, "excluded")
    assert [e["host"] for e in excluded] == ["node2", "node3"] and all("health check" in e["reason"]
                                                                      for e in excluded), excluded
    assert [e["hosts"] for e in _events(run_dir, "launch")] == [["node1", "node2"], ["node1", "node3"], ["node1"]]
    assert _events(run_dir, "spare_used") and _events(run_dir, "replanned")[0]["new"]["devices"] == 2
    # excluded through SLURM: the next steps' srun leave the node out (--exclude)
    assert "--exclude=node2" in _step_log(run_dir, 1).splitlines()[0]
    assert "--exclude=node2,node3" in _step_log(run_dir, 2).splitlines()[0]
    want, got = _losses(reference), _losses(run_dir)
    assert abs(got[STEPS] - want[STEPS]) < TOL, (got[STEPS], want[STEPS])  # the uninterrupted run's final loss
    for x, y in zip(_final_params(reference), _final_params(run_dir)):
        np.testing.assert_allclose(y, x, atol=TOL, rtol=0)


def test_supervised_job_survives_a_node_failure_on_the_spare_within_a_minute(cluster, tmp_path, corpus,
                                                                          compile_cache, reference):
    run_dir = tmp_path / "run"
    job = Job(cluster, tmp_path, _flags(corpus, run_dir, **{"supervisor.spares": 1}), compile_cache, "--supervise")
    try:
        beat = job.wait_step(1, 4)
        assert beat["host"] == "node2", beat
        killed = cluster.kill_node("node2")  # everything in node2's namespace, its slurmd included
        assert beat["pid"] in killed
        assert job.finish() == "COMPLETED", job.output()[-5000:]
        # the job survived the node (--no-kill): SLURM took node2 out of its allocation, the job went on
        assert job.info("NodeList") == "node[1,3]"
        events = [(e["kind"], {k: e.get(k) for k in ("attempt", "hosts", "host", "failures", "reason") if k in e})
                   for e in read_events(run_dir / "events.jsonl")]
        (detected,) = _events(run_dir, "detected")
        # node2 is blamed, not the survivor that left because node2 died
        assert [(f["rank"], f["host"]) for f in detected["failures"]] == [(1, "node2")], events
        (excluded,) = _events(run_dir, "excluded")
        assert excluded["host"] == "node2", events
        assert [e["hosts"] for e in _events(run_dir, "launch")] == [["node1", "node2"], ["node1", "node3"]]
        first = [e for e in _events(run_dir, "first_step") if e["attempt"] == 1]
        recovery = first[0]["time"] - detected["time"]
        print(f"node failure: detected {detected['time'] - job.t0:.1f} s into the job, recovered (first step of the "
              f"restarted job) {recovery:.1f} s after detection")
        assert recovery <= 60, recovery
        want, got = _losses(reference), _losses(run_dir)
        assert abs(got[STEPS] - want[STEPS]) < TOL, (got[STEPS], want[STEPS])
        for x, y in zip(_final_params(reference), _final_params(run_dir)):
            np.testing.assert_allclose(y, x, atol=TOL, rtol=0)
    finally:
        cluster.start_node("node2")
        cluster._wait(lambda: cluster.node_state("node2") == "idle", 60, "node2 idle again")


@pytest.fixture(scope="module")
def bucket(cluster):
    """moto's S3-compatible server on the controller's address, which every node reaches: the only storage the
    nodes share in the test below."""
    from tests.msjax.object_store import S3Server

    with S3Server(host=cluster.controller_addr) as server:
        server.make_bucket("ckpt")
        yield server


def test_nodes_that_share_only_a_bucket_checkpoint_there_and_a_node_failure_resumes_from_what_survives(
        cluster, tmp_path, corpus, compile_cache, reference, bucket):
    """Each node's local tier is its own tmpfs at one path (cluster.node_local); checkpoints reach the bucket only
    as each process's upload of its own part. Everything on node2 is killed after step 6: node2's local tier is
    gone with it; the spare node3 (an empty local tier) reads its part from the bucket, node1 its own tier, and
    the run ends with the uninterrupted run's parameters (read back from the bucket). Nothing is written to the
    machine's own directory at the local tier's path."""
    from msjax import paths
    from msjax.checkpoint import latest_verified
    from tests.msjax.object_store import S3_CREDENTIALS

    run_dir, url = tmp_path / "run", f"s3://ckpt/{tmp_path.name}"
    flags = _flags(corpus, run_dir, **{"supervisor.spares": 1, "checkpoint.dir": url,
                                       "checkpoint.local_dir": cluster.node_local / tmp_path.name,
                                       **bucket.overrides()})
    job = Job(cluster, tmp_path, flags, compile_cache, "--supervise", env=S3_CREDENTIALS)
    try:
        beat = job.wait_step(1, 6)
        assert beat["host"] == "node2", beat
        job.wait(lambda: (latest_verified(url) or 0) >= 4, 120, "step 4 complete in the bucket")
        killed = cluster.kill_node("node2")
        assert beat["pid"] in killed
        survived = latest_verified(url)
        assert job.finish() == "COMPLETED", job.output()[-5000:]
        assert job.info("NodeList") == "node[1,3]"
        assert [e["hosts"] for e in _events(run_dir, "launch")] == [["node1", "node2"], ["node1", "node3"]]
        resumed = [int(s) for s in re.findall(r"resumed from step (\d+)", job.output())]
        assert resumed and resumed[-1] >= survived, (resumed, survived)
        assert latest_verified(url) == STEPS and not any(cluster.node_local.iterdir())
        names = {paths.basename(o.path) for o in paths.walk_files(f"{url}/{STEPS}")}
        assert ".zarray" in names, names  # every process's chunks, uploaded by each
        for x, y in zip(_final_params(reference), _final_params(run_dir, url)):
            np.testing.assert_allclose(y, x, atol=TOL, rtol=0)
    finally:
        cluster.start_node("node2")
        cluster._wait(lambda: cluster.node_state("node2") == "idle", 60, "node2 idle again")


def _replicated(run_dir: Path, attempt: int = 0) -> int:
    """The newest step of which rank 0 of `attempt` holds a complete copy of rank 1's local part (its log's peer
    replica lines), 0 for none."""
    log = run_dir / "logs" / f"attempt{attempt}.rank0.log"
    text = log.read_text() if log.exists() else ""
    return max([int(s) for s in re.findall(r"step (\d+): a copy of process 1's local part is held", text)],
               default=0)


def test_with_peer_replicas_a_node_failure_resumes_from_the_newest_local_step(cluster, tmp_path, corpus,
                                                                              compile_cache, reference, bucket):
    """checkpoint.local_replicas=1 with the bucket taking only the last step (checkpoint.persistent_every=STEPS):
    every checkpoint stays in the nodes' own tiers, node1 also holding a copy of node2's part. Everything on node2
    is killed after step 6: the job resumes on node1 and the spare node3 from the newest step whose copy node1
    completed (node3 copies its part from node1), not from step 0, and ends with the uninterrupted run's
    parameters."""
    from msjax.checkpoint import latest_verified
    from tests.msjax.object_store import S3_CREDENTIALS

    # A local tier of its own on every node: the cluster (and each node's tmpfs) outlives a test, and another
    # run's parts in the same tier would be taken for this run's checkpoints.
    run_dir, url = tmp_path / "run", f"s3://ckpt/{tmp_path.name}"
    flags = _flags(corpus, run_dir, **{"supervisor.spares": 1, "checkpoint.dir": url,
                                       "checkpoint.local_dir": cluster.node_local / tmp_path.name,
                                       "checkpoint.local_replicas": 1, "checkpoint.persistent_every": STEPS,
                                       **bucket.overrides()})
    job = Job(cluster, tmp_path, flags, compile_cache, "--supervise", env=S3_CREDENTIALS)
    try:
        beat = job.wait_step(1, 6)
        assert beat["host"] == "node2", beat
        job.wait(lambda: _replicated(run_dir) >= 4, 120, "node1 holding a copy of node2's part of step 4")
        assert latest_verified(url) is None  # nothing in the bucket before the last step
        killed = cluster.kill_node("node2")
        assert beat["pid"] in killed
        newest_local = _replicated(run_dir)  # node2's part can no longer be copied: this is final
        assert job.finish() == "COMPLETED", job.output()[-5000:]
        assert job.info("NodeList") == "node[1,3]"
        resumed = [int(s) for s in re.findall(r"resumed from step (\d+)", job.output())]
        assert resumed and set(resumed) == {newest_local}, (resumed, newest_local, job.output()[-3000:])
        assert latest_verified(url) == STEPS and not any(cluster.node_local.iterdir())
        for x, y in zip(_final_params(reference), _final_params(run_dir, url)):
            np.testing.assert_allclose(y, x, atol=TOL, rtol=0)
    finally:
        cluster.start_node("node2")
        cluster._wait(lambda: cluster.node_state("node2") == "idle", 60, "node2 idle again")


def test_scancel_ends_every_process_of_a_supervised_job_on_every_node(cluster, tmp_path, corpus, compile_cache):
    job = Job(cluster, tmp_path, _flags(corpus, tmp_path / "run", **{"train.steps": 1000}), compile_cache,
              "--supervise")
    job.wait_step(1, 2)
    assert _no_job_process_left(cluster, job.id)  # the job's processes, on node1 and node2
    job.cancel()
    job.wait(lambda: job.state() == "CANCELLED", 60, "the job cancelled")
    job.wait(lambda: not _no_job_process_left(cluster, job.id), 30, "no process of the job left on any node")
