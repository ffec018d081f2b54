"""The installed package: one top-level name (`msjax`) whose import tree is its file tree, and a wheel that runs a
supervised multi-process job with no checkout: built from a copy of the repository, installed into a fresh
virtualenv outside it, launched from another directory and from the repository root."""

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("msjax-train", "msjax-launch", "msjax-supervise", "msjax-plan", "msjax-report", "msjax-redis",
            "msjax-output")


def test_the_import_tree_is_the_file_tree():
    """Every folder of msjax/ that holds Python files is a regular package (an __init__.py), found by the build's
    `packages.find`, and no other top-level package is built. The design card's top-level configs/,
    sharding_rules/ and pallas_kernels/ are the files' one home; msjax/<name> is a relative link to each, so the
    source tree's msjax/ holds every subpackage an install has (run from the repository root, it shadows an
    installed copy with the same tree) and the wheel carries them as msjax.<name>."""
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert find["include"] == ["msjax", "msjax.*"]
    folders = {p.parent for p in (ROOT / "msjax").rglob("*.py") if "__pycache__" not in p.parts}
    missing = sorted(str(d.relative_to(ROOT)) for d in folders if not (d / "__init__.py").is_file())
    assert not missing, f"folders of msjax/ with Python files but no __init__.py (not packaged): {missing}"
    for name in ("configs", "sharding_rules", "pallas_kernels"):
        link = ROOT / "msjax" / name
        assert link.is_symlink() and link.readlink() == Path("..") / name, name
        assert (ROOT / name / "__init__.py").is_file(), name
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert sorted(scripts) == sorted(COMMANDS)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh virtualenv (outside the repository) with msjax installed from a wheel built from a copy of the
    repository; returns its bin/ folder.

    msjax comes from the wheel alone. Its dependencies (jax, flax, orbax, ... ~800 MB) are not downloaded again:
    a .pth file puts this interpreter's site-packages after the venv's own, so `import msjax` finds the wheel's
    copy first and only the wheel's (an editable install's finder there is a .pth of its own, which Python only
    reads in a site directory, never in a path a .pth adds)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, symlinks=True,
                    ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", ".pytest_cache", "runs"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp / "dist"),
                            str(src)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("msjax-*.whl")
    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    done = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    outer = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(site, "msjax_test_dependencies.pth").write_text("\n".join(sorted(outer)) + "\n")
    return env_dir / "bin"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A few real standard-library sources copied as .txt files."""
    d = tmp_path_factory.mktemp("corpus")
    for name in ("textwrap.py", "fnmatch.py", "glob.py", "shlex.py"):
        shutil.copy(Path(sysconfig.get_paths()["stdlib"]) / name, d / f"{name}.txt")
    return d


def _run(bin_dir: Path, argv: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MSJAX_", "JAX_", "PYTHON"))}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _flags(corpus: Path, run_dir: Path) -> list[str]:
    return ["--config=gpt_tiny", "--model.num_layers=2", "--model.d_model=32", "--model.num_heads=2",
            "--model.max_seq_len=32", f"--data.paths={corpus}", "--data.tokenizer=char", "--train.seq_len=32",
            "--train.global_batch=8", "--train.steps=4", "--train.eval_every=0", "--train.sample_tokens=0",
            "--train.progress=false", f"--train.run_dir={run_dir}", "--checkpoint.every=2", "--mesh.data=2",
            "--mesh.fsdp=2", "--supervisor.standby=false"]


@pytest.mark.slow
def test_a_wheel_in_a_fresh_venv_runs_a_supervised_two_process_job_from_anywhere(installed, tmp_path, corpus):
    for command in COMMANDS:
        assert (installed / command).is_file(), command
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # the package the venv imports is the wheel's, from any directory; from the repository root, the source tree
    # (first on sys.path for `python -m`/`-c`) is complete too: nothing is missing from it
    where = _run(installed, ["python", "-c", "import msjax, msjax.sharding_rules, msjax.configs; "
                             "print(msjax.__file__)"], elsewhere)
    assert where.returncode == 0 and where.stdout.startswith(str(installed.parent)), where.stderr[-2000:]
    from_root = _run(installed, ["python", "-c", "import msjax.sharding_rules, msjax.pallas_kernels"], ROOT)
    assert from_root.returncode == 0, from_root.stderr[-2000:]
    for cwd, name in ((elsewhere, "elsewhere"), (ROOT, "root")):
        run_dir = tmp_path / f"run-{name}"
        done = _run(installed, ["msjax-launch", "--backend=local", "--num_processes=2", "--devices_per_process=2",
                                "--supervise", "--", *_flags(corpus, run_dir)], cwd)
        assert done.returncode == 0, (name, done.stdout[-3000:], done.stderr[-3000:])
        assert "[supervisor] run finished after 0 restart(s)" in done.stdout, done.stdout[-3000:]
        assert '"final_step": 4' in done.stdout and (run_dir / "checkpoints" / "4").is_dir()
        logs = sorted(p.name for p in (run_dir / "logs").glob("attempt0.rank*.log"))
        assert logs == ["attempt0.rank0.log", "attempt0.rank1.log"]
    help_ = _run(installed, ["python", "-m", "msjax.train", "--help"], elsewhere)
    assert help_.returncode == 0 and "--train.steps" in help_.stdout, help_.stderr[-2000:]
