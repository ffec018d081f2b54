"""The goodput projection's model (msjax.planner.goodput) against a simulation of the process it describes, and its
optimum interval against a search of the same model."""

import json
import math
import re
import random

import numpy as np
import pytest

from msjax.planner import goodput as gp


def _simulated_ettr(rng: random.Random, interval_s: float, stall_s: float, restart_s: float, mtbf_s: float,
                    segments: int) -> float:
    """Productive / wall seconds of `segments` segments run as the model says: exponential failures (mean
    `mtbf_s`) strike anywhere, in a segment (its work and checkpoint are then redone after a restart) or in a
    restart (which then starts over)."""
    wall = 0.0
    for _ in range(segments):
        while True:
            fail = rng.expovariate(1.0 / mtbf_s)
            if fail >= interval_s + stall_s:
                wall += interval_s + stall_s
                break
            wall += fail
            while True:  # the restart, itself exposed to failures
                fail = rng.expovariate(1.0 / mtbf_s)
                if fail >= restart_s:
                    wall += restart_s
                    break
                wall += fail
    return segments * interval_s / wall


def test_ettr_matches_a_simulation_of_the_failure_process():
    """Random settings in the regime of real runs (intervals and restarts well below the MTBF, and a few near it);
    40,000 simulated segments each. Tolerance 1.5% relative: the simulated ETTR's standard error here is below
    0.4%."""
    rng = random.Random(20261128)
    for _ in range(6):
        mtbf = rng.uniform(600.0, 20_000.0)
        interval, stall, restart = (rng.uniform(0.02, 0.6) * mtbf, rng.uniform(0.0, 0.05) * mtbf,
                                    rng.uniform(0.0, 0.3) * mtbf)
        model = gp.ettr(interval, stall, restart, mtbf)
        simulated = _simulated_ettr(rng, interval, stall, restart, mtbf, 40_000)
        assert model == pytest.approx(simulated, rel=0.015), (mtbf, interval, stall, restart)


def test_training_only_failures_with_step_overheads_match_a_simulation():
    """restart_failures=False (faults injected into a training job, as scripts/bench_recovery.py --fault_every_s
    does): failures strike the steps, their overheads and the checkpoints, never a restart, which then always
    costs R in full. 40,000 simulated segments each; tolerance 1.5% relative on the ETTR (standard error below
    0.4%) and 3% on the failures per segment."""
    rng = random.Random(20261129)
    for _ in range(6):
        mtbf = rng.uniform(20.0, 600.0)
        interval, stall, restart, overhead = (rng.uniform(0.01, 0.3) * mtbf, rng.uniform(0.0, 0.05) * mtbf,
                                              rng.uniform(0.05, 0.5) * mtbf, rng.uniform(0.0, 0.3))
        work = interval * (1.0 + overhead) + stall
        wall, failures, segments = 0.0, 0, 40_000
        for _ in range(segments):
            while (fail := rng.expovariate(1.0 / mtbf)) < work:
                wall += fail + restart
                failures += 1
            wall += work
        simulated = segments * interval / wall
        model = gp.ettr(interval, stall, restart, mtbf, restart_failures=False, overhead=overhead)
        assert model == pytest.approx(simulated, rel=0.015), (mtbf, interval, stall, restart, overhead)
        # The same through project(), with a once-only part outside the failure process.
        once = 0.1 * wall
        p = gp.project(wall + once, 1, 3600.0 / mtbf, {"process": gp.FailureKind(1.0, {"restore": restart})},
                       stall_s=stall, interval_s=interval, overhead=overhead, fixed_s=once, restart_failures=False)
        assert p.ettr == pytest.approx(model * wall / (wall + once), rel=1e-12)
        assert sum(p.failures.values()) / (p.badput["productive"] / interval) == pytest.approx(
            failures / segments, rel=0.03)
        assert p.badput["once"] == once and sum(p.badput.values()) == pytest.approx(p.run_s, rel=1e-12)
        assert p.badput["lost work"] >= 0.0


