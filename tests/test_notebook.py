"""The quickstart notebook: its ``.py`` twin matches it cell for cell, and it runs end to end on CPU (tiny config).

``examples/quickstart.py`` (jupytext "percent" format) is the source of truth for review; regenerate the
notebook after editing it with ``python tests/test_notebook.py --sync`` (outputs are not stored).
The execution test starts a real Jupyter kernel on this interpreter (nbclient + ipykernel, the ``test`` extra)
with ``K3_NOTEBOOK_CONFIG=tiny`` and a handful of steps, and fails on the first cell that raises.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"
TWIN = ROOT / "examples" / "quickstart.py"
# the CPU test run: enough steps to see the loss move, small enough for < 120 s on 2 idle cores
TEST_ENV = {"K3_NOTEBOOK_CONFIG": "tiny", "K3_NOTEBOOK_STEPS": "4", "K3_NOTEBOOK_BATCH": "2",
            "K3_NOTEBOOK_SEQ_LEN": "64", "K3_NOTEBOOK_GEN_TOKENS": "8"}


def percent_cells(text: str) -> list[dict]:
    """Parse a jupytext percent-format script into ``[{"cell_type", "source"}]`` (header block dropped).

    ``# %%`` starts a code cell, ``# %% [markdown]`` a markdown cell whose lines carry a ``# `` prefix.
    Blank lines around a cell's body are not part of it.
    """
    cells: list[dict] = []
    kind, lines = None, []

    def flush() -> None:
        if kind is None:
            return
        body = list(lines)
        while body and not body[0].strip():
            body.pop(0)
        while body and not body[-1].strip():
            body.pop()
        if kind == "markdown":
            body = [ln[2:] if ln.startswith("# ") else ln.lstrip("#") for ln in body]
        cells.append({"cell_type": kind, "source": "\n".join(body)})

    for line in text.splitlines():
        if line.startswith("# %%"):
            flush()
            kind, lines = ("markdown" if "[markdown]" in line else "code"), []
        elif kind is not None:
            lines.append(line)
    flush()
    return cells


def notebook_from_twin() -> dict:
    """The notebook JSON (nbformat 4, no outputs) built from the ``.py`` twin."""
    cells = []
    for i, c in enumerate(percent_cells(TWIN.read_text(encoding="utf-8"))):
        src = c["source"].splitlines(keepends=True)
        cell = {"cell_type": c["cell_type"], "id": f"cell-{i:02d}", "metadata": {}, "source": src}
        if c["cell_type"] == "code":
            cell.update(execution_count=None, outputs=[])
        cells.append(cell)
    meta = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
            "language_info": {"name": "python"},
            "jupytext": {"formats": "ipynb,py:percent"}}
    return {"cells": cells, "metadata": meta, "nbformat": 4, "nbformat_minor": 5}


def _source(cell: dict) -> str:
    src = cell["source"]
    return "".join(src) if isinstance(src, list) else src


def test_twin_matches_notebook():
    nb = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
    got = [(c["cell_type"], _source(c).strip("\n")) for c in nb["cells"]]
    want = [(c["cell_type"], c["source"]) for c in percent_cells(TWIN.read_text(encoding="utf-8"))]
    assert len(got) == len(want), f"{NOTEBOOK.name} has {len(got)} cells, {TWIN.name} {len(want)}: run --sync"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"cell {i} differs between {NOTEBOOK.name} and {TWIN.name} (run --sync):\n{g}\n---\n{w}"


def test_notebook_has_no_absolute_paths_or_downloads():
    text = TWIN.read_text(encoding="utf-8")
    for bad in ("/work/", "/tmp/", "/home/", "http://", "https://", "urlopen", "wget", "curl "):
        assert bad not in text, f"{TWIN.name} contains {bad!r}"


@pytest.mark.slow
def test_notebook_executes_on_cpu(tmp_path, monkeypatch):
    nbclient = pytest.importorskip("nbclient", reason="nbclient missing: pip install -e '.[test]'")
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("ipykernel")
    # a kernel spec for *this* interpreter, so the kernel sees the same environment as the test
    spec_dir = tmp_path / "jupyter" / "kernels" / "k3-notebook-test"
    spec_dir.mkdir(parents=True)
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "k3-jax test", "language": "python"}
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    # one host device (conftest asks for 8 for the sharding tests); conftest's compile flags (-O0) stay
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform")]
    monkeypatch.setenv("XLA_FLAGS", " ".join(flags))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")  # plots render as in Jupyter
    monkeypatch.setenv("K3_NOTEBOOK_OUT", str(tmp_path / "out"))
    for k, v in TEST_ENV.items():
        monkeypatch.setenv(k, v)
    nb = nbformat.reads(NOTEBOOK.read_text(encoding="utf-8"), as_version=4)
    client = nbclient.NotebookClient(nb, timeout=900, kernel_name="k3-notebook-test",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    t0, cpu0 = time.time(), resource.getrusage(resource.RUSAGE_CHILDREN)
    client.execute()  # raises CellExecutionError naming the failing cell
    wall, cpu1 = time.time() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    kernel_cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    images = [c for c in nb.cells if any("image/png" in o.get("data", {}) for o in c.get("outputs", []))]
    if importlib.util.find_spec("matplotlib") is not None:  # the run's figure and the expert-load heatmaps
        assert len(images) >= 2, f"{len(images)} cells rendered a plot"
    assert summary["config"] == "k3-tiny.json" and summary["steps"] == int(TEST_ENV["K3_NOTEBOOK_STEPS"])
    losses = list(summary["loss_curve"].values())
    assert all(0.0 < x < 20.0 for x in losses), losses
    assert len(summary["generated"]) == 4
    assert abs(summary["eval_loss_mxfp4_export"] - summary["eval_loss"]) < 0.5, summary
    print(f"notebook executed in {wall:.1f} s wall, kernel CPU time {kernel_cpu:.1f} s")


def execute_to(out_path: str, timeout: int = 1200) -> None:
    """Run the notebook as is (this interpreter's kernel, the current environment) and save the rendered copy."""
    import nbclient
    import nbformat

    nb = nbformat.reads(NOTEBOOK.read_text(encoding="utf-8"), as_version=4)
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    try:
        client.execute()
    finally:
        nbformat.write(nb, out_path)


if __name__ == "__main__":
    if sys.argv[1:] == ["--sync"]:
        NOTEBOOK.write_text(json.dumps(notebook_from_twin(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"wrote {NOTEBOOK.relative_to(ROOT)} from {TWIN.relative_to(ROOT)}")
    elif len(sys.argv) == 3 and sys.argv[1] == "--execute":
        execute_to(sys.argv[2])
    else:
        sys.exit(f"usage: python {Path(__file__).name} --sync | --execute OUT.ipynb   (or run it with pytest)")
