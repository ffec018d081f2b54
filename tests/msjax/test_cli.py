"""The command line (msjax/cli.py) of every script: --help, one parser, bad flags and paths as one `error:` line
with exit status 2, logging flags."""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from msjax import cli
from msjax.config import ConfigError, apply_overrides, coerce, flat_keys, get_key, load_preset

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"


def _script(name: str, *args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "MSJAX_COMPILATION_CACHE": "0", "COLUMNS": "80"}  # 80: one column of help
    return subprocess.run([sys.executable, str(SCRIPTS / name), *args], cwd=cwd or REPO, capture_output=True,
                          text=True, timeout=timeout, env=env)


def _expected_metavar(tp) -> str:
    """What --help must show as a flag's type: INT, FLOAT, BOOL, STR, {choice,...} for a Literal, X,Y,... for a
    tuple, INT_OR_NONE for an optional int."""
    if typing.get_origin(tp) is typing.Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(tp)) + "}"
    if typing.get_origin(tp) is tuple:
        return "X,Y,..."
    if set(typing.get_args(tp)) == {int, type(None)}:
        return "INT_OR_NONE"
    return {int: "INT", float: "FLOAT", bool: "BOOL", str: "STR"}[tp]


def _expected_default(value) -> str:
    if value in ("", ()):
        return "''"
    return ",".join(value) if isinstance(value, tuple) else str(value)


