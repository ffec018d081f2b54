"""Pictures of a run: `python scripts/report.py RUN_DIR [--out=DIR]` writes heatmaps over the mesh, loss/MFU
curves and a per-rank timeline as PNGs plus an index.html (default `RUN_DIR/report/`)."""

import dataclasses
import sys

from msjax import cli
from msjax.config import ConfigError


@dataclasses.dataclass(frozen=True)
class ReportOptions:
    """report.py's flags; RUN_DIR, the run directory to draw, is its one positional argument.

    Attributes:
      out: the directory for the PNGs and index.html; empty: RUN_DIR/report/.
    """

    out: str = ""


_TAKES_VALUE = ("--out", "--log_level")  # flags that may take their value as the next argument


def main(argv: list[str]) -> int:
    def body() -> int:
        flags, run_dirs, rest = [], [], list(argv)
        while rest:
            arg = rest.pop(0)
            if not arg.startswith("-"):
                run_dirs.append(arg)
                continue
            flags.append(arg)
            if arg in _TAKES_VALUE and rest:
                flags.append(rest.pop(0))
        common, opts = cli.parse_options(flags, ReportOptions(), prog="report.py RUN_DIR", description=__doc__)
        cli.setup_logging(common)
        if len(run_dirs) != 1:
            raise ConfigError(f"report.py takes one RUN_DIR (a run directory); got {run_dirs or 'none'}")
        from msjax.observe.report import ReportError, write_report

        try:
            index = write_report(run_dirs[0], opts.out or None)
        except ReportError as e:
            raise ConfigError(str(e)) from None
        print(index)
        return 0

    return cli.main_guard(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
