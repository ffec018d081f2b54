"""The installed package: one top-level name (`msjax`), the design card's folders under it, scripts that need no
path edits."""

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("msjax", "configs", "sharding_rules", "pallas_kernels")


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _folder_of(package: str, package_dir: dict[str, str]) -> Path:
    """The folder setuptools builds `package` from: the longest package-dir prefix, then the rest as folders."""
    parts = package.split(".")
    for k in range(len(parts), 0, -1):
        prefix = ".".join(parts[:k])
        if prefix in package_dir:
            return ROOT / package_dir[prefix] / Path(*parts[k:])
    return ROOT / Path(*parts)


def test_every_package_folder_is_installed_under_msjax_and_nothing_else_is_top_level():
    cfg = _setuptools()
    listed = {_folder_of(p, cfg["package-dir"]).resolve(): p for p in cfg["packages"]}
    on_disk = {init.parent.resolve() for folder in FOLDERS for init in (ROOT / folder).rglob("__init__.py")}
    missing = sorted(str(d.relative_to(ROOT)) for d in on_disk - set(listed))
    assert not missing, f"package folders not listed in pyproject's [tool.setuptools] packages: {missing}"
    assert all(folder.is_dir() for folder in listed), "a listed package has no folder"
    assert {p.split(".")[0] for p in cfg["packages"]} == {"msjax"}


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
