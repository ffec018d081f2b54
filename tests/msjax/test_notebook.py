"""notebooks/quickstart.ipynb runs top to bottom on CPU (nbclient); any failing cell fails the test."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quickstart_notebook_runs(tmp_path):
    import nbclient  # the dev extra: pip install -e ".[dev]"
    import nbformat

    nb = nbformat.read(ROOT / "notebooks" / "quickstart.ipynb", as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT / "notebooks")}})
    client.execute()  # raises CellExecutionError naming the cell that failed
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "final train loss" in outputs and "Memory per device" in outputs and "index.html" in outputs
