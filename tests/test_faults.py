"""Faults: every one ends in a clean fallback or a clean error, never in wrong tensors, and the next call works.

- the daemon SIGKILLed while a kernel publishes, during a hit (between the lookup answer and the end of the
  rebuild), and while a preload worker loads and a kernel waits for it;
- a kernel SIGKILLed while it holds GPU units, a pin on an entry and an in-flight load;
- a full disk: the state directory on a 2 MiB tmpfs with file arenas (and the daemon's log on it), and a
  file-size limit (RLIMIT_FSIZE) on a kernel with memfd arenas;
- a corrupt entry published through the real protocol: a truncated graph, an arena shorter than its graph
  says, a file arena truncated after it was published;
- the checkpoint deleted or rewritten between the cache key (which fingerprints it) and the load.

The timing windows are made deterministic by loaders and objects that wait at a gate (tests/faults_helpers.py),
not by hooks in the product. What the tests cannot see: an arena whose bytes were changed while its size and
graph stayed valid. Arenas are sealed memfds (or unnamed files) written once by the user's own process,
and a rebuild does not checksum gigabytes it maps lazily; see Note [Copy-on-write mappings].
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kernel_server import Client, arena, settings
from kernel_server.client import reset_shared_client
from kernel_server.lifecycle import process_gone
from overmind_jupyter import keys, loading, rebuild
from overmind_jupyter.errors import FallbackWarning
from overmind_jupyter.preloading import PreloadError, preload
from tests.helpers import faults_helpers, tiny_modules
from tests.helpers.faults_helpers import Gate, daemon_log, daemon_pid, digest, kill_daemon, wait_until
from tests.helpers.snippets import last_json, run_py, start_py


def kernel_env(**extra: str) -> dict[str, str]:
    """The environment of a kernel process started now: this test's, with the tests importable."""
    return dict(os.environ, **extra)


def in_arena(model: torch.nn.Module) -> bool:
    return all(rebuild.entry_of(p.data_ptr()) is not None for p in model.parameters())


def entries(client: Client) -> list[str]:
    return [e["key"] for e in client.request("ls")["entries"]]


def assert_cached_again(fn, *args, ref: str, **kwargs) -> None:  # type: ignore[no-untyped-def]
    """The next calls work: a call (a miss that publishes, or already a hit), then a hit from the arena,
    both bit-equal to `ref`."""
    first = loading.cached(fn, *args, **kwargs)
    assert digest(first) == ref
    second = loading.cached(fn, *args, **kwargs)
    assert digest(second) == ref and in_arena(second), "the call after the fault is a hit again"


# -- the daemon dies ------------------------------------------------------------------------------------

def test_daemon_sigkilled_while_a_kernel_publishes(overmind_home: Path) -> None:
    """Killed between the reserve and the publish of a 32 MiB entry, while the kernel copies it into its
    arena: the load the kernel already returned stays right, the publish falls back, and the next call
    starts a new daemon and caches."""
    for attempt in range(4):
        seed = 100 + attempt
        ref = digest(tiny_modules.build("mlp", seed, width=2048))
        watcher = Client(overmind_home, role="test")
        killed: list[int] = []

        def kill_when_reserved(watcher: Client = watcher, killed: list[int] = killed) -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                status = watcher.request("status")
                if status["reserved"]:
                    os.kill(status["daemon"]["pid"], signal.SIGKILL)
                    killed.append(status["daemon"]["pid"])
                    return
                if status["entries"]:
                    return  # the publish won the race
                time.sleep(0.0005)

        killer = threading.Thread(target=kill_when_reserved)
        killer.start()
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            model = loading.cached(tiny_modules.build, "mlp", seed, width=2048)
        killer.join(60)
        watcher.close()
        assert digest(model) == ref
        if killed and loading.fallbacks():
            break
        loading.clear_fallbacks()  # the publish won the race: try again with another model
    else:
        pytest.fail("the kill never landed between reserve and publish in 4 attempts")
    wait_until(lambda: process_gone(killed[0]), 5, "the daemon is gone")
    said = [str(w.message) for w in warned if issubclass(w.category, FallbackWarning)]
    assert len(said) == 1 and "was loaded normally but not cached: " in said[0], said
    assert "without the cache" not in said[0], "said once, not twice in other words"
    assert [f["kind"] for f in loading.fallbacks()] == ["publish"]
    assert_cached_again(tiny_modules.build, "mlp", seed, width=2048, ref=ref)
    assert loading.shared_client().daemon_pid != killed[0]
    assert "Traceback" not in daemon_log(overmind_home)


