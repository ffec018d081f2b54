"""The rule of scripts/README.md: benchmarks live in scripts/, the package holds what a training run uses."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_package_holds_no_benchmark_module():
    found = sorted(str(p.relative_to(REPO)) for p in REPO.joinpath("msjax").rglob("*.py")
                   if p.stem.startswith("bench"))
    assert found == [], f"benchmark modules in the package (move them to scripts/): {found}"


def test_no_package_module_imports_or_runs_a_script():
    """No msjax module imports a scripts/ module or names the scripts/ folder (to run a script by path)."""
    scripts = {p.stem for p in REPO.joinpath("scripts").glob("*.py")}
    found = []
    for path in REPO.joinpath("msjax").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [(node.module or "").split(".")[0]]
            if any(n == "scripts" or n in scripts for n in names):
                found.append(f"{path.relative_to(REPO)}:{node.lineno} imports {names}")
            if isinstance(node, ast.Constant) and node.value == "scripts":
                found.append(f"{path.relative_to(REPO)}:{node.lineno} names the scripts folder")
    assert found == []
