"""Measured figures, kept as JSON and rendered to docs/results.md.

Record: `python scripts/results.py --record=NAME -- python scripts/bench.py --config=shakespeare_char ...` runs the
benchmark command, takes the JSON line it prints last (every benchmark script ends with one, msjax.cli.print_result)
and writes `docs/results/NAME.json`: the command, the machine (CPU model and cores, GPU model when there is one,
the 1-minute load average when it started), the date (UTC), the versions of jax and msjax's commit, and the
result. The table of docs/results.md is then rendered again.

Render: `python scripts/results.py` writes docs/results.md from every `docs/results/*.json`, one row each, with its
command, machine and date; `--check` only says whether docs/results.md is up to date (exit 1 when not), as the
test suite does. Nothing in docs/results.md is edited by hand.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "docs" / "results"
RESULTS_MD = REPO / "docs" / "results.md"

# The figures each benchmark's row shows, by the script its command runs: (label, key path, format). A result
# without a known script (or whose keys are missing) shows its top-level numbers instead.
HEADLINES: dict[str, list[tuple[str, str, str]]] = {
    "bench.py": [("step", "step_s", "{:.4f} s"), ("tokens/s", "tokens_per_s", "{:,.0f}"), ("MFU", "mfu", "{:.1%}"),
                 ("of peak", "peak_flops", "{:.3g} FLOP/s"), ("msjax step", "msjax_step_s", "{:.4f} s"),
                 ("plain JAX step", "plain_step_s", "{:.4f} s"),
                 ("msjax / plain JAX", "ratio", "{:.3f}"), ("msjax wall", "summary.msjax_wall_s", "{:.1f} s"),
                 ("reference wall", "summary.reference_wall_s", "{:.1f} s"),
                 ("msjax / reference wall", "summary.wall_ratio", "{:.3f}"),
                 ("val loss", "summary.msjax_val_loss", "{:.4f}")],
    "bench_convert.py": [("HF -> msjax", "import_seconds", "{:.1f} s"), ("msjax -> HF", "export_seconds", "{:.1f} s"),
                         ("baseline (safetensors read)", "baseline_seconds", "{:.2f} s"),
                         ("import peak RSS", "import_peak_rss_bytes", "{:.3g} B")],
    "bench_checkpoint.py": [("state", "state_bytes", "{:.3g} B"), ("save blocks the loop", "blocked_s", "{:.3f} s"),
                            ("of a synchronous save", "blocked_fraction_of_sync", "{:.1%}"),
                            ("write in background", "background_s", "{:.2f} s"),
                            ("restore, local tier", "restore_local_s", "{:.2f} s"),
                            ("restore, persistent tier", "restore_persistent_s", "{:.2f} s"),
                            ("verification's share of a restore", "verify_fraction_of_restore_persistent",
                             "{:.1%}")],
    "bench_recovery.py": [("measured ETTR", "projection_check.measured_ettr", "{:.1%}"),
                          ("projected from the run's own rate and costs", "projection_check.ettr", "{:.1%}"),
                          ("projected - measured", "projection_check.difference_points", "{:+.1f} points"),
                          ("job MTBF", "projection_check.mtbf_s", "{:.1f} s"),
                          ("ETTR at one fault per 5 min", "ettr_one_fault_per_5min", "{:.1%}"),
                          ("mean cost of a fault", "mean_fault_cost_s", "{:.1f} s"), ("step", "step_s", "{:.3f} s")],
    "bench_observe.py": [("overhead", "overhead", "{:+.2%}"), ("95% CI high", "overhead_ci95.1", "{:+.2%}"),
                         ("CPU overhead", "cpu_overhead", "{:+.2%}"), ("plain step", "plain_step_s", "{:.4f} s")],
}


# Benchmarks whose result holds a list of rows: the list's key, each row's label (a format string over the row's
# fields), the figure shown and its format.
ROW_FIGURES: dict[str, tuple[str, str, str, str]] = {
    "bench_init.py": ("rows", "{store} {what} at {ranks} ranks", "seconds", "{:.4f} s"),
    "bench_attention.py": ("rows", "{impl} T={seq_len} W={window} fwd+bwd", "fwd_bwd_s", "{:.4f} s"),
    "bench_generate.py": ("rows", "batch {batch} {mode}", "tokens_per_s", "{:,.0f} tokens/s"),
    "bench_generate_memory.py": ("rows", "{mode}: peak over baseline / parameters", "ratio_to_params", "{:.2f}x"),
    "bench_parallel.py": ("rows", "{layout} {mode} ({tree})", "step_s", "{:.4f} s"),
    "bench_recovery.py": ("faults", "{kind} fault: detected in {detection_s:.2f} s, recovered in", "recovery_s",
                          "{:.1f} s"),
}


class ResultsError(ValueError):
    """A record or a results file msjax cannot use (names it and what is allowed)."""


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if isinstance(obj, dict) and part in obj:
            obj = obj[part]
        elif isinstance(obj, list) and part.isdigit() and int(part) < len(obj):
            obj = obj[int(part)]
        else:
            return None
    return obj


# Instruction-set extensions that change what a CPU's matmuls run at (machines with the same model name differ).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def cpu_flags() -> list[str]:
    """Which of CPU_FLAGS /proc/cpuinfo lists (empty where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                present = set(line.split(":", 1)[1].split())
                return [f for f in CPU_FLAGS if f in present]
    except OSError:
        pass
    return []


def gpu_models() -> list[str]:
    """The GPUs' names from `nvidia-smi` (empty without NVIDIA GPUs)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def machine() -> dict[str, Any]:
    """What ran a benchmark: CPU model, its matmul-relevant flags and logical cores, GPU models, the 1-minute load
    average."""
    from msjax.hardware import cpu_model  # imported here: rendering docs/results.md needs no jax
    return {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "cores": os.cpu_count(), "gpus": gpu_models(),
            "load_1min": round(os.getloadavg()[0], 2)}


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def last_json(stdout: str, command: str) -> dict[str, Any]:
    """The last line of `stdout` that parses as a JSON object.

    Raises:
      ResultsError: there is none (names the command).
    """
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    raise ResultsError(f"{command}: printed no JSON object line; allowed is a benchmark script that ends with one "
                       "(msjax.cli.print_result)")


def record(name: str, command: Sequence[str], timeout_s: float = 3600.0, results_dir: Path = RESULTS_DIR
           ) -> Path:
    """Runs `command` (stdout captured, stderr passed through) and writes `results_dir/name.json`.

    Raises:
      ResultsError: a name that is not a plain file stem, a command that fails or prints no JSON line.
      subprocess.TimeoutExpired: it ran longer than `timeout_s` seconds (the child is killed).
    """
    if not name or name != Path(name).name or name.startswith(".") or not name.replace("-", "_").isidentifier():
        raise ResultsError(f"--record={name!r}: allowed is a name of letters, digits, '_' and '-' (the file stem)")
    if not command:
        raise ResultsError("--record needs the benchmark command after '--'")
    text = shlex.join(command)
    started = datetime.datetime.now(datetime.timezone.utc)
    where = machine()
    proc = subprocess.run(list(command), cwd=REPO, stdout=subprocess.PIPE, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise ResultsError(f"{text}: exited with status {proc.returncode}; nothing was recorded")
    import importlib.metadata

    row = {"name": name, "command": text, "date": started.strftime("%Y-%m-%d %H:%M UTC"), "machine": where,
           "jax": importlib.metadata.version("jax"), "commit": _commit(), "result": last_json(proc.stdout, text)}
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.json"
    path.write_text(json.dumps(row, indent=1) + "\n")
    return path


REQUIRED = ("name", "command", "date", "machine", "result")


def load(results_dir: Path = RESULTS_DIR) -> list[dict[str, Any]]:
    """Every record in `results_dir`, sorted by name.

    Raises:
      ResultsError: a file that is not JSON or lacks one of REQUIRED (names the file and the key).
    """
    rows = []
    for path in sorted(results_dir.glob("*.json")):
        try:
            row = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ResultsError(f"{path}: not JSON ({e})") from None
        missing = [k for k in REQUIRED if k not in row] if isinstance(row, dict) else list(REQUIRED)
        if missing:
            raise ResultsError(f"{path}: missing {', '.join(missing)}; a record holds {', '.join(REQUIRED)}")
        rows.append(row)
    return sorted(rows, key=lambda r: r["name"])


# Scripts that run another command (scripts/README.md): a record's benchmark is the command they run.
WRAPPERS = ("refuse_amx.py",)


def script_of(command: str) -> str:
    """The scripts/*.py benchmark a command runs, behind any of WRAPPERS ("" when none)."""
    for word in shlex.split(command):
        if word.endswith(".py") and Path(word).name not in WRAPPERS:
            return Path(word).name
    return ""


def figures(row: dict[str, Any]) -> str:
    """The row's headline figures: its script's HEADLINES present in the result and its ROW_FIGURES, else its
    top-level numbers."""
    result, script = row["result"], script_of(row["command"])
    shown = [f"{label} {fmt.format(v)}" for label, key, fmt in HEADLINES.get(script, [])
             if isinstance(v := _get(result, key), (int, float)) and not isinstance(v, bool)]
    if script in ROW_FIGURES and isinstance(result.get(ROW_FIGURES[script][0]), list):
        rows, label, key, fmt = ROW_FIGURES[script]
        shown += [f"{label.format_map(collections.defaultdict(str, r))} {fmt.format(r[key])}"
                  for r in result[rows] if isinstance(r, dict) and isinstance(r.get(key), (int, float))]
    if not shown:
        shown = [f"{k} {v:.4g}" for k, v in result.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool)][:8]
    return ", ".join(shown) or "-"


def describe_machine(m: dict[str, Any]) -> str:
    gpus = m.get("gpus") or []
    gpu = f"{len(gpus)} x {gpus[0]}, " if gpus else ""
    flags = f", {' '.join(m['cpu_flags'])}" if m.get("cpu_flags") else ""
    return f"{gpu}{m.get('cpu', 'unknown CPU')} ({m.get('cores', '?')} cores{flags}), load {m.get('load_1min', '?')}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(rows: list[dict[str, Any]]) -> str:
    """docs/results.md's text for `rows` (from `load`)."""
    lines = ["# Measured results", "",
             "Generated by `python scripts/results.py` from the records in `docs/results/*.json`; do not edit by "
             "hand. Record a new one with `python scripts/results.py --record=NAME -- <benchmark command>`. Each "
             "row names the command that measured it, the machine it ran on and when. Timings on a shared machine "
             "move with its load: compare figures measured side by side in one command (the ratios), not rows "
             "of different machines or dates.", ""]
    if not rows:
        return "\n".join(lines + ["No results recorded yet.", ""])
    lines += ["| result | figures | command | machine | date |", "|---|---|---|---|---|"]
    for r in rows:
        # Under refuse_amx.py the CPU still lists its AMX flags; the machine column says the command had none.
        refused = " (AMX refused)" if "refuse_amx.py" in r["command"] else ""
        lines.append("| " + " | ".join(_cell(x) for x in (
            r["name"], figures(r), f"`{r['command']}`", describe_machine(r["machine"]) + refused, r["date"])) + " |")
    return "\n".join(lines) + "\n"


@dataclasses.dataclass(frozen=True)
class ResultsOptions:
    """results.py's flags.

    Attributes:
      record: run the command after `--` and keep its JSON as docs/results/RECORD.json, then render.
      check: do not write: exit 1 when docs/results.md differs from what the records render to.
      timeout_s: the longest a recorded command may run (seconds).
    """

    record: str = ""
    check: bool = False
    timeout_s: float = 3600.0


def main(argv: list[str]) -> int:
    from msjax import cli
    from msjax.config import ConfigError

    def body() -> int:
        flags, command = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
        common, opts = cli.parse_options(flags, ResultsOptions(), prog="results.py", description=__doc__)
        cli.setup_logging(common)
        try:
            if opts.record:
                print(f"recorded {record(opts.record, command, opts.timeout_s).relative_to(REPO)}")
            elif command:
                raise ResultsError("a command after '--' is run only with --record=NAME")
            rows = load()
        except ResultsError as e:
            raise ConfigError(str(e)) from None
        text = render(rows)
        if opts.check:
            current = RESULTS_MD.read_text() if RESULTS_MD.exists() else ""
            if current != text:
                print(f"{RESULTS_MD.relative_to(REPO)} is out of date: run python scripts/results.py",
                      file=sys.stderr)
                return 1
            return 0
        RESULTS_MD.write_text(text)
        print(f"wrote {RESULTS_MD.relative_to(REPO)} ({len(rows)} results)")
        return 0

    return cli.main_guard(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
