"""A run's report: PNGs and an index.html beside them, from the files a run leaves in its directory.

Reads `config.json`, `metrics.jsonl`, `ranks/rank<i>.jsonl` + `.meta.json`, `ranks/windows.jsonl`,
`events.jsonl` and `goodput.json` (all optional but the per-rank rows or metrics.jsonl); writes into
`<run_dir>/report/`:

  heatmap_<figure>.png  a per-rank figure over mesh coordinates: one panel per pipeline stage, data x tensor inside
                        it (fsdp and sequence coordinates averaged), colour bar in milliseconds, stragglers outlined.
  curves.png            training loss and MFU against steps and against wall time (validation loss too).
  timeline.png          per-rank step time over steps, and per-rank window figures with straggler flags.
  goodput.png           where the wall time went (msjax.goodput's buckets): one stacked bar for the run, one per
                        attempt of a supervised run.
  expert_load.png       a mixture of experts' load, MoE layers x experts, at the first and last logging step
                        (`expert_load.jsonl`).
  index.html            the pictures, a summary, the goodput table and the straggler table.

Matplotlib (the Agg backend: no display needed) draws everything: a well-kept plotting library, no reason to own
one.
"""

from __future__ import annotations

import dataclasses

import html
import json
from pathlib import Path
from typing import Any

import numpy as np

from msjax.events import read_events
from msjax.goodput import BUCKETS, read_ledger
from msjax.observe.experts import EXPERT_LOAD_FILE
from msjax.sharding_rules.axes import MESH_AXES

# Heatmaps drawn when the data exists: figure key -> (title, source). "window" figures come from windows.jsonl
# (means over the run's windows), "step" figures from the per-rank rows (means over steps after compilation).
HEATMAPS = {
    "own_compute_s": ("own compute per step (forward and backward on its devices, timed inside the step)", "window"),
    "host_lag_s": ("host lag per step (the process could not run: stopped, throttled, descheduled)", "window"),
    "host_stall_s": ("host stall per step (devices waiting for this host)", "step"),
    "probe_s": ("collective-free compute probe, time per matmul (a second signal)", "window"),
    "compute_s": ("device time per step", "step"),
}


class ReportError(ValueError):
    """The run directory has nothing to report on."""


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_run(run_dir: str | Path) -> dict[str, Any]:
    """Everything the report draws, as plain Python values.

    Returns:
      dict with config (dict or {}), metrics (rows of metrics.jsonl), ranks (process -> list of per-step rows),
      meta (process -> meta dict), windows (rows of windows.jsonl), events (rows of events.jsonl), goodput (the
      ledger of goodput.json, or None), expert_load (rows of expert_load.jsonl: a mixture of experts' load).
    Raises:
      ReportError: `run_dir` is not a directory, or holds neither metrics.jsonl nor per-rank rows.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a directory")
    ranks, meta = {}, {}
    for f in sorted((run_dir / "ranks").glob("rank*.jsonl")):
        ranks[int(f.stem[4:])] = _jsonl(f)
    for f in sorted((run_dir / "ranks").glob("rank*.meta.json")):
        meta[int(f.name[4:].split(".")[0])] = json.loads(f.read_text())
    metrics = _jsonl(run_dir / "metrics.jsonl")
    if not metrics and not any(ranks.values()):
        raise ReportError(f"{run_dir} holds neither metrics.jsonl nor ranks/rank*.jsonl: not a run directory?")
    config = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").exists() else {}
    return {"config": config, "metrics": metrics, "ranks": ranks, "meta": meta,
            "windows": _jsonl(run_dir / "ranks" / "windows.jsonl"), "events": read_events(run_dir),
            "goodput": read_ledger(run_dir), "expert_load": _jsonl(run_dir / EXPERT_LOAD_FILE)}


def per_rank_figure(run: dict[str, Any], figure: str) -> dict[int, float] | None:
    """Process -> the figure's mean over the run (seconds), or None when the run has no such data."""
    source = HEATMAPS.get(figure, ("", "step"))[1]
    if source == "window":
        rows = [w for w in run["windows"] if figure in w["figures"]]
        if not rows:
            return None
        values = np.mean([w["figures"][figure] for w in rows], axis=0)
        return {p: float(v) for p, v in enumerate(values)}
    out = {}
    for p, rows in run["ranks"].items():
        vals = [r[figure] for r in rows if not r.get("compile") and figure in r]
        if vals:
            out[p] = float(np.mean(vals))
    return out or None


