"""Self-check diagnostics per host (MegaScale sec. 5.2): run after a failure, before restarting, to find the
host to exclude.

Each host runs `python -m msjax.supervise.diagnostics` (`command`), in a process of its own (so a hang is killed,
not waited on; the launcher's backend starts it: a local subprocess, an srun step):
  0. the site's own health check, when `supervisor.health_check` names one (a shell command such as LBNL's NHC,
     the script a SLURM site runs as its HealthCheckProgram): a non-zero exit fails the host;
  1. matmul correctness: on every local device, a float32 (n x n) @ (n x n) product of random matrices (seeded per
     host and device) against a NumPy float64 reference; fails when max|C - C_ref| / max|C_ref| > `MATMUL_RTOL`.
     Computed at `Precision.HIGHEST` so a GPU's TF32 default is not taken for a fault.
  2. matmul speed: the best of a few timed products against the expected per-device rate (`min_flops`).
  3. a cross-process all-reduce: a psum over every device of every host (jax.distributed, its own coordinator),
     checked against the exact sum; hosts that cannot join within the timeout are reported.
Each result is one `MSJAX_DIAG {json}` line; `diagnoses` reads the verdicts back from each host's output. The
launcher's backends run two rounds (`command(..., round=...)`): the local checks (0-2) of every host, each alone,
then the all-reduce among the hosts that passed, so that a host that cannot even start (a dead node) is found at
once and holds nobody's local verdict back; whatever has not finished by the timeout is killed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

MATMUL_RTOL = 1e-4
MATMUL_N = 256
SPEED_N = 512


@dataclass
class HostDiagnosis:
    """One host's verdict.

    Attributes:
      host, rank: which host (its rank in the diagnostic run).
      ok: True when every check it finished passed and it answered in time.
      reasons: why it failed (empty when ok).
      devices: per device {"device", "error" (relative), "flops" (FLOP/s), "ok"}.
      allreduce: {"ok", "seconds"} or {"ok": False, "error"}; None when the host never got that far.
      device_kind: jax's device_kind of its devices (for the planner's hardware model).
      seconds: the subprocess's wall time.
    """

    host: str
    rank: int
    ok: bool
    reasons: list[str] = field(default_factory=list)
    devices: list[dict] = field(default_factory=list)
    allreduce: dict | None = None
    device_kind: str = ""
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def check_devices(host: str, rank: int, min_flops: float) -> dict:
    """Matmul correctness and speed on every local device of this process (steps 1 and 2 above).

    Args:
      host, rank: this host's name and rank (the rank seeds the random matrices).
      min_flops: expected per-device FLOP/s; 0 takes 0.1 x the catalogue peak, or 1e9 on CPU.
    Returns:
      {"host", "rank", "device_kind", "devices": [...], "ok", "reasons"}.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from msjax.hardware import for_device_kind

    devices = jax.local_devices()
    kind = devices[0].device_kind
    if not min_flops:
        hw = for_device_kind(kind)
        min_flops = 0.1 * hw.peak_flops if hw is not None else 1e9
    matmul = jax.jit(lambda a, b: jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST))
    out, reasons = [], []
    for i, d in enumerate(devices):
        rng = np.random.default_rng([rank, i])
        a = rng.standard_normal((MATMUL_N, MATMUL_N), dtype=np.float32)
        b = rng.standard_normal((MATMUL_N, MATMUL_N), dtype=np.float32)
        c = np.asarray(matmul(jax.device_put(a, d), jax.device_put(b, d)))
        ref = a.astype(np.float64) @ b.astype(np.float64)
        err = float(np.max(np.abs(c - ref)) / np.max(np.abs(ref)))
        x = jax.device_put(rng.standard_normal((SPEED_N, SPEED_N), dtype=np.float32), d)
        matmul(x, x).block_until_ready()
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            matmul(x, x).block_until_ready()
            best = min(best, time.perf_counter() - t0)
        flops = 2 * SPEED_N**3 / best
        ok = err <= MATMUL_RTOL and flops >= min_flops
        if err > MATMUL_RTOL:
            reasons.append(f"device {d.id}: matmul error {err:.3g} > {MATMUL_RTOL:g} against the float64 reference")
        if flops < min_flops:
            reasons.append(f"device {d.id}: matmul rate {flops:.3g} FLOP/s < expected {min_flops:.3g}")
        out.append({"device": d.id, "error": err, "flops": flops, "ok": ok})
    return {"host": host, "rank": rank, "device_kind": kind, "devices": out, "ok": not reasons, "reasons": reasons}


