"""Run notebooks top to bottom in a fresh kernel and store them with their outputs.

    python notebooks/execute.py                      # every notebook here, at full size
    python notebooks/execute.py notebooks/whatif.ipynb

The committed notebooks hold the outputs of such a run, so a reader sees the results without running
anything (tests/test_notebooks.py checks that, and runs each at its small size).
"""

import os
import sys
import time
from pathlib import Path

import nbclient
import nbformat

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 3600  # per cell: the full goodput study simulates 2,048 nodes for a month, five times


def execute(path: Path) -> float:
    """Execute `path` in place; its wall seconds."""
    started = time.perf_counter()
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()
    nbformat.write(notebook, path)
    return time.perf_counter() - started


def main(argv: list[str]) -> int:
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")  # inline plots
    for path in [Path(a) for a in argv] or sorted(HERE.glob("*.ipynb")):
        print(f"{path}: {execute(path):.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
