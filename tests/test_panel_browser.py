"""The side panel and its status-bar item in a real JupyterLab, driven in Debian's Chromium through Playwright.

One JupyterLab (real kernels, a real daemon on a temporary OVERMIND_HOME, two simulated GPUs) serves the
whole module; its tests run in order, as a user's session goes:

1. No daemon yet: panel and status bar say so, and over 30 s of polling the server logs no error.
2. Three notebooks (`alpha.ipynb`, `beta.ipynb`, `work/gamma.ipynb`) turn overmind on and load a tiny
   model: the panel and the status bar name each kernel by its notebook, with the pid on hover.
3. The status item and the charts (memory per model against the budget, load time saved, GPU units over
   time) render and change after a load and after an evict from the panel.
4. A first load of a model large enough to take seconds shows its progress in the panel.
5. The settings: without the status item, a hidden panel stops polling.

Every view is checked for contrast (every visible text at least 4.5:1 against its background, from the
computed styles) in the light and the dark theme. Screenshots, light and dark, land in test-artifacts/
(gitignored): panel-down-{light,dark}.png, panel-notebooks-{light,dark}.png,
statusbar-{light,dark}.png, panel-loaded-{light,dark}.png, panel-evicted-{light,dark}.png,
panel-progress-light.png (the loading section, when a poll caught the load before it ended); and
panel-<test>-failure.png when a test fails.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import stop_daemon
from tests.helpers.browser_lab import (
    ARTIFACTS,
    JupyterLab,
    chromium,
    contrast_failures,
    failure_report,
    launch,
    set_theme,
)

pytestmark = pytest.mark.browser

TIMEOUT_MS = 120_000
REFRESH_S = 0.5  # the panel's refresh interval in these tests (its setting)
QUIET_S = 15  # the server must log no error over this long with the panel open and no daemon (3 polls)
NOTEBOOKS = ("alpha.ipynb", "beta.ipynb", "work/gamma.ipynb")
THEMES = {"light": "JupyterLab Light", "dark": "JupyterLab Dark"}
PANEL = "#overmind-panel"
STATUS_ITEM = '[data-testid="overmind-statusbar"]'


@dataclass
class Lab:
    """The module's JupyterLab, its page and what the page saw."""

    lab: JupyterLab
    page: Any
    home: Path
    models: Path
    console: list[str] = field(default_factory=list)
    polls: list[float] = field(default_factory=list)

    @property
    def panel(self) -> Any:
        return self.page.locator(PANEL)

    @property
    def status_item(self) -> Any:
        return self.page.locator(STATUS_ITEM)

    def open_panel(self) -> None:
        if not self.panel.is_visible():
            self.page.locator('.jp-SideBar .lm-TabBar-tab[data-id="overmind-panel"]').click()
        self.page.wait_for_selector(PANEL, state="visible")

    def run_notebook(self, path: str) -> None:
        """Open `path` in JupyterLab and run all its cells (the call returns once they are queued)."""
        self.page.evaluate("""async (path) => {
            const app = window.jupyterapp;
            const widget = await app.commands.execute('docmanager:open', {path, factory: 'Notebook'});
            await widget.context.ready;
            await widget.sessionContext.ready;
            app.shell.activateById(widget.id);
            await app.commands.execute('notebook:run-all-cells');
        }""", path)

    def each_theme(self, name: str, *selectors: str, target: Any = None) -> None:
        """In both themes: screenshot `target` (the panel by default) as `name`-THEME.png and check the
        contrast of every visible text in the panel and the status item (and `selectors`)."""
        for theme, title in THEMES.items():
            set_theme(self.page, title)
            (self.panel if target is None else target).screenshot(path=str(ARTIFACTS / f"{name}-{theme}.png"))
            checked, failures = 0, []
            for selector in (PANEL, STATUS_ITEM, *selectors):
                n, bad = contrast_failures(self.page, selector)
                checked, failures = checked + n, failures + bad
            assert checked > 5, f"{name} ({theme}): only {checked} texts seen"
            assert not failures, f"{name} ({theme}): texts under 4.5:1: {failures}"
        set_theme(self.page, THEMES["light"])


def _notebook(*cells: str) -> Any:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


ON = "%load_ext overmind_jupyter\n%overmind on"


def _load(model: Path, name: str = "model") -> str:
    return (f"from transformers import AutoModelForCausalLM\n"
            f"{name} = AutoModelForCausalLM.from_pretrained({str(model)!r})")


