"""Shared set-up for loop-level tests: a small real-text corpus and a tiny run config on a 2x2x2 mesh.

Session-scoped so that every test module reuses one corpus (and its token cache) instead of building its own.
"""

import shutil
import sysconfig
from pathlib import Path

import pytest

from tests.msjax.tiny_runs import tiny_run_config


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """A few real standard-library sources copied as .txt files (real text, present on every machine)."""
    d = tmp_path_factory.mktemp("small_corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("textwrap.py", "fnmatch.py", "glob.py", "shlex.py", "bisect.py", "colorsys.py"):
        shutil.copy(stdlib / name, d / f"{name}.txt")
    return d


@pytest.fixture
def make_tiny_config():
    """The `tiny_run_config` factory, as a fixture (conftest functions are not importable by test modules)."""
    return tiny_run_config


@pytest.fixture(scope="session")
def layout_tokens():
    """The one batch every parallel-equivalence run trains on (tests/msjax/layouts.py)."""
    from tests.msjax.layouts import random_tokens

    return random_tokens()


@pytest.fixture(scope="session")
def layout_reference(layout_tokens):
    """`reference(**overrides)`: the single-device LayoutRun of `layouts.tiny_config(**overrides)`, computed once
    per session for each distinct config (test_parallel, test_overlap and test_pipeline share them)."""
    from tests.msjax.layouts import run_layout, tiny_config

    cache = {}

    def reference(**overrides):
        cfg = tiny_config(**overrides)
        if cfg not in cache:
            cache[cfg] = run_layout(cfg, layout_tokens, 1)
        return cache[cfg]

    return reference