def mesh_grid(meta: dict[int, dict], values: dict[int, float]) -> tuple[np.ndarray, np.ndarray]:
    """Per-device values on the mesh, reduced to (pipeline, data, tensor).

    Args:
      meta: process -> meta dict with `mesh` (axis -> size) and `device_coords` (list of [pipeline, data, fsdp, expert,
        sequence, tensor] of each of its devices).
      values: process -> value.
    Returns:
      (grid_pdt, owner_pdt): mean value over fsdp, expert and sequence, and the owning process (-1 when several
      processes share the cell), both of shape (pipeline, data, tensor).
    """
    any_meta = next(iter(meta.values()))
    shape = [int(any_meta["mesh"].get(a, 1)) for a in MESH_AXES]
    grid = np.full(shape, np.nan)
    owner = np.full(shape, -1)
    expert = MESH_AXES.index("expert")
    for p, m in meta.items():
        for c in m["device_coords"]:
            if len(c) == len(MESH_AXES) - 1:  # a run from before the expert axis: its coordinate is 0
                c = [*c[:expert], 0, *c[expert:]]
            grid[tuple(c)] = values.get(p, np.nan)
            owner[tuple(c)] = p
    inner = (2, 3, 4)  # fsdp, expert, sequence
    grid_pdt = np.nanmean(grid, axis=inner) if not np.isnan(grid).all() else grid.mean(axis=inner)
    own = np.full(grid_pdt.shape, -1)
    for idx in np.ndindex(grid_pdt.shape):
        cell = np.unique(owner[idx[0], idx[1], :, :, :, idx[2]])
        own[idx] = cell[0] if len(cell) == 1 else -1
    return grid_pdt, own


def _stragglers(run: dict[str, Any]) -> set[int]:
    return {e["process"] for e in run["events"] if e.get("kind") == "straggler"}


