"""The notebook widgets in a real JupyterLab, driven in Debian's Chromium through Playwright.

A notebook loads a tiny model with `%overmind on` and shows `%overmind status` (the cache table over the GPU
units bar) and `%overmind adapters` (the adapter panel). It is run from the page with JupyterLab's own
command; the test then reads the rendered widgets through DOM queries: the entry row of the model, the two
simulated devices and the model's segment, the gate's adapters. It evicts the entry with its button and sees
the row go within 2 s, switches the default adapter with a click, compares two adapters side by side, and
clears the outputs to see the widgets' polling stop. Screenshots: test-artifacts/widgets.png (the status
widget), widgets-adapters.png (the adapter panel), widgets-lab.png (the window).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.browser_lab import (
    ARTIFACTS,
    JupyterLab,
    chromium,
    closing_browser,
    contrast_failures,
    launch,
    set_theme,
)

pytestmark = pytest.mark.browser

TIMEOUT_MS = 90_000
CHANGE_MS = 2_000  # a widget reflects a state change within 2 s


def _notebook(model_dir: Path, tokenizer_dir: Path) -> dict[str, Any]:
    import nbformat

    cells = [
        "%load_ext overmind_jupyter\n%overmind on",
        ("import torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "import overmind_jupyter\n"
        "from overmind_jupyter import units\n"
        "torch.set_num_threads(1)\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(model_dir)!r})\n"
        "units.place(model, label='tiny-llama')"),
        "%overmind status",
        ("from peft import LoraConfig, get_peft_model\n"
        f"tok = AutoTokenizer.from_pretrained({str(tokenizer_dir)!r})\n"
        f"base = AutoModelForCausalLM.from_pretrained({str(model_dir)!r})  # a hit: the cached copy\n"
        "lora = dict(r=4, lora_alpha=8, target_modules='all-linear', init_lora_weights=False)\n"
        "torch.manual_seed(1)\n"
        "lm = get_peft_model(base, LoraConfig(**lora), adapter_name='fr')\n"
        "torch.manual_seed(2)\n"
        "lm.add_adapter('de', LoraConfig(**lora))\n"
        "lm = lm.eval()"),
        "%overmind adapters lm --tokenizer tok",
    ]
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def _settings(lab: JupyterLab) -> None:
    """Every cell attached to the page (no windowing), and the app on `window` for its commands."""
    page_config = lab.workdir / "config" / "labconfig" / "page_config.json"
    config = json.loads(page_config.read_text())
    config["exposeAppInBrowser"] = True
    page_config.write_text(json.dumps(config))
    tracker = lab.workdir / "settings" / "@jupyterlab" / "notebook-extension"
    tracker.mkdir(parents=True, exist_ok=True)
    (tracker / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))


def _kernel_client(lab: JupyterLab, notebook: str = "widgets.ipynb") -> Any:
    """A second client on a notebook's kernel (to look inside it; the notebook shows nothing of it)."""
    from jupyter_client import BlockingKernelClient

    (kernel_id,) = [s["kernel"]["id"] for s in lab.request("GET", "api/sessions") if s["path"] == notebook]
    deadline = time.monotonic() + 60
    while not (files := list(lab.runtime.glob(f"kernel-{kernel_id}*.json"))):
        assert time.monotonic() < deadline, f"no connection file of {notebook}'s kernel"
        time.sleep(0.1)
    client = BlockingKernelClient(connection_file=str(files[0]))
    client.load_connection_file()
    client.start_channels(hb=False)
    client.wait_for_ready(timeout=90)
    return client


def _other_notebooks(lab: JupyterLab, model_dir: Path) -> list[Any]:
    """Two more notebooks' kernels (sessions of the server, as JupyterLab opens them), each loading the
    model: hits, named by their notebooks."""
    clients = []
    for name in ("second.ipynb", "third.ipynb"):
        lab.request("POST", "api/sessions", {"path": name, "name": name, "type": "notebook",
                                             "kernel": {"name": "python3"}})
        kc = _kernel_client(lab, name)
        clients.append(kc)
        _ask(kc, "%load_ext overmind_jupyter\n%overmind on\n"
                 "from transformers import AutoModelForCausalLM\n"
                 f"m = AutoModelForCausalLM.from_pretrained({str(model_dir)!r})")
    return clients


