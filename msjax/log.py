"""The package's one output channel for what it says: the standard `logging` tree under the `msjax` logger.

Every module logs to `logging.getLogger(__name__)` (a child of `msjax`); scripts configure the handlers
(msjax.cli.setup_logging: one stream on stderr, `warning: ` / `error: ` prefixes) and the train command routes the
records around its progress bar (tqdm.contrib.logging.logging_redirect_tqdm). Command-line output that is the
command's result (a table, a JSON summary, a job id) is printed by the command itself, and signal handlers write to
stderr directly: `logging` takes a lock that the interrupted thread may hold.

A program that configured no logging at all (a notebook calling `msjax.train.run`) would see only warnings
(logging's last-resort handler): `ensure_visible` gives the `msjax` logger one handler that writes INFO and up
through `tqdm.write`, so messages land above a progress bar instead of through it. It is called by the loop,
never on import, does nothing when any handler is configured, and steps aside once the root logger has one.
"""

from __future__ import annotations

import logging
import sys

from tqdm import tqdm

ROOT = "msjax"


class TqdmHandler(logging.Handler):
    """Writes each record with `tqdm.write` (on stderr), which clears and redraws any active progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:  # logging configured since: the root's handlers show the record
            return
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging's own contract: report, never raise
            self.handleError(record)


def ensure_visible() -> None:
    """Adds a TqdmHandler at INFO to the `msjax` logger when neither it nor any ancestor has a handler."""
    logger = logging.getLogger(ROOT)
    if logger.hasHandlers():
        return
    logger.addHandler(TqdmHandler())
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
