"""The supervisor: runs that heal themselves (MegaScale sec. 5; ByteRobust). Policy only: what to do when a
worker fails. Where workers run is the launcher's (msjax.launch provides the backends); the signals it watches
travel through the control plane (msjax.control). It imports neither the launcher nor any script.

Owns, module by module:
  supervisor  the loop that launches workers through a backend, watches them, stops, diagnoses, excludes,
              re-plans and restarts; `WorkerBackend`, the small interface of where workers run.
  detect      failure detection as pure functions of observed worker state (exit codes, heartbeats, reported
              non-finite losses, steps that stop advancing), and which failure to blame.
  policy      the restart budget and exponential backoff; a fault loop ends with a report.
  diagnostics MegaScale's self-checks per host (the site's health check, matmul correctness and speed per
              device, a cross-process all-reduce with a timeout), run as a process per host so a hang is killable.
  exclusion   which hosts a restart leaves out (failed self-checks; stragglers, softly).
  replan      the best layout of the same global batch on the devices that are left (msjax.planner).
  figures     recovery figures read off the run's event log (msjax.events): detection latency, recovery time,
              recomputed steps, where each restart's time went. The whole run's goodput is msjax.goodput's.
"""
