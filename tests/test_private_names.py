"""A module uses another's public names only (STYLE.md; issue 14: `planner/cli.py` took `config._coerce`): no file
of msjax/ or scripts/ imports or reaches a leading-underscore name of another msjax module."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _msjax_modules(tree: ast.AST) -> dict[str, str]:
    """Local names bound to msjax modules: `import msjax.x as y`, `from msjax import x`, `from msjax.a import b`
    where b is a module (a file or package under REPO)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update({a.asname or a.name.split(".")[0]: a.name for a in node.names if a.name.startswith("msjax")})
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("msjax"):
            for a in node.names:
                path = REPO.joinpath(*f"{node.module}.{a.name}".split("."))
                if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
                    out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def private_uses(source: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every private msjax name that `source` imports or reads through a module."""
    tree = ast.parse(source)
    modules, found = _msjax_modules(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("msjax"):
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names if _is_private(a.name)]
        elif isinstance(node, ast.Attribute) and _is_private(node.attr):
            base, path = node.value, [node.attr]
            while isinstance(base, ast.Attribute):
                path.insert(0, base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                found.append((node.lineno, ".".join([modules[base.id], *path])))
    return sorted(found)


def test_the_check_sees_both_kinds_of_private_use():
    src = ("from msjax.planner.memory import _DTYPE_BYTES, StageParams\n"
           "from msjax import config\nimport msjax.planner.search as search\n"
           "x = config._coerce('k', int, '1')\ny = search._reason_kind\nz = config.Config().model\n")
    assert private_uses(src) == [(1, "msjax.planner.memory._DTYPE_BYTES"), (4, "msjax.config._coerce"),
                                 (5, "msjax.planner.search._reason_kind")]


def test_no_module_uses_another_modules_private_names():
    files = sorted([*REPO.joinpath("msjax").rglob("*.py"), *REPO.joinpath("scripts").glob("*.py")])
    assert len(files) > 50
    found = {str(f.relative_to(REPO)): uses for f in files if (uses := private_uses(f.read_text()))}
    assert found == {}