def plot_heatmap(run: dict[str, Any], figure: str, path: Path) -> bool:
    """Draws the heatmap of `figure` (milliseconds) to `path`; False when the run has no data for it."""
    import matplotlib.pyplot as plt

    values = per_rank_figure(run, figure)
    if values is None or not run["meta"]:
        return False
    grid, owner = mesh_grid(run["meta"], {p: v * 1e3 for p, v in values.items()})
    stages, data, tensor = grid.shape
    slow = _stragglers(run)
    fig, axes = plt.subplots(1, stages, figsize=(max(6.5, 1.5 + 2.4 * stages * max(1, tensor / 2)),
                                                 2.2 + 0.9 * data), squeeze=False, constrained_layout=True)
    vmin, vmax = float(np.nanmin(grid)), float(np.nanmax(grid))
    if vmax - vmin < 1e-6 * max(abs(vmax), 1e-9):  # one value everywhere (e.g. one process): a visible range
        vmin, vmax = vmin * 0.9, vmax * 1.1 + 1e-9
    for s in range(stages):
        ax = axes[0, s]
        im = ax.imshow(grid[s], cmap="viridis", vmin=vmin, vmax=vmax, aspect="auto")
        ax.set_title(f"pipeline stage {s}", fontsize=10)
        ax.set_xlabel("tensor coordinate")
        ax.set_ylabel("data coordinate")
        ax.set_xticks(range(tensor))
        ax.set_yticks(range(data))
        for d in range(data):
            for t in range(tensor):
                p = owner[s, d, t]
                label = f"{grid[s, d, t]:.3g}" + (f"\np{p}" if p >= 0 else "")
                ax.text(t, d, label, ha="center", va="center", fontsize=8,
                        color="white" if grid[s, d, t] < (vmin + vmax) / 2 else "black")
                if p in slow:
                    ax.add_patch(plt.Rectangle((t - 0.5, d - 0.5), 1, 1, fill=False, edgecolor="red", lw=3))
    bar = fig.colorbar(im, ax=axes[0, :].tolist(), label=f"{figure.removesuffix('_s')} (ms)")
    bar.formatter.set_useOffset(False)
    bar.update_ticks()
    title = HEATMAPS.get(figure, (figure, ""))[0]
    fig.suptitle(f"{title}\nmean per process over the mesh, ms" + (" (red box: straggler)" if slow else ""),
                 fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_curves(run: dict[str, Any], path: Path) -> bool:
    """Loss and MFU against steps and wall time (minutes since the first step), from process 0's rows."""
    import matplotlib.pyplot as plt

    rows = [r for r in run["ranks"].get(0, []) if not r.get("compile")]
    if rows:
        steps = np.array([r["step"] for r in rows])
        wall = (np.array([r["time"] for r in rows]) - rows[0]["time"]) / 60
        loss, mfu = np.array([r["loss"] for r in rows]), np.array([r["mfu"] for r in rows]) * 100
    else:  # a run without per-rank rows: the loop's log steps (no wall clock there)
        rows = [r for r in run["metrics"] if "loss" in r]
        if not rows:
            return False
        steps = np.array([r["step"] for r in rows])
        wall, loss, mfu = None, np.array([r["loss"] for r in rows]), np.array([r["mfu"] for r in rows]) * 100
    val = [(r["step"], r["val_loss"], r.get("wall_s")) for r in run["metrics"] if "val_loss" in r]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    for col, (x, xlabel) in enumerate(((steps, "step"), (wall, "wall time since first step (min)"))):
        ax_l, ax_m = axes[0, col], axes[1, col]
        if x is None:
            for ax in (ax_l, ax_m):
                ax.text(0.5, 0.5, "no wall-clock data (observe.per_rank off)", ha="center", transform=ax.transAxes)
            continue
        ax_l.plot(x, loss, lw=1, label="train loss")
        if val and col == 0:
            ax_l.plot([v[0] for v in val], [v[1] for v in val], "o-", label="validation loss")
        ax_l.set_xlabel(xlabel)
        ax_l.set_ylabel("loss (nats/token)")
        ax_l.legend()
        ax_l.grid(alpha=0.3)
        ax_m.plot(x, mfu, lw=1, color="tab:green")
        ax_m.set_xlabel(xlabel)
        ax_m.set_ylabel("MFU (%)")
        ax_m.grid(alpha=0.3)
    fig.suptitle("loss and model FLOPs utilisation (per step, process 0)")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_expert_load(run: dict[str, Any], path: Path) -> bool:
    """A mixture of experts' load as a heatmap of MoE layers x experts: each expert's share of its layer's
    assignments over the mean share (1: even), at the first and the last logging step side by side
    (`expert_load.jsonl`, `msjax.observe.experts`); False when the run has none."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = run["expert_load"]
    if not rows:
        return False
    picks = [rows[0], rows[-1]] if len(rows) > 1 else rows[-1:]
    grids = [np.asarray(r["load"]) * np.asarray(r["load"]).shape[-1] for r in picks]
    vmax = max(float(g.max()) for g in grids)
    fig, axes = plt.subplots(1, len(grids), figsize=(5.5 * len(grids), 4), constrained_layout=True, squeeze=False)
    for ax, grid, row in zip(axes[0], grids, picks):
        im = ax.imshow(grid, cmap="magma", vmin=0.0, vmax=vmax, aspect="auto")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("expert")
        ax.set_ylabel("MoE layer")
        ax.set_title(f"step {row['step']}: max {grid.max():.2f} x the mean share")
    fig.colorbar(im, ax=list(axes[0]), label="share of the layer's assignments / mean share")
    fig.suptitle("expert load (mixture of experts)")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_timeline(run: dict[str, Any], path: Path) -> bool:
    """Per-rank step time over steps, and per-rank window figures (own compute, host lag) with straggler marks."""
    import matplotlib.pyplot as plt

    if not any(run["ranks"].values()):
        return False
    panels = 2 if run["windows"] else 1
    fig, axes = plt.subplots(panels, 1, figsize=(11, 3.6 * panels), squeeze=False, constrained_layout=True)
    ax = axes[0, 0]
    for p, rows in sorted(run["ranks"].items()):
        rows = [r for r in rows if not r.get("compile")]
        ax.plot([r["step"] for r in rows], [r["step_s"] * 1e3 for r in rows], lw=1, label=f"process {p} step")
        ax.plot([r["step"] for r in rows], [r["host_stall_s"] * 1e3 for r in rows], lw=1, ls=":",
                label=f"process {p} host stall")
    ax.set_xlabel("step")
    ax.set_yscale("symlog", linthresh=1.0)  # compilation, eval and checkpoint steps are 10-1000x the rest
    ax.set_ylabel("time per step (ms, log above 1)")
    ax.set_title("per-rank step time (equal on all ranks of a synchronous step) and host stall (the rank's own)")
    ax.legend(fontsize=8, ncol=2)
    ax.grid(alpha=0.3)
    if panels == 2:
        ax = axes[1, 0]
        wsteps = [w["step"] for w in run["windows"]]
        for figure, style in (("own_compute_s", "o-"), ("host_lag_s", "s:")):
            values = np.array([w["figures"].get(figure, [0.0]) for w in run["windows"]]) * 1e3  # (W, P)
            for p in range(values.shape[1]):
                ax.plot(wsteps, values[:, p], style, color=f"C{p}",
                        label=f"process {p} {figure.removesuffix('_s').replace('_', ' ')}")
        for e in run["events"]:
            if e.get("kind") == "straggler":
                ax.axvline(e["step"], color="red", ls="--", lw=1)
                ax.text(e["step"], ax.get_ylim()[1], f" straggler: process {e['process']}", color="red",
                        va="top", fontsize=8)
        ax.set_xlabel("step (end of window)")
        ax.set_ylabel("ms per step (window mean)")
        ax.set_title("per-rank own compute and host lag per window (the straggler's are larger)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# One colour per bucket, the same in every bar: productive green, the rest by kind of loss.
GOODPUT_COLOURS = {"productive": "tab:green", "startup": "tab:blue", "compilation": "tab:cyan",
                   "data_wait": "tab:olive", "checkpoint": "tab:purple", "evaluation": "tab:pink",
                   "straggler": "tab:orange", "recomputed": "tab:red", "restart": "tab:brown", "teardown": "tab:gray"}


def plot_goodput(run: dict[str, Any], path: Path) -> bool:
    """Stacked horizontal bars of the goodput ledger's buckets (seconds): the whole run, then each attempt of a
    supervised run. False when the run wrote no goodput.json."""
    import matplotlib.pyplot as plt

    ledger = run.get("goodput")
    if not ledger:
        return False
    bars = [("run", ledger["buckets"])] + [(f"attempt {a['attempt']}", a["buckets"])
                                          for a in ledger.get("attempts", [])]
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.5 * len(bars)), constrained_layout=True)
    labelled = set()
    for y, (_, buckets) in enumerate(bars):
        left = 0.0
        for k in BUCKETS:
            v = buckets.get(k, 0.0)
            if v > 0:
                ax.barh(y, v, left=left, color=GOODPUT_COLOURS[k], label=None if k in labelled else k,
                        edgecolor="white", lw=0.5)
                labelled.add(k)
                left += v
    ax.set_yticks(range(len(bars)), [name for name, _ in bars])
    ax.invert_yaxis()
    ax.set_xlabel("wall time (s)")
    ettr = ledger.get("ettr")
    ax.set_title(f"where the wall time went: {ledger['wall_s']:.1f} s, effective training time ratio "
                 f"{(ettr or 0):.1%}")
    ax.legend(fontsize=8, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(bars) < 3 else -0.15))
    ax.grid(alpha=0.3, axis="x")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Writes the PNGs and index.html; returns the path of index.html.

    Raises ReportError (see `load_run`).
    """
    import matplotlib

    matplotlib.use("Agg")
    run_dir = Path(run_dir)
    run = load_run(run_dir)
    out = Path(out_dir) if out_dir else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    images = []
    for figure in HEATMAPS:
        if plot_heatmap(run, figure, out / f"heatmap_{figure.removesuffix('_s')}.png"):
            images.append((f"heatmap_{figure.removesuffix('_s')}.png", HEATMAPS[figure][0]))
    if plot_curves(run, out / "curves.png"):
        images.append(("curves.png", "loss and MFU"))
    if plot_timeline(run, out / "timeline.png"):
        images.append(("timeline.png", "per-rank timeline"))
    if plot_goodput(run, out / "goodput.png"):
        images.append(("goodput.png", "goodput: where the wall time went"))
    if plot_expert_load(run, out / "expert_load.png"):
        images.append(("expert_load.png", "expert load: each expert's share of its layer's tokens"))
    (out / "index.html").write_text(_html(run_dir, run, images))
    return out / "index.html"


def _html(run_dir: Path, run: dict[str, Any], images: list[tuple[str, str]]) -> str:
    cfg = run["config"]
    rows0 = [r for r in run["ranks"].get(0, []) if not r.get("compile")]
    summary = [("run", str(run_dir)), ("config", cfg.get("name", "?")),
               ("mesh", json.dumps(next(iter(run["meta"].values()))["mesh"]) if run["meta"] else "?"),
               ("processes", str(len(run["ranks"]) or 1))]
    if rows0:
        summary += [("steps", f"{rows0[0]['step']}..{rows0[-1]['step']}"),
                    ("final loss", f"{rows0[-1]['loss']:.4f}"),
                    ("median step time", f"{np.median([r['step_s'] for r in rows0]) * 1e3:.1f} ms"),
                    ("median MFU", f"{np.median([r['mfu'] for r in rows0]):.2%}")]
    strag = [e for e in run["events"] if e.get("kind") == "straggler"]
    table = "".join(
        f"<tr><td>{e['step']}</td><td>{e['process']}</td><td>{html.escape(e.get('host', ''))}</td>"
        f"<td>{html.escape(', '.join(f'{a} {v}' for a, v in e.get('coords', {}).items()))}</td>"
        f"<td>{html.escape(json.dumps(e.get('scores', {})))}</td></tr>" for e in strag)
    ledger = run.get("goodput")
    goodput = ""
    if ledger:
        wall = ledger["wall_s"] or 1.0
        goodput = ("<h2>Goodput</h2><table><tr><th>bucket</th><th>seconds</th><th>share of wall time</th></tr>"
                   + "".join(f"<tr><td>{k}</td><td>{v:.2f}</td><td>{v / wall:.1%}</td></tr>"
                             for k, v in ledger["buckets"].items())
                   + f"<tr><th>wall</th><td>{ledger['wall_s']:.2f}</td><td>ETTR {(ledger['ettr'] or 0):.1%}</td>"
                   "</tr></table>")
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>msjax run report</title><style>"
        "body{font-family:sans-serif;margin:2em}td,th{border:1px solid #ccc;padding:4px 8px}"
        "table{border-collapse:collapse}img{max-width:100%;border:1px solid #eee}</style></head><body>"
        f"<h1>msjax run report: {html.escape(cfg.get('name', run_dir.name))}</h1><table>"
        + "".join(f"<tr><th>{k}</th><td>{html.escape(v)}</td></tr>" for k, v in summary) + "</table>"
        + goodput + "<h2>Stragglers</h2>"
        + (f"<table><tr><th>step</th><th>process</th><th>host</th><th>mesh coordinates</th>"
           f"<th>slowdown vs others' median</th></tr>{table}</table>" if strag else "<p>none flagged</p>")
        + "".join(f"<h2>{html.escape(t)}</h2><img src='{f}' alt='{html.escape(t)}'>" for f, t in images)
        + "</body></html>\n")


