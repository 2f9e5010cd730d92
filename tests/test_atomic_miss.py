"""The atomic miss (Note [Atomic miss] in overmind_jupyter/publishing.py): an entry is fixed before the
loading call returns, the loading kernel's model lies in it from that moment, and no write of the
user's, by any route, reaches another kernel or a later hit.

The write routes run in real kernels (jupyter_client) with progress bars on and a thread of the
user's alive, as in JupyterLab.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from kernel_server import Client, formats
from kernel_server.compaction import _CHUNK as COMPACTION_CHUNK
from overmind_jupyter import demo_models, load_maps, loading, rebuild
from tests.helpers import tiny_modules
from tests.helpers.faults_helpers import wait_until
from tests.helpers.kernels import USER_THREAD, execute, kernel, kernel_env
from tests.helpers.snippets import last_json, run_py

# -- write routes, in the loading kernel ----------------------------------------------------------------

# Each route writes the model `m` in place (or returns the model to keep, for merge_and_unload).
ROUTES: dict[str, str] = {
    "data.mul_": "m.model.layers[0].mlp.gate_proj.weight.data.mul_(2)",
    "data.copy_": "w = m.model.layers[0].mlp.up_proj.weight; w.data.copy_(torch.full_like(w, 0.5))",
    "data +=": "w = m.model.layers[0].mlp.down_proj.weight\nw.data += 1",
    "no_grad add_": "with torch.no_grad():\n    m.model.layers[0].self_attn.q_proj.weight.add_(1)",
    "load_state_dict": "m.load_state_dict({k: v + 1 for k, v in m.state_dict().items()})",
    "nn.init.normal_": "torch.nn.init.normal_(m.model.layers[1].mlp.gate_proj.weight)",
    "SGD step": "opt = torch.optim.SGD(m.parameters(), lr=0.5)\nm(IDS, labels=IDS).loss.backward()\nopt.step()",
    "AdamW foreach": ("opt = torch.optim.AdamW(m.parameters(), lr=0.1, foreach=True)\n"
                      "m(IDS, labels=IDS).loss.backward()\nopt.step()"),
    "AdamW fused": ("opt = torch.optim.AdamW(m.parameters(), lr=0.1, fused=True)\n"
                    "m(IDS, labels=IDS).loss.backward()\nopt.step()"),
    "merge_and_unload": ("from peft import LoraConfig, get_peft_model\n"
                         "m = get_peft_model(m, LoraConfig(r=4, target_modules=['q_proj', 'v_proj'],"
                         " init_lora_weights=False)).merge_and_unload()"),
    "numpy view": "m.model.norm.weight.detach().view(torch.uint8).numpy()[:] = 7",
    "untyped_storage": "m.model.layers[1].input_layernorm.weight.untyped_storage().fill_(9)",
    "ctypes memset": ("import ctypes\nw = m.model.layers[1].post_attention_layernorm.weight\n"
                      "ctypes.memset(w.data_ptr(), 5, w.nbytes)"),
    "buffer inv_freq": "m.model.rotary_emb.inv_freq.mul_(2)",
}

DIGEST = """
import hashlib, torch
def digest(m):
    h = hashlib.sha256()
    tensors = sorted(m.state_dict(keep_vars=True).items()) + sorted(("buffer " + n, b) for n, b in m.named_buffers())
    for name, t in tensors:
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
IDS = torch.arange(12)[None]
"""


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    tensors = sorted(model.state_dict(keep_vars=True).items()) + sorted(
        ("buffer " + n, b) for n, b in model.named_buffers())
    for name, t in tensors:
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def apply(route: str, var: str) -> str:
    """A cell fragment that applies `route` to models[var] and stores the model back."""
    body = ROUTES[route].replace("\n", "\n    ")
    return f"if True:\n    m = models[{var!r}]\n    {body}\n    models[{var!r}] = m\n"


@pytest.fixture(scope="module")
def route_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One copy of a tiny Llama per route and dtype (separate files: separate entries)."""
    root = tmp_path_factory.mktemp("routes")
    base = demo_models.build_llama(root / "base", "tiny", dtype="bfloat16")
    out = {}
    for i, route in enumerate(ROUTES):
        for dtype in ("bfloat16", "float32"):
            out[f"{dtype} {route}"] = Path(shutil.copytree(base, root / f"{dtype}-{i}"))
    return out