def test_daemon_sigkilled_during_a_hit(overmind_home: Path, gate: Gate) -> None:
    """Killed after it answered a lookup with the entry's descriptors and before the kernel finished the
    rebuild: the rebuild completes from the descriptors it holds, bit-equal; the next call starts a new
    daemon."""
    ref = digest(faults_helpers.rendezvous_build("mlp", 7, width=256))
    loading.cached(faults_helpers.rendezvous_build, "mlp", 7, width=256)
    old_pid = daemon_pid(overmind_home)
    gate.close()

    def killer() -> None:
        gate.wait_for("rebuilding")  # the kernel is inside the rebuild, holding the entry's descriptors
        kill_daemon(overmind_home)
        gate.open()

    thread = threading.Thread(target=killer)
    thread.start()
    model = loading.cached(faults_helpers.rendezvous_build, "mlp", 7, width=256)
    thread.join(30)
    assert process_gone(old_pid)
    assert digest(model) == ref and in_arena(model), "the hit was served from the arena, bit-equal"
    assert loading.fallbacks() == []
    del model  # its unpin goes to a dead daemon: dropped quietly
    assert_cached_again(faults_helpers.rendezvous_build, "mlp", 7, width=256, ref=ref)
    assert daemon_pid(overmind_home) != old_pid


def test_daemon_sigkilled_during_a_preload(overmind_home: Path, gate: Gate) -> None:
    """A preload worker is loading, the kernel waits for it (single flight), the daemon dies: the kernel
    asks the next daemon and loads the model itself, cached there; the preload ends in a PreloadError
    that says why; the next call is a hit."""
    ref = digest(tiny_modules.build("mlp", 9, width=64))
    gate.close()
    job = preload(faults_helpers.gated_build, "mlp", 9, width=64)
    worker_pid = gate.wait_for("started")[0]
    assert worker_pid == job.pid
    watcher = Client(overmind_home, role="test")
    old_pid = watcher.daemon_pid

    def killer() -> None:
        wait_until(lambda: any(load["waiters"] for load in watcher.request("status")["loading"]), 30,
                   "the kernel waits for the preload")
        kill_daemon(overmind_home)
        gate.open()

    thread = threading.Thread(target=killer)
    thread.start()
    model = loading.cached(faults_helpers.gated_build, "mlp", 9, width=64)
    thread.join(30)
    watcher.close()
    assert digest(model) == ref
    assert loading.fallbacks() == [], "a lost daemon is asked again, not a fallback"
    assert daemon_pid(overmind_home) != old_pid
    with pytest.raises(PreloadError, match="not cached"):
        job.wait(60)
    assert process_gone(job.pid)
    assert_cached_again(faults_helpers.gated_build, "mlp", 9, width=64, ref=ref)
    assert daemon_pid(overmind_home) != old_pid


# -- a kernel dies ----------------------------------------------------------------------------------------

