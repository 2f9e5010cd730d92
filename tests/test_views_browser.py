"""The views users of jupyter-resource-usage and jupyterlab-nvdashboard expect (issue 40), in a real
JupyterLab driven in Debian's Chromium through Playwright.

One JupyterLab (real kernels, a real daemon on a temporary OVERMIND_HOME whose budget two tiny models
fill past the warning, two simulated GPUs) serves the module; its tests run in order:

1. The status-bar item turns the warning colour once the cache holds 90% of its budget (model.ts
   WARN_FRACTION), and its tooltip says why.
2. Where memory is shown, a line says that tools adding up RSS count a shared model once per kernel,
   and names PSS.
3. The panel follows the focused notebook: its kernel, the models it uses and its GPU units are marked,
   and its kernel comes first.
4. Each chart of the panel opens in a main-area tab that stays live.
5. A single Evict asks first, and the rows stay where they were while the pointer is over them (Note
   [No reflow under the pointer] in labextension/src/panel.ts).
6. A reload of the page opens the charts' tabs again, live.

Every view is checked for contrast in the light and the dark theme. Screenshots land in test-artifacts/
(gitignored): views-statusbar-warn-{light,dark}.png, views-pss-{light,dark}.png,
views-focus-alpha-{light,dark}.png, views-focus-beta-{light,dark}.png,
views-chart-{memory,saved,units}-{light,dark}.png, views-evict-dialog-{light,dark}.png,
views-evicted-{light,dark}.png; and views-<test>-failure.png when a test fails.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.browser_lab import (
    ARTIFACTS,
    JupyterLab,
    chromium,
    failure_report,
)
from tests.test_panel_browser import ON, Lab, _load, _notebook, browser_session

pytestmark = pytest.mark.browser

REFRESH_S = 0.5
NOTEBOOKS = ("alpha.ipynb", "beta.ipynb")
# What an entry of a tiny model holds beyond its checkpoint's tensors (its graph, alignment), about.
ENTRY_OVERHEAD = 40_000
# Two entries fill this much of the budget: past the warning (90%), one alone far under it.
TWO_ENTRIES_FILL = 0.94


def _focus_notebook(lab: Lab, path: str) -> None:
    """Bring `path`'s (open) notebook to the front, as a click on its tab does."""
    lab.page.evaluate("""async (path) => {
        const app = window.jupyterapp;
        const widget = await app.commands.execute('docmanager:open', {path, factory: 'Notebook'});
        app.shell.activateById(widget.id);
    }""", path)


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path, models_dir: Path) -> Iterator[Lab]:
    executable = chromium()
    import nbformat

    from overmind_jupyter.demo_models import build_llama

    ARTIFACTS.mkdir(exist_ok=True)
    other = build_llama(models_dir / "tiny-llama-other", "tiny", seed=1, tie_word_embeddings=True)
    entry = max(sum(f.stat().st_size for f in m.glob("*.safetensors")) for m in (tiny_llama, other))
    budget = int(2 * (entry + ENTRY_OVERHEAD) / TWO_ENTRIES_FILL)
    home = Path(tempfile.mkdtemp(prefix="om-", dir="/tmp"))  # short, for the socket path limit
    os.chmod(home, 0o700)
    env = dict(os.environ, OVERMIND_HOME=str(home), OVERMIND_FAKE_GPUS="2x16", OVERMIND_BUDGET=str(budget))
    lab = JupyterLab(tmp_path_factory.mktemp("lab"), env, expose_app=True, settings={
        "overmind-jupyter:panel": {"refreshInterval": REFRESH_S},
        "@jupyterlab/notebook-extension:tracker": {"windowingMode": "none"},
    })
    units = "from overmind_jupyter import units\nunits.place(model, label='tiny-llama')"
    sources = ([ON, _load(tiny_llama), units], [ON, _load(other)])
    for path, cells in zip(NOTEBOOKS, sources, strict=True):
        nbformat.write(_notebook(*cells), lab.root / path)
    yield from browser_session(lab, executable, home, models_dir, "views")