def test_every_write_route_stays_in_the_loading_kernel(overmind_home: Path, route_checkpoints: dict[str, Path]) -> None:
    """Each route, made in the same cell as the miss and again in the next cell, is seen by the loading
    kernel in every later cell, and never by another kernel or by a hit after its restart. Both dtypes:
    bf16 entries refer to their checkpoint (pieces, compacted later), fp32 ones are copied at once."""
    from transformers import AutoModelForCausalLM

    plain = {dtype: digest(AutoModelForCausalLM.from_pretrained(next(iter(route_checkpoints.values())),
                                                               dtype=getattr(torch, dtype)))
             for dtype in ("bfloat16", "float32")}
    env = kernel_env()
    setup = "%load_ext overmind_jupyter\n%overmind on\n" + USER_THREAD + DIGEST + (
        "from transformers import AutoModelForCausalLM\nimport json, overmind_jupyter\nmodels = {}\n")

    def load_all(check_routes: bool) -> str:
        cell = ""
        for name, path in route_checkpoints.items():
            dtype, route = name.split(" ", 1)
            cell += f"models[{name!r}] = AutoModelForCausalLM.from_pretrained({str(path)!r}, dtype=torch.{dtype})\n"
            if check_routes:
                cell += apply(route, name)  # in the same cell as the miss
        return cell

    dump = "print(json.dumps({k: digest(v) for k, v in models.items()}))\n"
    with kernel(env) as (km, kc):
        execute(kc, setup)
        first = json.loads(execute(kc, load_all(True) + dump))
        calls = json.loads(execute(kc, "print(json.dumps(overmind_jupyter.loading.calls()))"))
        assert calls == {"miss": len(route_checkpoints)}, f"every load was a cached miss: {calls}"
        for name, seen in first.items():
            assert seen != plain[name.split()[0]], f"{name}: the write took effect"
        assert json.loads(execute(kc, dump)) == first, "every write is still there in the next cell"
        second = json.loads(execute(kc, "".join(apply(n.split(" ", 1)[1], n) for n in first) + dump))
        assert json.loads(execute(kc, "import gc; gc.collect()\n" + dump)) == second, "and in the cell after"

        with kernel(env) as (_, other):  # another kernel, while the writer lives
            execute(other, setup)
            seen = json.loads(execute(other, load_all(False) + dump))
            assert json.loads(execute(other, "print(json.dumps(overmind_jupyter.loading.calls()))")) == {
                "hit": len(route_checkpoints)}
        for name, d in seen.items():
            assert d == plain[name.split()[0]], f"{name}: another kernel saw the loading kernel's write"

        km.restart_kernel(now=False)
        kc.wait_for_ready(timeout=120)
        execute(kc, setup)
        again = json.loads(execute(kc, load_all(False) + dump))
        for name, d in again.items():
            assert d == plain[name.split()[0]], f"{name}: a hit after the restart got the write"


# -- entries that refer to their checkpoint ---------------------------------------------------------------

def entries(client: Client) -> list[dict]:
    return client.request("ls")["entries"]


MAPS_PROBE = """
    import json, sys, torch
    from transformers import AutoModelForCausalLM
    from overmind_jupyter import loading
    m = loading.cached(AutoModelForCausalLM.from_pretrained, sys.argv[1], dtype=torch.bfloat16)
    with torch.no_grad():
        out = m(torch.arange(8)[None]).logits.double().sum().item()
    maps = open("/proc/self/maps").read()
    print(json.dumps({"out": out, "calls": loading.calls(), "maps_checkpoint": "model.safetensors" in maps}))
"""