def test_a_sigkilled_kernel_frees_its_units_pins_and_load_within_1s(
        overmind_home: Path, gate: Gate, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OVERMIND_FAKE_GPUS", "1x16")
    monkeypatch.setenv("OVERMIND_GPU_RESERVE", "1")
    watcher = Client(overmind_home, role="test")  # starts the daemon with a simulated device
    loading.cached(tiny_modules.build, "mlp", 41, width=64)
    ref = digest(tiny_modules.build("mlp", 42, width=64))
    gate.close()
    victim = start_py("""
        import sys, threading
        from tests.helpers import faults_helpers, tiny_modules
        from overmind_jupyter import loading, units
        model = loading.cached(tiny_modules.build, "mlp", 41, width=64)  # a hit: its entry is pinned
        units.place(model, units=4)                                       # 4 simulated GPU units
        threading.Thread(target=loading.cached, args=(faults_helpers.gated_build, "mlp", 42),
                         kwargs={"width": 64}, daemon=True).start()       # an in-flight load
        print("ready", flush=True)
        sys.stdin.read()
    """, env=kernel_env())
    try:
        assert victim.stdout.readline().strip() == "ready", victim.stderr.read()
        gate.wait_for("started")
        status = watcher.request("status")
        [entry] = status["entries"]
        assert [k["pid"] for k in entry["pinned_by"]] == [victim.pid]
        assert [load["loader"]["pid"] for load in status["loading"]] == [victim.pid]
        assert [h["pid"] for h in status["units"]["devices"][0]["holders"]] == [victim.pid]

        results: list[torch.nn.Module] = []
        waiter = threading.Thread(target=lambda: results.append(
            loading.cached(faults_helpers.gated_build, "mlp", 42, width=64)))
        waiter.start()  # the same load: it waits for the victim's (single flight)
        wait_until(lambda: watcher.request("status")["loading"][0]["waiters"] == 1, 10)

        victim.send_signal(signal.SIGKILL)
        killed = time.monotonic()

        def released() -> bool:
            s = watcher.request("status")
            return (not s["entries"][0]["pinned_by"] and not s["units"]["devices"][0]["holders"]
                    and [load["loader"]["pid"] for load in s["loading"]] == [os.getpid()])

        wait_until(released, 5, "the victim's units, pins and load released")
        assert time.monotonic() - killed < 1.0, "a SIGKILLed kernel's leases go within a second"
        gate.open()  # the waiter, now the loader, loads
        waiter.join(60)
        assert len(results) == 1 and digest(results[0]) == ref
        assert loading.fallbacks() == []
        hit = loading.cached(faults_helpers.gated_build, "mlp", 42, width=64)
        assert digest(hit) == ref and in_arena(hit)
    finally:
        victim.kill()
        victim.wait()
        watcher.close()


# -- the user's threads ------------------------------------------------------------------------------------

@pytest.mark.parametrize("wait_timeout", ["600", "999999999999"])  # the default; "forever", a year
def test_threads_of_one_kernel_asking_for_one_model_load_it_once(overmind_home: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 wait_timeout: str) -> None:
    """Threads of one kernel share its connection: asked for one model at once, one thread loads it and
    the others wait for its entry and map it, as other kernels do (Note [Loads in the user's threads]);
    none falls back, and the model is loaded once. Also with a wait timeout too long for the platform's
    waits (settings.LONGEST_S)."""
    monkeypatch.setattr(loading.options, "wait_timeout", settings.seconds(wait_timeout))
    counter = tmp_path / "loads"
    monkeypatch.setenv("LOAD_COUNTER", str(counter))
    calls = dict(loading.calls())
    got: dict[int, torch.nn.Module] = {}

    def load(i: int) -> None:
        got[i] = loading.cached(tiny_modules.counted_build, "mlp", 0.5, 11)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(got) == 3
    assert counter.read_text().count("\n") == 1, "loaded once"
    assert loading.fallbacks() == []
    now = loading.calls()
    assert (now.get("miss", 0) - calls.get("miss", 0), now.get("hit", 0) - calls.get("hit", 0)) == (1, 2)
    ref = digest(tiny_modules.build("mlp", 11))
    assert all(digest(m) == ref for m in got.values())


def _first(m: torch.Tensor) -> float:
    return float(m.sum())


def _second(m: torch.Tensor) -> float:
    return float(m.sum()) + 1


def _third(m: torch.Tensor) -> float:
    return float(m.sum()) + 2


def test_each_call_that_falls_back_is_told_and_a_threads_fallback_names_the_threads_line(
        overmind_home: Path) -> None:
    """Two calls that fall back for reasons of one kind are each told; a call repeated (a loop), once (Note
    [Never worse] in loading.py). A fallback in a user's thread is told in the main thread, at its next load
    or cell, naming the line of the thread that loaded; a load in another thread tells nothing."""
    loading.clear_fallbacks()
    tensor = torch.ones(2)
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        assert [loading.cached(f, tensor) for f in (_first, _first, _second)] == [2.0, 2.0, 3.0]
        for seed in range(3):  # one reason: said once
            loading.cached(_second, torch.full((2,), float(seed)))
    said = [str(w.message) for w in told if issubclass(w.category, FallbackWarning)]
    assert len(said) == 2 and "_first" in said[0] and "_second" in said[1], said
    assert {f["kind"] for f in loading.fallbacks()} == {"uncacheable"}

    at: list[int] = []

    def in_a_thread() -> None:
        at.append(sys._getframe().f_lineno + 1)
        loading.cached(_third, tensor)

    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        for target in (in_a_thread, loading.flush_warnings):
            thread = threading.Thread(target=target)
            thread.start()
            thread.join()
        assert told == [], "told in the main thread only"
        loading.flush_warnings()
    (warning,) = told
    assert "_third" in str(warning.message) and (warning.filename, warning.lineno) == (__file__, at[0])


# Two threads of a kernel with the cache on load two tied checkpoints at once, in other dtypes each round,
# as a user parallelising loads would; the kernel's last line is JSON: what each load got.
THREADED_LOADS = """
    import json, os, threading, torch
    import overmind_jupyter
    from overmind_jupyter import loading
    from transformers import AutoModelForCausalLM
    overmind_jupyter.enable()
    a, b = os.environ["A"], os.environ["B"]
    rounds = [((a, torch.bfloat16), (b, torch.float16)), ((a, torch.float16), (b, torch.bfloat16)),
              ((a, torch.float32), (b, torch.float32))]
    got = []

    def load(path, dtype, barrier):
        barrier.wait()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        got.append({"load": f"{path} {dtype}", "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
                    "tied": model.lm_head.weight is model.model.embed_tokens.weight,
                    "sums": [float(p.double().sum()) for p in model.parameters()]})

    for pair in rounds:
        barrier = threading.Barrier(2)
        threads = [threading.Thread(target=load, args=(*one, barrier)) for one in pair]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    print(json.dumps({"got": got, "default": str(torch.get_default_dtype()), "calls": loading.calls(),
                      "fallbacks": loading.fallbacks()}))
"""


def test_loads_in_two_threads_each_get_the_model_they_asked_for(overmind_home: Path, tmp_path: Path) -> None:
    """Note [One library load at a time] in loading.py. transformers' `from_pretrained` sets torch's default
    dtype and switches tying off for the whole process while it builds a model; two at once in two threads
    built models with parameters of both dtypes and untied embeddings, and left the default dtype changed,
    and the cache published them for every kernel. With the cache on, each load gets what one load alone
    gets, in the kernel that loads (misses) and in the next one (hits), and the default dtype is left as
    it was."""
    from transformers import AutoModelForCausalLM

    from overmind_jupyter import demo_models

    a = demo_models.build_llama(tmp_path / "a", "tiny", tie_word_embeddings=True)
    b = demo_models.build_llama(tmp_path / "b", "tiny", seed=1, tie_word_embeddings=True)
    alone = {}
    for path in (a, b):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
            alone[f"{path} {dtype}"] = [float(p.detach().double().sum()) for p in model.parameters()]
    for outcome in ("miss", "hit"):
        out = last_json(run_py(THREADED_LOADS, env=kernel_env(A=str(a), B=str(b)), timeout=300))
        assert out["calls"] == {outcome: 6} and out["fallbacks"] == [], out["calls"]
        assert out["default"] == "torch.float32", "the default dtype as the kernel had it"
        assert sorted(load["load"] for load in out["got"]) == sorted(alone)
        for load in out["got"]:
            assert load["dtypes"] == [load["load"].rsplit(" ", 1)[1]], load["load"]
            assert load["tied"], load["load"]
            assert load["sums"] == alone[load["load"]], load["load"]


# A function of the user's, given to `cached`, loads one model and has a thread load another meanwhile.
USERS_FUNCTION_WITH_A_THREAD = """
    import json, os, threading, torch
    import overmind_jupyter
    from overmind_jupyter import loading
    from transformers import AutoModelForCausalLM
    overmind_jupyter.enable()

    def both(a, b):
        other = []
        thread = threading.Thread(target=lambda: other.append(AutoModelForCausalLM.from_pretrained(b)))
        thread.start()
        model = AutoModelForCausalLM.from_pretrained(a, dtype=torch.bfloat16)
        thread.join()
        return model, other[0]

    first, second = loading.cached(both, os.environ["A"], os.environ["B"])
    print(json.dumps({"calls": loading.calls(), "dtypes": [str(first.dtype), str(second.dtype)],
                      "default": str(torch.get_default_dtype())}))
"""


def test_a_users_function_whose_thread_loads_meanwhile_ends(overmind_home: Path, tmp_path: Path) -> None:
    """Note [One library load at a time]: a function of the user's runs without the lock, so its own
    thread's load takes it while the function's load does not hold it, and the function ends; each load
    gets what it asked for."""
    from overmind_jupyter import demo_models

    a = demo_models.build_llama(tmp_path / "a", "tiny", tie_word_embeddings=True)
    b = demo_models.build_llama(tmp_path / "b", "tiny", dtype="float32", seed=1)
    out = last_json(run_py(USERS_FUNCTION_WITH_A_THREAD, env=kernel_env(A=str(a), B=str(b)), timeout=120))
    assert out["calls"] == {"miss": 3}, out
    assert out["dtypes"] == ["torch.bfloat16", "torch.float32"] and out["default"] == "torch.float32", out


# A kernel's loads wait for another thread's load (a thread holding the lock as a load does while it builds
# its model): one waits until it ends, one is interrupted by the user. The last line is JSON.
WAITS_FOR_ANOTHER_THREAD = """
    import json, os, signal, threading, time, warnings
    import torch
    import overmind_jupyter
    from overmind_jupyter import loading
    from transformers import AutoModelForCausalLM
    overmind_jupyter.enable()
    path = os.environ["MODEL"]

    def another_load(release):
        held = threading.Event()

        def run():
            with loading._library_held(AutoModelForCausalLM.from_pretrained):
                held.set()
                release.wait(60)

        thread = threading.Thread(target=run)
        thread.start()
        held.wait(10)
        return thread

    release = threading.Event()
    other = another_load(release)
    threading.Timer(2.5, release.set).start()
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        started = time.monotonic()
        AutoModelForCausalLM.from_pretrained(path)
        waited = time.monotonic() - started
    other.join()

    release = threading.Event()
    other = another_load(release)
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16)
        cell = "loaded"
    except KeyboardInterrupt:
        cell = "interrupted"
    release.set()
    other.join()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16)
    print(json.dumps({"told": [str(w.message) for w in told], "waited": waited, "cell": cell,
                      "calls": loading.calls(), "tied": model.lm_head.weight is model.model.embed_tokens.weight}))
"""


def test_a_load_waiting_for_another_threads_load_is_told_why_and_can_be_interrupted(overmind_home: Path,
                                                                                      tiny_llama: Path) -> None:
    """Note [One library load at a time]: a load that waits for another thread's load is told why past two
    seconds, then goes on and is cached once that load ends; a cell the user stops while it waits ends at
    once, holding nothing, and the next load is cached."""
    out = last_json(run_py(WAITS_FOR_ANOTHER_THREAD, env=kernel_env(MODEL=str(tiny_llama))))
    assert out["waited"] >= 2.5
    assert [m for m in out["told"] if "waits for a load in another thread of this kernel" in m], out["told"]
    assert out["cell"] == "interrupted"
    assert out["calls"] == {"miss": 2} and out["tied"], out


# -- a kernel forks ----------------------------------------------------------------------------------------

# A kernel holding a cached model forks (a DataLoader's workers, multiprocessing's fork context, the user's
# own os.fork). The child drops what it inherited, which runs the finalizers of the model's mappings there,
# loads through the cache itself, and exits through Python's exit. Without helper threads (as with
# HF_DEACTIVATE_ASYNC_LOAD=1) a finalizer's unpin is sent by the next load, so the child's would be sent
# before its load. The parent's last line is JSON.
FORKING_KERNEL = """
    import gc, json, os, sys, time
    from kernel_server.client import shared_client
    from overmind_jupyter import loading
    from tests.helpers import tiny_modules

    model = loading.cached(tiny_modules.build, "mlp", 8, width=64)
    client = shared_client()

    def pinned():
        return [sorted(p["pid"] for p in e["pinned_by"]) for e in client.request("status")["entries"]]

    before = pinned()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"
        del model
        gc.collect()
        child = loading.cached(tiny_modules.build, "mlp", 8, width=64)
        os.write(w, json.dumps(loading.calls()).encode())
        sys.exit(0)
    os.close(w)
    child_calls = json.loads(os.read(r, 4096))
    os.waitpid(pid, 0)
    # The daemon drops the dead child's own pins when it reads the end of the child's connection, which
    # may come after this kernel's next request: wait for that, at most 10 s.
    deadline = time.monotonic() + 10
    while any(pid in pids for pids in pinned()) and time.monotonic() < deadline:
        time.sleep(0.02)
    print(json.dumps({"before": before, "after": pinned(), "pid": os.getpid(), "child": child_calls,
                      "parent": loading.calls()}))
"""


def test_a_forked_child_never_speaks_on_its_parents_connection(overmind_home: Path) -> None:
    """What the child inherits of its parent's connection stays the parent's: the child's finalizers unpin
    nothing there (the parent's model stays pinned by the parent while it lives), and the child's own
    load goes through a connection of its own."""
    loading.cached(tiny_modules.build, "mlp", 8, width=64)  # the entry (its result dropped at once)
    out = last_json(run_py(FORKING_KERNEL, env=kernel_env()))
    assert out["parent"] == {"hit": 1} and out["child"] == {"hit": 2}, out
    assert out["before"] == [[out["pid"]]], out
    assert out["after"] == out["before"], "the child's finalizers unpinned the parent's model"


# -- transformers' tying switched off by loads in threads -------------------------------------------------

def test_a_load_after_two_threads_switched_tying_off_is_not_cached(overmind_home: Path, tiny_llama: Path,
                                                                   tmp_path: Path) -> None:
    """Note [Tying switched off] in loading.py. Two threads' `from_pretrained` calls go through transformers'
    own `no_tie_weights` in this order (each builds its model under it), and the second puts back the
    first's no-op: `tie_weights` does nothing in the process after. A load then has its tied embeddings
    apart, plain or not; the cache does not keep it for other kernels. A model without ties is cached as
    ever, and once tying works again, the tied one is too."""
    from transformers import AutoModelForCausalLM, initialization
    from transformers.modeling_utils import PreTrainedModel

    from overmind_jupyter import demo_models

    untied = demo_models.build_llama(tmp_path / "untied", "tiny")

    original = PreTrainedModel.tie_weights
    first, second = initialization.no_tie_weights(), initialization.no_tie_weights()
    first.__enter__()  # thread one builds its model
    second.__enter__()  # thread two builds its model: it finds thread one's no-op in place
    first.__exit__(None, None, None)
    second.__exit__(None, None, None)  # and puts the no-op back
    try:
        assert PreTrainedModel.tie_weights is not original, "transformers' own sequence leaves the no-op"
        before = loading.calls()
        with pytest.warns(FallbackWarning, match="`tie_weights` does nothing in this process"):
            model = loading.cached(AutoModelForCausalLM.from_pretrained, tiny_llama)
        after = loading.calls()
        assert after.get("plain", 0) - before.get("plain", 0) == 1 and after.get("miss") == before.get("miss")
        assert model.lm_head.weight is not model.model.embed_tokens.weight, "what the plain load gives here"
        assert rebuild.entry_of(model.lm_head.weight.data_ptr()) is None, "nothing of it cached"
        apart = loading.cached(AutoModelForCausalLM.from_pretrained, untied)
        assert rebuild.entry_of(apart.lm_head.weight.data_ptr()) is not None, "no ties: cached"
    finally:
        PreTrainedModel.tie_weights = original
    model = loading.cached(AutoModelForCausalLM.from_pretrained, tiny_llama)
    assert loading.calls().get("miss") == (after.get("miss", 0) + 2)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert rebuild.entry_of(model.lm_head.weight.data_ptr()) is not None


# -- the disk is full --------------------------------------------------------------------------------------

@pytest.fixture
def tiny_tmpfs(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """OVERMIND_HOME on a fresh 2 MiB tmpfs (needs root and mount); unmounted at the end."""
    from tests.conftest import stop_daemon

    if os.getuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a tmpfs needs root and mount(8); "
                    "test_a_file_size_limit_fails_publishing_cleanly covers a full disk without one")
    home = Path(tempfile.mkdtemp(prefix="om-full-", dir="/tmp"))
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(home)],
                           capture_output=True, text=True, check=False)
    if mount.returncode != 0:
        home.rmdir()
        pytest.skip(f"cannot mount a tmpfs here ({mount.stderr.strip()}); "
                    "test_a_file_size_limit_fails_publishing_cleanly covers a full disk without one")
    monkeypatch.setenv("OVERMIND_HOME", str(home))
    reset_shared_client()
    loading.clear_fallbacks()
    try:
        yield home
    finally:
        reset_shared_client()
        stop_daemon(home)
        subprocess.run(["umount", "-l", str(home)], check=False)
        home.rmdir()


