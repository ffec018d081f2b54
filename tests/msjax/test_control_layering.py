"""One way down: launching (msjax.launch) and supervision (msjax.supervise) sit on the control plane
(msjax.control), which imports neither, nor the loop, checkpoints or fault handling; supervision never imports
the launcher; no package of the three imports another in a circle; the loop, checkpoints, observability and the
planner know nothing of who watches them; the loop reads the resolved layout, not the planner; the model and its
ops never import the parallel transforms applied to them; and no module of the package runs a script by path. Every import counts, those inside functions too."""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "msjax"


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, module: str) -> set[str]:
    """The msjax modules `source` (module `module`) imports, anywhere in it, relative imports resolved."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "msjax"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(module.split(".")[:-node.level] + ([base] if base else []))
            if base.split(".")[0] == "msjax":
                out.add(base)
                out |= {f"{base}.{a.name}" for a in node.names}
    return out


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {m: {i for i in imports_of(p.read_text(), m) if i in modules} for m, p in modules.items()}


def _package(module: str) -> str:
    """The part a module belongs to: msjax.control, msjax.launch, ... (a top-level module stands for itself)."""
    return ".".join(module.split(".")[:2])


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(edges):
        if n not in state and (found := visit(n)):
            return found
    return None


# (importer, imported, why): what must never import what.
NEVER = [
    ("msjax.control", "msjax.launch", "transport knows no launcher"),
    ("msjax.control", "msjax.supervise", "transport knows no policy"),
    ("msjax.supervise", "msjax.launch", "policy names no backend: the launcher hands it one"),
    ("msjax.train", "msjax.supervise", "the loop knows nothing of who watches it"),
    ("msjax.faults", "msjax.supervise", "the loop knows nothing of who watches it"),
    ("msjax.checkpoint", "msjax.supervise", "checkpoints know no policy"),
    ("msjax.observe", "msjax.supervise", "measuring is not deciding"),
    ("msjax.planner", "msjax.supervise", "plans know no running job"),
    ("msjax.control", "msjax.checkpoint", "transport knows no checkpoint: the loop passes in what it needs"),
    ("msjax.control", "msjax.faults", "transport knows no fault or NaN handling"),
    ("msjax.control", "msjax.train", "transport knows no loop"),
    ("msjax.train", "msjax.planner", "the loop reads the resolved layout, not the planner"),
    ("msjax.layout", "msjax.planner", "the layout stands below the planner, which reads it"),
    ("msjax.model", "msjax.parallel", "the model is single-device math; parallel/ applies itself"),
    ("msjax.ops", "msjax.parallel", "ops are single-device math; parallel/ applies itself"),
    ("msjax.sharding", "msjax.parallel", "the model's side of the interface knows no transform"),
]


def test_the_checker_sees_imports_inside_functions_and_relative_ones():
    src = "import os\ndef f():\n    from msjax.supervise import detect\n    from . import store\n"
    assert imports_of(src, "msjax.control.hook") == {"msjax.supervise", "msjax.supervise.detect",
                                                     "msjax.control", "msjax.control.store"}
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_dependencies_point_one_way():
    graph = _graph()
    found = sorted((m, i, why) for m, imported in graph.items() for i in imported for src, dst, why in NEVER
                   if _package(m) == src and _package(i) == dst)
    assert not found, "imports against the layering:\n" + "\n".join(f"  {m} -> {i}: {why}" for m, i, why in found)
    parts = ("msjax.control", "msjax.launch", "msjax.supervise")
    packages = {p: {_package(i) for m, imported in graph.items() if _package(m) == p for i in imported
                    if _package(i) in parts and _package(i) != p} for p in parts}
    assert _cycle(packages) is None, f"a circle among the control, launch and supervise packages: {packages}"
    # and none among their modules (importing one's own package's __init__ is no circle: it runs first anyway)
    modules = {m: {i for i in imported if _package(i) in parts and not m.startswith(i + ".") and i != m}
               for m, imported in graph.items() if _package(m) in parts}
    assert _cycle(modules) is None, f"a circle among the modules of those packages: {_cycle(modules)}"


def test_no_launcher_runs_a_script_by_path():
    """Workers, specs, the supervisor and standbys start processes as installed commands (`python -m msjax.train`,
    `msjax-train`), never as a file of a checkout: no code string (docstrings aside) of the control, launch and
    supervise packages or the train command names a scripts/ file."""
    found = []
    for path in [*(PACKAGE / "control").rglob("*.py"), *(PACKAGE / "launch").rglob("*.py"),
                 *(PACKAGE / "supervise").rglob("*.py"), PACKAGE / "train.py"]:
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                if node.value == "scripts" or re.search(r"(^|/)scripts/\w+\.py", node.value):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value[:80]!r}")
    assert not found, found
