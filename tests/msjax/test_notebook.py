"""notebooks/quickstart.ipynb runs top to bottom on CPU (nbclient); any failing cell fails the test. The kernel
inherits this process's 8 fake CPU devices (tests/conftest.py), and the notebook picks its mesh from the devices it
finds (data 2 x fsdp 2 x tensor 2 here; all 1 on one GPU): nothing in it forces a device count."""

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
    assert "8 devices" in outputs and "mesh: data 2 x fsdp 2 x tensor 2" in outputs
    assert "'def " in outputs and "'import " in outputs  # the generation cell's two completions
    assert "xla_force_host_platform_device_count" not in "".join(
        "".join(c.source) for c in nb.cells if c.cell_type == "code")
