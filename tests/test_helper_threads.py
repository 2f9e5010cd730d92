"""A load with the cache on starts no thread the plain load would not start where transformers promises
a load on the calling thread alone (HF_DEACTIVATE_ASYNC_LOAD), and otherwise only the helpers the work
needs (Note [Helper threads] in overmind_jupyter/threads.py). Each load runs in a fresh process, with
progress bars on, as a kernel and the kernel after a restart would. transformers' own
`test_loading_respect_env_variable_for_threading` checks the promise for the plain load; it lives in
tests/utils/, which transformers' sdist does not ship, so the conformance run cannot run it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from snippets import last_json, run_py

from overmind_jupyter import demo_models

# Records the name of every thread the process starts from the first line on: threading's threads by
# their name, `_thread` ones by their function. Nothing is changed about how they start.
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

    def load(checkpoint):
        before = len(started)
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        return model, started[before:]

    small = load(os.environ["SMALL"])[1] if "SMALL" in os.environ else []
    model, first = load(os.environ["CHECKPOINT"])
    with torch.no_grad():
        out = model(torch.tensor([[1, 5, 9, 3]])).logits.double().sum().item()
    del model
    gc.collect()  # the result's mappings die: its entry is unpinned
    model, second = load(os.environ["CHECKPOINT"])
    print(json.dumps({"small": small, "first": first, "second": second, "all": started, "out": out,
                      "calls": loading.calls() if cache else {}, "fallbacks": loading.fallbacks() if cache else []}))
"""


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama whose float32 load converts 128 MiB (bfloat16 on disk): a miss copies it into the arena,
    more than one chunk, the size for which the fill takes a helper thread where helpers are allowed."""
    return demo_models.build_llama(tmp_path_factory.mktemp("threads") / "wide", "tiny", hidden_size=256,
                                   intermediate_size=256, num_hidden_layers=1, vocab_size=65536)


def loads(checkpoint: Path, cache: str, **env: str) -> dict:
    environment = dict(os.environ, CHECKPOINT=str(checkpoint), CACHE=cache, **env)
    environment.pop("TQDM_DISABLE", None)  # progress bars on, as users have them
    return last_json(run_py(PROBE, env=environment, timeout=300))


def ours(names: list[str]) -> list[str]:
    """The threads that are not the libraries' own (tqdm's monitor, transformers' loading pool)."""
    return [n for n in names if n != "tqdm_monitor" and not n.startswith("ThreadPoolExecutor")]


def test_no_thread_the_plain_load_does_not_start_where_transformers_promises_none(overmind_home: Path,
                                                                                 wide: Path) -> None:
    """With HF_DEACTIVATE_ASYNC_LOAD=1 the plain load starts no thread but tqdm's monitor; the miss (which
    fills an arena), the hit after a restart, and the unpins after each, start none that it does not."""
    plain = loads(wide, "off", HF_DEACTIVATE_ASYNC_LOAD="1")
    miss = loads(wide, "on", HF_DEACTIVATE_ASYNC_LOAD="1")
    hit = loads(wide, "on", HF_DEACTIVATE_ASYNC_LOAD="1")
    assert not any(n.startswith("ThreadPoolExecutor") for n in plain["all"]), plain  # the library's promise
    assert miss["calls"] == {"miss": 1, "hit": 1} and hit["calls"] == {"hit": 2}, (miss, hit)
    assert not miss["fallbacks"] and not hit["fallbacks"]
    for run in (miss, hit):
        for load in ("first", "second"):
            extra = [n for n in run[load] if n not in plain["first"]]
            assert extra == [], (load, run)
        assert ours(run["all"]) == [], run  # nor between the loads (the unpins of the dropped model)
    assert hit["out"] == miss["out"] == plain["out"]


def test_helper_threads_are_what_the_work_needs(overmind_home: Path, tmp_path: Path, wide: Path) -> None:
    """Without the setting: a miss of a small model copies on the calling thread, a miss of a large copy
    takes one fill helper, a hit one populate thread; none stays but the unpinner."""
    small = str(demo_models.build_llama(tmp_path / "small", "tiny"))
    wide_miss, wide_hit = loads(wide, "on", SMALL=small), loads(wide, "on")
    assert wide_miss["calls"] == {"miss": 2, "hit": 1} and wide_hit["calls"] == {"hit": 2}, (wide_miss, wide_hit)
    assert ours(wide_miss["small"]) == [], wide_miss
    assert ours(wide_miss["first"]) == ["overmind-fill"], wide_miss
    assert ours(wide_hit["first"]) == ours(wide_hit["second"]) == ["_populate"], wide_hit
    assert ours(wide_hit["all"]).count("overmind-unpin") <= 1, wide_hit
    assert json.dumps(wide_hit["out"]) == json.dumps(wide_miss["out"])
