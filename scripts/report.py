"""Pictures of a run: `python scripts/report.py RUN_DIR [--out=DIR]` writes heatmaps over the mesh, loss/MFU
curves and a per-rank timeline as PNGs plus an index.html (default `RUN_DIR/report/`)."""

import sys



def main(argv: list[str]) -> int:
    args = [a for a in argv if not a.startswith("--")]
    flags = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    bad = [a for a in argv if a.startswith("--") and ("=" not in a or a[2:].split("=", 1)[0] != "out")]
    if len(args) != 1 or bad:
        print(f"error: usage: scripts/report.py RUN_DIR [--out=DIR]; got {argv}", file=sys.stderr)
        return 2
    from msjax.observe.report import ReportError, write_report

    try:
        index = write_report(args[0], flags.get("out"))
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(index)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
