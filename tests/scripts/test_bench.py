"""bench.py's step mode: its figures follow from the step it timed, --trace writes a profiler trace, and --vs
times the step with and without overrides in alternating windows."""

import json
import statistics

import pytest

from msjax.config import apply_overrides, load_preset
from msjax.flops import flops_per_token
from tests.scripts.loader import load_script

benchmark = load_script("bench").benchmark


def test_step_figures_follow_from_the_timed_step_and_a_trace_is_written(tmp_path):
    cfg = apply_overrides(load_preset("shakespeare_char"), {"model.vocab_size": 65, "mesh.data": -1,
                                                             "train.global_batch": 16}).validate()  # 8 devices
    row = benchmark(cfg, steps=2, warmup=1, repeats=2, trace_dir=str(tmp_path / "trace"))
    tokens = cfg.train.global_batch * cfg.train.seq_len
    assert row["params"] == 804_992 and row["step_s"] > 0 and row["compile_s"] > 0
    assert row["tokens_per_s"] == pytest.approx(tokens / row["step_s"], rel=1e-12)
    assert row["model_flops_per_step"] == pytest.approx(flops_per_token(cfg.model, cfg.train.seq_len) * tokens,
                                                        rel=1e-12)
    assert row["mfu"] == pytest.approx(row["model_flops_per_step"] / row["step_s"] / row["peak_flops"], rel=1e-12)
    assert list((tmp_path / "trace").rglob("*.xplane.pb")), "no profiler trace written"


def test_vs_times_the_step_with_and_without_the_overrides_in_alternating_windows(tmp_path):
    bench = load_script("bench")
    json_path = tmp_path / "vs.json"
    # Through the command line, as a user gives it: the overrides must reach the second program (a narrower
    # model has fewer parameters) and bench.py's own flags must stay out of both configs.
    assert bench.main(["--config=shakespeare_char", "--model.vocab_size=65", "--mesh.data=-1",  # 8 devices
                       "--train.global_batch=16", "--steps=2", "--repeats=3",
                       "--vs=--model.d_model=64 --model.num_heads=2", f"--json={json_path}"]) == 0
    row = json.loads(json_path.read_text())
    assert row["overrides"] == "--model.d_model=64 --model.num_heads=2"
    # nanoGPT's shapes at width 64 without biases: tied 72 x 64 embedding, 64 x 64 positions, per layer
    # 4 * 64^2 + 2 * 64 * 256 weights and two layernorm scales, a final layernorm scale
    narrow = 72 * 64 + 64 * 64 + 4 * (4 * 64 * 64 + 2 * 64 * 256 + 2 * 64) + 64
    assert row["base_params"] == 804_992 and row["vs_params"] == narrow == 205_888, row
    assert len(row["base_s"]) == len(row["vs_s"]) == row["repeats"] == 3 and min(row["base_s"] + row["vs_s"]) > 0
    ratios = [v / b for v, b in zip(row["vs_s"], row["base_s"])]
    assert row["ratio"] == pytest.approx(statistics.median(ratios), rel=1e-12)
    assert row["faster_rounds"] == sum(r < 1 for r in ratios)
    assert row["base_step_s"] == pytest.approx(statistics.median(row["base_s"]), rel=1e-12)


def test_alternating_windows_reverses_the_order_every_round_and_carries_each_state():
    bench = load_script("bench")
    order = []

    def arm(name):
        def step(state, batch):
            order.append(name)
            return state + 1, state
        return step

    # b runs 2 steps per call (train.steps_per_execution): a window of 2 steps is one call of it
    arms = {"a": [arm("a"), 0, None, 1], "b": [arm("b"), 100, None, 2]}
    times = bench.alternating_windows(arms, steps=2, repeats=3)
    assert len(times["a"]) == len(times["b"]) == 3
    # round 0 (warm-up, 3 calls each) runs b then a; then a b, b a, a b
    rounds = ["b"] * 3 + ["a"] * 3 + ["a"] * 2 + ["b"] + ["b"] + ["a"] * 2 + ["a"] * 2 + ["b"]
    assert order == rounds
    assert arms["a"][1] == 3 + 6 and arms["b"][1] == 100 + 3 + 3  # each arm's state carried across its windows