def browser_session(lab: JupyterLab, executable: str, home: Path, models_dir: Path, name: str,
                    on_page: Callable[[Lab], None] = lambda s: None) -> Iterator[Lab]:
    """Start `lab`, open it in Chromium and yield the session (for a module's fixture); `on_page` runs
    before the page loads. At the end: the browser, JupyterLab and the daemon of `home` are stopped."""
    from playwright.sync_api import expect, sync_playwright

    lab.start()
    started = time.monotonic()
    try:
        with sync_playwright() as pw:
            browser = launch(pw, executable)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(TIMEOUT_MS)
            # a poll of the panel, its fetch and a redraw can take seconds with three test workers on two
            # cores: every expectation waits up to 20 s instead of playwright's 5
            expect.set_options(timeout=20_000)
            s = Lab(lab, page, home, models_dir)
            page.on("console", lambda m: s.console.append(f"{m.type}: {m.text}"))
            on_page(s)
            with failure_report(page, s.console, lab, f"{name}-setup-failure.png"):
                page.goto(f"{lab.url}lab?token={lab.token}")
                page.wait_for_function("() => window.jupyterapp && window.jupyterapp.started")
                page.wait_for_selector(STATUS_ITEM)
            try:
                yield s
            finally:
                browser.close()
    finally:
        lab.stop()
        stop_daemon(home)
        shutil.rmtree(home, ignore_errors=True)
        print(f"{name} browser tests: {time.monotonic() - started:.1f} s after JupyterLab answered")


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path, models_dir: Path) -> Iterator[Lab]:
    executable = chromium()
    import nbformat

    ARTIFACTS.mkdir(exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="om-", dir="/tmp"))  # short, for the socket path limit
    os.chmod(home, 0o700)
    env = dict(os.environ, OVERMIND_HOME=str(home), OVERMIND_FAKE_GPUS="2x16")
    env.pop("TQDM_DISABLE", None)  # progress bars on, as users have them
    lab = JupyterLab(tmp_path_factory.mktemp("lab"), env, expose_app=True, settings={
        "overmind-jupyter:panel": {"refreshInterval": REFRESH_S},
        "@jupyterlab/notebook-extension:tracker": {"windowingMode": "none"},
    })
    (lab.root / "work").mkdir()
    units = "from overmind_jupyter import units\nunits.place(model, label='tiny-llama')"
    # beta's load is a hit; its `%overmind status` sends the hit's time to the daemon
    sources = ([ON, _load(tiny_llama), units], [ON, _load(tiny_llama), "%overmind status"], [ON])
    for path, cells in zip(NOTEBOOKS, sources, strict=True):
        nbformat.write(_notebook(*cells), lab.root / path)
    def count_polls(s: Lab) -> None:
        s.page.on("request", lambda r: s.polls.append(time.monotonic()) if "/overmind/state" in r.url else None)

    yield from browser_session(lab, executable, home, models_dir, "panel", count_polls)


@pytest.fixture
def lab(session: Lab, request: pytest.FixtureRequest) -> Iterator[Lab]:
    """The module's JupyterLab, with a screenshot, the console and the server's log on a failure."""
    with failure_report(session.page, session.console, session.lab, f"panel-{request.node.name}-failure.png"):
        yield session


def _log_lines(lab: Lab) -> list[str]:
    return lab.lab.log_path.read_text(errors="replace").splitlines()


def test_without_a_daemon_panel_and_status_say_so_and_the_server_logs_no_error(lab: Lab) -> None:
    from playwright.sync_api import expect

    before = len(_log_lines(lab))
    lab.open_panel()
    start = time.monotonic()
    down = lab.panel.get_by_test_id("overmind-down")
    expect(down).to_contain_text("No overmind daemon is running")
    expect(down.locator("code").first).to_have_text("%overmind on")  # code, not literal backticks
    assert "`" not in lab.panel.inner_text(), "hints show code as code, not backticks"
    expect(lab.status_item).to_have_text("Overmind: no daemon")
    expect(lab.panel.get_by_test_id("overmind-refresh").locator("svg")).to_have_count(1)  # JupyterLab's icon
    lab.each_theme("panel-down")
    lab.page.wait_for_timeout(max(0.0, QUIET_S - (time.monotonic() - start)) * 1000)

    polls = [t for t in lab.polls if t >= start]
    assert len(polls) >= QUIET_S // 5 - 1, f"the open panel polled {len(polls)} times in {QUIET_S} s"
    new = _log_lines(lab)[before:]
    errors = [line for line in new if re.match(r"\[[EWC] ", line) or "Traceback" in line or " 503 " in line]
    assert not errors, "the server logged, with the panel open and no daemon:\n" + "\n".join(errors)
    assert not [line for line in new if "overmind/state" in line], "each poll must not be logged"
    assert not (lab.home / "daemon.sock").exists(), "the panel must not start a daemon"


