"""Entry points of a supervised local run.

    python scripts/launch.py --backend=local --num_processes=2 --devices_per_process=2 --supervise -- <train flags>
    python -m msjax.supervise --hosts=2 --devices_per_host=2 <train flags> [--inject=kill:1@40 ...]

`launch.py` (msjax.control.launch) hands a local run to `supervise_local` when `--supervise` is given or the
train flags say `--supervisor.enabled=true`. `python -m msjax.supervise` is the same with its own flags:
`--hosts`, `--devices_per_host` (CPU devices each; 0 leaves devices alone), `--redis_url` (an existing Redis;
default: a private server for this run), `--run_id`, `--inject` (repeatable).

Fault injection is for tests and benchmarks only: `--inject=SPEC` or MSJAX_TEST_INJECT=SPEC[,SPEC...] (what
`launch.py` runs take), SPEC as in `msjax.supervise.supervisor.Fault.parse`.

Exit codes: 0 finished, 2 bad input, 3 no hosts or no layout left, 4 restart budget exhausted.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Sequence

from msjax.config import ConfigError, config_from_flags, parse_args, split_flags

INJECT_ENV = "MSJAX_TEST_INJECT"


def faults_from_env() -> list:
    """The faults in MSJAX_TEST_INJECT (comma-separated specs). Raises ValueError naming a bad spec."""
    from msjax.supervise.supervisor import Fault

    return [Fault.parse(x) for x in os.environ.get(INJECT_ENV, "").split(",") if x.strip()]


def supervise_local(train_flags: Sequence[str], num_hosts: int, devices_per_host: int = 0,
                    redis_url: str | None = None, run_id: str | None = None, faults: Sequence = (),
                    rdzv_timeout_s: int = 300, out=sys.stdout) -> int:
    """Runs `scripts/train.py <train_flags>` on `num_hosts` local worker processes under the supervisor.

    Args:
      train_flags: the workers' flags (the config, including its `supervisor` section, is parsed from them).
      num_hosts: worker processes (one per host); `supervisor.spares` more are held back.
      devices_per_host: CPU devices per worker (0: leave the device setup alone, one device each on CPU).
      redis_url: an existing Redis; None starts a private one (msjax.control.server.RedisServer).
      run_id: the run's namespace in Redis (default: generated).
      faults: faults to inject (tests, benchmarks), plus those in MSJAX_TEST_INJECT.
      rdzv_timeout_s: the workers' rendezvous timeout.
    Returns:
      The exit code (see the module docstring); bad flags print `error: ...` and return 2.
    """
    from msjax.control.server import RedisServer
    from msjax.supervise.supervisor import LocalBackend, Supervisor

    try:
        cfg, rest = parse_args(list(train_flags))
        if rest:
            raise ConfigError(f"unexpected train flags {rest}; flags look like --train.steps=100")
        faults = list(faults) + faults_from_env()
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    def interrupted(signum, frame):  # unwind through Supervisor.run's cleanup: workers stopped, Redis stopped
        raise SupervisorInterrupted(signum)

    previous = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGTERM, signal.SIGINT)}
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: [signal.signal(sig, h) for sig, h in previous.items()])
        if not redis_url:
            redis_url = stack.enter_context(RedisServer()).url
        backend = LocalBackend(train_flags, devices_per_host, Path(cfg.train.run_dir) / "supervisor",
                               rdzv_timeout_s=rdzv_timeout_s)
        sup = Supervisor(cfg, backend, redis_url, num_hosts, devices_per_host or 1, faults, run_id=run_id, out=out)
        try:
            return sup.run().exit_code
        except SupervisorInterrupted as e:
            print(f"[supervisor] interrupted by {signal.Signals(e.signum).name}: workers stopped", file=out,
                  flush=True)
            return 128 + e.signum


class SupervisorInterrupted(Exception):
    """SIGTERM or SIGINT reached the supervisor (its workers are stopped on the way out)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def main(argv: Sequence[str] | None = None, out=sys.stdout) -> int:
    """`python -m msjax.supervise`: returns the exit code (see the module docstring)."""
    from msjax.supervise.supervisor import Fault

    try:
        pairs, positional = split_flags(sys.argv[1:] if argv is None else argv, valueless={"resume"})
        if positional:
            raise ConfigError(f"unexpected arguments {positional}; flags look like --train.steps=100")
        own = {"hosts": 1, "devices_per_host": 0, "redis_url": "", "run_id": ""}
        faults, train_flags = [], []
        for key, value in pairs:
            if key == "inject":
                faults.append(Fault.parse(value))
            elif key in ("hosts", "devices_per_host"):
                try:
                    own[key] = int(value)
                except ValueError:
                    raise ConfigError(f"--{key}={value!r}: allowed is an integer") from None
                if own[key] < (1 if key == "hosts" else 0):
                    raise ConfigError(f"--{key}={value}: allowed is an integer >= {1 if key == 'hosts' else 0}")
            elif key in own:
                own[key] = value
            else:
                train_flags.append("--resume" if key == "resume" else f"--{key}={value}")
        config_from_flags([])  # the presets load (a broken checkout fails here, before anything starts)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return supervise_local(train_flags, own["hosts"], own["devices_per_host"], own["redis_url"] or None,
                           own["run_id"] or None, faults, out=out)