@dataclasses.dataclass(frozen=True)
class ReportOptions:
    """The report command's flags; RUN_DIR, the run directory to draw, is its one positional argument.

    Attributes:
      out: the directory for the PNGs and index.html; empty: RUN_DIR/report/.
    """

    out: str = ""


_TAKES_VALUE = ("--out", "--log_level")  # flags that may take their value as the next argument


def main(argv: list[str] | None = None) -> int:
    """The report command (`msjax-report RUN_DIR [--out=DIR]`, scripts/report.py): writes `write_report`'s
    pictures and prints the index.html path. Returns 0, or 2 after one `error: ...` line (a bad flag, no run)."""
    import sys

    from msjax import cli
    from msjax.config import ConfigError

    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        flags, run_dirs, rest = [], [], list(argv)
        while rest:
            arg = rest.pop(0)
            if not arg.startswith("-"):
                run_dirs.append(arg)
                continue
            flags.append(arg)
            if arg in _TAKES_VALUE and rest:
                flags.append(rest.pop(0))
        common, opts = cli.parse_options(flags, ReportOptions(), prog="msjax-report RUN_DIR",
                                         description=main.__doc__)
        cli.setup_logging(common)
        if len(run_dirs) != 1:
            raise ConfigError(f"report takes one RUN_DIR (a run directory); got {run_dirs or 'none'}")
        try:
            index = write_report(run_dirs[0], opts.out or None)
        except ReportError as e:
            raise ConfigError(str(e)) from None
        print(index)
        return 0

    return cli.main_guard(body)