def test_train_help_lists_every_config_key_with_type_default_and_doc(tmp_path):
    """Every dotted key of the preset's config appears in --help as `--key TYPE doc (default: value)`: the type
    from the field's annotation, the default the preset's value, the doc the `Attributes:` entry of the section's
    docstring (non-empty for every key)."""
    import docstring_parser

    proc = _script("train.py", "--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.replace("│", " ").split())  # the help's box, unwrapped
    cfg = load_preset("gpt_tiny")
    keys = flat_keys(cfg)
    assert len(keys) > 90  # every section's leaves, not one of them
    for key, value in keys.items():
        if "." not in key:  # `name`, documented by the parser itself
            assert f"--{key} STR the run's name (the preset's, unless set) (default: {value})" in text
            continue
        section_key, field_name = key.rsplit(".", 1)
        section = type(get_key(cfg, section_key))
        docs = {p.arg_name: " ".join((p.description or "").split())
                for p in docstring_parser.parse(section.__doc__ or "").params}
        assert docs.get(field_name), f"{key} has no doc in {section.__name__}'s Attributes"
        tp = typing.get_type_hints(section)[field_name]
        want = f"--{key} {_expected_metavar(tp)} {docs[field_name]} (default: {_expected_default(value)})"
        assert want in text, want
    assert "--resume" in text and "shakespeare_char" in text  # the preset list is in --config's help


def _load_script(name: str):
    """scripts/<name> imported as a module (not run), for the helpers it defines."""
    spec = importlib.util.spec_from_file_location(Path(name).stem, SCRIPTS / name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their class's module up while it is being defined
    spec.loader.exec_module(module)
    return module


# every script in scripts/, with one of its own flags that --help must list
HELP_FLAGS = {"train.py": "--train.steps", "bench.py": "--reference_cmd", "plan.py": "--tune_virtual_stages",
              "bench_attention.py": "--seq_lens", "bench_observe.py": "--pairs", "report.py": "--out",
              "bench_checkpoint.py": "--local_dir", "bench_init.py": "--barriers",
              "bench_parallel.py": "--layouts", "bench_recovery.py": "--faults_per_kind",
              "launch.py": "--num_processes", "convert.py": "--from_hf", "generate.py": "--max_new_tokens",
              "bench_generate.py": "--new_tokens", "bench_generate_memory.py": "--run_dir",
              "bench_convert.py": "--width", "results.py": "--record", "bench_sft.py": "--examples"}


# Scripts that run another command, as `nice` does: no flags of their own, so no msjax flags either; their
# --help gives the usage.
WRAPPERS = {"refuse_amx.py": "refuse_amx.py COMMAND [ARGS...]"}


def test_help_flags_cover_every_script():
    """Every entry point in scripts/ (a file run as `__main__`; helper modules such as store_clients.py are not)."""
    entry_points = [p.name for p in SCRIPTS.glob("*.py") if 'if __name__ == "__main__":' in p.read_text()]
    assert sorted(HELP_FLAGS | WRAPPERS) == sorted(entry_points)
    assert "store_clients.py" not in entry_points and (SCRIPTS / "store_clients.py").exists()


@pytest.mark.parametrize("script, flag", sorted(HELP_FLAGS.items()))
def test_every_script_has_help(script, flag):
    proc = _script(script, "--help")
    assert proc.returncode == 0, proc.stderr
    assert flag in proc.stdout and "--log_level" in proc.stdout


@pytest.mark.parametrize("script, usage", sorted(WRAPPERS.items()))
def test_every_wrapper_has_help(script, usage):
    proc = _script(script, "--help")
    assert proc.returncode == 0 and usage in proc.stdout, proc.stderr


@pytest.mark.parametrize("script, args, named", [
    ("bench_checkpoint.py", ["--saves=1"], "--saves=1: allowed is >= 2"),
    ("bench_checkpoint.py", ["--gibs=1"], "unknown flag --gibs; allowed: "),
    ("bench_init.py", ["--barriers=x"], "barriers='x': allowed is int"),
    ("bench_parallel.py", ["--layouts=dp,pp3"], "--layouts='dp,pp3': allowed is a comma-separated list of dp, "),
    ("bench_parallel.py", ["--repeats=x"], "repeats='x': allowed is int"),
    ("bench_recovery.py", ["--kinds=kill,nap"], "--kinds='kill,nap': allowed is a comma-separated subset of "),
    ("bench_recovery.py", ["--hosts=1"], "--hosts=1: allowed is >= 2"),
    ("launch.py", ["--backend=local", "--accelerator=fpga", "--"], "accelerator='fpga': allowed is one of 'gpu', "),
    ("launch.py", ["--backend=local", "--num_processes=2", "--", "--train.stepz=3"],
     "train flags: unknown config key 'train.stepz'"),
    ("train.py", ["--model.moe.num_experts=4", "--model.moe.experts_per_token=5"],
     "model.moe.experts_per_token=5: allowed is 1 <= k <= model.moe.num_experts=4"),
    ("train.py", ["--model.moe.num_experts=4", "--model.moe.capacity_factor=-1"],
     "model.moe.capacity_factor=-1.0: allowed is a number >= 0 (0: dropless)"),
    ("train.py", ["--model.moe.num_experts=4", "--model.moe.every=2", "--model.scan_layers=false",
                  "--mesh.pipeline=2"],
     "model.moe.every=2 with mesh.pipeline=2: a pipeline stacks its chunks' layers, so they must all be alike"),
    ("train.py", ["--mesh.expert=2"], "mesh.expert=2: an expert-parallel axis needs a mixture-of-experts model "
     "(model.moe.num_experts > 0); allowed for a dense model: mesh.expert=1"),
    ("train.py", ["--model.moe.num_experts=6", "--mesh.expert=4"],
     "mesh.expert=4: the model's model.moe.num_experts=6 experts must split evenly over it; allowed: a divisor"),
])
def test_a_bad_flag_of_a_script_is_one_error_line(script, args, named):
    """Caught before any work starts (no backend, no Redis, no child process): one `error:` line, status 2."""
    proc = _script(script, *args)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: ") and named in proc.stderr, proc.stderr


def test_supervise_help_and_bad_flags(capsys):
    """`msjax-supervise` (msjax.launch.cli.supervise) takes the launcher's flags: --help lists them, a bad one is one
    error line before anything starts."""
    from msjax.launch.cli import supervise

    with pytest.raises(SystemExit) as done:
        supervise(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and "--num_processes" in out and "--devices_per_process" in out and "--nodes" in out
    for args, named in ((["--backend=ssh", "--num_processes=1"], "backend='ssh': allowed is one of 'local', 'slurm', "
                                                                 "'k8s'"),
                        (["--num_processes=0"], "--num_processes=0: must be >= 1"),
                        (["--num_processes=1", "--sbatch"], "flag --sbatch needs a value"),
                        (["--backend=k8s", "--num_processes=1", "--", "--mesh.data=1"],
                         "--backend=k8s needs --run_id")):
        assert supervise(args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and named in err, err


def test_diagnostics_parse_with_the_scripts_parser():
    """`python -m msjax.supervise.diagnostics` (run by the supervisor, SLURM and the Kubernetes initContainer)
    parses through msjax.cli like every script: --help lists its flags, a bad or missing one is one error line."""
    def diagnostics(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "msjax.supervise.diagnostics", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "80"})

    proc = diagnostics("--help")
    assert proc.returncode == 0 and "--fail_exit" in proc.stdout and "--min_flops" in proc.stdout, proc.stderr
    for args, named in ((["--rank", "0", "--num", "1"], "--host is required"),
                        (["--host", "h0", "--rank", "2", "--num", "2", "--coordinator", "x:1"],
                         "--rank=2: allowed is an int in [0, 1]"),
                        (["--host", "h0", "--rank", "0", "--num", "2"], "--coordinator is required"),
                        (["--host", "h0", "--rank", "0", "--num", "1", "--bogus", "1"], "unknown flag --bogus")):
        proc = diagnostics(*args)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith("error: ") and named in proc.stderr, proc.stderr


def test_launch_parses_its_flags_then_the_train_flags():
    """One options type for every launcher; repeatable flags (--sbatch, --srun_args) keep every value whole (an
    sbatch option may hold commas); the train flags after `--` are parsed (and checked) too."""
    from msjax.launch.options import LaunchOptions, parse

    common, opts, cfg, train = parse(["--backend=slurm", "--num_processes", "4", "--supervise", "--quiet",
                                      "--output", "job.sbatch", "--sbatch=--mail-type=END,FAIL", "--sbatch",
                                      "--constraint=a100", "--nodes=n1,n2", "--", "--train.steps=3", "--resume"])
    assert (opts.backend, opts.num_processes, opts.supervise, opts.output, common.quiet) == (
        "slurm", 4, True, "job.sbatch", True)
    assert opts.sbatch == ("--mail-type=END,FAIL", "--constraint=a100") and opts.nodes == ("n1", "n2")
    assert cfg.train.steps == 3 and cfg.checkpoint.resume and train == ["--train.steps=3", "--resume"]
    assert opts.flags("num_processes", "sbatch", "accelerator") == [
        "--num_processes=4", "--sbatch=--mail-type=END,FAIL", "--sbatch=--constraint=a100"]
    assert LaunchOptions().devices_per_process == 1
    with pytest.raises(ConfigError, match=r"--num_processes=0: must be >= 1"):
        parse(["--backend=local", "--", "--train.steps=3"])


def test_bench_checkpoint_keeps_its_old_local_dir_spelling():
    module = _load_script("bench_checkpoint.py")
    _, opts = cli.parse_options(["--local-dir=/dev/shm/x", "--json", "out.json"], module.CheckpointBenchOptions())
    assert (opts.local_dir, opts.json) == ("/dev/shm/x", "out.json")


def test_bench_parallel_rows_parse_the_users_flags_with_the_layout_winning():
    """A row's child process gets the user's flags, then its layout's: the layout's mesh wins, the rest stays."""
    module = _load_script("bench_parallel.py")
    user = ["--model.d_model=96", "--mesh.tensor", "3", "--layouts=tp", "--steps=2"]
    child = module.row_argv(user, {"mesh.data": -1, "mesh.tensor": 2, "mesh.tp_overlap": "xla"})
    cfg, (_, opts) = cli.parse(child, module.ParallelBenchOptions())
    assert (cfg.mesh.tensor, cfg.mesh.tp_overlap, cfg.model.d_model) == (2, "xla", 96)
    assert opts.row and opts.steps == 2 and opts.layouts == ("tp",)


def test_bench_recovery_hands_its_config_to_the_supervisor_unchanged(tmp_path):
    """DEFAULTS under the user's flags; the run's config goes to the supervised workers as train flags that parse
    back to it (tuples, None, bools and floats round-trip through msjax.config.coerce)."""
    module = _load_script("bench_recovery.py")
    for tp, value in ((tuple[str, ...], ("a.txt", "b.txt")), (tuple[str, ...], ()), (int | None, None),
                      (int | None, 16), (bool, True), (bool, False), (float, 2.5), (float, 1e-5), (int, -1),
                      (str, "char")):
        assert coerce("k", tp, cli.flag_value(value)) == value, (tp, value)
    defaults = [f"--{key}={cli.flag_value(value)}" for key, value in module.DEFAULTS.items()]
    user = ["--data.paths=a.txt,b.txt", f"--train.run_dir={tmp_path}", "--resume", "--model.attention.window=16",
            "--mesh.fsdp=1", "--quiet", "--seed=3", "--kinds=stop,kill", "--faults_per_kind=2"]
    cfg, (common, own) = cli.parse([*defaults, *user], module.RecoveryBenchOptions(), validate=False)
    assert (cfg.model.d_model, cfg.mesh.fsdp, cfg.train.progress) == (64, 1, False)  # a default, the user's
    run_cfg, train, faults, seed = module.supervised_run(cfg, common, own)
    assert seed == 3 and [f.kind for f in faults] == ["kill", "kill", "stop", "stop"]
    assert [f.attempt for f in faults] == [0, 1, 2, 3] and all(0 <= f.rank < own.hosts for f in faults)
    assert run_cfg.train.run_dir == str(tmp_path / "run") and run_cfg.supervisor.spares == 1
    assert "unhealthy-" in run_cfg.supervisor.health_check  # how a diag fault fails its host's self-check
    back, (back_common,) = cli.parse(train)
    assert back == run_cfg and back_common.quiet
    assert back.data.paths == ("a.txt", "b.txt") and back.model.attention.window == 16 and back.checkpoint.resume
    none_window = apply_overrides(load_preset("gpt_tiny"), {"model.attention.window": 8})
    assert cli.config_flags(load_preset("gpt_tiny"), none_window) == ["--model.attention.window=none"]


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
    assert proc.stderr.startswith("error: unknown config key 'devicez'") and "--tune_virtual_stages" in proc.stderr
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
    is seen on stderr; --quiet hides it; `--profile_steps K:N` traces steps K..K+N-1 from the start."""
    from msjax.events import read_events
    from msjax.observe import traced_steps

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
    proc = _script("train.py", *args, f"--train.run_dir={tmp_path / 'run2'}", "--quiet", "--profile_steps", "2:1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "val loss" not in proc.stderr and "msjax:" not in proc.stderr
    (event,) = read_events(tmp_path / "run2", "profile")
    assert (event["first_step"], event["last_step"]) == (2, 2) and traced_steps(event["path"]) == [2]


def test_recipe_row_of_a_failed_run_keeps_the_error_message():
    """bench.py --recipe on a run that fails: the row's error holds the child's message naming the bad argument,
    not only the closing line ("error: see the message above", which used to be all it kept)."""
    bench = _load_script("bench.py")
    msjax_recipe_row, time_command = bench.msjax_recipe_row, bench.time_command

    # a stray argument (e.g. `--json out.json` for `--json=out.json`): tyro boxes the message, then msjax closes
    timed = time_command([sys.executable, str(SCRIPTS / "train.py"), "--config=shakespeare_char", "out.json"],
                         timeout_s=120)
    row = msjax_recipe_row(timed)
    assert timed["returncode"] == 2 and "Unrecognized options: out.json" in row["error"], row
    assert "stdout" not in row and "stderr" not in row


def test_explicit_keys_are_the_dotted_keys_on_the_command_line():
    from msjax.cli import explicit_keys

    argv = ["--config=gpt530b", "--model.remat=none", "--train.steps", "3", "--devices=8", "--mesh-tensor=2",
            "--model.attention.window=None", "value.with.dot"]
    assert explicit_keys(argv) == {"model.remat", "train.steps", "model.attention.window"}