@pytest.fixture
def lab(session: Lab, request: pytest.FixtureRequest) -> Iterator[Lab]:
    with failure_report(session.page, session.console, session.lab, f"views-{request.node.name}-failure.png"):
        yield session


def test_the_status_item_warns_from_90_percent_of_the_budget(lab: Lab) -> None:
    from playwright.sync_api import expect

    lab.run_notebook("alpha.ipynb")
    lab.open_panel()
    expect(lab.status_item).to_contain_text("Overmind: 1 model ·")
    expect(lab.status_item).to_have_attribute("data-level", "normal")  # one model: under half the budget
    expect(lab.panel.get_by_test_id("overmind-used")).to_have_attribute("data-level", "normal")

    lab.run_notebook("beta.ipynb")
    expect(lab.status_item).to_contain_text("Overmind: 2 models ·")
    state = lab.lab.request("GET", "overmind/state")
    held = (state["used"] + state["reserved"]) / state["budget"]
    assert held >= 0.9, f"two tiny models hold {held:.0%} of the budget: ENTRY_OVERHEAD is off"
    expect(lab.status_item).to_have_attribute("data-level", "warn")
    expect(lab.status_item).to_have_class(re.compile(r"\bjp-mod-warn\b"))
    title = lab.status_item.get_attribute("title") or ""
    assert f"holds {round(held * 100)}% of its budget" in title, title
    assert "from 90%" in title and "evict the least recently used" in title, title
    used = lab.panel.get_by_test_id("overmind-used")
    expect(used).to_have_attribute("data-level", "warn")
    expect(used).to_have_attribute("title", re.compile("from 90%"))
    # the item's colour is the theme's warning colour, not the status bar's
    background = lab.status_item.evaluate("el => getComputedStyle(el).backgroundColor")
    assert background not in ("rgba(0, 0, 0, 0)", "transparent"), background
    lab.each_theme("views-statusbar-warn", target=lab.page.locator("#jp-main-statusbar"))


def test_memory_lines_say_rss_counts_a_shared_model_once_per_kernel(lab: Lab) -> None:
    from playwright.sync_api import expect

    lab.open_panel()
    pss = lab.panel.get_by_test_id("overmind-pss")
    expect(pss).to_be_visible()
    expect(pss).to_contain_text("RSS counts a model once per kernel")
    expect(pss).to_contain_text("PSS")
    expect(pss).to_have_attribute("title", re.compile(r"PSS \(proportional set size"))
    expect(lab.status_item).to_have_attribute("title", re.compile(r"RSS count a model once per kernel.*PSS"))
    lab.each_theme("views-pss")  # the summary is rebuilt at each change: the panel stays


def test_the_panel_follows_the_focused_notebook(lab: Lab) -> None:
    from playwright.sync_api import expect

    lab.open_panel()
    focus = lab.panel.get_by_test_id("overmind-focus")
    marked = lab.panel.locator('[data-testid="overmind-entry"][data-focused="true"]')
    kernels = lab.panel.get_by_test_id("overmind-kernel")

    _focus_notebook(lab, "alpha.ipynb")
    expect(focus).to_have_attribute("data-path", "alpha.ipynb")
    expect(focus.get_by_test_id("overmind-focus-uses")).to_contain_text("tiny-llama'")
    expect(focus.get_by_test_id("overmind-focus-units")).to_contain_text(re.compile(r"\b1 GPU unit on cuda:"))
    assert lab.panel.evaluate("el => el.scrollWidth <= el.clientWidth"), "the card's long label wraps in the sidebar"
    expect(marked).to_have_count(1)
    expect(marked).to_contain_text("alpha.ipynb")
    expect(lab.panel.locator('[data-testid="overmind-holder"][data-focused="true"]')).to_have_count(1)
    expect(kernels.first).to_have_attribute("data-focused", "true")
    expect(kernels.first.locator(".jp-Overmind-label")).to_have_text("alpha.ipynb")
    lab.each_theme("views-focus-alpha")

    _focus_notebook(lab, "beta.ipynb")
    expect(focus).to_have_attribute("data-path", "beta.ipynb")
    expect(focus.get_by_test_id("overmind-focus-uses")).to_contain_text("tiny-llama-other")
    expect(focus.get_by_test_id("overmind-focus-units")).to_have_count(0)  # beta placed nothing on a GPU
    expect(marked).to_have_count(1)
    expect(marked).to_contain_text("beta.ipynb")
    expect(lab.panel.locator('[data-testid="overmind-holder"][data-focused="true"]')).to_have_count(0)
    expect(kernels.first.locator(".jp-Overmind-label")).to_have_text("beta.ipynb")
    lab.each_theme("views-focus-beta")


