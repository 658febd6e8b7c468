"""Both analysis notebooks run top to bottom (nbclient) on real short runs, with their runs as
parameters; each one's last cell checks that the rows it plotted are the ledger's rows."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from test_compare import sync_async_runs

ANALYSIS = Path(__file__).resolve().parent.parent / "analysis"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["version_lag", "sync_vs_async"])
def test_notebook_runs_top_to_bottom(name, tmp_path_factory, monkeypatch):
    runs = sync_async_runs(tmp_path_factory.getbasetemp() / "sync_async")
    monkeypatch.setenv("VLASLURM_RUNS", f"{runs['sync']},{runs['async']}")
    monkeypatch.setenv("VLASLURM_RUNS_ROOT", str(runs["sync"].parent.parent))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    nb = nbformat.read(ANALYSIS / f"{name}.ipynb", as_version=4)
    assert "parameters" in nb.cells[1].metadata.get("tags", [])
    NotebookClient(
        nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path_factory.mktemp(name))}}
    ).execute()
    last = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    assert "rows" in last, last