def test_a_same_dtype_miss_is_servable_at_once_and_compacted_by_the_daemon(
        overmind_home: Path, tmp_path: Path) -> None:
    """A bf16 load of a bf16 checkpoint: the entry refers to `model.safetensors` (nothing copied) and
    serves another kernel at once; the daemon copies it into an arena of its own, and later hits map
    that arena alone, while the loading kernel keeps its pages."""
    from transformers import AutoModelForCausalLM

    path = demo_models.build_llama(tmp_path / "m", "tiny", num_hidden_layers=4)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = plain(torch.arange(8)[None]).logits.double().sum().item()
    model = loading.cached(AutoModelForCausalLM.from_pretrained, str(path), dtype=torch.bfloat16)
    key, _ = rebuild.entry_of(model.model.embed_tokens.weight.data_ptr())
    assert all(rebuild.entry_of(p.data_ptr())[0] == key for p in model.parameters())
    client = Client(overmind_home, role="test")
    [entry] = entries(client)
    assert entry["pending"] is not None and entry["pending"]["sources"] == [str(path / "model.safetensors")]
    assert entry["pending"]["bytes"] >= 0.9 * (path / "model.safetensors").stat().st_size
    wait_until(lambda: entries(client)[0]["pending"] is None, 60, "the daemon compacted the entry")
    hit = last_json(run_py(MAPS_PROBE.replace("sys.argv[1]", repr(str(path)))))
    assert hit["calls"] == {"hit": 1} and hit["out"] == ref
    assert not hit["maps_checkpoint"], "a hit after the compaction maps the arena, not the checkpoint"
    assert client.request("status")["stats"].get("compacted") == 1
    with torch.no_grad():
        assert model(torch.arange(8)[None]).logits.double().sum().item() == ref
    client.close()


def test_a_same_dtype_miss_leaves_its_tensors_on_the_one_mapping_its_load_made(
        overmind_home: Path, tmp_path: Path) -> None:
    """The load maps the checkpoint through us (Note [Files the load maps] in load_maps.py): after the
    miss, the file is mapped once in this process, every parameter lies on that mapping (nothing was
    moved onto a second one), the registry holds it for the entry, and torch's `from_file` is its own
    again."""
    from transformers import AutoModelForCausalLM

    path = demo_models.build_llama(tmp_path / "m", "tiny", num_hidden_layers=2)
    checkpoint = str(path / "model.safetensors")
    misses = loading.calls().get("miss", 0)
    model = loading.cached(AutoModelForCausalLM.from_pretrained, str(path), dtype=torch.bfloat16)
    assert loading.calls().get("miss", 0) == misses + 1 and not loading.fallbacks()
    [line] = mapped(checkpoint)
    start, end = (int(x, 16) for x in line.split()[0].split("-"))
    assert all(start <= p.data_ptr() < end for p in model.parameters())
    first = next(model.parameters()).data_ptr()
    key, _ = rebuild.entry_of(first)
    assert all(rebuild.entry_of(p.data_ptr())[0] == key for p in model.parameters())
    assert "from_file" not in vars(torch.UntypedStorage)
    del model
    gc.collect()
    assert not mapped(checkpoint)
    assert rebuild.entry_of(first) is None, "the registry lets the mapping go with the model"


KEY_PROBE = """
    import json, sys, torch
    from transformers import AutoModelForCausalLM
    from overmind_jupyter import loading, rebuild
    opens = []
    sys.addaudithook(lambda event, args: opens.append(args[0]) if event == "open" else None)
    m = loading.cached(AutoModelForCausalLM.from_pretrained, sys.argv[1], dtype=torch.bfloat16)
    key, _ = rebuild.entry_of(m.model.norm.weight.data_ptr())
    del opens[:]
    found = loading.result_key(m)
    asked = sum(path == "/proc/self/pagemap" for path in opens)
    with torch.no_grad():
        m.model.layers[1].mlp.down_proj.weight.mul_(2)
    print(json.dumps({"calls": loading.calls(), "fallbacks": loading.fallbacks(), "same": found == key,
                      "asked": asked, "storages": len({p.untyped_storage().data_ptr() for p in m.parameters()}),
                      "after_write": loading.result_key(m)}))
"""


