"""The overhead bench's interval: the distribution-free CI of a median covers the true median at least as often as
its level says (simulated on skewed random samples), and the trial length holds whole observer periods."""

import numpy as np
import pytest

from msjax.config import Config, apply_overrides
from tests.scripts.loader import load_script

bench_observe = load_script("bench_observe")
median_ci, trial_period = bench_observe.median_ci, bench_observe.trial_period


@pytest.mark.parametrize("n", [6, 40, 101])
def test_median_interval_covers_the_true_median_at_its_level(n):
    rng = np.random.default_rng(n)
    true_median = np.log(2.0)  # of the exponential distribution (scale 1): skewed, so a symmetric CI would fail
    hits = 0
    for _ in range(2000):
        x = rng.exponential(1.0, n)
        med, lo, hi = median_ci(x)
        assert lo <= med <= hi
        hits += lo <= true_median <= hi
    # exact coverage is >= 95%; 2000 draws: the binomial sd of the rate is ~0.5%, so 0.935 is > 3 sd below
    assert hits / 2000 >= 0.935, hits / 2000


def test_too_few_samples_for_an_interval_is_an_error():
    with pytest.raises(ValueError, match="too few"):
        median_ci(np.arange(5.0))


def test_trials_hold_whole_windows_and_gc_periods():
    assert trial_period(Config()) == 100  # window 20, gc_every 50
    assert trial_period(apply_overrides(Config(), {"observe.window": 0, "observe.gc_every": 0})) == 1
