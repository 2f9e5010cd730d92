"""The notebook widgets against a real daemon, real units and a real adapter gate, and in a real kernel.

Each test changes real state (a load, an eviction, units taken by this and by another process, a gate's
switch, mix and requests) and waits, with a deadline of 2 s, for the widget's trait values to show it. The
latencies are written to test-artifacts/widgets-latency.json. The kernel test checks what the frontend
receives: comm messages sent by the widgets' background thread, while a cell runs and while the kernel is
idle, and none while every view of the widget is gone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kernel_server import Client
from tests.helpers.kernels import magic_json
from tests.helpers.snippets import run_py

REPO = Path(__file__).resolve().parent.parent
ARTIFACTS = REPO / "test-artifacts"
DEADLINE = 2.0  # seconds: the bound for a widget to reflect a state change
LATENCIES: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def _report_latencies() -> Iterator[None]:
    yield
    if LATENCIES:
        ARTIFACTS.mkdir(exist_ok=True)
        text = json.dumps(LATENCIES, indent=2, sort_keys=True)
        (ARTIFACTS / "widgets-latency.json").write_text(text + "\n")


def within(what: str, predicate: Callable[[], Any], deadline: float = DEADLINE) -> float:
    """Wait until `predicate()` holds; record and return how long it took; fail past the deadline."""
    start = time.monotonic()
    while True:
        if predicate():
            took = time.monotonic() - start
            LATENCIES[what] = max(LATENCIES.get(what, 0.0), round(took, 4))
            return took
        if time.monotonic() - start > deadline:
            raise AssertionError(f"{what}: not seen within {deadline} s")
        time.sleep(0.005)


@pytest.fixture
def sim_daemon(overmind_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Client]:
    """A daemon simulating two 16 GiB GPUs, started by this kernel's own connection (as `%overmind on`
    does); yields a second client, another process's view of the same daemon."""
    from kernel_server.client import shared_client

    monkeypatch.setenv("OVERMIND_FAKE_GPUS", "2x16")
    shared_client()
    other = Client(overmind_home, role="test", label="other-kernel")
    yield other
    other.close()


@pytest.fixture
def closing() -> Iterator[list[Any]]:
    """Widgets to close at the end, whatever happens; then the poller's thread must end."""
    made: list[Any] = []
    yield made
    for widget in made:
        widget.close()
    from overmind_jupyter.widgets.polling import poller

    within("poller stops once no widget is open", lambda: not poller().running)


def test_importing_widgets_is_light() -> None:
    proc = run_py("""
        import sys
        import overmind_jupyter, overmind_jupyter.widgets
        heavy = ("ipywidgets", "anywidget", "torch", "transformers", "IPython")
        heavy = [m for m in heavy if m in sys.modules]
        print(heavy)
    """, fresh=True)
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_memory_segments_look_different_for_thirty_entries() -> None:
    """Note [Segment colours]: the widget draws "Memory per model" with the side panel's charts.ts, whose
    palette its bundle carries, and gives 30 entries 30 different fills."""
    from overmind_jupyter.widgets.live import frontend

    charts = (REPO / "labextension" / "src" / "charts.ts").read_text()
    listed = re.search(r"export const SEGMENT_COLOURS = \[(.*?)\];", charts, re.S)
    assert listed is not None
    colours = re.findall(r"'(#[0-9a-f]{6})'", listed.group(1))
    assert len(set(colours)) == len(colours) == 10
    assert "export const SEGMENT_PATTERNS = 3;" in charts
    bundle = frontend("cache")[0].read_text()
    node = shutil.which("node") or shutil.which("nodejs")
    if node is None:
        pytest.skip("no node here to run the widget's code")
    code = bundle[bundle.index("var SEGMENT_COLOURS"):bundle.index("function segmentBackground")]
    script = code + "\nconsole.log(JSON.stringify([...Array(30).keys()].map(segmentFill)));"
    fills = json.loads(subprocess.run([node, "-e", script], capture_output=True, text=True, check=True).stdout)
    assert len({(f["colour"], f["pattern"]) for f in fills}) == 30, fills
    assert [f["colour"] for f in fills] == colours * 3


