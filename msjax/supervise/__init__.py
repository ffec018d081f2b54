"""The supervisor: runs that heal themselves (MegaScale sec. 5; ByteRobust).

Owns, module by module:
  events      the run's event log (`<run_dir>/events.jsonl`, and Redis when a sink is given): fault injected or
              observed, detected, diagnosed, restarted, first step after restart; detection latency, recovery
              time and the effective training time ratio are read off it.
  detect      failure detection as pure functions of observed worker state (exit codes, heartbeats, reported
              non-finite losses, steps that stop advancing).
  policy      the restart budget and exponential backoff; a fault loop ends with a report.
  diagnostics MegaScale's self-checks per host (matmul correctness and speed per device, a cross-process
              all-reduce with a timeout), run as subprocesses so a hang is killable.
  replan      the best layout of the same global batch on the devices that are left (msjax.planner).
  heartbeat   the worker side: a loop Hook that sends heartbeats (step, TTL) and reports non-finite losses.
  store       where heartbeats and reports travel (Redis).
  supervisor  the loop that launches workers, watches them, stops, diagnoses, excludes, re-plans and restarts;
              `WorkerBackend`, the small interface of where workers run, and `LocalBackend`.
  slurm       the SLURM backend (an srun step in an allocation); k8s: the JobSet backend (restarts through the
              JobSet's failurePolicy); cluster: the specs that run the supervisor as the job's controller.
  phases      start-up timestamps of a worker (imports, rendezvous, restore, first step) for recovery breakdowns.
"""
