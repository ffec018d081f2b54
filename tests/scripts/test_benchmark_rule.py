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


def test_every_benchmark_prints_its_json_line():
    """scripts/results.py records a benchmark from the JSON line it prints last: every bench_*.py script prints one
    (`msjax.cli.print_result`, or `print(json.dumps(...))` where the table was printed row by row)."""
    missing = []
    for path in sorted(REPO.joinpath("scripts").glob("bench_*.py")):
        calls = [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)]
        prints_json = any(ast.unparse(c.func) == "cli.print_result" or (
            ast.unparse(c.func) == "print" and c.args and ast.unparse(c.args[0]).startswith("json.dumps("))
            for c in calls)
        if not prints_json and path.stem != "bench_reference":  # bench_reference: the plain-JAX model, no benchmark
            missing.append(path.name)
    assert missing == [], f"benchmarks that print no JSON line for scripts/results.py: {missing}"
