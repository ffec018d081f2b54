"""The installed package: one top-level name (`msjax`), the design card's folders under it, scripts that need no
path edits."""

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_import_tree_is_the_file_tree():
    """Every folder of msjax/ that holds Python files is a regular package (an __init__.py), found by the build's
    `packages.find`, and no other top-level package is built: the design card's configs/, sharding_rules/ and
    pallas_kernels/ live under msjax/, so the source tree never lacks a folder that an install has."""
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert find["include"] == ["msjax", "msjax.*"]
    folders = {p.parent for p in (ROOT / "msjax").rglob("*.py") if "__pycache__" not in p.parts}
    missing = sorted(str(d.relative_to(ROOT)) for d in folders if not (d / "__init__.py").is_file())
    assert not missing, f"folders of msjax/ with Python files but no __init__.py (not packaged): {missing}"
    for name in ("configs", "sharding_rules", "pallas_kernels"):
        assert (ROOT / "msjax" / name / "__init__.py").is_file() and not (ROOT / name).exists(), name


def test_installed_names_import_from_any_directory_without_path_edits(tmp_path):
    code = ("import importlib.util, msjax.configs, msjax.sharding_rules, msjax.pallas_kernels.sliding_window_attention;"
            "from msjax.config import load_preset; load_preset('gpt_tiny');"
            "print(importlib.util.find_spec('configs') is None, importlib.util.find_spec('sharding_rules') is None)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True"], "a bare top-level configs/sharding_rules is importable"
    help_ = subprocess.run([sys.executable, str(ROOT / "scripts" / "plan.py"), "--help"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
    assert help_.returncode == 0 and "--devices" in help_.stdout, help_.stderr[-2000:]
