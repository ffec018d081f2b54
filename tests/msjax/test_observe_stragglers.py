"""Straggler scoring as pure functions over synthetic per-rank series (random noise, one rank slowed), and each
process's mesh coordinates from a device array."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest

from msjax.observe import StragglerDetector, mesh_places, persistent_stragglers, slowdown_scores
from msjax.observe.stragglers import leave_one_out_median
from msjax.sharding_rules.axes import MESH_AXES


def _series(ranks: int, windows: int, seed: int, noise: float = 0.05) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return 0.020 * (1.0 + noise * rng.standard_normal((ranks, windows)))  # 20 ms probes, 5% noise


def test_leave_one_out_median_matches_a_direct_computation():
    x = np.random.default_rng(0).random(7)
    expected = [np.median([x[j] for j in range(7) if j != r]) for r in range(7)]
    np.testing.assert_allclose(leave_one_out_median(x), expected)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        leave_one_out_median(np.ones(1))


@pytest.mark.parametrize("ranks", [2, 4, 16])
def test_a_rank_slowed_from_window_3_is_flagged_after_persist_windows(ranks):
    x = _series(ranks, 8, seed=ranks)
    slow = ranks - 1
    x[slow, 3:] *= 2.0
    scores = slowdown_scores(x)
    assert scores[slow, 3:].min() > 1.6 and np.abs(scores[:, :3] - 1).max() < 0.3
    assert persistent_stragglers(scores[:, :3], threshold=1.5, persist=2) == []
    assert persistent_stragglers(scores[:, :4], threshold=1.5, persist=2) == []  # one slow window is not enough
    assert persistent_stragglers(scores[:, :5], threshold=1.5, persist=2) == [slow]


def test_noise_and_single_spikes_flag_nobody():
    x = _series(8, 40, seed=1, noise=0.1)
    x[2, 5] *= 3.0  # one bad window on rank 2, one on rank 5
    x[5, 20] *= 3.0
    assert persistent_stragglers(slowdown_scores(x), threshold=1.5, persist=2) == []


def test_floor_keeps_near_zero_figures_from_exploding():
    stall = np.abs(np.random.default_rng(2).normal(0, 1e-5, (4, 3)))  # microseconds of host stall
    assert slowdown_scores(stall, floor=0.0).max() > 1.5  # ratios of noise
    assert slowdown_scores(stall, floor=0.002).max() < 1.1  # 10% of a 20 ms step as the floor
    stall[1] += 0.05  # one host stalls 50 ms per step
    assert persistent_stragglers(slowdown_scores(stall, floor=0.002), 1.5, 3) == [1]


def test_detector_reports_new_and_recovered_ranks():
    det = StragglerDetector({"probe_s": 0.0, "host_stall_s": 0.1}, threshold=1.5, persist=2)
    rng = np.random.default_rng(3)
    verdicts = []
    for w in range(8):
        probe = 0.02 * (1 + 0.05 * rng.standard_normal(4))
        if 2 <= w < 5:
            probe[1] *= 2.5
        verdicts.append(det.update({"probe_s": probe, "host_stall_s": np.zeros(4) + 1e-6}, step_s=0.1))
    assert [v.new for v in verdicts] == [[], [], [], [1], [], [], [], []]
    assert [v.stragglers for v in verdicts] == [[], [], [], [1], [1], [], [], []]
    assert [v.recovered for v in verdicts] == [[], [], [], [], [], [1], [], []]
    with pytest.raises(ValueError, match="threshold"):
        StragglerDetector({"probe_s": 0.0}, threshold=1.0, persist=1)


def test_an_unscored_window_neither_flags_nor_counts_toward_persistence():
    """A figure left unscored in a window (the observer's first, single-call probe) adds nothing to its history:
    a spike there flags nobody even when the next window is slow too, and persistence counts scored windows."""
    det = StragglerDetector({"probe_s": 0.0}, threshold=3.0, persist=2)
    rng = np.random.default_rng(5)

    def probe(slow: float) -> np.ndarray:
        x = 0.02 * (1 + 0.05 * rng.standard_normal(4))
        x[2] *= slow
        return x

    first = det.update({"probe_s": probe(20.0)}, step_s=0.1, unscored=("probe_s",))
    assert first.scores == {} and first.stragglers == []
    second = det.update({"probe_s": probe(4.0)}, step_s=0.1)
    assert second.scores["probe_s"][2] > 3.0 and second.stragglers == []  # one scored window of 2
    third = det.update({"probe_s": probe(4.0)}, step_s=0.1)
    assert third.new == [2]
    # Scored, the same first window would have flagged rank 2 one window earlier.
    eager = StragglerDetector({"probe_s": 0.0}, threshold=3.0, persist=2)
    eager.update({"probe_s": probe(20.0)}, step_s=0.1)
    assert eager.update({"probe_s": probe(4.0)}, step_s=0.1).new == [2]


def test_mesh_places_give_each_process_its_coordinates():
    # pipeline 2 x data 2 x fsdp 1 x expert 1 x sequence 1 x tensor 2 = 8 devices, 2 per process, tensor innermost.
    devices = np.empty((2, 2, 1, 1, 1, 2), dtype=object)
    for i, idx in enumerate(np.ndindex(devices.shape)):
        devices[idx] = SimpleNamespace(id=i, process_index=i // 2)
    places = mesh_places(devices, hosts={1: "host-b"})
    assert sorted(places) == [0, 1, 2, 3]
    assert places[1].coords == {"pipeline": [0], "data": [1], "fsdp": [0], "expert": [0], "sequence": [0],
                                "tensor": [0, 1]}
    assert places[2].coords["pipeline"] == [1] and places[2].devices == [4, 5]
    assert places[1].describe() == ("process 1 on host-b (pipeline 0, data 1, fsdp 0, expert 0, sequence 0, "
                                         "tensor 0-1)")


def test_mesh_places_on_a_real_mesh():
    mesh = jax.make_mesh((1, 2, 2, 1, 1, 2), MESH_AXES)
    places = mesh_places(mesh.devices)
    assert list(places) == [0]
    assert places[0].coords["data"] == [0, 1] and places[0].coords["tensor"] == [0, 1]
    assert len(places[0].devices) == 8