def test_the_optimum_with_step_overheads_is_the_optimum_of_the_stretched_segment():
    stall, mtbf, overhead = 30.0, 5_000.0, 0.25
    p = gp.project(86_400.0, 1, 3600.0 / mtbf, _kinds(), stall_s=stall, overhead=overhead)
    assert p.interval_s == pytest.approx(gp.best_interval(stall, mtbf) / (1.0 + overhead), rel=1e-12)
    near = [gp.ettr(p.interval_s * f, stall, 100.0, mtbf, overhead=overhead) for f in (0.98, 1.0, 1.02)]
    assert near[1] >= max(near[0], near[2])


def test_best_interval_is_the_maximum_and_daly_and_young_approach_it():
    rng = np.random.default_rng(7)
    for mtbf, stall in zip(rng.uniform(1e3, 1e6, 8), rng.uniform(1.0, 200.0, 8)):
        best = gp.best_interval(stall, mtbf)
        grid = best * np.exp(np.linspace(-2.0, 2.0, 2001))  # a factor of e^2 either side
        values = np.array([gp.ettr(t, stall, 30.0, mtbf) for t in grid])
        top = gp.ettr(best, stall, 30.0, mtbf)
        assert top >= values.max() - 1e-12
        assert grid[values.argmax()] == pytest.approx(best, rel=5e-3)  # the grid's step is 0.2%
        # Daly's higher-order interval is the optimum within 0.2% wherever δ <= M / 5 (measured: 1e-8 at
        # δ / M = 1e-4, 1.2e-3 at 0.2; here δ / M is at most 0.2); Young's first-order one only as δ / M -> 0
        # (0.5% at 1e-4, 25% at 0.2).
        assert gp.daly_interval(stall, mtbf) == pytest.approx(best, rel=2e-3)
        if stall / mtbf < 1e-3:
            assert gp.young_interval(stall, mtbf) == pytest.approx(best, rel=0.02)


def test_the_optimum_does_not_depend_on_the_restart_cost():
    stall, mtbf = 40.0, 10_000.0
    best = gp.best_interval(stall, mtbf)
    for restart in (0.0, 100.0, 3000.0):
        near = [gp.ettr(best * f, stall, restart, mtbf) for f in (0.98, 1.0, 1.02)]
        assert near[1] >= max(near[0], near[2])


def _kinds():
    return {"process": gp.FailureKind(0.7, {"detection": 1.0, "teardown": 2.0, "startup": 60.0, "compilation": 30.0,
                                            "restore": 90.0}),
            "host": gp.FailureKind(0.3, {"detection": 30.0, "teardown": 5.0, "startup": 120.0, "compilation": 30.0,
                                         "restore": 90.0})}


def test_projection_accounts_for_every_second_and_names_the_largest_part():
    # 2,048 devices at 2e-5 failures per device-hour: a failure every ~24 minutes; 30 days
    p = gp.project(30 * 86_400.0, 2048, 2e-5, _kinds(), stall_s=5.0, lag_s=20.0)
    assert p.mtbf_s == pytest.approx(3600.0 / (2048 * 2e-5))
    assert sum(p.failures.values()) == pytest.approx(p.run_s / p.mtbf_s)
    assert p.failures["process"] == pytest.approx(0.7 * p.run_s / p.mtbf_s)
    assert sum(p.badput.values()) == pytest.approx(p.run_s, rel=1e-9)
    assert all(v >= 0 for v in p.badput.values()), p.badput
    assert p.badput["productive"] == pytest.approx(p.ettr * p.run_s)
    assert p.interval_s == p.best_s > 20.0 and p.largest in p.badput and p.largest != "productive"
    assert p.badput[p.largest] == max(v for k, v in p.badput.items() if k != "productive")
    # a failure costs its restart and the lost work: restarts' parts are the share-weighted costs per failure
    assert p.badput["startup"] == pytest.approx(sum(p.failures.values()) * (0.7 * 60.0 + 0.3 * 120.0))
    # any other interval does worse
    for f in (0.5, 2.0):
        assert gp.project(p.run_s, 2048, 2e-5, _kinds(), 5.0, 20.0, interval_s=p.best_s * f).ettr < p.ettr


