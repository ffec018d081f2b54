"""Command line of a supervised local run (used by `scripts/launch.py --backend=local --supervise` and by
`python -m msjax.supervise`):

    python -m msjax.supervise --hosts=2 --devices_per_host=4 --config=gpt_tiny --train.steps=200 \
        [--supervisor.heartbeat_period_s=0.5 ...] [--inject=kill:1@40 --inject=stop:0@90#1]

Flags: `--hosts` (workers, one per host), `--devices_per_host` (CPU devices each; 0 leaves devices alone),
`--redis_url` (an existing Redis; default: a private server for this run), `--inject` (test/benchmark faults,
see `Fault.parse`), and every config key (passed to the workers as well). Exit codes: 0 finished, 2 bad input,
3 no hosts or no layout left, 4 restart budget exhausted.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Sequence

from msjax.config import ConfigError, config_from_flags, split_flags

OWN_FLAGS = ("hosts", "devices_per_host", "redis_url", "inject", "run_id")


def parse(argv: Sequence[str]) -> tuple[dict, list[str], object]:
    """(own options, the training flags, the validated Config). Raises ConfigError / ValueError on bad input."""
    from msjax.supervise.supervisor import Fault

    pairs, positional = split_flags(argv, valueless={"resume"})
    if positional:
        raise ConfigError(f"unexpected arguments {positional}; flags look like --train.steps=100")
    own: dict = {"hosts": 1, "devices_per_host": 0, "redis_url": "", "inject": [], "run_id": ""}
    train_flags, cfg_pairs = [], []
    for key, value in pairs:
        if key == "inject":
            own["inject"].append(Fault.parse(value))
        elif key in ("hosts", "devices_per_host"):
            try:
                own[key] = int(value)
            except ValueError:
                raise ConfigError(f"--{key}={value!r}: allowed is an integer") from None
            if own[key] < (1 if key == "hosts" else 0):
                raise ConfigError(f"--{key}={value}: allowed is an integer >= {1 if key == 'hosts' else 0}")
        elif key in OWN_FLAGS:
            own[key] = value
        else:
            cfg_pairs.append((key, value))
            train_flags.append("--resume" if key == "resume" else f"--{key}={value}")
    cfg = config_from_flags(cfg_pairs)
    return own, train_flags, cfg


def main(argv: Sequence[str] | None = None, out=sys.stdout) -> int:
    """Runs a supervised local job; returns the exit code (see the module docstring)."""
    from msjax.supervise.store import local_redis_server
    from msjax.supervise.supervisor import LocalBackend, Supervisor

    try:
        own, train_flags, cfg = parse(sys.argv[1:] if argv is None else argv)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        url = own["redis_url"] or stack.enter_context(local_redis_server())
        backend = LocalBackend(train_flags, own["devices_per_host"], Path(cfg.train.run_dir) / "supervisor")
        sup = Supervisor(cfg, backend, url, own["hosts"], own["devices_per_host"] or 1, own["inject"],
                         run_id=own["run_id"] or None, out=out)
        result = sup.run()
    return result.exit_code