def test_each_chart_opens_in_a_main_area_tab(lab: Lab) -> None:
    from playwright.sync_api import expect

    lab.open_panel()
    buttons = lab.panel.get_by_test_id("overmind-chart-open")
    expect(buttons).to_have_count(3)  # memory, load time saved, GPU units
    for kind, testid in (("memory", "overmind-chart-memory"), ("saved", "overmind-chart-saved"),
                         ("units", "overmind-chart-units")):
        lab.panel.get_by_test_id(testid).get_by_test_id("overmind-chart-open").click()
        view = lab.page.locator(f'#jp-main-dock-panel .jp-Overmind-chartView[data-chart="{kind}"]')
        expect(view).to_be_visible()
        expect(view.get_by_test_id(testid)).to_have_count(1)
        expect(view.get_by_test_id("overmind-chart-open")).to_have_count(0)
        tab = lab.page.locator(f'.lm-DockPanel-tabBar .lm-TabBar-tab[data-id="overmind-chart-{kind}"]')
        expect(tab).to_contain_text("Overmind: ")
        picture = view.locator("svg").first
        if kind != "saved" or picture.is_visible():
            # larger than in the panel (each poll draws the charts again: a box may be missing a moment)
            in_panel = lab.panel.get_by_test_id(testid).locator("svg").first
            assert _wait_for_box(lab, picture)["height"] > _wait_for_box(lab, in_panel)["height"]
        lab.each_theme(f"views-chart-{kind}", f'.jp-Overmind-chartView[data-chart="{kind}"]', target=view)
    # a second click shows the open tab rather than another
    lab.panel.get_by_test_id("overmind-chart-memory").get_by_test_id("overmind-chart-open").click()
    expect(lab.page.locator(".jp-Overmind-chartView")).to_have_count(3)
    expect(lab.page.locator('.jp-Overmind-chartView[data-chart="memory"]')).to_be_visible()
    # a chart's tab in focus leaves the focused notebook as it was
    expect(lab.panel.get_by_test_id("overmind-focus")).to_have_attribute("data-path", "beta.ipynb")