def _status_widget_goes(page: Any, cells: list[int], end: str) -> Any:
    """Run `cells` of the notebook (the last one `%overmind status`), check that its widget is live, then end
    its kernel with the script `end`: the widget says once that its kernel is gone (the cache table and the
    units bar both know) and its buttons do nothing. Returns the widget's output."""
    from playwright.sync_api import expect

    page.evaluate("""async (cells) => {
        const panel = window.jupyterapp.shell.currentWidget;
        for (const cell of cells) {
            panel.content.activeCellIndex = cell;
            await window.jupyterapp.commands.execute("notebook:run-cell");
        }
    }""", cells)
    status = page.get_by_test_id("overmind-widget-cache")
    expect(status.get_by_test_id("overmind-widget-entry")).to_have_count(1, timeout=30_000)
    expect(status.get_by_test_id("overmind-widget-evict")).to_be_enabled()
    expect(status.get_by_test_id("overmind-widget-gone")).to_have_count(0)
    shown = page.locator(".jp-OutputArea-output", has=status)
    page.evaluate(end)
    gone = shown.get_by_test_id("overmind-widget-gone")
    expect(gone.first).to_contain_text("kernel that is gone", timeout=30_000)
    expect(shown.locator(".om-view.om-dead")).to_have_count(2)
    expect(gone).to_have_count(1)
    expect(status.get_by_test_id("overmind-widget-evict")).to_be_disabled()
    return shown


def _ask(kc: Any, code: str) -> str:
    out: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])

    reply = kc.execute_interactive(code, timeout=60, output_hook=hook)
    if reply["content"]["status"] != "ok":
        raise AssertionError("\n".join(reply["content"].get("traceback", [])))
    return "".join(out).strip()