FULL_DISK_KERNEL = """
    import json
    from tests.helpers import tiny_modules
    from tests.helpers.faults_helpers import digest
    from overmind_jupyter import loading, rebuild

    def load(seed, width):
        model = loading.cached(tiny_modules.build, "mlp", seed, width=width)
        ok = digest(model) == digest(tiny_modules.build("mlp", seed, width=width))
        return ok, all(rebuild.entry_of(p.data_ptr()) is not None for p in model.parameters())

    out = {{}}
    out["big"] = load({big_seed}, 512)             # 2 MiB of weights: more than the disk holds
    out["small"] = load({small_seed}, 32)          # a few pages: fits
    out["small_again"] = load({small_seed}, 32)    # a hit
    out["fallbacks"] = [f["kind"] for f in loading.fallbacks()]
    out["reasons"] = [f["reason"] for f in loading.fallbacks()]
    if {memfd_seed}:
        loading.options.backing = "memfd"      # shared memory, not the disk
        out["memfd"] = load({memfd_seed}, 32)
        out["memfd_again"] = load({memfd_seed}, 32)
    print(json.dumps(out))
"""


def test_a_full_disk_under_file_arenas_falls_back_and_the_daemon_lives(tiny_tmpfs: Path) -> None:
    env = kernel_env(OVERMIND_ARENA="file", OVERMIND_ARENA_DIR=str(tiny_tmpfs))
    watcher = Client(tiny_tmpfs, role="test")
    pid = watcher.daemon_pid
    try:
        # File arenas live on the state directory's disk: one too big for it is refused (ENOSPC at
        # allocation, not SIGBUS at the first write), the next, smaller one is cached.
        proc = run_py(FULL_DISK_KERNEL.format(big_seed=1, small_seed=2, memfd_seed=0), env=env, check=False)
        assert proc.returncode == 0, f"the kernel died ({proc.returncode}): {proc.stderr[-2000:]}"
        out = last_json(proc)
        assert out["big"] == [True, False], "the big load is right, and plain; a cached miss is its entry at once"
        assert out["small"] == [True, True] and out["small_again"] == [True, True]
        assert out["fallbacks"] == ["publish"] and "No space left" in out["reasons"][0]

        # Now fill the disk to the last byte: the daemon's log cannot be written any more.
        with open(tiny_tmpfs / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):  # until ENOSPC
            while True:
                f.write(b"\0" * 65536)
        assert shutil.disk_usage(tiny_tmpfs).free < 4096
        for i in range(5):  # each new device is a line in the daemon's log
            watcher.request("units_register", devices=[{"id": f"disk-full-{i}", "name": f"cuda:{i}",
                                                         "total_bytes": 8 << 30}])
        proc = run_py(FULL_DISK_KERNEL.format(big_seed=3, small_seed=4, memfd_seed=5), env=env, check=False)
        assert proc.returncode == 0, f"the kernel died ({proc.returncode}): {proc.stderr[-2000:]}"
        out = last_json(proc)
        assert out["big"] == [True, False] and out["small"] == [True, False] and out["small_again"] == [True, False]
        assert set(out["fallbacks"]) == {"publish"}, "loads on a full disk go the plain way"
        assert out["memfd"] == [True, True] and out["memfd_again"] == [True, True], "memfd arenas need no disk"
        assert watcher.request("ping")["pong"] and daemon_pid(tiny_tmpfs) == pid

        (tiny_tmpfs / "filler").unlink()
        watcher.request("units_register", devices=[{"id": "after-the-disk-emptied", "name": "cuda:9",
                                                     "total_bytes": 8 << 30}])
        wait_until(lambda: "after-the-disk-emptied" in daemon_log(tiny_tmpfs), 5, "the daemon logs again")
        assert Client(tiny_tmpfs, role="test").daemon_pid == pid, "the same daemon serves on"
    finally:
        watcher.close()