def test_a_single_evict_asks_first_and_the_rows_stay_under_the_pointer(lab: Lab) -> None:
    from playwright.sync_api import expect

    lab.open_panel()
    entries = lab.panel.get_by_test_id("overmind-entry")
    expect(entries).to_have_count(2)
    memory = lab.panel.get_by_test_id("overmind-chart-memory")
    tab = lab.page.locator('.jp-Overmind-chartView[data-chart="memory"]')  # open since the last test
    expect(tab.get_by_test_id("overmind-chart-memory")).to_have_attribute("data-segments", "2")
    first, second = entries.nth(0), entries.nth(1)
    key = first.get_attribute("data-key")
    button = first.get_by_test_id("overmind-evict")
    box, below = button.bounding_box(), second.get_by_test_id("overmind-evict").bounding_box()
    dialog = lab.page.locator(".jp-Dialog")

    button.click()  # cancelled: nothing goes
    expect(dialog).to_be_visible()
    expect(dialog).to_contain_text("Evict ")
    expect(dialog).to_contain_text("reads it from disk again")
    dialog.locator(".jp-mod-reject").click()
    expect(dialog).to_have_count(0)
    lab.page.wait_for_timeout(3 * REFRESH_S * 1000)
    expect(entries).to_have_count(2)

    button.click()
    expect(dialog).to_be_visible()
    lab.each_theme("views-evict-dialog", ".jp-Dialog-content", target=dialog.locator(".jp-Dialog-content"))
    # where the rows are as the user confirms (a poll may have changed them since: a copy that ended; a
    # row being drawn again has no box for a moment)
    box, below = _wait_for_box(lab, button), _wait_for_box(lab, second.get_by_test_id("overmind-evict"))
    dialog.locator(".jp-mod-accept").click()
    expect(dialog).to_have_count(0)
    # the pointer comes back where it clicked: the row evicted is still there, the next Evict is not
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    lab.page.mouse.move(x, y)
    expect(memory).to_have_attribute("data-segments", "1")
    ghost = lab.panel.get_by_test_id("overmind-evicted")
    expect(ghost).to_have_count(1)
    expect(ghost).to_have_attribute("data-key", key or "")
    expect(ghost).to_contain_text("evicted")
    expect(entries).to_have_count(1)
    assert _wait_for_box(lab, entries.first.get_by_test_id("overmind-evict")) == below, "the next row moved"
    under = lab.page.evaluate("([x, y]) => { const el = document.elementFromPoint(x, y);"
                              " return el.closest('button:not([disabled])') !== null; }", [x, y])
    assert not under, "an enabled button lies under the pointer after the evict"
    expect(tab.get_by_test_id("overmind-chart-memory")).to_have_attribute("data-segments", "1")  # live
    expect(lab.status_item).to_have_attribute("data-level", "normal")  # one model: under half the budget
    lab.page.mouse.move(x, y + 1)
    lab.each_theme("views-evicted")

    # once the pointer leaves the list, the rows close up
    lab.page.mouse.move(x, y + 2)
    lab.panel.locator(".jp-Overmind-header").hover()
    expect(ghost).to_have_count(0)
    expect(lab.panel.locator('[data-testid="overmind-entries"] > li')).to_have_count(1)
    assert lab.panel.get_by_test_id("overmind-entries").evaluate("el => el.style.paddingTop") == ""


def test_chart_tabs_open_again_after_a_reload_and_stay_live(lab: Lab) -> None:
    from playwright.sync_api import expect

    views = lab.page.locator("#jp-main-dock-panel .jp-Overmind-chartView")
    expect(views).to_have_count(3)  # open since the charts' test
    lab.page.reload()
    lab.page.wait_for_function("() => window.jupyterapp && window.jupyterapp.started")
    lab.page.evaluate("() => window.jupyterapp.restored")  # the layout, with what it reopens
    for kind in ("memory", "saved", "units"):
        tab = lab.page.locator(f'.lm-DockPanel-tabBar .lm-TabBar-tab[data-id="overmind-chart-{kind}"]')
        expect(tab).to_have_count(1)
    expect(views).to_have_count(3)
    memory = lab.page.locator('.jp-Overmind-chartView[data-chart="memory"]')
    lab.page.locator('.lm-DockPanel-tabBar .lm-TabBar-tab[data-id="overmind-chart-memory"]').click()
    # live after the reload: the one entry the evict test left, drawn from a poll of this page
    expect(memory.get_by_test_id("overmind-chart-memory")).to_have_attribute("data-segments", "1")


def _wait_for_box(lab, locator, timeout_s: float = 10.0):  # type: ignore[no-untyped-def]
    """The element's bounding box, once it has one (a poll may be drawing its row again)."""
    deadline = time.monotonic() + timeout_s
    while (box := locator.bounding_box()) is None and time.monotonic() < deadline:
        lab.page.wait_for_timeout(50)
    assert box is not None, "the element has no box"
    return box
