"""Which hosts the next restart leaves out: hosts that failed diagnostics, and (with `observe.exclude_stragglers`)
hosts the run's straggler detector recorded in the control plane's excluded set.

MegaScale (NSDI'24) found ~0.5% of machines to be stragglers and gained 0.7% MFU by removing them. A straggler
is slow, not broken, so its exclusion is *soft*: it is honoured only when the job can go on without the host (a
spare takes its place, or re-planning onto fewer hosts is allowed); otherwise the host is kept and the run goes
on at the straggler's pace rather than stopping. A host that failed diagnostics is excluded whatever it costs.

Pure functions: the supervisor (msjax.supervise.supervisor) feeds them its host lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Mapping, Sequence


@dataclass(frozen=True)
class StragglerExclusion:
    """The supervisor's decision on recorded stragglers at a restart.

    Attributes:
      exclude: straggler hosts to leave out from now on.
      keep: straggler hosts kept because nothing could replace them (no spare, re-planning off or no host left).
    """

    exclude: list[str]
    keep: list[str]


def straggler_exclusions(recorded: Collection[str], running: Sequence[str], all_hosts: Sequence[str],
                         excluded: Mapping[str, str] | Collection[str], needed: int,
                         replan: bool) -> StragglerExclusion:
    """Decides which recorded straggler hosts the next restart leaves out.

    Args:
      recorded: the run's excluded-host set as read from Redis (straggler hosts, and hosts the supervisor
        excluded itself, which are already in `excluded`).
      running: the hosts of the attempt that just ended.
      all_hosts: every host the supervisor knows (the job's and the spares), in preference order.
      excluded: hosts already excluded (after this restart's diagnostics).
      needed: hosts the job runs on now.
      replan: whether re-planning onto fewer hosts is allowed (`supervisor.replan`).
    Returns:
      StragglerExclusion: `exclude` when the job keeps at least one host and either spares cover every excluded
      host or `replan` is on; else everything goes to `keep`.
    """
    slow = [h for h in running if h in recorded and h not in excluded]
    if not slow:
        return StragglerExclusion([], [])
    left = [h for h in all_hosts if h not in excluded and h not in slow]
    if left and (len(left) >= needed or replan):
        return StragglerExclusion(slow, [])
    return StragglerExclusion([], slow)
