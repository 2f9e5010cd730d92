"""Progress of long work and the hit times behind the time-saved figures (issue 23): a first load's bars
carry the model's name and reach the daemon; a preload shows its worker's progress in the waiting cell; a
hit's time reaches the daemon's hits log after the hit, never on its path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kernel_server import Client
from kernel_server.store import HITS_LOG

LOAD = """
import overmind_jupyter, torch
from transformers import AutoModelForCausalLM
overmind_jupyter.cached(AutoModelForCausalLM.from_pretrained, {path!r}, dtype=torch.{dtype})
print("loaded", flush=True)
"""


@pytest.fixture(scope="module")
def mid_llama(models_dir: Path) -> Path:
    """A model with enough tensors that loading it takes a moment (about 45M parameters)."""
    from overmind_jupyter.demo_models import build_llama

    return build_llama(models_dir / "mid-llama", "tiny", hidden_size=256, intermediate_size=512,
                       num_hidden_layers=48, vocab_size=32000)


def watch_progress(home: Path, seen: list[dict[str, Any]], stop: threading.Event) -> threading.Thread:
    """Collect every load progress the daemon reports, from another connection, until `stop`."""
    def run() -> None:
        with Client(home, role="test") as client:
            while not stop.is_set():
                for load in client.request("status")["loading"]:
                    if load.get("progress"):
                        seen.append(load["progress"] | {"by": load["loader"]})
                time.sleep(0.005)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def run_snippet(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env or dict(os.environ),
                          capture_output=True, text=True, timeout=600, check=True)


def test_a_first_load_shows_named_progress_and_reports_it(daemon: Client, overmind_home: Path,
                                                          mid_llama: Path) -> None:
    seen: list[dict[str, Any]] = []
    stop = threading.Event()
    watcher = watch_progress(overmind_home, seen, stop)
    env = dict(os.environ, JPY_SESSION_NAME="/home/ada/first.ipynb")
    try:
        miss = run_snippet(LOAD.format(path=str(mid_llama), dtype="float32"), env)
    finally:
        stop.set()
        watcher.join(30)
    assert "Loading weights (mid-llama)" in miss.stderr, "the library's bar in the cell names the model"
    labels = {p["label"] for p in seen}
    assert labels & {"Loading weights mid-llama", "caching mid-llama"}, labels
    assert all(p["by"]["label"] == "/home/ada/first.ipynb" for p in seen)
    assert any(0 < p["done"] <= p["total"] for p in seen)

    (entry,) = daemon.request("status")["entries"]
    assert entry["load_s"] > 0, "the plain load's time, measured by the loader at its miss"
    run_snippet(LOAD.format(path=str(mid_llama), dtype="float32"))  # a hit in another process, which exits
    deadline = time.monotonic() + 10
    while (log := daemon.request("status")["hits_log"]) and log[-1]["hit_s"] is None and time.monotonic() < deadline:
        time.sleep(0.05)
    (hit,) = log
    assert hit["load_s"] == entry["load_s"] and 0 < hit["hit_s"] < 30, hit


def test_preload_shows_its_workers_progress_in_the_waiting_cell(daemon: Client, overmind_home: Path) -> None:
    # a load whose "Loading weights" lasts 1.5 s in the worker: a real one of a small model can be over
    # between two reads of the waiting cell (its conversions are written as it loads: Note [Staged conversions])
    waiting = run_snippet("""
        import overmind_jupyter
        from overmind_jupyter import loading
        from tests.helpers.cached_modules import slowly_built
        overmind_jupyter.enable()  # %overmind on
        p = overmind_jupyter.preload(slowly_built, 15, 0.1)
        p.wait()
        print("preloaded", flush=True)
        overmind_jupyter.cached(slowly_built, 15, 0.1)
        print(loading.calls(), flush=True)
    """)
    assert "preloaded" in waiting.stdout and "{'hit': 1}" in waiting.stdout, waiting.stdout + waiting.stderr[-2000:]
    assert "preload: Loading weights " in waiting.stderr, waiting.stderr[-2000:]
    (entry,) = daemon.request("status")["entries"]
    assert "slowly_built" in entry["meta"]["label"]


def test_disable_gives_transformers_back_the_tqdm_hook_it_had(overmind_home: Path, tiny_llama: Path) -> None:
    """The named bars come through transformers' `set_tqdm_hook`; `disable()` restores the user's own
    hook, as it restores every patch (docs/design.md invariant 6)."""
    proc = run_snippet(f"""
        import overmind_jupyter
        import overmind_jupyter.loading
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging

        def users_hook(factory, args, kwargs):
            kwargs = dict(kwargs, desc="user: " + str(kwargs.get("desc")))
            return factory(*args, **kwargs)

        logging.set_tqdm_hook(users_hook)
        overmind_jupyter.enable()
        AutoModelForCausalLM.from_pretrained({str(tiny_llama)!r})  # a miss: our hook goes on
        during = logging.set_tqdm_hook(None)
        logging.set_tqdm_hook(during)
        overmind_jupyter.disable()
        after = logging.set_tqdm_hook(None)
        print(during is users_hook, after is users_hook, overmind_jupyter.loading.calls())
    """)
    assert proc.stdout.split()[:2] == ["False", "True"], proc.stdout + proc.stderr
    assert "miss" in proc.stdout, proc.stdout
    assert "user: Loading weights (tiny-llama)" in proc.stderr, "the user's hook saw the named bar"


def test_a_bar_collected_inside_a_send_of_its_own_thread_ends_without_a_hang(overmind_home: Path) -> None:
    """Note [Requests from finalizers] in kernel_server/client.py: a load's bar is freed by the collector
    (the relay holds it in a cycle), and the collector can run at any allocation, also inside a send of
    the same connection. The bar's close then gives up its report after a moment, and the process goes
    on. The test holds the connection's send lock around a collection, where a send's allocation would
    have started it."""
    code = """
        import gc, json, weakref
        from transformers.utils import logging
        from kernel_server.client import shared_client
        from overmind_jupyter import progress

        client = shared_client()
        with progress.loading(client, "0" * 64, "LlamaForCausalLM.from_pretrained('/models/tiny')"):
            bar = logging.tqdm(range(3), desc="Loading weights")  # through transformers' hook, as a load's
            for _ in bar:
                pass
        gc.disable()
        freed = weakref.ref(bar)
        del bar  # only the collector frees it
        with client._send_lock:  # inside a send of this thread
            gc.collect()
        print(json.dumps({"freed": freed() is None, "ping": client.request("ping")["pong"] > 0}))
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, check=True)
    assert json.loads(proc.stdout.splitlines()[-1]) == {"freed": True, "ping": True}


