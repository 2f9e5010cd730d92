"""A load with the cache on starts no thread the plain load would not start where transformers promises
a load on the calling thread alone (HF_DEACTIVATE_ASYNC_LOAD), and otherwise only the helpers the work
needs (Note [Helper threads] in overmind_jupyter/threads.py). Each load runs in a fresh process, with
progress bars on, as a kernel and the kernel after a restart would. transformers' own
`test_loading_respect_env_variable_for_threading` checks the promise for the plain load; it lives in
tests/utils/, which transformers' sdist does not ship, so the conformance run cannot run it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from kernel_server import Client
from kernel_server.client import ANSWER_TIMEOUT
from overmind_jupyter import demo_models
from tests.helpers.faults_helpers import Gate, wait_until
from tests.helpers.snippets import last_json, run_py, start_py

# Records the name of every thread the process starts from the first line on: threading's threads by
# their name, `_thread` ones by their function. Nothing is changed about how they start. The loads run
# first with HF_DEACTIVATE_ASYNC_LOAD=1 ("first", "second", with the first result dropped between them),
# then without it ("small", "eager": another key of the wide checkpoint).
PROBE = """
    import _thread, gc, json, os, threading
    started = []

    def recorded(start):
        def start_and_record(function, *args, **kwargs):
            owner = getattr(function, "__self__", None)
            started.append(owner.name if isinstance(owner, threading.Thread) else function.__qualname__)
            return start(function, *args, **kwargs)
        return start_and_record

    for name in ("_start_new_thread", "_start_joinable_thread"):
        if hasattr(threading, name):
            setattr(threading, name, recorded(getattr(threading, name)))
    _thread.start_new_thread = recorded(_thread.start_new_thread)

    import torch
    from transformers import AutoModelForCausalLM
    cache = os.environ["CACHE"] == "on"
    if cache:
        import overmind_jupyter
        from overmind_jupyter import loading
        overmind_jupyter.enable()

    def load(checkpoint, **kwargs):
        before = len(started)
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, **kwargs)
        return model, started[before:]

    os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"
    model, first = load(os.environ["WIDE"])
    with torch.no_grad():
        out = model(torch.tensor([[1, 5, 9, 3]])).logits.double().sum().item()
    del model
    gc.collect()  # the result's mappings die: its entry is unpinned
    model, second = load(os.environ["WIDE"])
    promised = list(started)
    del os.environ["HF_DEACTIVATE_ASYNC_LOAD"]
    small = load(os.environ["SMALL"])[1]
    eager = load(os.environ["WIDE"], attn_implementation="eager")[1]
    print(json.dumps({"first": first, "second": second, "promised": promised, "small": small, "eager": eager,
                      "all": started, "out": out, "calls": loading.calls() if cache else {},
                      "fallbacks": loading.fallbacks() if cache else []}))
"""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A Llama whose float32 load converts 128 MiB (bfloat16 on disk): a miss copies it into the arena,
    more than one chunk, the size for which the fill takes a helper thread where helpers are allowed;
    and a tiny one, whose copy is far less than a chunk."""
    root = tmp_path_factory.mktemp("threads")
    wide = demo_models.build_llama(root / "wide", "tiny", hidden_size=256, intermediate_size=256,
                                   num_hidden_layers=1, vocab_size=65536)
    return {"WIDE": str(wide), "SMALL": str(demo_models.build_llama(root / "small", "tiny"))}


def loads(checkpoints: dict[str, str], cache: str) -> dict:
    environment = dict(os.environ, CACHE=cache, **checkpoints)
    environment.pop("TQDM_DISABLE", None)  # progress bars on, as users have them
    environment.pop("HF_DEACTIVATE_ASYNC_LOAD", None)
    return last_json(run_py(PROBE, env=environment, timeout=300))


def ours(names: list[str]) -> list[str]:
    """The threads that are not the libraries' own (tqdm's monitor, transformers' loading pool)."""
    return [n for n in names if n != "tqdm_monitor" and not n.startswith("ThreadPoolExecutor")]


