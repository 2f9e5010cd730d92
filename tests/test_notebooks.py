"""Every notebook in notebooks/ runs top to bottom in a real kernel, as a reader would run it.

A markdown cell tagged `restart-kernel` stands for the reader pressing Restart: the test restarts the
kernel there for real and goes on with the next cells.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.util import run_sync

from kernel_server.client import Client

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def execute(name: str, workdir: Path, env: dict[str, str], extra: tuple[str, ...] = (),
            restart: bool = True) -> nbformat.NotebookNode:
    """Run notebooks/<name> in `workdir` (a copy), restarting where it says so (unless not `restart`: Run
    All, as most people first run a notebook), then the `extra` cells; return it executed."""
    shutil.copy(NOTEBOOKS / name, workdir / name)
    nb = nbformat.read(workdir / name, as_version=4)
    nb.cells += [nbformat.v4.new_code_cell(source) for source in extra]
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(workdir)}})
    with client.setup_kernel(env=env, cwd=str(workdir)):
        for index, cell in enumerate(nb.cells):
            if restart and "restart-kernel" in cell.metadata.get("tags", []):
                before = client.km.provisioner.pid
                run_sync(client.km.restart_kernel)(now=False)  # graceful, as the restart button
                run_sync(client.kc.wait_for_ready)(timeout=120)
                assert client.km.provisioner.pid != before, "a restart gives a new kernel process"
            if cell.cell_type == "code":
                client.execute_cell(cell, index)
    return nb


def stdout_of(nb: nbformat.NotebookNode) -> str:
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                   if o.get("output_type") == "stream")


@pytest.fixture
def notebook_env(overmind_home: Path) -> dict[str, str]:
    return dict(os.environ, OVERMIND_DEMO_MODEL="tiny", PYTHONWARNINGS="ignore")


def test_quickstart_restart_gives_a_hit(tmp_path: Path, notebook_env: dict[str, str], overmind_home: Path) -> None:
    """The times it prints are for the reader (benchmarks/ measure speed); the test checks that the load
    after the real restart was served by the daemon."""
    nb = execute("quickstart.ipynb", tmp_path, notebook_env)
    text = stdout_of(nb)
    assert re.search(r"first load \(before the restart\):\s+\d+ ms", text), text
    assert re.search(r"same load after the restart:\s+\d+ ms", text), text
    with Client(overmind_home, role="test") as client:
        status = client.request("status")
    assert status["stats"]["misses"] == 1 and status["stats"]["hits"] == 1, status["stats"]
    assert widget_views(nb.cells[-1]) == 1, "the status cell shows the cache widget"
    # run again with the daemon up (`make demo --keep-daemon`): both loads are hits, and it claims no speed-up
    text = stdout_of(execute("quickstart.ipynb", tmp_path, notebook_env))
    assert "a hit already" in text and "was a hit too" in text, text
    assert "faster" not in text, text


def test_quickstart_run_all_without_a_restart_claims_no_speed_up(tmp_path: Path,
                                                                 notebook_env: dict[str, str]) -> None:
    """Run All never restarts: the cell after "Now restart the kernel" sees the same kernel and says so,
    instead of printing a speed-up that no restart showed."""
    text = stdout_of(execute("quickstart.ipynb", tmp_path, notebook_env, restart=False))
    assert "No restart happened" in text and "restart the kernel" in text, text
    assert "faster" not in text and "after the restart" not in text, text


@pytest.mark.parametrize("name", sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")))
def test_notebooks_are_stored_without_outputs(name: str) -> None:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{name} holds outputs: strip them"


@pytest.mark.parametrize("name", sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")))
def test_notebooks_are_stored_as_jupyterlab_leaves_them(name: str) -> None:
    """A notebook opens in JupyterLab unmodified only if nothing the frontend writes on opening differs: the
    kernel's `language_info` goes into the metadata as the kernel starts (without one the notebook opened
    marked modified), and the file is in the normal form nbformat writes. The version is the Python's the
    notebooks were saved with; `make demo` writes its own Python's into its copies (tests/test_demo.py)."""
    from ipykernel.ipkernel import IPythonKernel

    raw = (NOTEBOOKS / name).read_text()
    nb = nbformat.reads(raw, as_version=4)
    assert raw == nbformat.writes(nb) + "\n", f"{name} is not as nbformat writes it: nbformat.write it"
    info = dict(nb.metadata.get("language_info") or {})
    assert info.pop("version", None), f"{name} has no language_info (JupyterLab adds it on opening)"
    assert info == {k: v for k, v in IPythonKernel.language_info.items() if k != "version"}, info
    assert nb.metadata["kernelspec"] == {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                         "language": "python"}


def widget_views(cell: nbformat.NotebookNode) -> int:
    return sum("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in cell.get("outputs", []))


# What the adapter panel's Compare shows (the panel of the notebook's last cell, driven as its button does).
COMPARE = """
import json
from overmind_jupyter import widgets
panel = widgets.adapter_panel(model, tokenizer)
for thread in panel.generate("hello world the model", ["fr", "de", "__base__"], max_new_tokens=8):
    thread.join()
print("COMPARE", json.dumps({"vocab": [len(tokenizer), model.config.vocab_size],
                             "outputs": list(panel._results.values())}))
panel.close()
"""


@pytest.mark.parametrize("size", ["tiny", "0.1b"])
def test_adapters_notebook_serves_every_request_right(tmp_path: Path, notebook_env: dict[str, str],
                                                      size: str) -> None:
    """With the demo's default model too (0.1b: 32,000 tokens), whose tokenizer once had 256: Compare
    showed nothing."""
    nb = execute("adapters.ipynb", tmp_path, dict(notebook_env, OVERMIND_DEMO_MODEL=size), extra=(COMPARE,))
    text = stdout_of(nb)
    assert "12 concurrent requests, 0 wrong outputs" in text, text
    assert "batched: 0 wrong outputs" in text, text
    assert widget_views(nb.cells[-2]) == 1, "the adapter panel shows"
    compare = json.loads(text.split("COMPARE ", 1)[1].splitlines()[0])
    assert compare["vocab"][0] == compare["vocab"][1], "the tokenizer's vocabulary is the model's"
    for out in compare["outputs"]:
        assert out["status"] == "done" and out["tokens"] == 8, out
        words = out["text"].split()
        assert words, f"{out['adapter']}: generated {out['ids']}, which decode to nothing"


def test_gpu_units_notebook_moves_the_idle_model_off(tmp_path: Path, notebook_env: dict[str, str]) -> None:
    nb = execute("gpu_units.ipynb", tmp_path, notebook_env)
    text = stdout_of(nb)
    # what the prints say is what the text around them says, simulated device or not
    weights = "cpu" if "no GPU here" in text else "cuda:0"
    assert f"first: holds units of cuda:0, weights on {weights}" in text, text
    before = text.split("first:  ", 1)[0]
    assert re.search(r"\(this kernel\)\s+first\s", before) and "second" not in before, "the ledger then: the first"
    assert "first:  holds no units, weights on cpu" in text, text
    assert f"second: holds units of cuda:0, weights on {weights}" in text, text
    assert widget_views(nb.cells[-1]) == 1, "the units bar shows, after the text that says what it shows"
    assert "live" in nb.cells[-2].source and nb.cells[-2].cell_type == "markdown"