def test_panel_and_status_bar_name_each_kernel_by_its_notebook(lab: Lab) -> None:
    from playwright.sync_api import expect

    for path in NOTEBOOKS:
        lab.run_notebook(path)
    lab.open_panel()
    kernels = lab.panel.get_by_test_id("overmind-kernel")
    expect(kernels).to_have_count(3)
    names = sorted(kernels.nth(i).locator(".jp-Overmind-label").inner_text() for i in range(3))
    assert names == sorted(NOTEBOOKS), names
    for i in range(3):
        pid = kernels.nth(i).get_attribute("data-pid")
        detail = f"pid {pid}, notebook kernel"
        expect(kernels.nth(i).locator(".jp-Overmind-label")).to_have_attribute("title", re.compile(re.escape(detail)))
        expect(kernels.nth(i)).to_contain_text(detail)
    entry = lab.panel.get_by_test_id("overmind-entry")
    expect(entry).to_have_count(1)
    expect(entry).to_contain_text("alpha.ipynb")  # its users, by notebook
    expect(entry).to_contain_text("beta.ipynb")
    holder = lab.panel.get_by_test_id("overmind-holder")  # alpha placed the model on a simulated GPU
    expect(holder).to_contain_text("for tiny-llama (alpha.ipynb)")
    expect(lab.status_item).to_have_attribute("title", re.compile("alpha.ipynb, .*beta.ipynb|beta.ipynb, .*alpha"))
    title = lab.status_item.get_attribute("title") or ""
    assert all(path in title for path in NOTEBOOKS), title
    lab.each_theme("panel-notebooks")
    for theme, name in THEMES.items():
        set_theme(lab.page, name)
        lab.page.locator("#jp-main-statusbar").screenshot(path=str(ARTIFACTS / f"statusbar-{theme}.png"))
    set_theme(lab.page, THEMES["light"])


def test_status_item_and_charts_change_after_a_load_and_an_evict(lab: Lab) -> None:
    from playwright.sync_api import expect

    from overmind_jupyter.demo_models import build_llama

    lab.open_panel()
    memory = lab.panel.get_by_test_id("overmind-chart-memory")
    saved = lab.panel.get_by_test_id("overmind-chart-saved")
    units = lab.panel.get_by_test_id("overmind-chart-units")
    expect(memory).to_have_attribute("data-segments", "1")
    expect(lab.status_item).to_contain_text("Overmind: 1 model ·")
    expect(lab.status_item).to_contain_text("% hits")
    # beta's load was a hit: its plain load time (alpha's miss) against its own
    expect(saved).not_to_have_attribute("data-hits", "0")
    expect(saved.get_by_test_id("overmind-saved")).to_contain_text("saved over")
    expect(units).to_contain_text("simulated")
    expect(units.locator("polyline")).to_have_count(2)  # one line per simulated device
    used_before = lab.panel.get_by_test_id("overmind-used").inner_text()
    hits_before = saved.get_attribute("data-hits")

    # a second model, loaded in gamma: a segment more, more memory used
    other = build_llama(lab.models / "tiny-llama-b", "tiny", seed=1, tie_word_embeddings=True)
    lab.run_notebook("work/gamma.ipynb")  # its kernel is up: the cell below runs in it
    _run_cell(lab, _load(other, "other"))
    expect(memory).to_have_attribute("data-segments", "2")
    expect(lab.status_item).to_contain_text("Overmind: 2 models ·")
    # its "last used N seconds ago" moves on while shown, without a change of state
    fresh = lab.panel.get_by_test_id("overmind-entry").filter(has_text="gamma.ipynb").locator("[data-ago]")
    said, since = fresh.inner_text(), fresh.get_attribute("data-ago")
    expect(fresh).not_to_have_text(said, timeout=5_000)
    assert fresh.get_attribute("data-ago") == since
    expect(lab.panel.get_by_test_id("overmind-used")).not_to_have_text(used_before)
    expect(memory.locator('[data-testid="overmind-segment"]')).to_have_count(2)
    lab.each_theme("panel-loaded")

    # evict the first from the panel: its segment goes, the status item follows
    first = lab.panel.get_by_test_id("overmind-entry").filter(has_text="alpha.ipynb")
    first.get_by_test_id("overmind-evict").click()
    lab.page.locator(".jp-Dialog .jp-mod-accept").click()  # a single evict asks first
    expect(memory).to_have_attribute("data-segments", "1")
    expect(lab.status_item).to_contain_text("Overmind: 1 model ·")
    expect(saved).to_have_attribute("data-hits", hits_before or "")  # hits past stay in the session's picture
    lab.each_theme("panel-evicted")