def test_a_cached_load_starts_only_the_threads_it_needs(overmind_home: Path, checkpoints: dict[str, str]) -> None:
    """With HF_DEACTIVATE_ASYNC_LOAD=1 the plain load starts no thread but tqdm's monitor; the miss (which
    fills an arena), the hit after a restart, and the unpins after each, start none that it does not.
    Without the setting, a miss of a small model copies on the calling thread, a miss that converts a
    large model writes its weights into the entry on the library's own threads and starts none of ours
    (Note [Staged conversions]), a hit takes one populate thread, and a process at most one unpinner."""
    plain, miss, hit = loads(checkpoints, "off"), loads(checkpoints, "on"), loads(checkpoints, "on")
    assert not any(n.startswith("ThreadPoolExecutor") for n in plain["promised"]), plain  # the library's promise
    assert miss["calls"] == {"miss": 3, "hit": 1} and hit["calls"] == {"hit": 4}, (miss, hit)
    assert not miss["fallbacks"] and not hit["fallbacks"]
    for run in (miss, hit):
        for load in ("first", "second"):
            extra = [n for n in run[load] if n not in plain["first"]]
            assert extra == [], (load, run)
        assert ours(run["promised"]) == [], run  # nor between the loads (the unpins of the dropped model)
        assert ours(run["all"]).count("overmind-unpin") <= 1, run
    assert hit["out"] == miss["out"] == plain["out"]

    assert ours(miss["small"]) == ours(miss["eager"]) == [], miss
    assert ours(hit["small"]) == ours(hit["eager"]) == ["_populate"], hit


# A kernel that can start no thread: every new thread's stack is refused (it asks for more than any address
# space), as at a user's process limit on a shared machine (`ulimit -u`). The plain call of a loader that
# starts no thread of its own works there, so the cached call must too: what a helper thread of ours would do
# (fill an arena, populate a hit's pages, send unpins, read a long wait's reply) the calling thread does, or
# nobody (Note [Helper threads]). LOADER is the cached function; the last line is JSON.
STARVED = """
    import gc, json, os, threading
    threading.stack_size(1 << 48)
    try:
        threading.Thread(target=print).start()
        refused = False
    except RuntimeError:
        refused = True
    from kernel_server.client import shared_client
    from overmind_jupyter import loading
    from tests.helpers import faults_helpers, tiny_modules

    loader = getattr(faults_helpers, os.environ["LOADER"])
    width = int(os.environ["WIDTH"])
    model = loading.cached(loader, "mlp", width=width)
    same = faults_helpers.digest(model) == faults_helpers.digest(tiny_modules.build("mlp", width=width))
    del model
    gc.collect()  # its mappings die: its entry is unpinned, by the next load here
    kept = loading.cached(tiny_modules.build, "tied")
    client = shared_client()
    pinned = [e["meta"]["label"] for e in client.request("status")["entries"]
              if any(p["conn"] == client.conn_id for p in e["pinned_by"])]
    print(json.dumps({"refused": refused, "same": same, "pinned": pinned, "calls": loading.calls(),
                      "fallbacks": loading.fallbacks()}))
"""


