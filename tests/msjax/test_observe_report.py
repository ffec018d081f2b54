"""scripts/report.py on a synthetic 4-process run directory (random per-rank rows, pipeline 2 x data 2 x tensor 2
mesh, process 3 flagged) and on a missing directory: the grid puts each process's value on its devices, every
picture is written, index.html lists the straggler."""

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from msjax.events import append_event
from msjax.observe.report import load_run, mesh_grid, per_rank_figure, write_report

ROOT = Path(__file__).resolve().parents[2]
MESH = {"pipeline": 2, "data": 2, "fsdp": 1, "sequence": 1, "tensor": 2}


def _synthetic_run(run_dir: Path) -> dict[int, float]:
    rng = np.random.default_rng(0)
    ranks = run_dir / "ranks"
    ranks.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({"name": "synthetic"}))
    # process p drives the 2 tensor devices of (stage p // 2, data p % 2)
    probe = {p: 0.02 * (1 + 0.05 * rng.standard_normal()) * (2.0 if p == 3 else 1.0) for p in range(4)}
    t0 = time.time()
    for p in range(4):
        coords = [[p // 2, p % 2, 0, 0, t] for t in range(2)]
        (ranks / f"rank{p}.meta.json").write_text(json.dumps(
            {"process": p, "host": "h", "coords": {}, "devices": [2 * p, 2 * p + 1], "device_coords": coords,
             "mesh": MESH}))
        with open(ranks / f"rank{p}.jsonl", "w") as f:
            for s in range(1, 41):
                step_s = 0.1 * (1 + 0.1 * rng.random())
                f.write(json.dumps({"step": s, "time": t0 + 0.1 * s, "step_s": step_s, "compute_s": step_s * 0.9,
                                    "host_stall_s": 0.001 * rng.random(), "loss": 5 - 0.05 * s + 0.1 * rng.random(),
                                    "mfu": 0.3 + 0.02 * rng.random(), **({"compile": True} if s == 1 else {})})
                        + "\n")
    with open(ranks / "windows.jsonl", "w") as f:
        for w in range(1, 5):
            figs = [probe[p] * (1 + 0.02 * rng.standard_normal()) for p in range(4)]
            f.write(json.dumps({"step": 10 * w, "figures": {"probe_s": figs}, "stragglers": []}) + "\n")
    with open(run_dir / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 20, "val_loss": 4.5, "wall_s": 3.0}) + "\n")
    append_event(run_dir, "straggler", step=20, process=3, host="h", coords={"pipeline": [1], "data": [1]},
                 scores={"probe_s": 2.0})
    return probe


def test_grid_places_each_process_on_its_devices(tmp_path):
    _synthetic_run(tmp_path)
    run = load_run(tmp_path)
    values = per_rank_figure(run, "probe_s")
    grid, owner = mesh_grid(run["meta"], values)
    assert grid.shape == (2, 2, 2)
    for p in range(4):
        np.testing.assert_allclose(grid[p // 2, p % 2], values[p])
        assert (owner[p // 2, p % 2] == p).all()
    assert max(values, key=values.get) == 3


def test_report_script_writes_pictures_and_lists_the_straggler(tmp_path):
    _synthetic_run(tmp_path / "run")
    proc = subprocess.run([sys.executable, "scripts/report.py", str(tmp_path / "run")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "run" / "report"
    for name in ("heatmap_probe.png", "heatmap_host_stall.png", "curves.png", "timeline.png"):
        assert (out / name).stat().st_size > 10_000, name
    page = (out / "index.html").read_text()
    assert "<td>20</td><td>3</td>" in page and "heatmap_probe.png" in page
    bad = subprocess.run([sys.executable, "scripts/report.py", str(tmp_path / "missing")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error:")


def test_empty_directory_is_an_error(tmp_path):
    from msjax.observe.report import ReportError

    with pytest.raises(ReportError, match="neither metrics.jsonl"):
        write_report(tmp_path)


def test_heatmap_has_a_panel_per_stage_with_data_by_tensor_and_a_colour_bar_in_ms(tmp_path, monkeypatch):
    import matplotlib.figure

    from msjax.observe.report import plot_heatmap

    _synthetic_run(tmp_path)
    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    assert plot_heatmap(load_run(tmp_path), "probe_s", tmp_path / "h.png")
    (fig,) = saved
    panels = [ax for ax in fig.axes if ax.get_title().startswith("pipeline stage")]
    assert [ax.get_title() for ax in panels] == ["pipeline stage 0", "pipeline stage 1"]
    for s, ax in enumerate(panels):
        assert (ax.get_xlabel(), ax.get_ylabel()) == ("tensor coordinate", "data coordinate")
        shown = ax.get_images()[0].get_array()
        assert shown.shape == (2, 2)  # data x tensor
        for d in range(2):  # each process's mean probe time (ms) on both of its tensor devices
            np.testing.assert_allclose(shown[d], 1e3 * per_rank_figure(load_run(tmp_path), "probe_s")[2 * s + d])
        # the straggler (process 3: stage 1, data 1) is boxed in red
        boxed = [(p.get_x(), p.get_y()) for p in ax.patches if p.get_edgecolor()[:3] == (1.0, 0.0, 0.0)]
        assert boxed == ([(-0.5, 0.5), (0.5, 0.5)] if s == 1 else []), boxed
    bars = [ax for ax in fig.axes if ax not in panels]
    assert len(bars) == 1 and bars[0].get_ylabel() == "probe (ms)"


def test_goodput_is_drawn_as_one_stacked_bar_per_attempt_and_tabled(tmp_path, monkeypatch):
    import matplotlib.figure

    from msjax.goodput import BUCKETS, write_ledger
    from msjax.observe.report import plot_goodput

    _synthetic_run(tmp_path)
    rng = np.random.default_rng()
    attempts = [{"attempt": a, "buckets": {k: float(rng.uniform(0.5, 5)) for k in BUCKETS}} for a in range(2)]
    total = {k: sum(a["buckets"][k] for a in attempts) for k in BUCKETS}
    wall = sum(total.values())
    write_ledger(tmp_path, {"source": "supervisor", "wall_s": wall, "buckets": total,
                            "ettr": total["productive"] / wall, "unaccounted_s": 0.0, "attempts": attempts})
    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    assert plot_goodput(load_run(tmp_path), tmp_path / "g.png")
    (fig,) = saved
    (ax,) = fig.axes
    rects = ax.patches
    assert len(rects) == 3 * len(BUCKETS)  # the run, then each attempt, every bucket a segment
    for y, buckets in enumerate([total] + [a["buckets"] for a in attempts]):
        row = [r for r in rects if abs(r.get_y() + r.get_height() / 2 - y) < 1e-9]
        np.testing.assert_allclose([r.get_width() for r in row], [buckets[k] for k in BUCKETS], rtol=1e-12)
        np.testing.assert_allclose(row[-1].get_x() + row[-1].get_width(), sum(buckets.values()), rtol=1e-12)
    assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == sorted(BUCKETS)
    monkeypatch.undo()
    page = (write_report(tmp_path)).read_text()
    assert "goodput.png" in page and f"<td>productive</td><td>{total['productive']:.2f}</td>" in page
    assert (tmp_path / "report" / "goodput.png").stat().st_size > 10_000
