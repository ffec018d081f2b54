"""The launcher's one options type (`LaunchOptions`) and its command-line parser.

One vocabulary for every backend: a job is `num_processes` worker processes (one per node on a cluster) of
`devices_per_process` devices each; its mesh must multiply to their product. The train flags come after `--`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Sequence

from msjax import cli
from msjax.config import Config, ConfigError

# Flags that may be given several times, each a whole value (an sbatch or srun option may itself hold commas).
REPEATABLE = ("sbatch", "srun_args")


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """The launcher's flags (before `--`; the train flags come after it). Times are seconds.

    Attributes:
      backend: local: worker processes on this machine; slurm: an sbatch script; k8s: a JobSet manifest.
      num_processes: worker processes; on a cluster one per node (required, >= 1).
      devices_per_process: devices each worker process has: CPU devices forced through XLA_FLAGS (local, and
        accelerator=none), else the accelerators each node requests. The job's mesh must multiply to
        num_processes x devices_per_process.
      supervise: run the job under the supervisor (msjax.supervise): detection, diagnosis, exclusion, restarts.
      run_id: run id for the Redis keys; empty: generated (NAME-DATE-TIME-RANDOM).
      name: job name (k8s objects, slurm job, generated run ids).
      redis_url: local: use this Redis instead of starting a private one; the supervisor: the job's Redis
        (default: MSJAX_REDIS_URL, which the cluster specs set).
      redis_port: local: port of the private Redis; 0: a free one.
      rdzv_timeout_s: how long workers wait for each other at the rendezvous.
      term_grace_s: local: after Ctrl-C/SIGTERM, time between the stop command and forwarding SIGTERM.
      kill_grace_s: local: time between SIGTERM and SIGKILL.
      output: slurm, k8s: write the spec to this path instead of printing it.
      submit: slurm: submit the script with sbatch (it is written to --output, or a file beside the run directory,
        first) and print the job id.
      accelerator: slurm, k8s: what each node's devices are (none: CPU devices, forced through XLA_FLAGS).
      device_kind: the devices' kind for the memory check before launch (a msjax.hardware catalogue name or jax's
        device_kind, e.g. h100); empty: the local CPU's, or unchecked for accelerators.
      cpus_per_process: slurm, k8s: CPUs each worker process (node) requests.
      memory_per_process: k8s: memory each worker pod requests (a Kubernetes quantity, e.g. 256Gi).
      workdir: slurm: the directory the job starts in (default: where sbatch was run); k8s: the container's
        workingDir (default: the image's).
      image: k8s: container image holding msjax (required for k8s).
      tpu_type: k8s: cloud.google.com/gke-tpu-accelerator.
      tpu_topology: k8s: cloud.google.com/gke-tpu-topology.
      max_restarts: k8s: JobSet failurePolicy.maxRestarts (with --supervise: supervisor.restart_budget).
      namespace: k8s: the namespace of every object.
      redis_secret: k8s: Secret holding the Redis password; empty: NAME-redis, created by the manifest.
      partition: slurm: the partition; empty: the cluster's default.
      account: slurm: the account charged (sbatch --account); empty: the user's default.
      qos: slurm: the quality of service (sbatch --qos); empty: the default.
      time_limit: slurm: the job's time limit (sbatch --time).
      setup: slurm: shell commands run first in the batch script and in every task before msjax starts (activate a
        virtualenv, `module load`, enter a container's environment); msjax's commands must be on PATH after it.
      setup_file: slurm: a file whose text is run like --setup (after it).
      sbatch: slurm: an extra #SBATCH option, e.g. --sbatch=--constraint=a100 (repeat the flag for more).
      srun_args: slurm: an extra option of every srun step, e.g. --srun_args=--container-image=IMG with pyxis
        (repeat the flag for more).
      nodes: the supervisor under slurm: the nodes to use (default: the allocation's, in SLURM's order).
    """

    backend: Literal["local", "slurm", "k8s"] = "local"
    num_processes: int = 0
    devices_per_process: int = 1
    supervise: bool = False
    run_id: str = ""
    name: str = "msjax"
    redis_url: str = ""
    redis_port: int = 0
    rdzv_timeout_s: int = 300
    term_grace_s: float = 10.0
    kill_grace_s: float = 20.0
    output: str = ""
    submit: bool = False
    accelerator: Literal["gpu", "tpu", "none"] = "gpu"
    device_kind: str = ""
    cpus_per_process: int = 32
    memory_per_process: str = "256Gi"
    workdir: str = ""
    image: str = ""
    tpu_type: str = "tpu-v5p-slice"
    tpu_topology: str = "2x2x1"
    max_restarts: int = 3
    namespace: str = "default"
    redis_secret: str = ""
    partition: str = ""
    account: str = ""
    qos: str = ""
    time_limit: str = "24:00:00"
    setup: str = ""
    setup_file: str = ""
    sbatch: tuple[str, ...] = ()
    srun_args: tuple[str, ...] = ()
    nodes: tuple[str, ...] = ()

    def flags(self, *names: str) -> list[str]:
        """`--NAME=VALUE` for each of `names` whose value differs from the default (repeatable ones once per
        value): how a launcher hands its options on to a command it starts (the supervisor in a batch job)."""
        out = []
        for name in names:
            value, default = getattr(self, name), getattr(LaunchOptions(), name)
            if value == default:
                continue
            if name in REPEATABLE:
                out += [f"--{name}={v}" for v in value]
            else:
                out.append(f"--{name}={cli.flag_value(value)}")
        return out


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(launcher flags, train flags): everything after the first `--` goes to the train command."""
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def _take_repeatable(argv: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """Pulls every `--NAME=VALUE` / `--NAME VALUE` of REPEATABLE out of `argv` (argparse keeps a repeated flag's
    last value; these keep all, each whole)."""
    taken: dict[str, list[str]] = {name: [] for name in REPEATABLE}
    rest, args = [], list(argv)
    while args:
        arg = args.pop(0)
        key, eq, value = arg.partition("=")
        if key.startswith("--") and key[2:] in REPEATABLE:
            if not eq:
                if not args:
                    raise ConfigError(f"flag {key} needs a value ({key}=VALUE)")
                value = args.pop(0)
            taken[key[2:]].append(value)
        else:
            rest.append(arg)
    return taken, rest


def parse(argv: Sequence[str], prog: str = "msjax-launch", description: str | None = None
          ) -> tuple[cli.LoggingOptions, LaunchOptions, Config, list[str]]:
    """Parses a launcher's command line: (logging options, launch options, the workers' config, train flags).

    Raises:
      ConfigError: a bad launcher flag (naming it and what is allowed) or train flag (prefixed "train flags: ").
      SystemExit: after `--help`.
    """
    own, train_flags = split_argv(argv)
    repeated, own = _take_repeatable(own)
    common, opts = cli.parse_options(own, LaunchOptions(), prog=prog, description=description)
    opts = dataclasses.replace(opts, **{k: tuple(v) for k, v in repeated.items() if v})
    if opts.num_processes < 1:
        raise ConfigError(f"--num_processes={opts.num_processes}: must be >= 1 (worker processes, one per node on "
                          "a cluster; required)")
    if opts.devices_per_process < 1:
        raise ConfigError(f"--devices_per_process={opts.devices_per_process}: must be >= 1")
    try:  # a bad train flag fails here, before anything is rendered or started
        cfg, _ = cli.parse(train_flags, prog=f"{prog} [OPTIONS] --")
    except ConfigError as e:
        raise ConfigError(f"train flags: {e}") from None
    return common, opts, cfg, train_flags