def test_a_kernel_that_can_start_no_thread_loads_through_the_cache_as_it_loads_plainly(
        overmind_home: Path, tmp_path: Path) -> None:
    """In a process that can start no thread: a miss that fills a file arena of 128 MiB (a helper's size),
    the hit of it in the next such process, and a wait of two seconds for another kernel's load
    each give the plain load's weights, cached, with no fallback; and each result's unpin reaches the
    daemon at the next load, so the entry can be evicted again."""
    env = dict(os.environ, OVERMIND_ARENA="file", LOADER="gated_build")  # (no gate yet: it loads at once)
    env.pop("HF_DEACTIVATE_ASYNC_LOAD", None)
    miss = last_json(run_py(STARVED, env=dict(env, WIDTH="4096"), timeout=300))
    hit = last_json(run_py(STARVED, env=dict(env, WIDTH="4096"), timeout=300))
    assert miss["calls"] == {"miss": 2} and hit["calls"] == {"hit": 2}, (miss, hit)

    gate = Gate(tmp_path / "gate")
    gate.close()  # another kernel's load that lasts until the gate opens
    env["FAULTS_GATE"] = str(gate.path)
    holder = start_py("""
        from overmind_jupyter import loading
        from tests.helpers import faults_helpers
        loading.cached(faults_helpers.gated_build, "mlp", width=64)
        print("loaded", flush=True)
    """, env=env)
    waiter = None
    try:
        gate.wait_for("started")
        waiter = start_py(STARVED, env=dict(env, WIDTH="64"))
        with Client(overmind_home, role="test") as watcher:
            wait_until(lambda: [load["waiters"] for load in watcher.request("status")["loading"]] == [1], 60,
                       "the starved kernel waits for the load in flight")
        time.sleep(2 * ANSWER_TIMEOUT / 3)  # past the wait on the calling thread alone (Note [Who reads the socket])
        gate.open()
        out, err = waiter.communicate(timeout=120)
        assert waiter.returncode == 0, err
        waited = json.loads(out.strip().splitlines()[-1])
        assert holder.stdout is not None and holder.stdout.readline().strip() == "loaded"
    finally:
        gate.open()
        for process in (holder, waiter):
            if process is not None:
                process.kill()
                process.wait()
    assert waited["calls"] == {"hit": 2}, waited
    for run in (miss, hit, waited):
        assert run["refused"] and run["same"] and not run["fallbacks"], run
        assert run["pinned"] == ["tiny_modules.build(kind='tied')"], run  # the "tied" model's alone


# A daemon that can start no thread while the file $STARVED exists: a watcher, started before, makes every new
# thread's stack too large to be had then (as at the user's process limit) and lifts that once the file is gone.
STARVABLE_DAEMON = """
    import os, sys, threading, time

    def watch():
        starved = False
        while True:
            if os.path.exists(os.environ["STARVED"]) != starved:
                starved = not starved
                threading.stack_size(1 << 48 if starved else 0)
            time.sleep(0.01)

    threading.Thread(target=watch, daemon=True).start()
    from kernel_server.cli import main
    sys.exit(main(["start", "--foreground"]))
"""

KERNEL = """
    import json
    from overmind_jupyter import loading
    from tests.helpers import tiny_modules
    loading.cached(tiny_modules.build, "mlp", 9, width=64)
    print(json.dumps({"calls": loading.calls(), "fallbacks": [(f["kind"], f["reason"]) for f in loading.fallbacks()]}))
"""


def test_a_daemon_that_can_start_no_thread_for_a_while_keeps_serving_its_entries(
        overmind_home: Path, tmp_path: Path) -> None:
    """While the daemon's process can start no thread, a kernel that connects is turned away (it loads
    plainly, told why); the daemon lives on with its entries, and serves the next kernel a hit once threads
    can be had again."""
    starved = tmp_path / "starved"
    env = dict(os.environ, STARVED=str(starved))
    daemon = start_py(STARVABLE_DAEMON, env=env)
    try:
        wait_until((overmind_home / "daemon.sock").exists, 30, "the daemon serves")
        assert last_json(run_py(KERNEL, env=env))["calls"] == {"miss": 1}
        starved.touch()
        time.sleep(0.2)  # the watcher has seen it
        during = last_json(run_py(KERNEL, env=env, timeout=60))
        assert during["calls"] == {"plain": 1} and [kind for kind, _ in during["fallbacks"]] == ["daemon"], during
        assert "process limit" in during["fallbacks"][0][1], during  # told why
        starved.unlink()
        time.sleep(0.2)
        assert last_json(run_py(KERNEL, env=env))["calls"] == {"hit": 1}
        assert daemon.poll() is None, "the daemon lived through it"
    finally:
        starved.unlink(missing_ok=True)
        daemon.terminate()
        daemon.wait(30)
