"""Pictures of a run: `python scripts/report.py RUN_DIR [--out=DIR]` writes heatmaps over the mesh, loss/MFU
curves and a per-rank timeline as PNGs plus an index.html (default `RUN_DIR/report/`). The same command as
`msjax-report` (msjax.observe.report.main)."""

import sys

from msjax.observe.report import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
