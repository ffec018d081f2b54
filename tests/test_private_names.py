"""Private names, ours and our libraries'.

- A module uses another's public names only: no file of msjax/ or scripts/ imports or reaches a leading-underscore
  name of another msjax module.
- The private names of jax and Orbax live in one module, msjax/compat.py: no other file imports `jax._src` or
  `orbax.checkpoint._src`, every name it lists resolves on the installed versions (this is the test that fails
  loudly when an upgrade moves one), and a moved name is an error that names it.
"""

import ast
import importlib.metadata
import inspect
from pathlib import Path

import pytest

from msjax import compat

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


# ---- jax's and Orbax's private names --------------------------------------------------------------------------

def private_library_uses(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import of, or attribute chain through, a `_src` package of jax or Orbax."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if "._src" in a.name]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            module = node.module or ""
            if "._src" in module or any(a.name == "_src" for a in node.names):
                found.append((node.lineno, module))
        elif isinstance(node, ast.Attribute) and node.attr == "_src":
            found.append((node.lineno, "._src"))
    return sorted(found)


def test_the_check_sees_every_way_to_reach_a_private_package():
    src = ("from jax._src import distributed\nimport orbax.checkpoint._src.futures.future as f\n"
           "from jax import _src\nx = jax._src.config\nfrom msjax.compat import jax_distributed\n")
    assert [line for line, _ in private_library_uses(src)] == [1, 2, 3, 4]


def test_only_compat_reaches_private_packages_of_jax_and_orbax():
    files = sorted(p for d in ("msjax", "scripts", "pallas_kernels", "sharding_rules", "configs")
                   for p in REPO.joinpath(d).rglob("*.py"))
    found = {str(f.relative_to(REPO)): uses for f in files
             if f.name != "compat.py" and (uses := private_library_uses(f.read_text()))}
    assert found == {}


def test_installed_versions_are_the_ones_the_private_names_were_read_in():
    """An upgrade past `compat.VERIFIED` fails here first: re-read every name of compat.PRIVATE in the new release,
    then widen the range (and pyproject.toml's)."""
    for package in compat.VERIFIED:
        assert compat.verified(package), (package, importlib.metadata.version(package), compat.VERIFIED[package])


@pytest.mark.parametrize("key", sorted(compat.PRIVATE))
def test_every_private_name_resolves(key):
    module = compat.private(key)
    assert module.__name__ == compat.PRIVATE[key].module
    assert getattr(compat, key) is module


def test_cache_writer_has_the_parameters_the_wrapper_relies_on():
    from msjax.compat import jax_compiler

    writer = getattr(jax_compiler._cache_write, "__wrapped__", jax_compiler._cache_write)
    assert tuple(inspect.signature(writer).parameters) == compat.CACHE_WRITE_PARAMETERS


def test_a_moved_name_is_an_error_naming_it_and_the_versions():
    moved = compat.PrivateName("jax", "jax._src.distributed", ("global_state", "global_state.no_such_client"))
    with pytest.raises(compat.PrivateAPIError, match=r"jax_distributed: jax\._src\.distributed\."
                                                     r"global_state\.no_such_client is gone; read in jax>=0\.10\.2"):
        compat.resolve(moved, "jax_distributed")
    gone = compat.PrivateName("orbax-checkpoint", "orbax.checkpoint._src.no_such_module", ())
    with pytest.raises(compat.PrivateAPIError, match="no_such_module cannot be imported"):
        compat.resolve(gone)
    with pytest.raises(KeyError, match="allowed: jax_compilation_cache"):
        compat.private("jax_nothing")


def test_outside_the_verified_versions_a_present_name_is_used_with_a_warning(monkeypatch):
    monkeypatch.setitem(compat.VERIFIED, "jax", ((0, 1), (0, 2)))
    monkeypatch.delitem(compat._resolved, "jax_xla_bridge", raising=False)
    with pytest.warns(UserWarning, match=r"read in jax>=0\.1,<0\.2"):
        module = compat.private("jax_xla_bridge")
    assert module.backends_are_initialized is not None