def test_the_cache_widget_says_what_rss_and_pss_count_as_the_panel_does() -> None:
    """Issue 40: the line on RSS and PSS is the panel's own constant (texts.ts), in the widget's bundle."""
    from overmind_jupyter.widgets.live import frontend

    texts = (REPO / "labextension" / "src" / "texts.ts").read_text()
    pss = re.search(r"export const PSS_TEXT =\s*(.*?);\n", texts, re.S)
    assert pss is not None
    text = "".join(re.findall(r"'([^']*)'", pss.group(1)))
    assert "RSS count a model once per kernel" in text and "PSS (proportional set size" in text
    source = (REPO / "labextension" / "src" / "widgets" / "cache.ts").read_text()
    assert "import { hitRate, PSS_LINE, PSS_TEXT } from '../texts';" in source
    assert "'data-testid': 'overmind-widget-pss', title: PSS_TEXT }, PSS_LINE" in source
    assert text in frontend("cache")[0].read_text(), "the bundle is built from texts.ts"


def test_a_checkout_without_the_built_front_end_says_how_to_build_it(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from overmind_jupyter.errors import WidgetsNotBuilt
    from overmind_jupyter.widgets import live

    for name in ("cache", "units", "gate", "outputs"):
        esm, css = live.frontend(name)
        assert esm.stat().st_size > 0 and css.stat().st_size > 0
        assert "export {" in esm.read_text() and "import " not in esm.read_text().split("\n", 1)[0]
    monkeypatch.setattr(live, "STATIC", tmp_path / "static")
    with pytest.raises(WidgetsNotBuilt, match=r"cache\.js, .*cache\.css missing\): run `pip install -e \.`"):
        live.frontend("cache")
    # importing a widget's module in a checkout without them says the same
    proc = run_py(f"""
        from pathlib import Path
        from overmind_jupyter.widgets import live
        live.STATIC = Path({str(tmp_path)!r})
        try:
            from overmind_jupyter.widgets import cache
        except Exception as exc:
            print(type(exc).__name__, exc)
    """)
    assert "WidgetsNotBuilt" in proc.stdout and "make setup" in proc.stdout


def devices(bar: Any) -> list[dict[str, Any]]:
    """The devices of a units bar's state (the side panel's shape)."""
    return list(((bar.state or {}).get("units") or {}).get("devices") or [])


def daemon_pid(table: Any) -> Any:
    return (table.state.get("daemon") or {}).get("pid")


def fallbacks(table: Any) -> list[dict[str, Any]]:
    """Every fallback a cache table shows: the daemon's, and this kernel's that never reached it."""
    return [*table.state.get("fallbacks", []), *table.local.get("fallbacks", [])]


def test_status_panel_follows_loads_units_and_evictions(sim_daemon: Client, tiny_llama: Path,
                                                        closing: list[Any]) -> None:
    from transformers import AutoModelForCausalLM

    import overmind_jupyter
    from overmind_jupyter import units, widgets
    from overmind_jupyter.errors import FallbackWarning

    panel = widgets.status_panel()
    closing.append(panel)
    table, bar = panel.table, panel.units
    within("status: first snapshot", lambda: daemon_pid(table))
    within("units: first snapshot", lambda: devices(bar))  # its own poll: it may come after the table's
    assert table.state["entries"] == [] and table.error == ""
    assert table.state["daemon"]["pid"] != os.getpid() and table.local["pid"] == os.getpid()
    assert [d["device"] for d in devices(bar)] == ["cuda:0", "cuda:1"]
    assert bar.state["units"]["simulated"] and all(d["simulated"] and d["holders"] == [] for d in devices(bar))

    # a load: the entry appears with a readable label, and the meta the table names the model by
    model = overmind_jupyter.cached(AutoModelForCausalLM.from_pretrained, str(tiny_llama))
    within("status: a published load appears", lambda: len(table.state["entries"]) == 1)
    entry = table.state["entries"][0]
    assert entry["label"].startswith("AutoModelForCausalLM") and "tiny-llama" in entry["label"]
    assert entry["meta"]["class"].endswith("AutoModelForCausalLM") and str(tiny_llama) in entry["meta"]["source"]
    assert entry["bytes"] > 0 and entry["bytes_text"].endswith("iB") and entry["hits"] == 0
    assert entry["key"] and entry["last_used"] > 0

    # a hit: the count rises and this kernel shows as a user of the entry
    again = overmind_jupyter.cached(AutoModelForCausalLM.from_pretrained, str(tiny_llama))
    within("status: a hit counts", lambda: table.state["entries"] and table.state["entries"][0]["hits"] == 1)
    within("status: the kernel using it", lambda: table.local["conn"] is not None and any(
        k["conn"] == table.local["conn"] for k in table.state["entries"][0]["pinned_by"]))

    # units: this kernel's placement, then another kernel's, busy and idle
    units.place(model, label="tiny-llama")
    within("units: a placement appears", lambda: any(
        h["pid"] == bar.local["pid"] for d in devices(bar) for h in d["holders"]))
    holder = next(h for d in devices(bar) for h in d["holders"])
    assert holder["label"] == "tiny-llama" and holder["units"] == 1 and holder["busy"] is False
    sim_daemon.request("units_acquire", units=3, devices=["sim:1"], timeout_s=0, label="elsewhere", busy=True)
    within("units: another kernel's busy holding", lambda: any(
        h["label"] == "elsewhere" and h["busy"] and h["kernel"] == "other-kernel" and h["units"] == 3
        for h in devices(bar)[1]["holders"]))
    assert devices(bar)[1]["used"] == 3 and devices(bar)[1]["free"] == devices(bar)[1]["total"] - 3
    with units.using(model):
        within("units: busy while in use", lambda: devices(bar)[0]["holders"][0]["busy"])
    within("units: idle again", lambda: not devices(bar)[0]["holders"][0]["busy"])

    # a fallback, with its reason
    with pytest.warns(FallbackWarning):
        overmind_jupyter.cached(type(model).from_pretrained, None, config=model.config,
                                state_dict=model.state_dict())
    within("status: a fallback appears", lambda: any("state_dict" in f["reason"] for f in fallbacks(table)))
    assert any(f.get("pid", os.getpid()) == os.getpid() for f in fallbacks(table))

    # the evict button of the row (the message its view sends): gone at the next tick
    table._on_frontend_msg(table, {"event": "evict", "key": entry["key"]}, [])
    within("status: an evicted entry goes", lambda: table.state["entries"] == [])
    assert table.notice.startswith("evicted AutoModelForCausalLM")
    del again
    units.release(model)

    text = panel._repr_mimebundle_()
    text = (text[0] if isinstance(text, tuple) else text)["text/plain"]
    assert "daemon pid" in text, "a frontend without widgets shows the text status"


def test_units_bar_reads_the_ledger_and_never_starts_a_daemon(sim_daemon: Client, closing: list[Any]) -> None:
    from kernel_server.client import reset_shared_client
    from kernel_server.formats import seconds_text
    from overmind_jupyter import widgets

    bar = widgets.units_bar()
    closing.append(bar)
    within("units bar: first snapshot", lambda: len(devices(bar)) == 2)
    assert bar.state["units"]["simulated"] and bar.state["units"]["fake_gpus"] == "2x16"
    assert bar.state["units"]["unit_bytes"] == 1 << 30 and bar.state["texts"]["unit_bytes"] == "1.0 GiB"
    assert devices(bar)[0]["total_text"] == "16.0 GiB"
    sim_daemon.request("units_acquire", units=2, devices=["sim:0"], timeout_s=0, label="other", busy=False)
    within("units bar: a holding of another kernel",
           lambda: [(h["label"], h["busy"]) for h in devices(bar)[0]["holders"]] == [("other", False)])

    # a request that does not fit waits, and the idle holder is asked for its units: the bar says both
    home = Path(os.environ["OVERMIND_HOME"])
    waiting = Client(home, role="test", label="waiting-kernel")
    try:
        waiting.submit("units_acquire", units=14, devices=["sim:0"], timeout_s=30, label="big-model")
        within("units bar: the waiter", lambda: bar.state["units"]["waiters"])
        (waiter,) = bar.state["units"]["waiters"]
        assert (waiter["label"], waiter["units"], waiter["devices"]) == ("big-model", 14, [devices(bar)[0]["device"]])
        assert "waiting-kernel" in waiter["name"] and waiter["waited_text"].endswith("s")
        within("units bar: the idle holder asked to release",
               lambda: devices(bar)[0]["holders"][0]["release_requested"])
        (other,) = devices(bar)[0]["holders"]
        assert other["idle_s"] is not None and other["idle_text"] == seconds_text(other["idle_s"])
    finally:
        waiting.close()

    # the daemon stops: the bar says so, and its polls start no new daemon
    sim_daemon.close()
    reset_shared_client()
    from tests.conftest import stop_daemon

    stop_daemon(home)
    within("units bar: the daemon went", lambda: "no daemon" in bar.error or "not available" in bar.error)
    time.sleep(1.0)
    from kernel_server import lifecycle

    assert lifecycle.try_connect(home) is None, "a widget's poll must not start a daemon"


def test_views_going_and_closing_stop_the_updates(sim_daemon: Client, closing: list[Any]) -> None:
    from overmind_jupyter import widgets

    table = widgets.cache_table()
    closing.append(table)
    within("table: first snapshot", lambda: daemon_pid(table))
    sub = table._subscriptions[0]
    table._on_frontend_msg(table, {"event": "view", "shown": True}, [])
    table._on_frontend_msg(table, {"event": "view", "shown": False}, [])  # the output was cleared
    assert not table.shown
    time.sleep(0.3)
    delivered = sub.delivered
    sim_daemon.request("fallback", call="Model.from_pretrained('x')", kind="test", reason="while hidden")
    time.sleep(1.2)
    assert sub.delivered == delivered and fallbacks(table) == [], "a widget shown nowhere is not polled"
    table._on_frontend_msg(table, {"event": "view", "shown": True}, [])  # shown again (a reload, say)
    within("table: updates resume with a view",
           lambda: [f["reason"] for f in fallbacks(table)] == ["while hidden"])
    table.close()
    assert sub.closed and table._subscriptions == []


# -- the adapter panel ---------------------------------------------------------------------------------------


@pytest.fixture
def peft_model() -> Iterator[Any]:
    """A tiny PEFT Llama with LoRA adapters fr, de, es (tests/adapters/adapter_models.py), one torch thread.
    The gate a panel opened on it is closed at the end: left open, it keeps its guards patched on PEFT's
    classes until the collector finds it, and a later file's test of those patches fails."""
    import torch

    from overmind_jupyter import adapters
    from tests.adapters.adapter_models import build_peft

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    model = None
    try:
        model = build_peft()
        yield model
    finally:
        for gate in adapters.open_gates():
            if gate.model is model:
                gate.close()
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    from overmind_jupyter.demo_models import build_tokenizer

    path = build_tokenizer(tmp_path_factory.mktemp("tok") / "t", vocab_size=128)  # the models' vocabulary
    return AutoTokenizer.from_pretrained(path)


def test_adapter_panel_switches_mixes_and_compares(peft_model: Any, tokenizer: Any,
                                                   closing: list[Any]) -> None:
    from overmind_jupyter import adapters, widgets

    panel = widgets.adapter_panel(peft_model, tokenizer)
    closing.append(panel)
    gate = adapters.gate(peft_model)
    assert panel.gate is gate
    view = panel.gate_view
    assert view.gate["mode"] == "routed" and view.gate["default"] == "fr"
    assert [r["name"] for r in view.gate["adapters"]] == ["de", "es", "fr", "__base__"]
    assert panel.default_picker.value == "fr" and gate.default == "fr", "showing the panel switches nothing"
    # the adapters to compare: the base model first, every row in sight, and how to select several
    assert panel.choose.options == ("__base__", "de", "es", "fr") and panel.choose.rows >= 4
    assert "Ctrl-click" in panel.choose_hint.value and "__base__" in panel.choose_hint.value

    # the gate changes elsewhere (another thread, the user's code): the panel follows
    gate.switch("de")
    within("gate: an outside switch shows",
           lambda: view.gate["default"] == "de" and panel.default_picker.value == "de")
    assert gate.default == "de"
    # a click on a toggle button switches the gate's default
    panel.default_picker.value = "es"
    assert gate.default == "es"
    within("gate: a click's switch shows", lambda: view.gate["default"] == "es")

    # requests in flight and queued, per adapter
    release = threading.Event()
    inside = threading.Event()

    def hold(name: str) -> None:
        with gate.use(name):
            inside.set()
            release.wait(10)

    holder = threading.Thread(target=hold, args=("fr",))
    holder.start()
    inside.wait(10)
    within("gate: a request in flight", lambda: _row(view, "fr")["in_flight"] == 1)
    release.set()
    holder.join()
    within("gate: the request ended", lambda: _row(view, "fr")["in_flight"] == 0)
    locked, unlock = threading.Event(), threading.Event()

    def exclusive() -> None:
        with gate.exclusive():
            locked.set()
            unlock.wait(10)

    changer = threading.Thread(target=exclusive)
    changer.start()
    locked.wait(10)
    ids = tokenizer("hello world", return_tensors="pt")
    waiting = threading.Thread(target=lambda: gate.generate(**ids, adapter="de", max_new_tokens=2))
    waiting.start()
    within("gate: a queued request", lambda: _row(view, "de")["queued"] == 1 and view.gate["exclusive"])
    unlock.set()
    changer.join()
    waiting.join()
    within("gate: the queue drained", lambda: _row(view, "de")["queued"] == 0)

    # mix: sliders and a name, done off the main thread; the new adapter joins every list
    panel.mix_sliders["fr"].value = 0.7
    panel.mix_sliders["de"].value = 0.3
    panel.mix_name.value = "fr_de"
    panel.mix_button.click()
    within("gate: a mix shows", lambda: _row(view, "fr_de") is not None, deadline=30)
    within("gate: the controls know the mix", lambda: "fr_de" in panel.default_picker.options
           and "fr_de" in panel.mix_sliders and "fr_de" in panel.choose.options)
    assert "fr_de" in gate.adapters and "mixed" in view.notice

    # compare: one generation per selected adapter, side by side, equal to the gate's own answers
    panel.prompt.value = "hello world the model"
    panel.choose.value = ("fr", "fr_de", "__base__")
    panel.max_new_tokens.value = 4
    panel.generate_button.click()
    within("gate: three outputs", lambda: len(panel.outputs.outputs) == 3
           and all(o["status"] == "done" for o in panel.outputs.outputs), deadline=60)
    assert [o["adapter"] for o in panel.outputs.outputs] == ["fr", "fr_de", "__base__"]
    assert panel.outputs.prompt == "hello world the model"
    encoded = tokenizer("hello world the model", return_tensors="pt")
    for out in panel.outputs.outputs:
        expected = gate.generate(**encoded, adapter=out["adapter"], max_new_tokens=4, do_sample=False)
        assert out["tokens"] == 4
        new = expected[0, encoded["input_ids"].shape[1]:]
        assert out["text"] == tokenizer.decode(new, skip_special_tokens=True)
    within("gate: generate is enabled again", lambda: not panel.generate_button.disabled)

    panel.close()
    assert not gate.closed, "closing the panel leaves the gate to its owner"


def test_adapter_panel_asks_for_a_prompt_and_counts_no_switch(peft_model: Any, tokenizer: Any,
                                                              closing: list[Any]) -> None:
    """Generate with an empty prompt says a prompt is needed and calls no model; generating and mixing through
    a routed gate switches nothing, and the panel's count says so."""
    from overmind_jupyter import widgets

    panel = widgets.adapter_panel(peft_model, tokenizer)
    closing.append(panel)
    calls: list[int] = []
    hook = peft_model.get_base_model().register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        for empty in ("", "  \n "):
            panel.prompt.value = empty
            panel.generate_button.click()
            within("gate: the prompt is asked for", lambda: "prompt" in panel.outputs.notice)
            assert panel.outputs.outputs == [] and not panel.generate_button.disabled
            panel.outputs.notice = ""
        assert calls == [], "an empty prompt calls no model"
        panel.prompt.value = "hello world"
        panel.choose.value = ("fr", "de", "__base__")
        panel.max_new_tokens.value = 2
        panel.generate_button.click()
        within("gate: three outputs", lambda: len(panel.outputs.outputs) == 3
               and all(o["status"] == "done" for o in panel.outputs.outputs), deadline=60)
        panel.mix({"fr": 0.5, "de": 0.5}, name="fr_de").join()
        within("gate: the controls know the mix", lambda: "fr_de" in panel.choose.options, deadline=30)
        panel.choose.value = ("fr_de",)
        panel.generate_button.click()
        within("gate: the mix's output", lambda: [o["status"] for o in panel.outputs.outputs] == ["done"],
               deadline=60)
        within("gate: the count shown", lambda: _row(panel.gate_view, "fr_de") is not None)
        assert calls, "the prompts ran"
        assert panel.gate.state()["switches"] == panel.gate_view.gate["switches"] == 0, "the user switched nothing"
    finally:
        hook.remove()


def test_adapter_panel_without_tokenizer_reads_token_ids(peft_model: Any, tokenizer: Any,
                                                         closing: list[Any]) -> None:
    from overmind_jupyter import adapters, widgets

    panel = widgets.adapter_panel(peft_model)
    closing.append(panel)
    panel.generate("5 6 7", ["de"], 3)
    within("gate: an output from token ids", lambda: panel.outputs.outputs
           and panel.outputs.outputs[0]["status"] == "done", deadline=30)
    assert len(panel.outputs.outputs[0]["text"].split()) == 3
    panel.generate("hello", ["de"], 3)
    within("gate: a readable error", lambda: panel.outputs.outputs[0]["status"] == "error", deadline=30)
    assert "no tokenizer" in panel.outputs.outputs[0]["text"]

    # a tokenizer saved next to the model's checkpoint is found
    panel.close()
    peft_model.config.name_or_path = tokenizer.name_or_path
    panel = widgets.adapter_panel(peft_model)
    closing.append(panel)
    panel.generate("hello world", ["de"], 2)
    within("gate: an output with the checkpoint's tokenizer", lambda: panel.outputs.outputs
           and panel.outputs.outputs[0]["status"] == "done", deadline=30)
    assert panel.tokenizer is not None and panel.tokenizer.name_or_path == tokenizer.name_or_path
    adapters.gate(peft_model).close()
    within("gate: a closed gate shows", lambda: panel.gate_view.gate["mode"] == "closed")
    assert panel.generate_button.disabled and panel.mix_button.disabled


def _row(view: Any, name: str) -> Any:
    return next((r for r in view.gate["adapters"] if r["name"] == name), None)


# -- the magic outside a notebook ----------------------------------------------------------------------------


def test_magic_in_a_terminal_prints_text(sim_daemon: Client, peft_model: Any,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from IPython.core.error import UsageError
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "overmind_jupyter")
    try:
        assert shell.run_line_magic("overmind", "status") is None
        assert "daemon pid" in capsys.readouterr().out
        assert magic_json(shell, "status")["enabled"] is False
        assert shell.run_line_magic("overmind", "units") is None
        assert "simulated" in capsys.readouterr().out
        shell.user_ns["m"] = peft_model
        assert shell.run_line_magic("overmind", "adapters m") is None
        out = capsys.readouterr().out
        assert "<AdapterGate routed default='fr'" in out and "(default)" in out
        assert magic_json(shell, "adapters m")["default"] == "fr"
        shell.user_ns["three"] = 3
        with pytest.raises(UsageError, match="three holds an object of type int, not a PEFT model"):
            shell.run_line_magic("overmind", "adapters three")
        with pytest.raises(UsageError, match="no variable named 'nope'"):
            shell.run_line_magic("overmind", "adapters nope")
        with pytest.raises(UsageError, match="takes the variable"):
            shell.run_line_magic("overmind", "adapters")
    finally:
        shell.run_line_magic("unload_ext", "overmind_jupyter")
        shell.user_ns.pop("m", None)
        from overmind_jupyter import adapters

        adapters.gate(peft_model).close()


# -- in a real kernel: what the frontend receives ------------------------------------------------------------


def test_updates_reach_the_frontend_while_a_cell_runs_and_while_idle(sim_daemon: Client) -> None:
    """The widgets' thread sends comm updates over iopub during a running cell and between cells; none while
    every view is gone; the kernel shuts down promptly with the thread running."""
    from jupyter_client.manager import start_new_kernel

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    km, kc = start_new_kernel(kernel_name="python3", env=env, startup_timeout=90)
    try:
        reply, _ = _run(kc, "from overmind_jupyter import widgets\nimport time\nw = widgets.status_panel()\n"
                            "while not w.table.state.get('daemon'):\n    time.sleep(0.05)\n"
                            "print(w.table.model_id, w.units.model_id)")
        table_id, units_id = reply.split()

        # while a cell runs: the cell takes units, then sleeps; the update arrives before the cell ends
        code = ("from kernel_server.client import shared_client\nimport time\n"
                "shared_client().request('units_acquire', units=2, devices=['sim:0'], timeout_s=0, "
                "label='in-cell', busy=False)\nt = time.time()\ntime.sleep(3)\nprint(t)")
        _, messages = _run(kc, code)
        seen = [m for m in messages if _update_mentions(m, units_id, "in-cell")]
        assert seen, "no update of the units bar while the cell ran"
        first, end = seen[0]["arrived"], messages[-1]["arrived"]
        assert first < end - 0.5, "the update came only at the end of the cell"
        LATENCIES["kernel: update during a running cell"] = round(first - messages[0]["arrived"], 4)

        # idle: another process takes units; the update arrives with no cell running
        started = time.monotonic()
        sim_daemon.request("units_acquire", units=1, devices=["sim:1"], timeout_s=0, label="from-outside",
                           busy=True)
        idle = _watch(kc, lambda m: _update_mentions(m, units_id, "from-outside"), DEADLINE)
        assert idle is not None, "no update while the kernel was idle"
        LATENCIES["kernel: update while idle"] = round(idle["arrived"] - started, 4)

        # every view goes (the output was cleared): no more updates; a view comes back: updates again
        for comm_id in (table_id, units_id):
            _view(kc, comm_id, True)
            _view(kc, comm_id, False)
        time.sleep(0.5)
        sim_daemon.request("units_acquire", units=1, devices=["sim:1"], timeout_s=0, label="unseen",
                           busy=True)
        assert _watch(kc, lambda m: _update_mentions(m, units_id, "unseen"), 1.5) is None
        _view(kc, units_id, True)
        assert _watch(kc, lambda m: _update_mentions(m, units_id, "unseen"), DEADLINE) is not None

        # close: the poller's thread ends
        out, _ = _run(kc, "import time\nw.close()\nfrom overmind_jupyter.widgets.polling import poller\n"
                          "time.sleep(1)\nprint(poller().running)")
        assert out.strip() == "False"
    finally:
        kc.stop_channels()
        started = time.monotonic()
        km.shutdown_kernel(now=False)
        LATENCIES["kernel: shutdown"] = round(time.monotonic() - started, 3)


def _run(kc: Any, code: str, timeout: float = 120) -> tuple[str, list[dict[str, Any]]]:
    """Execute `code`; its stdout and every iopub message until the kernel is idle again, each with the
    monotonic time it arrived."""
    msg_id = kc.execute(code)
    out: list[str] = []
    messages: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while True:
        msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        msg["arrived"] = time.monotonic()
        messages.append(msg)
        parent = msg["parent_header"].get("msg_id")
        if msg["msg_type"] == "stream" and parent == msg_id:
            out.append(msg["content"]["text"])
        if msg["msg_type"] == "error" and parent == msg_id:
            raise AssertionError("\n".join(msg["content"]["traceback"]))
        if msg["msg_type"] == "status" and parent == msg_id and msg["content"]["execution_state"] == "idle":
            return "".join(out), messages


def _watch(kc: Any, predicate: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any] | None:
    """The first iopub message that satisfies `predicate` within `timeout` s, or None."""
    import queue

    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            msg = kc.get_iopub_msg(timeout=left)
        except queue.Empty:
            return None
        msg["arrived"] = time.monotonic()
        if predicate(msg):
            return msg
    return None


def _update_mentions(msg: dict[str, Any], comm_id: str, text: str) -> bool:
    if msg["msg_type"] != "comm_msg" or msg["content"].get("comm_id") != comm_id:
        return False
    data = msg["content"].get("data") or {}
    return data.get("method") == "update" and text in json.dumps(data.get("state", {}))


def _view(kc: Any, comm_id: str, shown: bool) -> None:
    """What anywidget's view sends as it renders (shown) and as it is disposed of (not shown)."""
    msg = kc.session.msg("comm_msg", {"comm_id": comm_id,
                                      "data": {"method": "custom", "content": {"event": "view", "shown": shown}}})
    kc.shell_channel.send(msg)


def test_no_widget_thread_is_left_behind() -> None:
    from overmind_jupyter.widgets.polling import poller

    assert not poller().running
    assert not [t for t in threading.enumerate() if t.name.startswith("overmind-widget")]


def test_status_widget_names_kernels_charts_memory_time_saved_and_progress(
        overmind_home: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, closing: list[Any]) -> None:
    """Issue 23: kernels by notebook (pid and command in the detail), the two charts' data (memory per
    entry with its users; each hit's plain load time against its own), a load's progress, and a notice
    that clears."""
    from transformers import AutoModelForCausalLM

    import overmind_jupyter
    from kernel_server.client import shared_client
    from kernel_server.formats import saved_figure
    from overmind_jupyter import widgets
    from overmind_jupyter.widgets import live

    monkeypatch.setenv("JPY_SESSION_NAME", "/home/ada/analysis.ipynb")  # what jupyter_server gives a kernel
    monkeypatch.setattr(live, "NOTICE_S", 0.5)
    shared_client()
    other = Client(overmind_home, role="kernel", label="/home/ada/second.ipynb")
    try:
        table = widgets.cache_table()
        closing.append(table)
        model = overmind_jupyter.cached(AutoModelForCausalLM.from_pretrained, str(tiny_llama))
        within("status: the load appears", lambda: len(table.state.get("entries", [])) == 1)
        entry = table.state["entries"][0]
        assert entry["load_s"] is not None and entry["load_s"] > 0, "the plain load's time, measured at the miss"

        hit = other.request("lookup", key=entry["key"], wait=False)  # another notebook's kernel hits it
        assert hit["status"] == "hit"
        hit.close()
        within("status: both kernels by notebook", lambda: {k["name"] for k in table.state["entries"][0]["pinned_by"]}
               >= {"second.ipynb"})
        (theirs,) = [k for k in table.state["entries"][0]["pinned_by"] if k["name"] == "second.ipynb"]
        assert f"pid {os.getpid()}" in theirs["detail"] and "/home/ada/second.ipynb" in theirs["detail"]
        within("status: the hit in the time-saved data", lambda: table.state["hits_log"])
        (logged,) = table.state["hits_log"]
        assert "tiny-llama" in logged["label"] and logged["load_s"] == entry["load_s"] and logged["hit_s"] is None
        # reported later, off the hit's path
        other.request("hits", hits=[{"key": entry["key"], "t": time.time(), "hit_s": 0.003}])
        within("status: the hit's own time", lambda: table.state["hits_log"][0]["hit_s"] == 0.003)
        # what the hit saved, less the caching its miss cost (Note [Load time saved])
        assert table.state["texts"]["saved"] == saved_figure(entry["load_s"] - 0.003 - entry["cache_s"])

        key = "p" * 64  # a load in flight in the other kernel, with its progress
        assert other.request("lookup", key=key, wait=False)["status"] == "load"
        other.request("progress", key=key, label="loading big-model", done=1, total=4, unit="B")
        within("status: a load's progress", lambda: table.state["loading"] and
               (table.state["loading"][0]["progress"] or {}).get("percent") == 25)
        load = table.state["loading"][0]
        assert load["loader"]["name"] == "second.ipynb"
        assert load["progress"]["text"].startswith("loading big-model: 25%")

        table._on_frontend_msg(table, {"event": "evict", "key": entry["key"]}, [])
        within("status: the eviction's notice", lambda: table.notice.startswith("evicted "))
        within("status: the notice clears", lambda: table.notice == "", deadline=live.NOTICE_S + DEADLINE)
        del model
    finally:
        other.close()


def test_status_and_units_send_their_text_with_the_widget_to_a_frontend_without_widgets(
        overmind_home: Path, tiny_llama: Path) -> None:
    """nbconvert, GitHub and `jupyter console` keep the text/plain a widget was displayed with: it is the
    state when the magic ran, not a placeholder (the widget's first tick comes after the display)."""
    from tests.helpers.kernels import execute, execute_all, kernel

    with kernel() as (_, kc):
        execute(kc, "%load_ext overmind_jupyter\n%overmind on\nfrom transformers import AutoModelForCausalLM\n"
                    f"model = AutoModelForCausalLM.from_pretrained({str(tiny_llama)!r})")
        [status] = [text for kind, text in execute_all(kc, "%overmind status") if kind == "display"]
        [units] = [text for kind, text in execute_all(kc, "%overmind units") if kind == "display"]
    assert "daemon pid" in status and "1 entry" in status and tiny_llama.name in status, status
    assert units.startswith("GPU units") and "cannot be read" not in units and "widget" not in units, units
