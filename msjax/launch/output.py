"""Where a worker's output goes: all of it to its log file in the run directory; to the terminal, rank 0's and
every rank's warnings and errors, each line prefixed `[rank R] `. The same for supervised and unsupervised runs.

A line counts as a warning or an error (`Alerts`) when it is
  - one of msjax's: `error: ...`, `warning: ...` (msjax.cli's logging), `msjax: rank R stopping: ...` (a worker
    leaving because a peer died or the job restarts);
  - a Python traceback (its first line to the exception line) or a `...Warning:` from the warnings module;
  - a glog/absl line of level W, E or F (`E1125 13:56:01.388 ...`), as XLA and gloo write them.
A worker that jax's distributed runtime aborts because another task died (its C++ client logs the fatal error and
a stack trace, then aborts, with no Python code in between) is shown as one line, `[rank R] stopping: lost the
JAX distributed service (another task died; ...)`: the stack stays in the log file.

Progress bars (tqdm writes `\\r` between updates) reach the terminal as they are written, so rank 0's bar still
updates in place.

Where the split happens: a local run's launcher pumps each worker's pipe (`Router.pump`); a SLURM worker step's
output is one `srun --label` stream, split by the supervisor (`Router.pump_labelled`) or, in an unsupervised
job, by `msjax-output` (`main`) in the job script.
"""

from __future__ import annotations

import re
import signal
import sys
import threading
from pathlib import Path
from typing import BinaryIO, Callable, Sequence, TextIO

_MSJAX = re.compile(rb"^(error: |warning: |msjax: rank \d+ stopping: )")
_GLOG = re.compile(rb"^[WEF]\d{4} \d\d:\d\d:\d\d")
_PY_WARNING = re.compile(rb"^\S.*:\d+: \w*Warning: ")
# What jax's C++ coordination client logs when it aborts a process whose peer (or the service) died: the verdict
# (for the supervisor's blame) and every glog line of the coordination service or the preemption sync that leads
# up to it (for the terminal, collapsed into one line from the first of them).
_LOST_SERVICE = re.compile(rb"Terminating process because the JAX distributed service detected fatal errors|"
                           rb"tasks are unhealthy \(stopped sending")
_SERVICE_TROUBLE = re.compile(rb"^[WEF]\d{4} .*(coordination[ _]service|JAX distributed service|"
                              rb"Failed to (retrieve preemption notice|cancel preemption barrier))")
LOST_SERVICE_LINE = "stopping: lost the JAX distributed service (another task died; its C++ stack is in the log)"


def lost_distributed_service(text: str) -> bool:
    """Whether a worker's output shows jax's distributed runtime ending it because another task died."""
    return bool(_LOST_SERVICE.search(text.encode(errors="replace")))


def log_shows_lost_service(path: Path, tail_bytes: int = 65536) -> bool:
    """`lost_distributed_service` of the end of a worker's log file (False when it cannot be read)."""
    try:
        with Path(path).open("rb") as f:
            f.seek(max(0, Path(path).stat().st_size - tail_bytes))
            return bool(_LOST_SERVICE.search(f.read()))
    except OSError:
        return False


class Alerts:
    """Tells, line by line, which lines of one worker's output are warnings or errors (see the module docstring).

    Feed it whole lines (with their `\\n` or `\\r` ending) in order; `keep(line)` returns the text to show for that
    line (the line itself, or the one-line summary of an abort), or None."""

    def __init__(self):
        self._traceback = False
        self._warning_source = False
        self.lost_service = False

    def keep(self, line: bytes) -> bytes | None:
        if self.lost_service:
            return None  # after the abort's summary, its stack and log lines stay in the log file
        if _LOST_SERVICE.search(line) or _SERVICE_TROUBLE.match(line):
            self.lost_service = True
            return LOST_SERVICE_LINE.encode() + b"\n"
        if self._traceback:
            if line[:1] in (b" ", b"\t") or line.startswith((b"During handling", b"The above exception",
                                                              b"Traceback")) or not line.strip():
                return line
            self._traceback = False
            return line  # the exception line
        if self._warning_source:
            self._warning_source = False
            if line[:1] in (b" ", b"\t"):
                return line
        if line.startswith(b"Traceback (most recent call last)"):
            self._traceback = True
            return line
        if _PY_WARNING.match(line):
            self._warning_source = True
            return line
        if _MSJAX.match(line) or _GLOG.match(line):
            return line
        return None


