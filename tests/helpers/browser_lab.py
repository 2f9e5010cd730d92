"""A real JupyterLab server and a real Chromium for the browser tests.

`JupyterLab` runs `jupyter lab` on 127.0.0.1 with a random token in its own config, runtime and
workspace directories (so nothing of the user's leaks in), and stops it by its pid. `chromium()` finds
Debian's chromium, or says why the test cannot run; `launch()` starts it through Playwright with the
flags that keep it off the network. `contrast_failures()` measures, in the page, the contrast of every
visible text against the background it is drawn on; `set_theme()` switches JupyterLab's theme.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

__all__ = ["ARTIFACTS", "CHROMIUM_ARGS", "MIN_CONTRAST", "JupyterLab", "chromium", "closing_browser",
           "contrast_failures", "failure_report", "launch", "set_theme"]

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"

CHROMIUM_ARGS = [
    "--no-sandbox",  # root in CI
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--no-first-run",
]


def chromium() -> str:
    """The path of Debian's chromium. Where it is missing: a failure in CI (`make setup` installs it
    there, as root), a skip with the reason elsewhere."""
    path = os.environ.get("OVERMIND_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    problem = None
    if not os.access(path, os.X_OK):
        problem = (f"no chromium at {path}: `make setup` installs Debian's chromium when run as root "
                   "(`apt-get install -y chromium`); or point OVERMIND_CHROMIUM at one")
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            problem = "the Python package playwright is missing: pip install -e '.[test]'"
    if problem is not None:
        if os.environ.get("CI"):
            pytest.fail(f"the browser test must run in CI: {problem}")
        pytest.skip(problem)
    return path


def launch(playwright: Any, executable: str) -> Any:
    """A headless Chromium driven by Playwright (never a browser Playwright downloads itself)."""
    return playwright.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)


@contextlib.contextmanager
def failure_report(page: Any, console: list[str], lab: JupyterLab, name: str) -> Iterator[None]:
    """On a failure inside, save a screenshot of `page` as test-artifacts/`name` and print the browser
    console and the end of JupyterLab's log."""
    try:
        yield
    except BaseException:
        page.screenshot(path=str(ARTIFACTS / name), full_page=True)
        print("browser console:\n" + "\n".join(console[-40:]))
        print("jupyter lab log:\n" + lab.log_tail())
        raise


@contextlib.contextmanager
def closing_browser(browser: Any, page: Any, console: list[str], lab: JupyterLab, name: str) -> Iterator[None]:
    """Close `browser` at the end, with a `failure_report` of what failed inside."""
    try:
        with failure_report(page, console, lab, name):
            yield
    finally:
        browser.close()


MIN_CONTRAST = 4.5  # WCAG AA for normal text

# Note [Contrast in the page]
# For each visible text node under the root: its colour (`color`, or `fill` for SVG text) composed over
# its effective background, and that background: the element's and its ancestors' background colours,
# composed from the nearest opaque one (else the page's white) up to the element. The ratio is WCAG's,
# (L1 + 0.05) / (L2 + 0.05) of the relative luminances. Background images and shadows are not seen: the
# panel uses none under text.
_CONTRAST_JS = r"""
(root) => {
  const parse = (c) => {
    const m = c && c.match(/rgba?\(([^)]+)\)/);
    if (!m) return null;
    const p = m[1].split(/[\s,\/]+/).filter(Boolean).map(Number);
    return [p[0], p[1], p[2], p.length > 3 ? p[3] : 1];
  };
  const over = (top, bottom) => {
    const a = top[3];
    return [0, 1, 2].map(i => top[i] * a + bottom[i] * (1 - a)).concat([1]);
  };
  const background = (el) => {
    const layers = [];
    for (let e = el; e; e = e.parentElement) {
      const c = parse(getComputedStyle(e).backgroundColor);
      if (c && c[3] > 0) {
        layers.push(c);
        if (c[3] >= 1) break;
      }
    }
    let bg = [255, 255, 255, 1];
    for (const layer of layers.reverse()) bg = over(layer, bg);
    return bg;
  };
  const luminance = (c) => {
    const [r, g, b] = c.slice(0, 3).map(v => {
      v /= 255;
      return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4);
    });
    return 0.2126 * r + 0.7152 * g + 0.0722 * b;
  };
  const out = [];
  let checked = 0;
  const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    const text = node.textContent.trim();
    const el = node.parentElement;
    if (!text || !el || el.closest('title, style, script')) continue;
    const style = getComputedStyle(el);
    if (style.visibility === 'hidden' || style.display === 'none' || !el.getClientRects().length) continue;
    const range = document.createRange();
    range.selectNodeContents(node);
    const rect = range.getBoundingClientRect();
    if (rect.width === 0 || rect.height === 0) continue;
    const isSvg = el instanceof SVGElement;
    const bg = background(el);
    const fg = over(parse(isSvg ? style.fill : style.color) || [0, 0, 0, 1], bg);
    const l1 = luminance(fg), l2 = luminance(bg);
    const ratio = (Math.max(l1, l2) + 0.05) / (Math.min(l1, l2) + 0.05);
    checked++;
    if (ratio < %MIN%) {
      out.push({text: text.slice(0, 60), ratio: Math.round(ratio * 100) / 100,
                color: style.color, background: 'rgb(' + bg.slice(0, 3).map(Math.round).join(', ') + ')',
                cls: el.className && el.className.baseVal === undefined ? el.className : ''});
    }
  }
  return {checked, failures: out};
}
""".replace("%MIN%", str(MIN_CONTRAST))