def check_allreduce() -> dict:
    """A psum over every device of every process, against the exact sum. Needs jax.distributed initialised."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    t0 = time.perf_counter()
    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("i",), axis_types=(jax.sharding.AxisType.Explicit,), devices=devices)
    # Device k of the mesh holds k + 1: the sum is n (n + 1) / 2, exact in float32 for any realistic n.
    mine = [(k, d) for k, d in enumerate(mesh.devices.flat) if d.process_index == jax.process_index()]
    x = jax.make_array_from_single_device_arrays(
        (len(devices),), NamedSharding(mesh, P("i")),
        [jax.device_put(np.array([k + 1], np.float32), d) for k, d in mine])
    total = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "i"), mesh=mesh, in_specs=P("i"), out_specs=P()))(x)
    got = float(np.asarray(total.addressable_data(0))[0])
    want = len(devices) * (len(devices) + 1) / 2
    ok = got == want
    return {"ok": ok, "seconds": time.perf_counter() - t0,
            **({} if ok else {"error": f"all-reduce gave {got}, expected {want}"})}


def health_check(command: str, host: str, timeout_s: float) -> str | None:
    """Runs the site's health check `command` (`sh -c`, MSJAX_HOST=host in its environment); returns why it failed
    (its exit status and last output line, or the timeout), or None when it exited 0."""
    try:
        done = subprocess.run(["sh", "-c", command], env={**os.environ, "MSJAX_HOST": host}, capture_output=True,
                              text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"health check {command!r} did not finish within {timeout_s:g} s"
    if done.returncode == 0:
        return None
    last = (done.stdout + done.stderr).strip().splitlines()[-1:] or [""]
    return f"health check {command!r} exited with status {done.returncode}: {last[0][-200:]}"


@dataclass(frozen=True)
class Checks:
    """What the self-checks ask of every host (the supervisor fills it from `supervisor.*`).

    Attributes:
      timeout_s: the diagnostics' time limit, seconds (a host that has not answered by then fails).
      min_flops: expected per-device matmul rate, FLOP/s (0: check_devices' default).
      health_check: the site's health check command, or "".
    """

    timeout_s: float
    min_flops: float = 0.0
    health_check: str = ""


def command(checks: Checks, host: str, rank: int = 0, num: int = 1, coordinator: str = "",
            python: str = sys.executable, fail_exit: bool = False, allreduce_only: bool = False) -> list[str]:
    """The command line that runs the self-checks of host `host`: alone (num 1: the local checks and a local
    all-reduce), or as rank `rank` of the `num` hosts of an all-reduce whose jax.distributed service `coordinator`
    (host:port) hosts, with `allreduce_only` (their local checks ran before)."""
    argv = [python, "-m", "msjax.supervise.diagnostics", "--host", host, "--rank", str(rank), "--num", str(num),
            "--min_flops", str(checks.min_flops), "--timeout", str(max(1.0, checks.timeout_s - 5))]
    if coordinator:
        argv += ["--coordinator", coordinator]
    if checks.health_check and not allreduce_only:
        argv += ["--health_check", checks.health_check]
    return argv + (["--allreduce_only"] if allreduce_only else []) + (["--fail_exit"] if fail_exit else [])


def passed_local(output: str) -> bool:
    """Whether a host's output holds a passing local verdict."""
    for line in output.splitlines():
        if line.startswith("MSJAX_DIAG "):
            rec = json.loads(line[len("MSJAX_DIAG "):])
            if rec.get("phase") == "local":
                return bool(rec.get("ok"))
    return False


@dataclass(frozen=True)
class DiagnosticsOptions:
    """`python -m msjax.supervise.diagnostics`'s flags (the supervisor, a SLURM step or a Kubernetes
    initContainer runs it; a user can too).

    Attributes:
      host: this host's name, as the report and the control plane name it.
      rank: this host's index among the hosts diagnosed together (0 .. num-1).
      num: how many hosts join the cross-process all-reduce (1: local checks and a local all-reduce only).
      coordinator: host:port of the all-reduce group's jax.distributed coordinator (needed when num > 1).
      min_flops: expected per-device float32 matmul rate, FLOP/s (0: check_devices' default).
      timeout: seconds to wait for the other hosts to join the all-reduce (and for the health check).
      health_check: a shell command run first (`sh -c`, with MSJAX_HOST set to --host); a non-zero exit fails the
        host (a site's node health check); empty: none.
      allreduce_only: only join the all-reduce group (the local checks ran before, in their own round).
      fail_exit: exit 1 when a check fails (a node's own self-check, e.g. a Kubernetes initContainer).
    """

    host: str = ""
    rank: int = -1
    num: int = 0
    coordinator: str = ""
    min_flops: float = 0.0
    timeout: float = 60.0
    health_check: str = ""
    allreduce_only: bool = False
    fail_exit: bool = False

    def checked(self) -> "DiagnosticsOptions":
        """Raises ConfigError naming the flag when a required flag is missing or out of range."""
        from msjax.config import ConfigError

        if not self.host:
            raise ConfigError("--host is required (this host's name)")
        if self.num < 1:
            raise ConfigError(f"--num={self.num}: allowed is an int >= 1 (the hosts diagnosed together)")
        if not 0 <= self.rank < self.num:
            raise ConfigError(f"--rank={self.rank}: allowed is an int in [0, {self.num - 1}] (--num={self.num})")
        if self.num > 1 and not self.coordinator:
            raise ConfigError(f"--coordinator is required when --num={self.num} > 1 (host:port)")
        if self.timeout <= 0:
            raise ConfigError(f"--timeout={self.timeout:g}: allowed is seconds > 0")
        return self


def _main(argv: Sequence[str] | None = None) -> int:
    from msjax import cli

    def body() -> int:
        common, opts = cli.parse_options(list(sys.argv[1:] if argv is None else argv), DiagnosticsOptions(),
                                         prog="python -m msjax.supervise.diagnostics", description=__doc__)
        cli.setup_logging(common)
        return _diagnose(opts.checked())

    return cli.main_guard(body)


def _diagnose(a: DiagnosticsOptions) -> int:
    """Runs the local checks, then the all-reduce, printing each result as one `MSJAX_DIAG {json}` line."""
    import jax

    joined, join_error = False, None
    if a.num > 1:
        try:
            jax.distributed.initialize(a.coordinator, num_processes=a.num, process_id=a.rank,
                                       initialization_timeout=max(1, int(a.timeout)))
            joined = True
        except Exception as e:  # noqa: BLE001 - reported, and the local checks still run
            join_error = f"could not join the all-reduce group within {a.timeout:g} s: {e!r}"
    if a.allreduce_only:
        local = {"ok": True, "reasons": []}
    else:
        local = check_devices(a.host, a.rank, a.min_flops)
        if a.health_check:
            failed = health_check(a.health_check, a.host, a.timeout)
            if failed:
                local["ok"], local["reasons"] = False, [failed, *local["reasons"]]
        print("MSJAX_DIAG " + json.dumps({"phase": "local", **local}), flush=True)
    if a.num > 1:
        result = check_allreduce() if joined else {"ok": False, "error": join_error}
    else:
        result = check_allreduce()
    print("MSJAX_DIAG " + json.dumps({"phase": "allreduce", **result}), flush=True)
    if a.fail_exit and not (local["ok"] and result.get("ok")):
        reason = "; ".join(local["reasons"]) or str(result.get("error"))
        print(f"msjax diagnostics: {a.host} failed: {reason}", file=sys.stderr, flush=True)
        _report_excluded(a.host, reason)
        return 1
    return 0


def _report_excluded(host: str, reason: str) -> None:
    """Adds a failing host to the run's excluded set in Redis when this runs in a job of the control plane
    (MSJAX_REDIS_URL and MSJAX_RUN_ID set: a Kubernetes initContainer), for the supervisor to report."""
    if not (os.environ.get("MSJAX_REDIS_URL") and os.environ.get("MSJAX_RUN_ID")):
        return
    try:
        from msjax.control.store import Store, env_connect

        Store(env_connect(), os.environ["MSJAX_RUN_ID"]).exclude_host(host, reason)
    except Exception as e:  # noqa: BLE001 - the exit status still fails the pod
        print(f"msjax diagnostics: could not report {host} to the control plane: {e!r}", file=sys.stderr)


def diagnoses(hosts: Sequence[str], outputs: Sequence[str], timeout_s: float, seconds: float,
              log_dir: Path | None = None) -> list[HostDiagnosis]:
    """One HostDiagnosis per host from each host's diagnostic output (its `MSJAX_DIAG {json}` lines), however
    the diagnostics were started (local subprocesses, an srun step).

    Args:
      hosts: host names; host i ran as rank i; outputs: the output of each, in the same order.
      timeout_s: the time limit they ran under (named in the verdict of a host that never answered).
      seconds: the diagnostics' wall time.
      log_dir: where each host's output is saved (diag_<host>.log); None: not saved.
    """
    results = []
    for rank, (host, out) in enumerate(zip(hosts, outputs)):
        if log_dir is not None:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            (Path(log_dir) / f"diag_{host}.log").write_text(out)
        phases = {}
        for line in out.splitlines():
            if line.startswith("MSJAX_DIAG "):
                rec = json.loads(line[len("MSJAX_DIAG "):])
                phases[rec.pop("phase")] = rec
        local = phases.get("local")
        if local is None:
            tail = out.strip().splitlines()[-1:] or [""]
            why = f"its self-check gave no verdict within the {timeout_s:g} s limit (last output: {tail[0][-200:]!r})"
            results.append(HostDiagnosis(host, rank, False, [why], seconds=seconds))
            continue
        reasons = list(local["reasons"])
        allreduce = phases.get("allreduce")
        results.append(HostDiagnosis(host, rank, not reasons, reasons, local["devices"], allreduce,
                                     local["device_kind"], seconds))
    # An all-reduce failure is a fault of the group, not of one host: it is reported on every host it touched,
    # and a host is excluded for it only when it alone did not finish (the others did).
    finished = [r for r in results if r.allreduce is not None and r.allreduce.get("ok")]
    if finished:
        for r in results:
            if r.ok and (r.allreduce is None or not r.allreduce.get("ok")):
                r.ok = False
                r.reasons.append("did not finish the cross-process all-reduce that the other hosts finished"
                                 + (f": {r.allreduce['error']}" if r.allreduce and "error" in r.allreduce else ""))
    return results


if __name__ == "__main__":
    sys.exit(_main())