class Router:
    """Writes the output of a job's workers to their log files and the terminal (see the module docstring).

    Args:
      out: the terminal (a text stream); lines from several threads never interleave within a line.
    """

    def __init__(self, out: TextIO = sys.stdout):
        self.out = out
        self._lock = threading.Lock()

    def say(self, text: str) -> None:
        """Writes one line of the launcher's own (`[launch] ...`, `[supervisor] ...`) to the terminal."""
        self.write(text if text.endswith("\n") else text + "\n")

    def write(self, text: str) -> None:
        """Writes `text` to the terminal whole (a file-like sink for the supervisor's own lines)."""
        with self._lock:
            self.out.write(text)
            self.out.flush()

    def flush(self) -> None:
        self.out.flush()

    def pump(self, rank: int, stream: BinaryIO, log_path: Path) -> threading.Thread:
        """Starts a thread that copies `stream` (one worker's merged stdout and stderr, binary) into `log_path` and
        to the terminal as the module docstring says, until the stream ends. Returns the thread."""
        def copy() -> None:
            with _RankSink(self, rank, log_path) as sink:
                while chunk := (stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536)):
                    sink.write(chunk)

        thread = threading.Thread(target=copy, name=f"msjax-output-rank{rank}", daemon=True)
        thread.start()
        return thread

    def pump_labelled(self, stream: BinaryIO, step_log: Path, log_path: Callable[[int], Path],
                      on_line: Callable[[str], None] = lambda line: None) -> threading.Thread:
        """Starts a thread that runs `copy_labelled` on `stream` until it ends. Returns the thread."""
        thread = threading.Thread(target=self.copy_labelled, args=(stream, step_log, log_path, on_line),
                                  name="msjax-output-step", daemon=True)
        thread.start()
        return thread

    def copy_labelled(self, stream: BinaryIO, step_log: Path, log_path: Callable[[int], Path],
                      on_line: Callable[[str], None] = lambda line: None) -> None:
        """Reads `stream`, the output of an `srun --label` step (each line `R: text`, R the task's rank), until it
        ends: every line goes to `step_log` and to `on_line`, and each task's text to its own log (`log_path(R)`)
        and the terminal, as `pump` does for one worker, but for the launcher's own bookkeeping lines (starting
        with TASK_LINE_PREFIX)."""
        sinks: dict[int, _RankSink] = {}
        step_log.parent.mkdir(parents=True, exist_ok=True)
        try:
            with step_log.open("ab") as log:
                for line in iter(stream.readline, b""):
                    log.write(line)
                    log.flush()
                    text = line.decode(errors="replace")
                    on_line(text)
                    m = _LABEL.match(line)
                    if m and not m.group(2).startswith(TASK_LINE_PREFIX):
                        rank = int(m.group(1))
                        if rank not in sinks:
                            sinks[rank] = _RankSink(self, rank, log_path(rank)).__enter__()
                        sinks[rank].write(m.group(2))
        finally:
            for sink in sinks.values():
                sink.__exit__()

    def show(self, rank: int, lines: list[bytes]) -> None:
        if lines:
            prefix = f"[rank {rank}] ".encode()
            text = b"".join(prefix + line for line in lines).decode(errors="replace")
            with self._lock:
                self.out.write(text)
                self.out.flush()


TASK_LINE_PREFIX = b"MSJAX_TASK "
_LABEL = re.compile(rb"^\s*(\d+): ?(.*\n?)$", re.S)


class _RankSink:
    """One worker's output: appended to its log file; split into lines (ending in \\n or \\r), of which rank 0's
    all and the others' alerts reach the terminal."""

    def __init__(self, router: Router, rank: int, log_path: Path):
        self.router, self.rank = router, rank
        self.alerts = Alerts()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = log_path.open("ab")
        self.pending = b""

    def __enter__(self) -> "_RankSink":
        return self

    def write(self, data: bytes) -> None:
        self.log.write(data)
        self.log.flush()
        lines = re.split(rb"(?<=[\r\n])", self.pending + data)
        self.pending = lines.pop()  # an unfinished line waits for its end
        self.router.show(self.rank, [kept for line in lines if (kept := self._keep(line)) is not None])

    def _keep(self, line: bytes) -> bytes | None:
        if self.rank == 0 and not (self.alerts.lost_service or _LOST_SERVICE.search(line)
                                   or _SERVICE_TROUBLE.match(line)):
            return line  # rank 0's every line; an abort's stack collapses for it too
        return self.alerts.keep(line)

    def __exit__(self, *exc) -> None:
        if self.pending:
            self.write(b"\n")
        self.log.close()


def main(argv: Sequence[str] | None = None) -> int:
    """`msjax-output --log_dir=DIR [--step_log=FILE]`: the terminal view of an unsupervised SLURM job's worker
    step, so that it reads as a supervised or a local run's (the module docstring). The job script pipes the
    step's merged output (`srun --label ... 2>&1 |`) into it: each task's lines go to `DIR/rank<R>.log`, and to
    standard output rank 0's lines and every rank's warnings and errors, `[rank R] `-prefixed; srun's own
    unlabelled lines (its errors) are shown as they are; every line also goes to the step log (default
    `DIR/step.log`). SIGTERM and SIGINT are ignored (a preempted job's last lines still arrive): it ends when the
    stream does, with status 0."""
    import argparse

    parser = argparse.ArgumentParser(prog="msjax-output", description=main.__doc__)
    parser.add_argument("--log_dir", required=True, help="where the per-rank logs go (the run's logs/ folder)")
    parser.add_argument("--step_log", default="", help="the whole labelled stream (default: LOG_DIR/step.log)")
    args = parser.parse_args(argv)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)
    log_dir = Path(args.log_dir)
    router = Router(sys.stdout)

    def unlabelled(text: str) -> None:
        if not _LABEL.match(text.encode(errors="replace")):
            router.write(text)

    router.copy_labelled(sys.stdin.buffer, Path(args.step_log) if args.step_log else log_dir / "step.log",
                         lambda rank: log_dir / f"rank{rank}.log", unlabelled)
    return 0


if __name__ == "__main__":
    sys.exit(main())