def contrast_failures(page: Any, selector: str) -> tuple[int, list[dict[str, Any]]]:
    """(texts checked, those under MIN_CONTRAST) in the elements matching `selector` (Note [Contrast in
    the page])."""
    checked = 0
    failures: list[dict[str, Any]] = []
    for handle in page.query_selector_all(selector):
        result = handle.evaluate(_CONTRAST_JS)
        checked += result["checked"]
        failures += result["failures"]
    return checked, failures


def set_theme(page: Any, theme: str) -> None:
    """Switch JupyterLab to `theme` ("JupyterLab Light", "JupyterLab Dark") and wait until it applies
    (the app must be exposed: `JupyterLab(..., expose_app=True)`)."""
    light = "true" if "Light" in theme else "false"
    page.evaluate("(theme) => window.jupyterapp.commands.execute('apputils:change-theme', {theme})", theme)
    page.wait_for_function(f"() => document.body.dataset.jpThemeLight === '{light}'")
    page.wait_for_timeout(300)  # the theme's stylesheet applies after the attribute


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class JupyterLab:
    """`jupyter lab` on 127.0.0.1 in `workdir`, for one test; `stop()` ends it by its pid.

    Args:
        workdir: holds the notebooks' root, the config, runtime and workspace directories and the log.
        env: the environment of the server (and so of its kernels).
        expose_app: put the application on `window.jupyterapp`, for its commands.
        settings: user settings of plugins, {"plugin-package:plugin": {setting: value}}.
    """

    def __init__(self, workdir: Path, env: dict[str, str], *, expose_app: bool = False,
                 settings: dict[str, dict[str, Any]] | None = None) -> None:
        self.workdir = workdir
        self.port = _free_port()
        self.token = secrets.token_hex(16)
        self.root = workdir / "root"
        self.runtime = workdir / "runtime"
        config = workdir / "config"
        for d in (self.root, self.runtime, config / "labconfig", workdir / "workspaces", workdir / "settings"):
            d.mkdir(parents=True, exist_ok=True)
        # no news prompt over the panel; nothing else of JupyterLab is turned off
        page_config: dict[str, Any] = {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}
        if expose_app:
            page_config["exposeAppInBrowser"] = True
        (config / "labconfig" / "page_config.json").write_text(json.dumps(page_config))
        for plugin, values in (settings or {}).items():
            package, name = plugin.split(":")
            (workdir / "settings" / package).mkdir(parents=True, exist_ok=True)
            (workdir / "settings" / package / f"{name}.jupyterlab-settings").write_text(json.dumps(values))
        self.env = dict(env, JUPYTER_CONFIG_DIR=str(config), JUPYTER_RUNTIME_DIR=str(self.runtime))
        self.log_path = workdir / "jupyter-lab.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def start(self, timeout: float = 90) -> JupyterLab:
        with open(self.log_path, "wb") as log:  # the server writes to its own copy of the descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root",
                 "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
                 f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
                 f"--LabApp.workspaces_dir={self.workdir / 'workspaces'}",
                 f"--LabApp.user_settings_dir={self.workdir / 'settings'}",
                 "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
                env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"jupyter lab exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                self.request("GET", "api/status")
                return self
            except (OSError, urllib.error.URLError):
                time.sleep(0.3)
        raise AssertionError(f"jupyter lab did not answer within {timeout} s:\n{self.log_tail()}")

    def request(self, method: str, path: str, body: Any = None, *, token: bool = True) -> Any:
        """A REST call to the server; the JSON answer (None for an empty one)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if token:
            req.add_header("Authorization", f"token {self.token}")
        with urllib.request.urlopen(req, timeout=30) as response:
            text = response.read()
        return json.loads(text) if text else None

    def start_kernel(self) -> tuple[str, Any]:
        """A kernel of this server (it shows in JupyterLab), and a client on its connection file."""
        from jupyter_client import BlockingKernelClient

        kernel_id = self.request("POST", "api/kernels", {"name": "python3"})["id"]
        deadline = time.monotonic() + 30
        while not (files := list(self.runtime.glob(f"kernel-{kernel_id}*.json"))):
            if time.monotonic() > deadline:
                raise AssertionError(f"no connection file of kernel {kernel_id} in {self.runtime}")
            time.sleep(0.1)
        client = BlockingKernelClient(connection_file=str(files[0]))
        client.load_connection_file()
        # No heartbeat: on 2 busy cores (Chromium rendering, the kernel importing) a missed 1 s beat
        # reads as a dead kernel; the kernel_info reply alone says it is ready.
        client.start_channels(hb=False)
        client.wait_for_ready(timeout=90)
        return kernel_id, client

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SIGTERM (the server shuts its kernels down), then SIGKILL after 20 s; by pid only."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
