"""Imports a script of scripts/ as a module, for the tests of the benchmark logic that lives there."""

import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(name: str):
    """scripts/<name>.py imported as the module `name` (scripts/ is not a package; a script may import a support
    module beside it, so scripts/ goes on sys.path first). Loaded once per process."""
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(SCRIPTS / f"{name}.py"):
        return sys.modules[name]
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their class's module up while it is being defined
    spec.loader.exec_module(module)
    return module
