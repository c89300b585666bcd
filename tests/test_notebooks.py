"""Every notebook in notebooks/ is stored with the outputs of a full run (`python notebooks/execute.py`)
and runs top to bottom at its small size
(ELASTOR_NOTEBOOK_QUICK=1). A notebook another test file already executes is left to that file."""

import pytest
from helpers import REPO

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
HERE = "test_notebooks.py"


def covered_elsewhere(notebook) -> bool:
    return any(
        notebook.name in path.read_text() for path in (REPO / "tests").glob("test_*.py") if path.name != HERE
    )


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[n.stem for n in NOTEBOOKS])
def test_notebook_is_stored_with_the_outputs_of_one_full_run(notebook):
    """A reader sees the results without running anything: every code cell ran, top to bottom in one
    kernel, without an error, and the plots are there."""
    nbformat = pytest.importorskip("nbformat")
    code = [c for c in nbformat.read(notebook, as_version=4).cells if c.cell_type == "code"]
    assert code and [c.execution_count for c in code] == list(range(1, len(code) + 1))
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)


EXECUTED = [n for n in NOTEBOOKS if not covered_elsewhere(n)]


SLOW = ("whatif", "goodput")  # a minute or more each at their quick size: -m slow (make test's budget)


@pytest.mark.parametrize(
    "notebook",
    [pytest.param(n, marks=pytest.mark.slow) if n.stem in SLOW else n for n in EXECUTED],
    ids=lambda n: n.stem,
)
def test_notebook_executes(notebook, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("ELASTOR_NOTEBOOK_QUICK", "1")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(notebook, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(notebook.parent)}}
    )
    client.execute()
    outputs = [o for c in nb.cells for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the plots are inline