def test_a_file_size_limit_fails_publishing_cleanly(overmind_home: Path) -> None:
    """RLIMIT_FSIZE below an entry's size (SIGXFSZ ignored, as a shell's `ulimit -f` leaves it): the default
    memfd arena cannot grow, the load falls back, and a smaller entry is cached."""
    Client(overmind_home, role="test").close()  # the daemon runs without the limit
    code = "import resource, signal\n" \
           "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n" \
           "resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))\n" + \
           textwrap.dedent(FULL_DISK_KERNEL.format(big_seed=11, small_seed=12, memfd_seed=0))
    proc = run_py(code, env=kernel_env(), check=False)
    assert proc.returncode == 0, f"the kernel died ({proc.returncode}): {proc.stderr[-2000:]}"
    out = last_json(proc)
    assert out["big"] == [True, False] and out["small"] == [True, True] and out["small_again"] == [True, True]
    assert out["fallbacks"] == ["publish"] and "File too large" in out["reasons"][0]


# -- corrupt entries -----------------------------------------------------------------------------------

def _publish_corrupt(client: Client, home: Path, key: str, case: str) -> None:
    """Publish, through the real protocol, an entry for `key` broken as `case` says."""
    model = tiny_modules.build("mlp", 5, width=64)
    packed = rebuild.pack((model, []))
    graph_bytes = packed.graph
    arena_bytes = packed.arena_bytes
    backing = "memfd"
    if case == "truncated graph":
        graph_bytes = graph_bytes[: len(graph_bytes) // 2]
    elif case == "short arena":
        arena_bytes = arena.PAGE  # the graph places storages far beyond it
    elif case == "file arena truncated after publish":
        backing = "file"
    assert client.request("lookup", key=key, wait=False)["status"] == "load"
    client.request("reserve", key=key, bytes=arena_bytes + len(graph_bytes))
    data = arena.ArenaWriter(arena_bytes, backing=backing, directory=home)
    if case != "short arena":
        for own in packed.own:
            data.write(own.offset, memoryview(torch.empty(0, dtype=torch.uint8).set_(own.storage).numpy()))
    graph = arena.ArenaWriter(len(graph_bytes))
    graph.view[:] = graph_bytes
    data_fd = data.seal()
    keep = os.dup(data_fd)
    client.request("publish", key=key, fds=[graph.seal(), data_fd], graph_bytes=len(graph_bytes),
                   arena_bytes=arena_bytes)
    graph.close()
    data.close()
    if case == "file arena truncated after publish":
        writable = os.open(f"/proc/self/fd/{keep}", os.O_RDWR)  # its owner can reopen it writable
        os.ftruncate(writable, arena.PAGE)
        os.close(writable)
    os.close(keep)


@pytest.mark.parametrize("case", ["truncated graph", "short arena", "file arena truncated after publish"])
def test_a_corrupt_entry_is_evicted_and_loaded_plainly(overmind_home: Path, case: str) -> None:
    key = keys.make_key(tiny_modules.build, ("mlp", 5), {"width": 64}).key
    client = loading.shared_client()
    _publish_corrupt(client, overmind_home, key, case)
    assert entries(client) == [key]
    ref = digest(tiny_modules.build("mlp", 5, width=64))
    with pytest.warns(FallbackWarning, match="evicted"):
        model = loading.cached(tiny_modules.build, "mlp", 5, width=64)
    assert digest(model) == ref and not in_arena(model), "never the corrupt entry's tensors"
    assert [f["kind"] for f in loading.fallbacks()] == ["corrupt"]
    assert entries(client) == [], "the corrupt entry is gone"
    assert_cached_again(tiny_modules.build, "mlp", 5, width=64, ref=ref)
    assert "Traceback" not in daemon_log(overmind_home)


# A kernel under `ulimit -v` with too little address space left to map the entry's 32 MiB arena; the last line
# is JSON: what its cached call raised, what the plain call raises there, and its fallbacks.
SHORT_KERNEL = """
    import json, resource
    from kernel_server.client import shared_client
    from overmind_jupyter import loading
    from tests.helpers import tiny_modules

    shared_client()  # connected before the limit, as a kernel with overmind on
    size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (size + (8 << 20), resource.RLIM_INFINITY))
    raised = {}
    for how, call in (("cached", lambda: loading.cached(tiny_modules.build, "mlp", 6, width=2048)),
                      ("plain", lambda: tiny_modules.build("mlp", 6, width=2048))):
        try:
            call()
        except Exception as exc:
            raised[how] = type(exc).__name__
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    print(json.dumps({"raised": raised, "fallbacks": [f["kind"] for f in loading.fallbacks()]}))
"""


def test_a_kernel_without_room_for_an_entry_loads_plainly_and_the_entry_stays(overmind_home: Path) -> None:
    """A rebuild that fails for want of this process's room (here a mapping refused under `ulimit -v`)
    says nothing of the entry: the call runs plainly, raising as the plain call raises there, and the entry
    is not evicted; the next kernel's call is a hit."""
    ref = digest(tiny_modules.build("mlp", 6, width=2048))
    model = loading.cached(tiny_modules.build, "mlp", 6, width=2048)
    client = loading.shared_client()
    kept = entries(client)
    assert len(kept) == 1 and in_arena(model)
    out = last_json(run_py(SHORT_KERNEL, env=kernel_env()))
    assert out["raised"] == {"cached": "RuntimeError", "plain": "RuntimeError"}, out  # torch's allocator refuses
    assert out["fallbacks"] == ["no_room"], out
    assert entries(client) == kept, "the entry stays"
    hits = loading.calls().get("hit", 0)
    assert digest(loading.cached(tiny_modules.build, "mlp", 6, width=2048)) == ref
    assert loading.calls().get("hit", 0) == hits + 1


# -- the checkpoint changes under the load ---------------------------------------------------------------

def _plain_digest(path: Path) -> str:
    os.environ.pop("FAULTS_MUTATE", None)
    return digest(faults_helpers.from_pretrained_after(str(path), dtype=torch.float32))


def test_a_checkpoint_deleted_between_key_and_load_raises_as_plain(
        overmind_home: Path, tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plain_copy, ckpt = tmp_path / "plain", tmp_path / "ckpt"
    shutil.copytree(tiny_llama, plain_copy)
    shutil.copytree(tiny_llama, ckpt)
    monkeypatch.setenv("FAULTS_MUTATE", "delete")
    with pytest.raises(Exception) as plain:
        faults_helpers.from_pretrained_after(str(plain_copy), dtype=torch.float32)
    monkeypatch.setenv("FAULTS_MUTATE", "delete")
    with pytest.raises(Exception) as cached:
        loading.cached(faults_helpers.from_pretrained_after, str(ckpt), dtype=torch.float32)
    assert type(cached.value) is type(plain.value), "the same exception type as without overmind"
    status = loading.shared_client().request("status")
    assert status["entries"] == [] and status["loading"] == []
    assert loading.fallbacks() == []
    shutil.copytree(tiny_llama, ckpt)  # the checkpoint is back: the next call works, and caches
    assert_cached_again(faults_helpers.from_pretrained_after, str(ckpt), dtype=torch.float32,
                        ref=_plain_digest(tiny_llama))


def test_a_checkpoint_rewritten_between_key_and_load_is_not_cached_under_the_old_key(
        overmind_home: Path, tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors.torch import load_file, save_file

    ckpt, saved, rewritten = tmp_path / "ckpt", tmp_path / "saved", tmp_path / "rewritten"
    shutil.copytree(tiny_llama, ckpt)
    shutil.copytree(ckpt, saved)  # copy2: the same sizes and mtimes, so the same fingerprint
    shutil.copytree(ckpt, rewritten)
    tensors = load_file(str(rewritten / "model.safetensors"))
    save_file({k: v + 1 for k, v in tensors.items()}, str(rewritten / "model.safetensors"), metadata={"format": "pt"})
    old_ref, new_ref = _plain_digest(ckpt), _plain_digest(rewritten)
    assert old_ref != new_ref

    monkeypatch.setenv("FAULTS_MUTATE", f"rewrite:{rewritten}")
    with pytest.warns(FallbackWarning, match="changed while it was loading"):
        model = loading.cached(faults_helpers.from_pretrained_after, str(ckpt), dtype=torch.float32)
    assert digest(model) == new_ref, "the load read the files on disk, as a plain load would"
    assert [f["kind"] for f in loading.fallbacks()] == ["changed"]
    client = loading.shared_client()
    assert entries(client) == [] and client.request("status")["loading"] == []

    for f in saved.iterdir():  # the old files come back with their old sizes and mtimes: the old key
        shutil.copy2(f, ckpt / f.name)
    again = loading.cached(faults_helpers.from_pretrained_after, str(ckpt), dtype=torch.float32)
    assert digest(again) == old_ref, "the old key never serves the rewritten bytes"
    assert_cached_again(faults_helpers.from_pretrained_after, str(ckpt), dtype=torch.float32, ref=old_ref)
