"""bench.py's step mode: its figures follow from the step it timed, and --trace writes a profiler trace."""

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
    assert row["params"] == 810_752 and row["step_s"] > 0 and row["compile_s"] > 0
    assert row["tokens_per_s"] == pytest.approx(tokens / row["step_s"], rel=1e-12)
    assert row["model_flops_per_step"] == pytest.approx(flops_per_token(cfg.model, cfg.train.seq_len) * tokens,
                                                        rel=1e-12)
    assert row["mfu"] == pytest.approx(row["model_flops_per_step"] / row["step_s"] / row["peak_flops"], rel=1e-12)
    assert list((tmp_path / "trace").rglob("*.xplane.pb")), "no profiler trace written"