def test_a_slow_first_load_shows_progress_in_the_panel(lab: Lab) -> None:
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import expect

    from overmind_jupyter.demo_models import build_llama

    # a real model, converted as it loads (fp32 stored, loaded as bf16); what makes the load slow is below
    big = build_llama(lab.models / "llama-f32", "tiny", dtype="float32")
    # the fastest refresh the settings allow, for several lines of the one load
    lab.lab.request("PUT", "lab/api/settings/overmind-jupyter:panel", {"raw": '{"refreshInterval": 0.5}'})
    lab.page.reload()
    lab.page.wait_for_function("() => window.jupyterapp && window.jupyterapp.started")
    lab.page.evaluate("() => window.jupyterapp.restored")
    lab.run_notebook("work/gamma.ipynb")  # the notebook the cell below runs in, its kernel as it was
    lab.open_panel()
    # every progress line the panel shows while the load runs, however briefly
    lab.page.evaluate("""() => {
        window.omProgress = [];
        const panel = document.querySelector('#overmind-panel');
        new MutationObserver(() => {
            for (const el of panel.querySelectorAll(
                    '[data-testid="overmind-loading"] [data-testid="overmind-progress"]')) {
                window.omProgress.push(el.textContent);
            }
        }).observe(panel, {childList: true, subtree: true});
    }""")
    # A first load that takes seconds on any machine (a converting miss of this model is written straight
    # into its entry, under a second here: Note [Staged conversions]): the checkpoint read behind a slow
    # disk, shown by a bar of transformers' own, as its shard bars are.
    _run_cell(lab, (
        "import time, torch, overmind_jupyter\n"
        "from transformers import AutoModelForCausalLM\n"
        "from transformers.utils import logging as hf_logging\n"
        "def load_slowly(path):\n"
        "    for _ in hf_logging.tqdm(range(12), desc='Reading from a slow disk'):\n"
        "        time.sleep(0.25)\n"
        "    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)\n"
        f"big = overmind_jupyter.cached(load_slowly, {str(big)!r})"))
    loading = lab.panel.get_by_test_id("overmind-loading")
    progress = loading.get_by_test_id("overmind-progress").first
    entry = lab.panel.get_by_test_id("overmind-entry").filter(has_text="load_slowly")
    try:  # a screenshot while it shows (the load may be over before a poll or two, or during the shot)
        progress.or_(entry).first.wait_for(state="visible", timeout=60_000)  # (not a minute past the load)
        if progress.is_visible():
            loading.screenshot(path=str(ARTIFACTS / "panel-progress-light.png"))
    except PlaywrightError:  # a timeout, or the line gone from the page while it was taken
        pass
    expect(entry).to_have_count(1)
    expect(loading).to_have_count(0)
    seen = lab.page.evaluate("() => window.omProgress")
    assert any("load_slowly" in text and re.search(r"\d+%", text) for text in seen), seen[-5:]
    # the time left shows while the daemon can estimate it (neither at the first report nor at 100%)
    assert all(" left" in text for text in seen if re.search(r"\b([1-9]\d?)%", text)), seen


def _run_cell(lab: Lab, code: str) -> None:
    """Add a cell with `code` at the end of the current notebook and run it."""
    lab.page.evaluate("""async (code) => {
        const app = window.jupyterapp;
        const nb = app.shell.currentWidget;
        nb.content.activeCellIndex = nb.content.widgets.length - 1;
        await app.commands.execute('notebook:insert-cell-below');
        nb.content.activeCell.model.sharedModel.setSource(code);
        await app.commands.execute('notebook:run-cell');
    }""", code)


def test_without_the_status_item_a_hidden_panel_stops_polling(lab: Lab) -> None:
    from playwright.sync_api import expect

    lab.lab.request("PUT", "lab/api/settings/overmind-jupyter:panel",
                    {"raw": '{"refreshInterval": 0.5, "showStatusItem": false}'})
    lab.page.reload()
    lab.page.wait_for_function("() => window.jupyterapp && window.jupyterapp.started")
    lab.page.evaluate("() => window.jupyterapp.restored")  # the workspace may reopen the panel
    lab.open_panel()
    expect(lab.panel.get_by_test_id("overmind-status")).to_have_attribute("data-state", re.compile("ok|down"))
    expect(lab.status_item).to_be_hidden()
    lab.page.locator('.jp-SideBar .lm-TabBar-tab[data-id="overmind-panel"]').click()
    expect(lab.panel).to_be_hidden()
    lab.page.wait_for_timeout(1000)
    quiet_from = time.monotonic()
    lab.page.wait_for_timeout(4000)
    assert not [t for t in lab.polls if t >= quiet_from], "a hidden panel without the status item polls"
    lab.open_panel()
    lab.page.wait_for_timeout(1500)
    assert [t for t in lab.polls if t >= quiet_from], "the panel polls again once shown"