def test_a_load_over_within_a_report_interval_reports_nothing(daemon: Client) -> None:
    """Note [Load progress]: a load reports its progress once it has run REPORT_S, and a bar's end
    (a forced report) is reported only after a first report: a 0.1 s load wakes the daemon for nothing."""
    from overmind_jupyter import progress

    key = "b" * 64
    assert daemon.request("lookup", key=key, wait=False)["status"] == "load"

    def shown() -> dict[str, Any] | None:
        (load,) = [load for load in daemon.request("status")["loading"] if load["key"] == key]
        return load["progress"]

    reporter = progress.Reporter(daemon, key, "quick")
    reporter.report("Loading weights", 1, 10)
    reporter.report("Loading weights", 10, 10, force=True)
    assert shown() is None, "nothing reported within the first interval"
    time.sleep(progress.REPORT_S)
    reporter.report("Loading weights", 5, 10)
    assert shown() is not None and shown()["done"] == 5
    reporter.report("Loading weights", 6, 10)
    assert shown()["done"] == 5, "at most one report an interval"
    reporter.report("Loading weights", 10, 10, force=True)
    assert shown()["done"] == 10, "the bar's end, reported at once after a first report"
    daemon.request("abandon", key=key)


def test_every_hit_of_a_long_loop_counts_in_the_time_saved(daemon: Client) -> None:
    """Note [Hit times] in overmind_jupyter/progress.py, Note [Load time saved] in kernel_server/store.py: a
    script that hits one entry more often than the daemon's hits log holds, and more often than the kernel
    keeps unsent hit times, with no cell, miss or status read between, gets every hit's time counted."""
    n = 1100
    run_snippet(f"""
        from overmind_jupyter import loading
        from tests.helpers import tiny_modules
        for _ in range({n} + 1):  # a miss, then the hits
            loading.cached(tiny_modules.build, "mlp", 1, width=8, depth=1)
        assert loading.calls() == {{"miss": 1, "hit": {n}}}, loading.calls()
    """)
    deadline = time.monotonic() + 10
    while (status := daemon.request("status").payload)["time_saved"]["hits"] < n and time.monotonic() < deadline:
        time.sleep(0.05)
    assert status["stats"]["hits"] == status["time_saved"]["hits"] == n, (status["stats"], status["time_saved"])
    assert len(status["hits_log"]) == HITS_LOG and all(h["hit_s"] is not None for h in status["hits_log"])
