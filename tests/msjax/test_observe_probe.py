"""The window-end compute probe keeps to its time budget (`observe.probe_budget`), on a real ComputeProbe.

The probe is calibrated, then run the way `StepObserver` runs it: each window it is planned for the budget, timed,
and its cost model rescaled by the measured time. After a few windows the probe's wall time must be within its
budget: median of 5 probes <= 1.25 x budget (the 25% is for the load of a shared machine between planning and
timing), and it must use its budget, not hide under it (>= 0.25 x budget), so a planner that always picked the
shortest chain fails too.
"""

import jax
import numpy as np
import pytest

from msjax.observe.timing import ComputeProbe, ProbeCost

BUDGET = 0.005  # the default observe.probe_budget
OVER, UNDER = 1.25, 0.25  # tolerances on probe time / budget (see the module docstring)


@pytest.fixture(scope="module")
def probe():
    p = ComputeProbe(jax.devices()[:2])  # 2 devices, as each worker of the multi-process straggler test
    p.calibrate()
    return p


@pytest.mark.parametrize("window_s", [0.6, 3.0])  # windows of e.g. 20 steps of 30 ms, and of 150 ms
def test_probe_time_stays_within_its_share_of_the_window(probe, window_s):
    budget_s = BUDGET * window_s
    assert probe.cost.predict(3) < budget_s, f"this machine's smallest probe {probe.cost} leaves no room to test"
    for _ in range(4):  # windows: plan, probe, follow the measured time
        probe.plan(budget_s)
        probe.rescale(probe()[1])
    assert probe.plan(budget_s)
    results = [probe() for _ in range(5)]
    walls = np.array([w for _, w in results])
    ratio = float(np.median(walls)) / budget_s
    assert UNDER <= ratio <= OVER, (ratio, walls, probe.chain, probe.cost)
    assert probe.repeats >= 3 and probe.chain >= 3
    for per_matmul, wall in results:  # seconds per matmul of the median call: it is <= half the whole probe
        assert 0 < per_matmul * probe.chain <= wall / 2 * (1 + 1e-9)


def test_the_plan_is_the_longest_chain_that_fits_and_says_when_none_does():
    cost = ProbeCost(size=128, overhead_s=1e-3, matmul_s=1e-4)
    assert cost.chain_for(2e-3) == 10 and cost.predict(10) == pytest.approx(2e-3)
    assert cost.chain_for(2.05e-3) == 10
    assert cost.chain_for(0.5e-3) == 1  # nothing fits: the smallest probe, reported as over budget
    assert cost.chain_for(1e3, max_chain=64) == 64
    assert cost.scaled(2.0) == ProbeCost(128, 2e-3, 2e-4)


def test_a_budget_too_small_for_the_smallest_probe_is_reported(probe):
    assert not probe.plan(probe.cost.predict(1) / 2)
    assert (probe.repeats, probe.chain) == (1, 1)
    assert probe.plan(3 * probe.cost.predict(1)) and probe.repeats == 3
    assert probe.plan(1.0) and probe.repeats == 25  # a large budget: the most calls, each longer than 4 ms
