"""The side panel in a real JupyterLab, driven in Debian's Chromium through Playwright.

One walk through what a user does: open the panel (no daemon yet: it says so), load a tiny model in a
kernel of that JupyterLab, watch the entry appear with its size, hits and the (simulated) GPUs, evict it
with its button, watch it go; close the panel and see it stop polling. Screenshots land in
test-artifacts/: panel.png (the panel with the entry), lab.png (the whole window), panel-evicted.png.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from browser_lab import ARTIFACTS, JupyterLab, chromium, closing_browser, launch
from kernels import execute

pytestmark = pytest.mark.browser

TIMEOUT_MS = 90_000


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_panel_shows_a_model_loaded_in_a_kernel_and_evicts_it(overmind_home: Path, tiny_llama: Path,
                                                               tmp_path: Path) -> None:
    executable = chromium()
    from playwright.sync_api import expect, sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    # OVERMIND_COMPACT=0: the entry keeps referring to its checkpoint, so the panel shows that state
    env = dict(os.environ, OVERMIND_HOME=str(overmind_home), OVERMIND_FAKE_GPUS="2x16", OVERMIND_COMPACT="0")
    lab = JupyterLab(tmp_path, env).start()
    kernel_pid = None
    kc = None
    try:
        with sync_playwright() as pw:
            browser = launch(pw, executable)
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.set_default_timeout(TIMEOUT_MS)
            console: list[str] = []
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            polls: list[str] = []
            page.on("request", lambda r: polls.append(r.url) if "/overmind/state" in r.url else None)
            with closing_browser(browser, page, console, lab, "panel-failure.png"):
                page.goto(f"{lab.url}lab?token={lab.token}")
                tab = page.locator('.jp-SideBar .lm-TabBar-tab[data-id="overmind-panel"]')
                tab.click()
                panel = page.locator("#overmind-panel")
                expect(panel).to_be_visible()
                # no kernel has loaded anything: no daemon, and the panel says how one starts
                expect(panel.get_by_test_id("overmind-down")).to_contain_text("%overmind on")
                assert not (overmind_home / "daemon.sock").exists(), "the panel must not start a daemon"

                kernel_id, kc = lab.start_kernel()
                kernel_pid = int(execute(kc, "import os; print(os.getpid())"))
                execute(kc, f"""
import overmind_jupyter
from transformers import AutoModelForCausalLM
model = overmind_jupyter.cached(AutoModelForCausalLM.from_pretrained, {str(tiny_llama)!r})
again = overmind_jupyter.cached(AutoModelForCausalLM.from_pretrained, {str(tiny_llama)!r})  # a hit
from kernel_server.client import shared_client  # the kernel's lease: 2 units of a simulated GPU
shared_client().request("units_acquire", units=2, devices=None, timeout_s=0, label="tiny-llama", busy=False)
""")
                entry = panel.get_by_test_id("overmind-entry")
                expect(entry).to_have_count(1)
                expect(entry).to_contain_text("tiny-llama")
                expect(entry).to_contain_text("KiB")
                expect(panel.get_by_test_id("overmind-kernels")).to_contain_text("kernel")
                expect(entry).to_contain_text("1 hit")
                expect(entry.get_by_test_id("overmind-pending")).to_contain_text("served from its checkpoint")
                expect(panel.get_by_test_id("overmind-stats")).to_contain_text("1 / 1 (50% hits)")
                devices = panel.get_by_test_id("overmind-device")
                expect(devices).to_have_count(2)
                for i in range(2):
                    expect(devices.nth(i)).to_contain_text("simulated")
                expect(panel.get_by_test_id("overmind-holder")).to_contain_text("2 for tiny-llama")
                panel.screenshot(path=str(ARTIFACTS / "panel.png"))
                page.screenshot(path=str(ARTIFACTS / "lab.png"))
                key = entry.get_attribute("data-key")
                assert key

                entry.get_by_test_id("overmind-evict").click()
                expect(entry).to_have_count(0)
                expect(panel.get_by_test_id("overmind-empty")).to_be_visible()
                panel.screenshot(path=str(ARTIFACTS / "panel-evicted.png"))

                # a hidden panel stands by: no poll while the sidebar is collapsed, one when shown again
                tab.click()
                expect(panel).to_be_hidden()
                page.wait_for_timeout(1000)
                polls.clear()
                page.wait_for_timeout(5000)
                assert polls == [], f"the hidden panel polled {len(polls)} times"
                tab.click()
                expect(panel).to_be_visible()
                page.wait_for_timeout(1500)
                assert polls, "the panel polls again once shown"

                from kernel_server import Client

                with Client(overmind_home, spawn=False, role="test") as client:
                    assert client.request("ls")["entries"] == [], "the daemon dropped the entry"
                # the kernel keeps its copy-on-write model after the eviction
                assert execute(kc, "print(sum(p.numel() for p in model.parameters()) > 0)").strip() == "True"
                lab.request("DELETE", f"api/kernels/{kernel_id}")
    finally:
        if kc is not None:
            kc.stop_channels()
        lab.stop()
        if kernel_pid is not None:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    os.kill(kernel_pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                _kill(kernel_pid)