def test_the_key_of_a_model_on_its_checkpoint_asks_for_written_pages_once_per_mapping(
        overmind_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A same-dtype model passed to a cached call (a base model given to PeftModel.from_pretrained) is
    keyed by its entry once `pack` has found its storages unwritten (Note [References] in results.py).
    Its checkpoint's mapping holds a span per piece, and the kernel is asked about written pages once for
    that mapping, not once per span (Note [Finding written pages] in mappings.py): after the miss, and
    after a hit whose pieces are still pending (compaction off here). A page written since is found all
    the same."""
    monkeypatch.setenv("OVERMIND_COMPACT", "0")
    path = demo_models.build_llama(tmp_path / "m", "tiny", num_hidden_layers=2)
    miss = last_json(run_py(KEY_PROBE.replace("sys.argv[1]", repr(str(path)))))
    hit = last_json(run_py(KEY_PROBE.replace("sys.argv[1]", repr(str(path)))))
    assert (miss["calls"], hit["calls"]) == ({"miss": 1}, {"hit": 1})
    for got in (miss, hit):
        assert got["same"] and not got["fallbacks"]
        assert got["storages"] >= 15, "a span per piece: many spans on the checkpoint's mapping"
        assert 1 <= got["asked"] <= 2, f"one question per mapping (the checkpoint's, the arena's): {got['asked']}"
        assert got["after_write"] is None, "a page written since makes it another object"
    client = Client(overmind_home, role="test")
    pending = entries(client)[0]["pending"]
    assert pending is not None, "the hit mapped the checkpoint"
    client.close()
    assert formats.pending_text(pending) == "served from its checkpoint (never copied: OVERMIND_COMPACT=0)", \
        "a copy that never comes is not said to be queued"


def test_a_miss_whose_file_torch_mapped_moves_its_tensors_onto_a_mapping_of_ours(
        overmind_home: Path, tmp_path: Path) -> None:
    """Where torch's own `from_file` mapped the checkpoint (a load on a worker thread, outside the
    miss's context), the publish maps the file once more and moves the tensors onto that mapping, which
    the registry holds: the file is mapped twice, every parameter lies on the second mapping, and the
    model computes what plain's does."""
    from transformers import AutoModelForCausalLM

    path = demo_models.build_llama(tmp_path / "m", "tiny", num_hidden_layers=2)
    checkpoint = str(path / "model.safetensors")
    ids = torch.arange(8)[None]
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)(ids).logits
    model = loading.cached(tiny_modules.load_on_a_worker, str(path))
    assert not loading.fallbacks()
    lines = mapped(checkpoint)
    assert len(lines) == 2, lines
    spans = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in lines]
    key, _ = rebuild.entry_of(next(model.parameters()).data_ptr())
    for p in model.parameters():
        assert rebuild.entry_of(p.data_ptr())[0] == key
        assert sum(start <= p.data_ptr() < end for start, end in spans) == 1
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)


def mapped(path: str) -> list[str]:
    """The lines of /proc/self/maps that map `path`."""
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(path)]


def test_files_mapped_maps_only_its_own_loads_files(tmp_path: Path) -> None:
    """`files_mapped` maps the files of `from_file(path, shared=False, nbytes=size)` calls of its own
    context, privately, and leaves every other call to torch: another size, another thread. The patch
    is undone after the block, also when the block raised."""
    data = bytes(range(256)) * 64
    f = tmp_path / "w.bin"
    f.write_bytes(data)

    def content(storage: torch.UntypedStorage) -> bytes:
        return torch.empty(0, dtype=torch.uint8).set_(storage).numpy().tobytes()

    others: list[torch.UntypedStorage] = []
    with load_maps.files_mapped() as made:
        ours = torch.UntypedStorage.from_file(str(f), shared=False, nbytes=len(data))
        part = torch.UntypedStorage.from_file(str(f), False, 4096)
        thread = threading.Thread(target=lambda: others.append(
            torch.UntypedStorage.from_file(str(f), shared=False, nbytes=len(data))))
        thread.start()
        thread.join()
    [load_map] = made
    st = f.stat()
    assert load_map.file.start == ours.data_ptr() and load_map.file.end == ours.data_ptr() + len(data)
    assert (load_map.file.path, load_map.file.dev, load_map.file.ino) == (str(f), st.st_dev, st.st_ino)
    assert content(ours) == data and content(part) == data[:4096] and content(others[0]) == data
    torch.empty(0, dtype=torch.uint8).set_(ours).fill_(7)  # private: the file keeps its bytes
    assert f.read_bytes() == data and content(ours) == bytes([7]) * len(data)
    assert "from_file" not in vars(torch.UntypedStorage)
    del ours
    assert load_map.mapping() is None, "the mapping goes with its last storage"
    with pytest.raises(ValueError, match="the load failed"), load_maps.files_mapped() as made:
        torch.UntypedStorage.from_file(str(f), shared=False, nbytes=len(data))
        raise ValueError("the load failed")
    assert made[0].mapping() is None and "from_file" not in vars(torch.UntypedStorage)


