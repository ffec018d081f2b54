"""The suite's pytest-xdist scheduler: `--dist loadfile`, with a worker crash handled without a hang.

pytest-xdist 3.8's LoadFileScheduling (LoadScopeScheduling underneath) puts a crashed worker's whole workload back
on the queue, files it had finished included. Those come back as empty work units; a worker sent an empty unit
never reports it complete, so the session waits forever (pytest-xdist issue 1378, open). The replacement worker
is then given one work unit; a worker runs a test only once it holds the next one (or is told to shut down), so
a unit of one test also waits forever (issue 1327). And the test that crashed runs again on the replacement
(pull request 1371, open). Seen here: CI's run lost one worker to an abort and then sat idle until CI's 90-minute
limit; reproduced by tests/test_xdist_scheduling.py, which hangs with xdist's own scheduler.

Below, as LoadScheduling (`--dist load`) already does, the test the worker died on is reported failed (by xdist,
from the returned id) and marked done, and only work units with tests still to run are requeued; and a node is
given work units until it holds two tests, or told to shut down once the queue is empty.
Remove this file when a pytest-xdist release fixes the scheduler; tests/test_xdist_scheduling.py shows when.
"""

from __future__ import annotations

import pytest


def _scheduler_class():
    from xdist.scheduler import LoadFileScheduling

    class CrashSafeLoadFileScheduling(LoadFileScheduling):
        def remove_node(self, node):
            workload = self.assigned_work.pop(node)
            pending = [(scope, nodeid) for scope, unit in workload.items()
                       for nodeid, done in unit.items() if not done]
            if not pending:
                return None
            scope, crashitem = pending[0]  # tests of a unit run in order: the first pending one is the crash
            workload[scope][crashitem] = True
            self.workqueue.update({s: unit for s, unit in workload.items() if not all(unit.values())})
            for other in self.assigned_work:
                self._reschedule(other)
            return crashitem

        def _reschedule(self, node):
            if node.shutting_down:
                return
            while self.workqueue and self._pending_of(self.assigned_work[node]) < 2:
                self._assign_work_unit(node)
            if not self.workqueue:
                node.shutdown()

    return CrashSafeLoadFileScheduling


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's; optional so `-p no:xdist` still runs the suite
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    return _scheduler_class()(config, log)
