"""The suite's own scheduler (tests/xdist_scheduling.py): a worker that dies mid-file costs one failed test, not
a session that never ends; a test that hangs is ended by pytest-timeout and costs the same."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_FILES = {
    "conftest.py": "from tests.xdist_scheduling import pytest_xdist_make_scheduler  # noqa: F401\n",
    "test_a.py": "def test_a1(): pass\ndef test_a2(): pass\ndef test_a3(): pass\n",
    # the worker dies in the middle of a file, after finishing another file (test_a or test_c): the case that hung
    "test_b.py": "import os\ndef test_b1(): pass\ndef test_b2_dies(): os._exit(1)\ndef test_b3(): pass\n",
    "test_c.py": "def test_c1(): pass\ndef test_c2(): pass\n",
    "test_d.py": "def test_d1(): pass\n",
    # a hang: pytest-timeout (the suite's `timeout`, 2 s here) ends the worker the same way
    "test_e.py": "import time\ndef test_e1(): pass\ndef test_e2_hangs(): time.sleep(600)\ndef test_e3(): pass\n",
}


@pytest.mark.slow
def test_a_worker_crash_or_hang_fails_one_test_and_the_session_ends(tmp_path):
    for name, text in _FILES.items():
        (tmp_path / name).write_text(text)
    # Each worker takes test_a first or test_c first; -n 1 makes the crashed worker the one that finished a file.
    for workers in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", workers, "--dist", "loadfile",
             "-o", "addopts=", "-o", "timeout=2", "-o", "timeout_method=thread", "--rootdir", str(tmp_path),
             str(tmp_path)],
            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True, text=True, timeout=60)  # xdist's own scheduler hangs here: this times out
        tail = out.stdout.strip().splitlines()[-1]
        assert out.returncode == 1, out.stdout + out.stderr
        assert "2 failed, 10 passed" in tail, out.stdout
        assert "test_b2_dies" in out.stdout and "test_e2_hangs" in out.stdout