def test_a_checkpoint_rewritten_while_referred_to_makes_its_entry_stale(
        overmind_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While an entry still refers to its checkpoint (compaction off here, to hold it there), a rewrite
    of the file in place with its size and mtime restored is seen by the daemon (the ctime moved): the
    entry is dropped and the next load reads the file as it is now."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("OVERMIND_COMPACT", "0")
    path = demo_models.build_llama(tmp_path / "m", "tiny", seed=1)
    loading.cached(AutoModelForCausalLM.from_pretrained, str(path), dtype=torch.bfloat16)
    client = Client(overmind_home, role="test")
    assert entries(client)[0]["pending"] is not None
    file = path / "model.safetensors"
    st = file.stat()
    other = demo_models.build_llama(tmp_path / "other", "tiny", seed=2) / "model.safetensors"
    time.sleep(0.01)
    file.write_bytes(other.read_bytes())  # same size, other weights
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file.stat().st_size == st.st_size and file.stat().st_mtime_ns == st.st_mtime_ns
    code = MAPS_PROBE.replace("sys.argv[1]", repr(str(path)))
    got = last_json(run_py(code))
    fresh = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    with torch.no_grad():
        assert got["out"] == fresh(torch.arange(8)[None]).logits.double().sum().item(), "never the old weights"
    assert client.request("status")["stats"].get("stale", 0) >= 1 or got["calls"] != {"hit": 1}
    client.close()


def test_the_daemon_refuses_pieces_that_do_not_match_their_file(daemon: Client, tmp_path: Path) -> None:
    """A publish whose source is writable, or whose identity or pieces do not match the descriptor it
    sends, is refused with a clear error; the daemon serves on."""
    from kernel_server import arena
    from kernel_server.errors import RemoteError

    file = tmp_path / "ckpt"
    file.write_bytes(os.urandom(3 * arena.PAGE))
    identity = arena.file_identity(file.stat())

    def attempt(mode: int, source: dict, pieces: list) -> None:
        key = f"k{os.urandom(4).hex()}"
        assert daemon.request("lookup", key=key, wait=False)["status"] == "load"
        daemon.request("reserve", key=key, bytes=4 * arena.PAGE)
        graph, data = arena.ArenaWriter(16), arena.ArenaWriter(2 * arena.PAGE)
        graph.view[:] = bytes(16)
        fd = os.open(file, mode)
        try:
            daemon.request("publish", key=key, fds=[graph.seal(), data.seal(), fd], graph_bytes=16,
                           arena_bytes=2 * arena.PAGE, sources=[source], pieces=pieces)
        finally:
            graph.close()
            data.close()
            os.close(fd)

    good = {"path": str(file), **identity}
    with pytest.raises(RemoteError, match="read-only"):
        attempt(os.O_RDWR, good, [[0, 100, 0, 0]])
    with pytest.raises(RemoteError, match="not the file announced"):
        attempt(os.O_RDONLY, good | {"ctime_ns": identity["ctime_ns"] - 1}, [[0, 100, 0, 0]])
    with pytest.raises(RemoteError, match="outside"):
        attempt(os.O_RDONLY, good, [[0, 100, 0, 3 * arena.PAGE]])
    with pytest.raises(RemoteError, match="overlaps"):
        attempt(os.O_RDONLY, good, [[0, 100, 0, 0], [50, 100, 0, 0]])
    attempt(os.O_RDONLY, good, [[0, 100, 0, 0], [arena.PAGE, 100, 0, 200]])
    assert daemon.request("ping")["pong"]


# -- share_memory right after a miss ---------------------------------------------------------------------

def test_share_memory_right_after_a_miss(overmind_home: Path, tiny_llama: Path) -> None:
    """torch.multiprocessing's `share_memory()` moves every storage right after the load returned: 20
    rounds, each a fresh miss, with no crash and logits equal to plain's."""
    from transformers import AutoModelForCausalLM

    ids = torch.arange(10)[None]
    misses = loading.calls().get("miss", 0)
    for dtype in (torch.float32, torch.bfloat16):
        with torch.no_grad():
            ref = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=dtype)(ids).logits
        for _ in range(10):
            model = loading.cached(AutoModelForCausalLM.from_pretrained, str(tiny_llama), dtype=dtype)
            model.share_memory()
            with torch.no_grad():
                assert torch.equal(model(ids).logits, ref)
            del model
            loading.shared_client().request("evict", all=True)
    assert loading.calls().get("miss", 0) == misses + 20 and not loading.fallbacks()


