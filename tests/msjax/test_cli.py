"""The command line (msjax/cli.py) of every script: --help, one parser, bad flags and paths as one `error:` line
with exit status 2, logging flags."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from msjax import cli
from msjax.config import Config, ConfigError, flat_keys, load_preset

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"


def _script(name: str, *args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "MSJAX_COMPILATION_CACHE": "0", "COLUMNS": "80"}  # 80: one column of help
    return subprocess.run([sys.executable, str(SCRIPTS / name), *args], cwd=cwd or REPO, capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_train_help_lists_every_config_key_with_type_default_and_doc(tmp_path):
    proc = _script("train.py", "--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.replace("│", " ").split())  # the help's box, unwrapped
    for key, value in flat_keys(load_preset("gpt_tiny")).items():
        assert f"--{key} " in text, key
    assert ("--train.log_every INT steps between logged metrics (loss, tokens/s, MFU); 0 logs only the last "
            "step. (default: 10)") in text
    assert "--model.block {serial,parallel}" in text
    assert "--resume" in text and "shakespeare_char" in text  # the preset list is in --config's help


@pytest.mark.parametrize("script, flag", [("bench.py", "--reference_cmd"), ("plan.py", "--virtual_stages"),
                                          ("bench_attention.py", "--seq_lens"), ("bench_observe.py", "--pairs"),
                                          ("report.py", "--out")])
def test_every_script_has_help(script, flag):
    proc = _script(script, "--help")
    assert proc.returncode == 0, proc.stderr
    assert flag in proc.stdout and "--log_level" in proc.stdout


def test_parse_with_script_options():
    @dataclasses.dataclass(frozen=True)
    class Opts:
        """Attributes:
          steps: how many.
          out: where.
        """

        steps: int = 3
        out: str = ""

    cfg, (common, opts) = cli.parse(["--config=shakespeare_char", "--steps", "7", "--mesh.tensor", "2",
                                     "--train.progress=false", "--resume", "--quiet", "--out=x.json"], Opts())
    assert (opts.steps, opts.out, cfg.mesh.tensor, cfg.train.progress) == (7, "x.json", 2, False)
    assert cfg.checkpoint.resume and common.quiet and cfg.name == "shakespeare_char"
    with pytest.raises(ConfigError, match=r"steps='x': allowed is int"):
        cli.parse(["--steps=x"], Opts())
    with pytest.raises(ConfigError, match=r"unknown config key 'stepz'.*script flags: .*--out.*--steps"):
        cli.parse(["--stepz=1"], Opts())


def test_plan_unknown_flag_lists_planner_flags_and_bad_paths_are_one_error_line(tmp_path):
    proc = _script("plan.py", "--devicez=8")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: unknown config key 'devicez'") and "--virtual_stages" in proc.stderr
    proc = _script("plan.py", "--devices=8", f"--hardware_file={tmp_path / 'missing.json'}")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "missing.json' does not exist" in proc.stderr
    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = _script("plan.py", "--devices=8", f"--json={blocker}/out.json")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"--json='{blocker}/out.json'" in proc.stderr and "does not exist" in proc.stderr


def test_train_unwritable_run_dir_and_cache_dir_are_one_error_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    corpus = tmp_path / "c.txt"
    corpus.write_text("some text for a corpus " * 200)
    # a batch that splits over the 8 fake devices, so the layout check (which runs first) passes
    base = ["--config=shakespeare_char", f"--data.paths={corpus}", "--train.steps=2", "--train.global_batch=16"]
    proc = _script("train.py", *base, f"--train.run_dir={blocker}/run")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert proc.stderr.startswith(f"error: train.run_dir='{blocker}/run' is not writable (Not a directory)")
    proc = _script("train.py", *base, f"--train.run_dir={tmp_path}/run", f"--data.cache_dir={blocker}/c")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert proc.stderr.startswith(f"error: data.cache_dir='{blocker}/c' is not writable")


@pytest.mark.slow
def test_log_every_zero_trains_and_library_messages_reach_the_log(tmp_path):
    """--train.log_every=0 (used to divide by zero) logs only the last step; "tokenized N files" from msjax.data
    is seen on stderr; --quiet hides it."""
    corpus = tmp_path / "c.txt"
    corpus.write_text((REPO / "msjax" / "config.py").read_text())
    args = ["--config=shakespeare_char", f"--data.paths={corpus}", "--model.num_layers=1", "--model.d_model=32",
            "--model.num_heads=2", "--model.max_seq_len=16", "--train.seq_len=16", "--train.global_batch=8",
            "--train.steps=3", "--train.log_every=0", "--train.eval_batches=1", "--train.sample_tokens=0",
            "--optimizer.decay_steps=3", f"--data.cache_dir={tmp_path / 'cache'}"]
    proc = _script("train.py", *args, f"--train.run_dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokenized 1 files" in proc.stderr and "step 3: val loss" in proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["final_step"] == 3 and summary["train_loss"] is not None
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [3]
    proc = _script("train.py", *args, f"--train.run_dir={tmp_path / 'run2'}", "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "val loss" not in proc.stderr and "msjax:" not in proc.stderr


def test_recipe_row_of_a_failed_run_keeps_the_error_message():
    """bench.py --recipe on a run that fails: the row's error holds the child's message naming the bad argument,
    not only the closing line ("error: see the message above", which used to be all it kept)."""
    from msjax.bench import msjax_recipe_row, time_command

    # a stray argument (e.g. `--json out.json` for `--json=out.json`): tyro boxes the message, then msjax closes
    timed = time_command([sys.executable, str(SCRIPTS / "train.py"), "--config=shakespeare_char", "out.json"],
                         timeout_s=120)
    row = msjax_recipe_row(timed)
    assert timed["returncode"] == 2 and "Unrecognized options: out.json" in row["error"], row
    assert "stdout" not in row and "stderr" not in row
