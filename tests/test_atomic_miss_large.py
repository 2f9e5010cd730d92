"""The atomic miss on the 1.1B model, in real kernels with progress bars on and a thread of the user's
alive: the loading kernel keeps no private copy beside its entry, and a restart or a SIGKILL right after
the loading cell returned (the copy of 4.1 GiB takes seconds here) leaves the entry servable.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from kernel_server import Client
from overmind_jupyter import demo_models
from tests.helpers.kernels import USER_THREAD, execute, execute_all, kernel, kernel_env

ANON = """
def anon():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) * 1024
"""

SETUP = "%load_ext overmind_jupyter\n%overmind on\n" + USER_THREAD + ANON + """
import json, os, threading, torch
from transformers import AutoModelForCausalLM
import overmind_jupyter
"""


@pytest.fixture(scope="module")
def llama_1b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_models.build_llama(tmp_path_factory.mktemp("large") / "llama-1.1b", "1.1b")


def warm_up(kc, tiny: Path) -> None:  # type: ignore[no-untyped-def]
    """A first load of a tiny model of the same class, so that what the measured load adds is the
    model, not the modules and caches a first load of a Llama imports and fills."""
    execute(kc, f"AutoModelForCausalLM.from_pretrained({str(tiny)!r}, dtype=torch.float32)\n"
                "overmind_jupyter.loading.clear_fallbacks()")


def load_cell(path: Path, dtype: str) -> str:
    return ("calls = overmind_jupyter.loading.calls()\n"
            f"model = AutoModelForCausalLM.from_pretrained({str(path)!r}, dtype=torch.{dtype})\n"
            "now = overmind_jupyter.loading.calls()\n"
            "print(json.dumps({'pid': os.getpid(), 'calls': {k: v - calls.get(k, 0) for k, v in now.items() "
            "if v != calls.get(k, 0)}, 'threads': sorted(t.name for t in threading.enumerate())}))")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_loading_kernel_keeps_no_private_copy(overmind_home: Path, llama_1b: Path, tiny_llama: Path,
                                                  dtype: str) -> None:
    """After the loading cell, the loading kernel's private (anonymous) memory grew by at most 5% of the
    model: its model lies in the entry (or in the checkpoint's page cache for a same-dtype load)."""
    model_bytes = (llama_1b / "model.safetensors").stat().st_size * (2 if dtype == "float32" else 1)
    with kernel(kernel_env()) as (_, kc):
        execute(kc, SETUP)
        warm_up(kc, tiny_llama)
        before = int(execute(kc, "print(anon())"))
        shown = execute_all(kc, load_cell(llama_1b, dtype))
        loaded = json.loads("".join(text for kind, text in shown if kind == "stdout"))
        assert loaded["calls"] == {"miss": 1}
        assert {"user-thread", "tqdm_monitor"} <= set(loaded["threads"]), "a kernel as JupyterLab runs it"
        # A long first load shows its progress; a converting one writes into the entry as it loads
        # (Note [Staged conversions]), so there is no copy afterwards to show.
        assert any(f"Loading weights ({llama_1b.name})" in text for _, text in shown), shown
        assert not any("overmind: caching" in text for _, text in shown), shown
        growth = int(execute(kc, "print(anon())")) - before
        assert growth <= 0.05 * model_bytes, f"{growth / 2**20:.0f} MiB private after a {dtype} miss"
        out = execute(kc, "with torch.no_grad():\n    print(model(torch.arange(8)[None]).logits.float().sum().item())")
        assert float(out) == float(out)  # a number: the model runs


@pytest.mark.parametrize("how,dtype", [("restart", "float32"), ("SIGKILL", "float32"), ("SIGKILL", "bfloat16")])
def test_a_kernel_gone_right_after_its_loading_cell_leaves_the_entry_servable(
        overmind_home: Path, llama_1b: Path, how: str, dtype: str) -> None:
    """Restart (as JupyterLab's button does) or SIGKILL the loading kernel the moment its loading cell
    returns: the next load in a fresh kernel is a hit."""
    env = kernel_env()
    with kernel(env) as (km, kc):
        execute(kc, SETUP)
        loaded = json.loads(execute(kc, load_cell(llama_1b, dtype)))
        assert loaded["calls"] == {"miss": 1}
        if how == "restart":
            km.restart_kernel(now=False)
        else:
            os.kill(loaded["pid"], signal.SIGKILL)
            km.restart_kernel(now=True)
        kc.wait_for_ready(timeout=120)
        execute(kc, SETUP)
        again = json.loads(execute(kc, load_cell(llama_1b, dtype)))
        assert again["pid"] != loaded["pid"] and again["calls"] == {"hit": 1}, again
    with Client(overmind_home, role="test") as client:
        assert len(client.request("ls")["entries"]) == 1