# -- a miss of an in-process builder, kept private ---------------------------------------------------------

def test_a_miss_moves_no_tensor_after_it_returned(overmind_home: Path) -> None:
    """Nothing moves the loading kernel's tensors later: their storages are the ones the call returned,
    cells later."""
    model = loading.cached(tiny_modules.build, "tied")
    before = {name: p.untyped_storage().data_ptr() for name, p in model.named_parameters()}
    for _ in range(3):
        loading.flush_warnings()  # what the extension runs after each cell
        loading.cached(tiny_modules.build, "mlp", width=32)  # other loads meanwhile
    assert {name: p.untyped_storage().data_ptr() for name, p in model.named_parameters()} == before


# -- what status, the widget and the CLI show of the work left on an entry -----------------------------

HOG = "while True: pass"


def test_status_widget_and_cli_show_the_copy_left_with_its_model_percent_and_time(
        overmind_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the daemon copies a same-dtype entry from its checkpoint (slowed here: every core is busy,
    so it waits for an idle one before each chunk), `%overmind status`'s text, the status widget's
    table and `overmind-daemon ls` name the model and show the percent done and the time left. The
    copy's arena takes its memory a chunk at a time, after each wait: none of it while the first wait
    lasts (the compactor once allocated the whole arena at once, as the loading kernel ran its first
    forward)."""
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    import overmind_jupyter
    from overmind_jupyter.api import format_status
    from overmind_jupyter.widgets.cache import state_of

    path = demo_models.build_llama(tmp_path / "m", "tiny", hidden_size=512, intermediate_size=1536,
                                   num_hidden_layers=8, vocab_size=8192)  # about 60 MiB in bf16
    monkeypatch.setattr(loading.options, "backing", "memfd")  # arenas `arenas_of` finds by name
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(os.cpu_count() or 1)]
    try:
        model = loading.cached(AutoModelForCausalLM.from_pretrained, str(path), dtype=torch.bfloat16)
        client = Client(overmind_home, role="test")
        [entry] = entries(client)
        wait_until(lambda: len(arenas_of(client, entry["key"])) == 2, 10, "the copy's arena was made")
        time.sleep(0.3)  # (an arena allocated at once is allocated by now)
        allocated = sum(arenas_of(client, entry["key"]).values())  # the entry's own holds a few pages
        done = (entries(client)[0]["pending"] or {}).get("done", 0)
        assert allocated <= done + COMPACTION_CHUNK < entry["bytes"], (allocated, done)
        wait_until(lambda: (entries(client)[0]["pending"] or {}).get("done", 0) > 0, 60, "a chunk was copied")
        status = overmind_jupyter.status()
        text = format_status(status)
        row = state_of(status["daemon"])["entries"][0]
        cli = subprocess.run([sys.executable, "-m", "kernel_server", "ls"], capture_output=True, text=True,
                             check=True).stdout
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert "AutoModelForCausalLM.from_pretrained" in text and "copying from its checkpoint: " in text
    assert " s left" in text and "%" in text, text
    assert row["meta"]["source"] == repr(str(path)) and 0 < row["pending"]["done"] < row["pending"]["bytes"]
    assert " s left" in row["pending"]["text"]
    assert "copying from its checkpoint: " in cli and "AutoModelForCausalLM" in cli, cli
    wait_until(lambda: entries(client)[0]["pending"] is None, 120, "the copy finished once the cores were free")
    assert "copying" not in format_status(overmind_jupyter.status())
    del model
    client.close()


def arenas_of(client: Client, key: str) -> dict[int, int]:
    """The memory allocated to each of `key`'s arenas (memfds) in the daemon, by inode: the entry's, and
    the one it compacts into."""
    pid = client.request("status")["daemon"]["pid"]
    found = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if f"memfd:overmind:{key[:12]}" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                st = os.stat(f"/proc/{pid}/fd/{fd}")
                found[st.st_ino] = st.st_blocks * 512
        except OSError:
            pass
    return found


def test_written_pages_are_found_alike_by_the_scan_and_by_reading_pagemap(tmp_path: Path) -> None:
    """A piece must be unwritten bytes of its file (Note [Atomic miss]): the pages this process wrote in
    a private mapping of a file are found by PAGEMAP_SCAN as by pagemap's entries (Note [Finding written
    pages] in mappings.py), read pages are not written ones, and a write anywhere in a range is seen."""
    import mmap

    from kernel_server.arena import PAGE
    from overmind_jupyter import mappings

    file = tmp_path / "weights.bin"
    file.write_bytes(os.urandom(64 * PAGE))
    with open(file, "r+b") as f:
        m = mmap.mmap(f.fileno(), 64 * PAGE, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    start = t.data_ptr()
    end = start + 64 * PAGE
    float(t[::PAGE].sum())  # every page read: present, still the file's
    for page in (3, 4, 20, 63):
        t[page * PAGE + 100] += 1  # copied on write
    probes = [(page * PAGE + at, n) for page in range(64) for at, n in ((0, 1), (PAGE - 1, 2), (5, 3 * PAGE))
              if page * PAGE + at + n <= 64 * PAGE]
    scanned = mappings.WrittenPages()
    answers = [scanned.any(start, end, start + at, n) for at, n in probes]
    expected = [any(p * PAGE < at + n and at < (p + 1) * PAGE for p in (3, 4, 20, 63)) for at, n in probes]
    assert answers == expected
    with open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
        sums = mappings.WrittenPages._read_sums(pagemap.fileno(), start, end)
    assert [bool(sums[(at + n - 1) // PAGE + 1] - sums[at // PAGE]) for at, n in probes] == expected
    release = tuple(int(x) for x in os.uname().release.split(".")[:2])
    assert mappings._scan_works or release < (6, 7), "this kernel has PAGEMAP_SCAN: the scan answered"
    del t
    m.close()


def test_a_skeleton_finds_a_pending_piece_in_its_file_before_the_arena_around_it(tmp_path: Path) -> None:
    """A hit of an entry whose pieces are pending maps its arena and its checkpoint, both registered
    under the entry's key: the arena whole, the checkpoint a record per piece. The finder a skeleton asks
    (`mappings.finder`) answers a piece's bytes with the checkpoint's mapping, which holds them, not with
    the arena's range around it, still empty there; other bytes with the arena; and once the checkpoint's
    mapping is gone, with the arena."""
    import mmap

    from kernel_server.arena import PAGE, map_private
    from overmind_jupyter import mappings

    key = "a-pending-entry"
    arena_mapping = mmap.mmap(-1, 8 * PAGE)
    file = tmp_path / "weights.bin"
    file.write_bytes(os.urandom(4 * PAGE))
    with open(file, "rb") as f:
        checkpoint = map_private(f.fileno(), 4 * PAGE)  # as a hit maps a pending piece's file
    forget = mappings.register(arena_mapping, key, None)
    # two pieces: the arena's [2, 3) pages are the file's [0, 1), its [5, 7) the file's [2, 4)
    mappings.register(checkpoint, key, None, [(0, PAGE, 2 * PAGE), (2 * PAGE, 2 * PAGE, 5 * PAGE)])
    find = mappings.finder(key)
    assert find(2 * PAGE + 10, 100) == (checkpoint, 10)
    assert find(6 * PAGE, PAGE) == (checkpoint, 3 * PAGE)
    assert find(0, PAGE) == (arena_mapping, 0)
    assert find(3 * PAGE, 2 * PAGE) == (arena_mapping, 3 * PAGE), "between the pieces"
    assert find(2 * PAGE + 10, PAGE) == (arena_mapping, 2 * PAGE + 10), "past a piece's end: the arena holds it"
    assert find(7 * PAGE, 2 * PAGE) is None, "past the arena's end"
    del checkpoint
    gc.collect()
    assert find(2 * PAGE + 10, 100) == (arena_mapping, 2 * PAGE + 10), "a mapping gone: the one left"
    assert mappings.finder(key)(6 * PAGE, PAGE) == (arena_mapping, 6 * PAGE)
    forget()
    assert mappings.finder(key)(0, PAGE) is None
    arena_mapping.close()


def test_file_mappings_are_found_alike_by_the_query_and_by_reading_maps(tmp_path: Path) -> None:
    """Which file maps a storage (Note [Finding file mappings] in mappings.py): the PROCMAP_QUERY ioctl
    says what /proc/self/maps says, for a private and a shared mapping of a file (at its offset), an
    unlinked one, anonymous memory and an address where nothing is mapped."""
    import mmap

    from kernel_server.arena import PAGE
    from overmind_jupyter import mappings

    file = tmp_path / "weights with a space.bin"
    file.write_bytes(os.urandom(16 * PAGE))
    gone = tmp_path / "gone.bin"
    gone.write_bytes(os.urandom(4 * PAGE))
    with open(file, "r+b") as f, open(gone, "r+b") as g:
        private = mmap.mmap(f.fileno(), 8 * PAGE, flags=mmap.MAP_PRIVATE, offset=4 * PAGE)
        shared = mmap.mmap(f.fileno(), 16 * PAGE, flags=mmap.MAP_SHARED)
        unlinked = mmap.mmap(g.fileno(), 4 * PAGE, flags=mmap.MAP_PRIVATE)
    gone.unlink()
    anonymous = mmap.mmap(-1, 4 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    st = file.stat()
    addresses = {name: mappings.address_of(m) for name, m in
                 (("private", private), ("shared", shared), ("unlinked", unlinked), ("anonymous", anonymous))}
    found = {}
    for name, address in addresses.items():
        queried = mappings.query_mapping(address + 5 * PAGE // 4)
        assert queried == mappings.ProcessMaps.read(address + 5 * PAGE // 4), name
        found[name] = queried
    assert found["private"] == mappings.FileMapping(addresses["private"], addresses["private"] + 8 * PAGE, 4 * PAGE,
                                                    st.st_dev, st.st_ino, str(file), True)
    assert found["shared"] is not None and not found["shared"].private and found["shared"].path == str(file)
    assert found["unlinked"] is not None and found["unlinked"].path == f"{gone} (deleted)"
    assert found["anonymous"] is None
    nowhere = addresses["anonymous"]
    anonymous.close()
    assert mappings.query_mapping(nowhere) is None and mappings.ProcessMaps.read(nowhere) is None
    release = tuple(int(x) for x in os.uname().release.split(".")[:2])
    assert mappings._query_works or release < (6, 11), "this kernel has PROCMAP_QUERY: the query answered"
    maps = mappings.ProcessMaps()  # asked again inside a mapping it found: the same answer
    assert maps.at(addresses["private"]) == maps.at(addresses["private"] + 7 * PAGE) == found["private"]
    for m in (private, shared, unlinked):
        m.close()
