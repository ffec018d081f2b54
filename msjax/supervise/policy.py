"""Restart policy: a budget of restarts and exponential backoff between them, so a fault loop ends.

Backoff as in Kubernetes' CrashLoopBackOff and torchelastic's restart policy: the k-th restart (0-based) waits
min(base * 2**k, max) seconds, giving a transient fault (a node rebooting, a port still held) time to clear.
k counts the failures since the last attempt that trained (took a step past its restore step), as
CrashLoopBackOff resets once a container has run well: a fault loop backs off ever longer, while independent faults
hours apart each restart after the base delay. The budget counts every restart.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class RestartBudgetExhausted(RuntimeError):
    """More failures than the restart budget allows; the message is the fault-loop report."""


@dataclass
class RestartPolicy:
    """Counts restarts against `budget` and gives the delay before each.

    Args:
      budget: restarts allowed over the run (0: the first failure ends it).
      backoff_s: delay before the first restart, seconds.
      backoff_max_s: the delay's cap, seconds.
    """

    budget: int
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    history: list[str] = field(default_factory=list)
    streak: int = 0  # failures since the last attempt that trained: the backoff's exponent

    def delay(self, restart_index: int) -> float:
        """Seconds to wait before restart `restart_index` (0-based): min(backoff_s * 2**k, backoff_max_s)."""
        return min(self.backoff_s * 2.0 ** restart_index, self.backoff_max_s)

    @property
    def restarts(self) -> int:
        return len(self.history)

    def next_restart(self, failure: str, trained: bool = False) -> float:
        """Records a failure that calls for a restart and returns the delay before it (seconds).

        Args:
          failure: what failed (for the fault-loop report).
          trained: the failed attempt took a step past its restore step; the backoff starts over.
        Raises:
          RestartBudgetExhausted: the budget is spent; the message lists every failure so far.
        """
        if self.restarts >= self.budget:
            raise RestartBudgetExhausted(self.report(failure))
        if trained:
            self.streak = 0
        delay = self.delay(self.streak)
        self.streak += 1
        self.history.append(failure)
        return delay

    def report(self, last_failure: str) -> str:
        """The fault-loop report: the budget and every failure, oldest first."""
        lines = [f"restart budget exhausted: {self.restarts} restart(s) allowed (supervisor.restart_budget="
                 f"{self.budget}) and the run failed again; failures:"]
        for i, f in enumerate(self.history + [last_failure]):
            lines.append(f"  attempt {i}: {f}")
        if len(set(self.history + [last_failure])) == 1 and self.history:
            lines.append("the same failure repeats at every start: a fault loop (fix the cause, then resume with "
                         "--resume)")
        return "\n".join(lines)
