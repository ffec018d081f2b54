"""One logger for what the package says (msjax.log): a program that configured no logging still sees the loop's
messages (once), a configured one sees them through its own handlers (once), and no module of the package prints
except the commands whose output is their result."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Modules whose print calls are a command's own output (a table, JSON, a job id, `error: ...` before exit 2) or a
# line protocol read by a parent process (the diagnostics' MSJAX_DIAG lines, the compile check's JSON).
PRINTS_ALLOWED = {
    "msjax/cli.py", "msjax/train.py", "msjax/launch/cli.py", "msjax/planner/cli.py", "msjax/planner/compile_check.py",
    "msjax/supervise/diagnostics.py", "msjax/control/server.py", "msjax/control/probe.py", "msjax/observe/report.py",
    "msjax/bench.py", "msjax/bench_reference.py", "msjax/observe/bench.py",
    "msjax/log.py",  # the handler that writes around a progress bar
}


def _say(setup: str) -> subprocess.CompletedProcess:
    code = (f"import logging, sys\n{setup}\nfrom msjax.log import ensure_visible\nensure_visible()\n"
            "logging.getLogger('msjax.train').info('loop message')\n"
            "logging.getLogger('msjax.train').debug('debug message')\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_messages_reach_an_unconfigured_program_and_a_configured_one_once():
    bare = _say("")
    assert bare.stderr.count("loop message") == 1 and "debug message" not in bare.stderr + bare.stdout
    configured = _say("logging.basicConfig(level='WARNING', stream=sys.stderr)")  # a --quiet script
    assert "loop message" not in configured.stderr
    # configured after the loop's handler was added: the root's handler alone shows it
    code = ("import logging, sys\nfrom msjax.log import ensure_visible\nensure_visible()\n"
            "logging.basicConfig(level='INFO', stream=sys.stderr, format='root: %(message)s')\n"
            "logging.getLogger('msjax.train').info('loop message')\n")
    late = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert late.stderr.splitlines() == ["root: loop message"], late.stderr


def test_no_module_prints_outside_the_commands():
    found = []
    for path in sorted((ROOT / "msjax").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in PRINTS_ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                found.append(f"{rel}:{node.lineno}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "write"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "tqdm"):
                found.append(f"{rel}:{node.lineno} (tqdm.write)")
    assert not found, f"print/tqdm.write outside the commands (log through logging.getLogger(__name__)): {found}"