def test_status_and_adapter_widgets_in_jupyterlab(overmind_home: Path, tiny_llama: Path,
                                                  tmp_path: Path) -> None:
    executable = chromium()
    from playwright.sync_api import expect, sync_playwright

    from overmind_jupyter.demo_models import build_tokenizer

    ARTIFACTS.mkdir(exist_ok=True)
    tokenizer_dir = build_tokenizer(tmp_path / "tokenizer")
    env = dict(os.environ, OVERMIND_HOME=str(overmind_home), OVERMIND_FAKE_GPUS="2x16")
    lab = JupyterLab(tmp_path / "lab", env)
    _settings(lab)
    import nbformat

    nbformat.write(_notebook(tiny_llama, tokenizer_dir), lab.root / "widgets.ipynb")
    lab.start()
    kc = None
    others: list[Any] = []
    started = time.monotonic()
    try:
        with sync_playwright() as pw:
            browser = launch(pw, executable)
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.set_default_timeout(TIMEOUT_MS)
            console: list[str] = []
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            with closing_browser(browser, page, console, lab, "widgets-failure.png"):
                page.goto(f"{lab.url}lab/tree/widgets.ipynb?token={lab.token}")
                page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                                       " && window.jupyterapp.shell.currentWidget.sessionContext")
                page.evaluate("""async () => {
                    const panel = window.jupyterapp.shell.currentWidget;
                    await panel.sessionContext.ready;
                    await window.jupyterapp.commands.execute("notebook:run-all-cells");
                }""")

                # %overmind status: the cache table and the units bar
                status = page.get_by_test_id("overmind-widget-cache")
                rows = status.get_by_test_id("overmind-widget-entry")
                entry = rows.filter(has_text="AutoModelForCausalLM")  # the tokenizer is cached too
                expect(entry).to_have_count(1)
                others = _other_notebooks(lab, tiny_llama)
                # the first load's progress in its cell: transformers' own bar (an ipywidgets bar), named
                bar = page.locator(".jp-OutputArea-output .jupyter-widgets", has_text="Loading weights (tiny-llama)")
                expect(bar.first).to_be_visible()
                expect(bar.first).to_contain_text("100%")
                expect(rows.filter(has_text="AutoTokenizer")).to_have_count(1)
                expect(entry).to_contain_text("this kernel")  # it uses the cached copy (`base`, a hit)
                # "Last used" moves on while shown, the entry unchanged
                last_used = entry.locator("td[data-ago]")
                said, since = last_used.inner_text(), last_used.get_attribute("data-ago")
                expect(last_used).not_to_have_text(said, timeout=5_000)
                assert last_used.get_attribute("data-ago") == since
                expect(entry.get_by_test_id("overmind-widget-model")).to_have_text("tiny-llama")
                # what its miss cost, in the words of the cell's line and the panel (issue 40)
                expect(entry.get_by_test_id("overmind-widget-miss")).to_have_text(
                    re.compile(r"^cached in \S+ m?s: loading \S+ m?s \+ caching \S+ m?s$"))
                expect(entry).to_contain_text("KiB")
                # the kernel by its notebook, the pid and command on hover
                kernels = entry.get_by_test_id("overmind-widget-kernel")
                expect(kernels).to_have_count(3)
                for name in ("widgets.ipynb", "second.ipynb", "third.ipynb"):
                    kernel = kernels.filter(has_text=name)
                    expect(kernel).to_have_count(1)
                    expect(kernel).to_have_attribute("title", re.compile(rf"^pid \d+, .*{name}: .*python"))
                # the two pictures, the side panel's (charts.ts): memory per entry against the budget, and
                # the hits' times against the plain loads' (`base` was a hit of `model`'s load)
                memory = status.get_by_test_id("overmind-widget-memory")
                expect(memory.get_by_test_id("overmind-widget-memory-segment")).to_have_count(2)
                expect(memory).to_contain_text("widgets.ipynb")
                assert memory.get_by_test_id("overmind-chart-memory").get_attribute("data-segments") == "2"
                saved = status.get_by_test_id("overmind-widget-saved")
                # the side panel's chart (charts.ts): `base` here, `m` in the two other notebooks, each
                # with its own time (sent after its cell)
                expect(saved.get_by_test_id("overmind-chart-saved")).to_have_attribute("data-hits", "3")
                expect(saved).to_contain_text("Load time saved")
                # what RSS and PSS count of a shared model, the panel's words (issue 40)
                pss = status.get_by_test_id("overmind-widget-pss")
                expect(pss).to_contain_text("RSS counts a model once per kernel")
                expect(pss).to_have_attribute("title", re.compile(r"PSS \(proportional set size"))
                units = page.get_by_test_id("overmind-widget-units")
                devices = units.get_by_test_id("overmind-widget-device")
                expect(devices).to_have_count(2)
                for i in range(2):
                    expect(devices.nth(i).get_by_test_id("overmind-widget-simulated")).to_have_text("simulated")
                segment = devices.nth(0).get_by_test_id("overmind-widget-segment")
                expect(segment).to_have_attribute("data-model", "tiny-llama")
                expect(segment).to_have_attribute("data-busy", "false")
                output = page.locator(".jp-OutputArea-output", has=status)
                output.screenshot(path=str(ARTIFACTS / "widgets.png"))

                # the adapter panel: switch with a click, compare two adapters side by side
                gate = page.get_by_test_id("overmind-widget-gate")
                expect(gate.get_by_test_id("overmind-widget-mode")).to_have_text("routed")
                expect(gate.get_by_test_id("overmind-widget-default")).to_have_text("fr")
                expect(gate.get_by_test_id("overmind-widget-adapter")).to_have_count(3)
                panel = page.locator(".jp-OutputArea-output", has=gate)
                panel.locator(".widget-toggle-button", has_text=re.compile(r"^de$")).click()
                expect(gate.get_by_test_id("overmind-widget-default")).to_have_text("de", timeout=CHANGE_MS)
                assert _row_default(gate, "de")
                # Generate with no prompt: the panel asks for one and runs nothing
                panel.locator(".widget-button", has_text="Generate").click()
                expect(panel.get_by_test_id("overmind-widget-outputs-notice")).to_contain_text("prompt")
                expect(panel.get_by_test_id("overmind-widget-output")).to_have_count(0)
                # the base model is in sight in the list of adapters to compare, with how to select several
                listbox = panel.locator(".widget-select-multiple select")
                assert listbox.evaluate("""(s) => {
                    const o = [...s.options].find((o) => o.textContent === "__base__");
                    const a = s.getBoundingClientRect(), b = o.getBoundingClientRect();
                    return b.top >= a.top && b.bottom <= a.bottom && s.scrollHeight <= s.clientHeight;
                }"""), "every adapter, __base__ first, in sight"
                expect(panel).to_contain_text("Ctrl-click")
                panel.locator(".widget-textarea textarea").fill("hello world the model")
                panel.locator(".widget-select-multiple select").select_option(label=["de", "fr"])
                panel.locator(".widget-button", has_text="Generate").click()
                outputs = panel.get_by_test_id("overmind-widget-output")
                expect(outputs).to_have_count(2)
                for i in range(2):
                    expect(outputs.nth(i)).to_have_attribute("data-status", "done")
                assert {outputs.nth(i).get_attribute("data-adapter") for i in range(2)} == {"de", "fr"}
                panel.screenshot(path=str(ARTIFACTS / "widgets-adapters.png"))
                page.screenshot(path=str(ARTIFACTS / "widgets-lab.png"), full_page=True)

                # every text of the widgets readable in both themes (computed styles, WCAG ratio >= 4.5)
                for theme, name in (("JupyterLab Dark", "dark"), ("JupyterLab Light", "light")):
                    set_theme(page, theme)
                    checked, failures = contrast_failures(page, ".om-w")
                    output.screenshot(path=str(ARTIFACTS / f"widgets-{name}.png"))
                    panel.screenshot(path=str(ARTIFACTS / f"widgets-adapters-{name}.png"))
                    assert checked > 30 and not failures, (theme, failures)

                # evict with the row's button: the row goes within 2 s
                entry.get_by_test_id("overmind-widget-evict").click()
                expect(entry).to_have_count(0, timeout=CHANGE_MS)
                expect(rows).to_have_count(1)
                expect(status.get_by_test_id("overmind-widget-notice")).to_contain_text("evicted")
                expect(memory.get_by_test_id("overmind-widget-memory-segment")).to_have_count(1, timeout=CHANGE_MS)
                expect(status.get_by_test_id("overmind-widget-notice")).to_have_count(0, timeout=12_000)  # it clears

                # the views told the kernel they exist; clearing the outputs stops the polling
                kc = _kernel_client(lab)
                probe = ("from overmind_jupyter.widgets.polling import poller\n"
                         "print(sorted(s.active() for s in list(poller()._subs.values())))")
                assert _ask(kc, probe) == "[True, True]"
                page.evaluate("() => window.jupyterapp.commands.execute('notebook:clear-all-cell-outputs')")
                expect(page.get_by_test_id("overmind-widget-cache")).to_have_count(0)
                deadline = time.monotonic() + 5
                while (answer := _ask(kc, probe)) != "[False, False]" and time.monotonic() < deadline:
                    time.sleep(0.2)
                assert answer == "[False, False]", "widgets shown nowhere must not be polled"

                # after a restart, a widget of the old kernel says it is gone and its buttons do nothing
                shown = _status_widget_goes(page, [2], "() => window.jupyterapp.shell.currentWidget"
                                            ".sessionContext.session.kernel.restart()")
                shown.screenshot(path=str(ARTIFACTS / "widgets-gone.png"))
                # Kernel > Shut Down marks nothing disconnected: the views find their kernel gone all the same
                # (Note [A kernel shut down] in labextension/src/widgets/live.ts); %overmind on, %overmind status
                _status_widget_goes(page, [0, 2],
                                    "() => window.jupyterapp.commands.execute('notebook:shutdown-kernel')")
                errors = [line for line in console if line.startswith("error") and "overmind" in line.lower()]
                assert not errors, errors
    finally:
        for other in others:
            other.stop_channels()
        if kc is not None:
            kc.stop_channels()
        lab.stop()
        print(f"browser test: {time.monotonic() - started:.1f} s after JupyterLab answered")


def _row_default(gate: Any, name: str) -> bool:
    row = gate.locator(f'[data-testid="overmind-widget-adapter"][data-adapter="{name}"]')
    return "om-default" in (row.get_attribute("class") or "")
