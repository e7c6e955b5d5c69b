"""Execute notebooks in place with nbclient, so committed outputs come from a real run.

Usage: python scripts/run_notebook.py notebooks/01_number_formats.ipynb [more.ipynb ...]
Runs from the notebook's folder, with a 600 s cell timeout, and prints each notebook's wall time.
"""
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def coalesce_streams(nb) -> None:
    """Merge consecutive stdout (or stderr) outputs of a cell into one, as a terminal would show
    them: otherwise one loop's prints render as several boxes. nbval merges them the same way."""
    for cell in nb.cells:
        merged = []
        for out in cell.get("outputs", []):
            if (merged and out.output_type == "stream" and merged[-1].output_type == "stream"
                    and merged[-1].name == out.name):
                merged[-1].text += out.text
            else:
                merged.append(out)
        if cell.cell_type == "code":
            cell.outputs = merged


def run(path: Path) -> float:
    nb = nbformat.read(path, as_version=4)
    nb.metadata.pop("widgets", None)  # saved widget state without "state" breaks renderers
    start = time.perf_counter()
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    elapsed = time.perf_counter() - start
    nb.metadata.pop("widgets", None)
    coalesce_streams(nb)
    nbformat.write(nb, path)
    return elapsed


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(f"{arg}: {run(Path(arg)):.1f} s", flush=True)
