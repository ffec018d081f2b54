"""Launching: a job's workers started here, or the spec a cluster runs them from, with or without the supervisor.

  options.py    `LaunchOptions`, the one options type and vocabulary of every backend: `num_processes` worker
                processes of `devices_per_process` devices each (one process per node on a cluster).
  preflight.py  the trainer's own layout and memory check on those devices, before anything is rendered or
                started.
  env.py        the MSJAX_* environment of a worker process (msjax.control.worker reads it).
  output.py     where workers' output goes: per-rank log files in the run directory; to the terminal, rank 0's
                lines and every rank's warnings and errors, `[rank R] `-prefixed.
  local.py      the one local process-group runner (`ProcessGroup`), an unsupervised local job, and the
                supervisor's local backend (`LocalBackend`); standby.py: its warm standby workers.
  slurm.py      the sbatch script as data (`SlurmScript`) and the supervisor's backend inside an allocation.
  k8s.py        the JobSet manifest as data and the supervisor's backend beside it.
  backends.py   the backends as one table (`BACKENDS`): what local, slurm and k8s each do at every step.
  cli.py        the commands: `msjax-launch`, `msjax-supervise`.

Every launcher starts a worker as the installed train command (`python -m msjax.train`, `msjax-train`), never by
a path into a checkout. Launching sits on top: it uses the control plane (msjax.control) and the supervisor's
policy (msjax.supervise); neither imports it.
"""