def test_bad_inputs_name_what_is_allowed():
    with pytest.raises(ValueError, match=r"sum to 0.9; they must sum to 1"):
        gp.project(86_400.0, 8, 1e-5, {"process": gp.FailureKind(0.9, {})}, stall_s=1.0)
    with pytest.raises(ValueError, match=r"devices=0: allowed is a finite number > 0"):
        gp.project(86_400.0, 0, 1e-5, _kinds(), stall_s=1.0)
    with pytest.raises(ValueError, match=r"mtbf_s=nan"):
        gp.ettr(10.0, 1.0, 1.0, math.nan)


def test_the_interval_is_never_shorter_than_the_background_write():
    """A save does not start before the previous one is written: with a write longer than the optimum interval,
    the projection checkpoints as often as the writes allow."""
    p = gp.project(86_400.0, 16_384, 2e-5, _kinds(), stall_s=2.0, lag_s=900.0)
    assert p.best_s < 900.0 and p.interval_s == 900.0


def test_plan_goodput_takes_every_cost_from_the_records_it_names(tmp_path):
    """scripts/plan.py --goodput on the flagship: the restart parts are the recovery record's phases (mean per kind,
    the rendezvous and restore replaced by scaled figures), the checkpoint stall and write are the checkpoint
    record's seconds per byte times the bytes per host, and a record with twice the restore time doubles the
    projected restore."""
    import io
    from pathlib import Path

    from msjax.planner.cli import RECORDS, run

    results = Path(__file__).resolve().parents[2] / "docs" / "results"
    argv = ["--config=gpt175b", "--devices=12288", "--goodput", "--run_days=30"]
    out = io.StringIO()
    g = run(argv, out=out)["goodput"]
    rec = json.loads((results / RECORDS["recovery_record"]).read_text())["result"]
    ckpt = json.loads((results / RECORDS["checkpoint_record"]).read_text())["result"]
    kill = next(r["phases"] for r in rec["recovery_phases"] if r["kind"] == "kill")
    costs = g["kinds"]["process"]["costs_s"]
    assert costs["detection"] == pytest.approx(kill["detect"])
    assert costs["compilation"] == pytest.approx(kill["compile_first_step"])
    assert costs["teardown"] == pytest.approx(kill["stop"] + kill["backoff"])
    scale = g["stall_s"] / ckpt["blocked_s"]  # bytes per host / the record's bytes
    assert g["lag_s"] == pytest.approx(ckpt["background_s"] * scale)
    assert costs["restore"] == pytest.approx(ckpt["restore_local_s"] * scale)
    assert g["kinds"]["host"]["costs_s"]["restore"] == pytest.approx(ckpt["restore_persistent_s"] * scale)
    assert g["interval_steps"] == pytest.approx(g["interval_s"] / g["step_s"])
    assert sum(g["badput_s"].values()) == pytest.approx(30 * 86_400.0) and 0.5 < g["ettr"] < 1.0
    text = out.getvalue()
    for name in RECORDS.values():
        assert f"docs/results/{name}" in text
    assert f"the largest loss: {g['largest']}" in text

    slow = dict(ckpt, restore_local_s=2 * ckpt["restore_local_s"],
                restore_persistent_s=2 * ckpt["restore_persistent_s"])
    path = tmp_path / "slow_restore.json"
    path.write_text(json.dumps({"result": slow}))
    g2 = run([*argv, f"--checkpoint_record={path}"], out=io.StringIO())["goodput"]
    assert g2["badput_s"]["restore"] == pytest.approx(2 * g["badput_s"]["restore"], rel=1e-6)
    assert str(path) in " ".join(g2["assumptions"]) and g2["ettr"] < g["ettr"]


@pytest.mark.parametrize("flag, message", [
    ("--failure_shares=process:0.5,host:0.2", r"the shares sum to 0.7; they must sum to 1"),
    ("--failure_shares=gpu:1", r"kinds: process, host, hang"),
    ("--run_days=0", r"--run_days=0.0, .*allowed are days > 0"),
    ("--recovery_record=/no/such.json", r"--recovery_record='/no/such.json': not a readable benchmark record"),
])
def test_plan_goodput_bad_flags_are_one_error_line(flag, message, capsys):
    from msjax.planner.cli import main

    assert main(["--config=gpt_tiny", "--devices=8", "--goodput", flag]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err, err
