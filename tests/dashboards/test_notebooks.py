"""Every notebook in docs/ runs top to bottom in a fresh kernel (the walkthroughs stay true).

Notebooks are picked up by glob, so a new `docs/*.ipynb` is tested without touching this file.
They load the embedded Gemma 3 270M, hence the `gemma` mark.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")  # jupyter_client finds ipykernel's own python3 kernelspec, installed or not

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "docs").glob("*.ipynb"))
IDS = [p.name for p in NOTEBOOKS]
ANSI = re.compile(r"\x1b\[[0-9;]*m")

pytestmark = pytest.mark.gemma


def test_docs_have_notebooks():
    assert NOTEBOOKS, f"no notebooks in {ROOT / 'docs'}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_is_saved_without_outputs(path: Path):
    nb = nbformat.read(path, as_version=4)
    stale = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not stale, f"{path.name}: code cells {stale} hold outputs; clear them before saving (CI runs it)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_runs_top_to_bottom(path: Path):
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        # the message holds the failing cell's source and its traceback (colour codes removed)
        pytest.fail(f"{path.name}: a cell raised\n{ANSI.sub('', str(e))}", pytrace=False)
