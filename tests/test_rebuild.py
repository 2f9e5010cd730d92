"""Pack and rebuild through a real daemon: zero-copy, copy-on-write, bit-equal, shared between entries."""

from __future__ import annotations

import collections
import os
import shutil
import signal
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kernel_server import arena
from kernel_server.client import Client
from overmind_jupyter import loading, populating, rebuild
from overmind_jupyter.errors import FallbackWarning
from tests.helpers import tiny_modules
from tests.helpers.snippets import last_json, run_py, start_py


@pytest.fixture
def env(overmind_home: Path) -> dict[str, str]:
    return dict(os.environ)


def load_twice(kind: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    first = loading.cached(tiny_modules.build, kind)
    second = loading.cached(tiny_modules.build, kind)
    return first, second


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(keep_vars=True), b.state_dict(keep_vars=True)
    assert sa.keys() == sb.keys()
    for name in sa:
        x, y = sa[name], sb[name]
        assert x.dtype == y.dtype and x.shape == y.shape and x.stride() == y.stride(), name
        assert x.device == y.device, name
        if x.device.type != "meta":
            assert torch.equal(x, y), name


def test_tied_weights_stay_tied(overmind_home: Path) -> None:
    first, second = load_twice("tied")
    assert second is not first
    assert second.head.weight is second.embed.weight
    assert rebuild.entry_of(second.embed.weight.data_ptr()) is not None, "served from an arena"
    ids = torch.arange(10)
    assert torch.equal(first(ids), second(ids))


def test_views_offsets_and_non_contiguous_tensors(overmind_home: Path) -> None:
    first, second = load_twice("noncontig")
    assert_same_state(first, second)
    assert not second.transposed.is_contiguous()
    assert second.transposed.untyped_storage().data_ptr() == second.base.untyped_storage().data_ptr()
    assert second.tail.storage_offset() == 12
    for name, tensor in second.state_dict().items():  # each storage is as large as the plain one's
        assert tensor.untyped_storage().nbytes() == first.state_dict()[name].untyped_storage().nbytes(), name
    second.base[3, 0] = 42.0  # views still share the storage
    assert second.tail[0, 0] == 42.0 and second.transposed[0, 3] == 42.0


def test_every_dtype_and_meta_tensors(overmind_home: Path) -> None:
    first, second = load_twice("dtypes")
    assert_same_state(first, second)
    assert second.on_meta.device.type == "meta" and second.empty.numel() == 0
    assert second.u16.dtype == torch.uint16
    assert second.conj.is_conj() and second.grad.requires_grad
    assert not second.frozen.requires_grad and second.frozen.tag == "kept"
    assert rebuild.entry_of(second.frozen.data_ptr()) is not None, "the second load is a hit"


def test_ordered_dicts_keep_order_attributes_sharing_and_class(overmind_home: Path) -> None:
    first, second = load_twice("ordered")
    assert rebuild.entry_of(second.lin.weight.data_ptr()) is not None, "the second load is a hit"
    assert_same_state(first, second)
    table, again, empty = second.tables
    assert list(table) == ["b", "a"] and table["a"] == [1, 2] and torch.equal(table["b"], torch.ones(2))
    assert table.note == "kept" and again is table and type(empty) is collections.OrderedDict and not empty
    assert type(second.tagged) is tiny_modules.Tagged and list(second.tagged.items()) == [("z", 1), ("y", 2)]


def test_hooks_are_kept_and_compiled_state_dropped_as_torch_pickles_modules(overmind_home: Path) -> None:
    first, second = load_twice("hooked")
    assert rebuild.entry_of(second.layers[0].weight.data_ptr()) is not None, "the second load is a hit"
    assert "_compiled_call_impl" in vars(first) and "_compiled_call_impl" not in vars(second)
    assert rebuild.pack(first).pickler == "pickle", "the C pickler, not dill, packed it: modules reduced alike"
    assert list(second._forward_hooks.values()) == [tiny_modules.doubled]
    x = torch.ones(1, 8)
    with torch.no_grad():
        assert torch.equal(second._call_impl(x), first._call_impl(x))
        assert torch.equal(second(x), 2 * second.forward(x)), "the hook runs"


def assert_same_modules(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """Same classes, attributes in the same order, flags, parameters and buffers (as objects of the same
    kinds, each on a storage of its own size), module by module."""
    pairs = list(zip(a.named_modules(), b.named_modules(), strict=True))
    for (name, x), (other, y) in pairs:
        assert name == other and type(x) is type(y), name
        assert list(vars(x)) == list(vars(y)), name
        assert x.training == y.training, name
        assert x._non_persistent_buffers_set == y._non_persistent_buffers_set, name
    assert_same_state(a, b)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert type(p) is type(q) and p.requires_grad == q.requires_grad and q.grad is None and q.is_leaf, name
        assert q._base is None and vars(p) == vars(q), name
        assert q.untyped_storage().nbytes() == p.untyped_storage().nbytes(), name
    assert [n for n, _ in a.named_buffers()] == [n for n, _ in b.named_buffers()]


def test_bf16_parameters_buffers_and_flags_are_the_plain_ones(overmind_home: Path) -> None:
    _, second = load_twice("bf16")
    plain = tiny_modules.build("bf16")
    assert rebuild.entry_of(second.proj.weight.data_ptr()) is not None, "the second load is a hit"
    assert_same_modules(plain, second)
    assert second.proj.weight.dtype == torch.bfloat16 and not second.norm.training
    assert not second.norm.weight.requires_grad and second.proj.weight.requires_grad
    assert "cache" not in second.state_dict() and "scale" in second.state_dict()
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(second(x), plain(x))
    second.proj.weight.sum().backward()  # a parameter of a hit trains as a plain one
    assert second.proj.weight.grad is not None and plain.proj.weight.grad is None


def test_a_hit_parameter_takes_what_a_plain_one_takes(overmind_home: Path) -> None:
    """A hit's parameter is the tensor made over the arena, given the Parameter class (Note [Cheap
    rebuild]), not a detached alias of it: the ways code replaces, converts, copies and trains
    parameters give the plain model's results, and the entry stays as it was."""
    import copy
    import io

    _, hit = load_twice("mlp")
    plain = tiny_modules.build("mlp")
    assert rebuild.entry_of(hit.layers[0].weight.data_ptr()) is not None, "the second load is a hit"
    x = torch.randn(4, 256)

    def exercise(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        for p in model.parameters():
            assert type(p) is torch.nn.Parameter and p.requires_grad and p.is_leaf and p.grad_fn is None
            assert p._base is None
        model.layers[1].bias.data = torch.full((256,), 0.5)  # replaced through .data
        twin = copy.deepcopy(model)
        assert all(type(p) is torch.nn.Parameter for p in twin.parameters())
        model.requires_grad_(False)
        model.requires_grad_(True)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=False)
        model(x).square().mean().backward()
        opt.step()  # in place, on the hit's copy-on-write pages
        wide = model.to(torch.float64)  # each parameter converted through .data, as Module._apply does
        assert all(p.dtype == torch.float64 and type(p) is torch.nn.Parameter for p in wide.parameters())
        buf = io.BytesIO()
        torch.save(wide.state_dict(), buf)
        buf.seek(0)
        return torch.load(buf), twin(x)

    got, got_twin = exercise(hit)
    want, want_twin = exercise(plain)
    # Equal up to rounding: MKL rounds a product of the same bits differently when an operand is
    # page-aligned (README, Limits), which the hit's arena tensors are and the plain load's may or may not
    # be, as the heap of a process that ran other tests lays them out (seen once under two workers). A step
    # or a write that did not happen moves values by about the learning rate, 0.1.
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    torch.testing.assert_close(got_twin, want_twin, rtol=1e-5, atol=1e-6)
    again = loading.cached(tiny_modules.build, "mlp")  # the entry did not see the training
    assert_same_state(tiny_modules.build("mlp"), again)


def test_hook_dicts_are_new_per_module_and_hooks_registered_after_a_hit_stay_on_it(overmind_home: Path) -> None:
    first, second = load_twice("mlp")
    assert rebuild.entry_of(second.layers[0].weight.data_ptr()) is not None, "the second load is a hit"
    plain = tiny_modules.build("mlp")
    assert_same_modules(plain, second)
    hook_dicts = [d for m in second.modules() for d in vars(m).values() if type(d) is collections.OrderedDict]
    assert len(hook_dicts) == sum(type(d) is collections.OrderedDict for m in plain.modules() for d in vars(m).values())
    assert hook_dicts and not any(hook_dicts)
    assert len({id(d) for d in hook_dicts}) == len(hook_dicts), "no two modules share a hook dict"
    second.layers[0].register_forward_hook(tiny_modules.doubled)
    second.layers[1].register_forward_pre_hook(lambda module, args: None)
    x = torch.ones(1, 256)
    with torch.no_grad():
        assert torch.equal(second.layers[0](x), 2 * first.layers[0](x))
        assert torch.equal(second.layers[1](x), first.layers[1](x))
    third = loading.cached(tiny_modules.build, "mlp")
    assert not any(d for m in (first, third) for sub in m.modules() for d in vars(sub).values()
                   if type(d) is collections.OrderedDict), "hooks stay on the module they were added to"
    assert len(second.layers[0]._forward_hooks) == 1 and not second.layers[0]._forward_pre_hooks


def rebuilt_from(packed: rebuild.Packed) -> Any:
    """The object of `packed` (a pack of (object, [], None)) rebuilt in this process over an arena of its
    storages' bytes (the daemon not involved)."""
    writer = arena.ArenaWriter(packed.arena_bytes)
    for own in packed.own:
        writer.write(own.offset, bytes(own.storage))  # type: ignore[arg-type]
    fd = writer.seal()
    try:
        rebuilt, _, _ = rebuild.rebuild(packed.graph, {"k": rebuild.ArenaRef("k", fd, packed.arena_bytes)}, "k",
                                        populate=False)
    finally:
        writer.close()  # and its descriptor: the rebuild's mapping stays
    return rebuilt


def test_packing_leaves_hook_dicts_as_it_found_them_and_keeps_their_attributes() -> None:
    """Note [Empty hook dicts]: more modules than the stand-ins made at import, each with hook dicts of
    its own after a rebuild; packing makes no instance dict for a hook dict, and one that has
    attributes keeps them."""
    import gc

    depth = len(rebuild._HOOK_MARKERS) // len(rebuild._HOOK_DICTS) + 50
    model = tiny_modules.build("mlp", width=2, depth=depth)
    hook_dicts = [d for m in model.modules() for d in vars(m).values() if type(d) is collections.OrderedDict]
    assert len(hook_dicts) > len(rebuild._HOOK_MARKERS) and not any(gc.get_referents(*hook_dicts))
    noted = model.layers[1]._forward_pre_hooks
    noted.note = "kept"  # an empty hook dict with an attribute
    rebuilt = rebuilt_from(rebuild.pack((model, [], None)))
    assert not any(gc.get_referents(*(d for d in hook_dicts if d is not noted))), "no instance dict made by the pack"
    assert_same_modules(model, rebuilt)
    again = [d for m in rebuilt.modules() for d in vars(m).values() if type(d) is collections.OrderedDict]
    assert len({id(d) for d in again}) == len(again) == len(hook_dicts), "a hook dict of its own, each"
    assert rebuilt.layers[1]._forward_pre_hooks.note == "kept" and not rebuilt.layers[1]._forward_pre_hooks
    assert not hasattr(rebuilt.layers[2]._forward_pre_hooks, "note")


def test_a_model_that_keeps_its_hooks_handles_stays_a_reference_and_its_handles_stay_its_own(
        overmind_home: Path) -> None:
    """A handle refers to its module's hook dicts, two of them empty (PEFT's ShadowPEFT keeps its
    handles). Packing once must not change how the next pack sees them: the miss's result and the hit
    are references (Note [References] in results.py) as often as they are asked, and the hit's handle
    removes its hook from the hit's own dicts, as the plain model's does."""
    import gc

    miss = loading.cached(tiny_modules.build, "handled")
    layer = miss.layers[0]
    kwargs_hooks, always_called = layer._forward_hooks_with_kwargs, layer._forward_hooks_always_called
    assert not kwargs_hooks and not always_called and layer._forward_hooks
    key = loading.result_key(miss)
    assert key is not None and loading.result_key(miss) == key, "asked twice: packing changed nothing"
    assert not gc.get_referents(kwargs_hooks, always_called), "no instance dict made by the packs"
    hit = loading.cached(tiny_modules.build, "handled")
    assert rebuild.entry_of(hit.layers[0].weight.data_ptr())[0] == key, "a hit"
    assert loading.result_key(hit) == key and loading.result_key(hit) == key
    assert loading.cached(tiny_modules.wrap, hit).inner is not None  # keyed by its reference: no fallback
    layer = hit.layers[0]
    assert hit.handle.hooks_dict_ref() is layer._forward_hooks
    extra = (layer._forward_hooks_with_kwargs, layer._forward_hooks_always_called)
    assert all(ref() is d for ref, d in zip(hit.handle.extra_dict_ref, extra, strict=True)), \
        "the handle's dicts are its module's"
    x = torch.ones(1, 8)
    with torch.no_grad():
        assert torch.equal(hit(x), 2 * hit.layers[0].forward(x))
        hit.handle.remove()
        assert not layer._forward_hooks and torch.equal(hit(x), hit.layers[0].forward(x))
        assert torch.equal(miss(x), 2 * miss.layers[0].forward(x)), "the miss's hook stays on it"


def test_a_hook_registered_after_a_hit_takes_an_id_of_its_own(env: dict[str, str]) -> None:
    """Note [Hook ids]: in a restarted kernel, a hook registered on a hit model takes an id past those of
    the hooks the model came with, so it is added beside them, not over one; its handle removes it alone."""
    code = """
        import json
        from tests.helpers import tiny_modules
        from overmind_jupyter import loading
        m = loading.cached(tiny_modules.build, "hooked")  # its hook's handle is not kept
        cached = dict(m._forward_hooks)
        handle = m.register_forward_hook(tiny_modules.doubled)
        kept = all(m._forward_hooks.get(k) is hook for k, hook in cached.items())
        handle.remove()
        print(json.dumps({"calls": loading.calls(), "cached": list(cached), "new": handle.id, "kept": kept,
                          "left": list(m._forward_hooks)}))
    """
    miss = last_json(run_py(code, env=env))
    hit = last_json(run_py(code, env=env))
    assert miss["calls"] == {"miss": 1} and hit["calls"] == {"hit": 1}
    assert hit["cached"] == miss["cached"], "the hit's hook keeps the id the loading process gave it"
    assert hit["new"] not in hit["cached"] and hit["kept"], "the new hook is added beside the cached one"
    assert hit["left"] == hit["cached"], "removing the new hook leaves the cached one"


def test_a_module_with_its_own_init_state_and_a_cycle_through_it(overmind_home: Path) -> None:
    first, second = load_twice("stateful")
    assert rebuild.entry_of(second.block.weight.data_ptr()) is not None, "the second load is a hit"
    assert_same_modules(tiny_modules.build("stateful"), second)
    assert (second.steps, second.names, second.options) == (3, ["a", "b"], collections.Counter(x=1))
    assert second.block.owners[0] is second, "the cycle leads back to the rebuilt module"
    second.names.append("c")
    second.options["x"] += 1
    third = loading.cached(tiny_modules.build, "stateful")
    assert third.names == ["a", "b"] and third.options["x"] == 1 and first.names == ["a", "b"]
    with torch.no_grad():
        assert torch.equal(second(torch.ones(1, 4)), first(torch.ones(1, 4)))


def test_a_rebuild_runs_no_python_code_per_module_and_little_per_tensor() -> None:
    """Note [Cheap rebuild]: modules are made and given their state by the C unpickler, and each tensor
    is one call of ours (plus its helpers), not a dozen."""
    import sys

    model = tiny_modules.build("mlp", width=32, depth=6)
    packed = rebuild.pack((model, [], None))
    writer = arena.ArenaWriter(packed.arena_bytes)
    for own in packed.own:
        writer.write(own.offset, bytes(own.storage))  # type: ignore[arg-type]
    fd = writer.seal()
    calls: list[str] = []

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "call":
            calls.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    try:
        sys.setprofile(profile)
        try:
            rebuilt, _, _ = rebuild.rebuild(packed.graph, {"k": rebuild.ArenaRef("k", fd, packed.arena_bytes)}, "k",
                                            populate=False)
        finally:
            sys.setprofile(None)
    finally:
        writer.close()  # and its descriptor: the rebuild's mapping stays
    assert_same_modules(model, rebuilt)
    assert rebuild.entry_of(rebuilt.layers[0].weight.data_ptr())[0] == "k"
    modules = [c for c in calls if c.endswith(("module.py:__setstate__", "module.py:__init__", ":_module"))]
    assert modules == [], "a module went through Python code"
    tensors = len(list(model.parameters()))
    assert len(calls) <= 4 * tensors + 30, f"{len(calls)} Python calls for {tensors} tensors: {calls}"


@pytest.mark.parametrize("backing", ["memfd", "file"])
def test_zero_copy_rebuild_and_private_memory(env: dict[str, str], backing: str, overmind_home: Path) -> None:
    """A hit maps the arena: no tensor is copied and the process's anonymous memory grows by a tiny
    fraction of the model (64 MiB of weights here), with either backing. So does the miss once its call
    has returned: its model lies in the entry it published (Note [Atomic miss])."""
    env = env | {"OVERMIND_ARENA": backing}
    code = """
        import json, torch
        from tests.helpers import tiny_modules
        from overmind_jupyter import loading, populating, rebuild
        def anon():
            for line in open("/proc/self/smaps_rollup"):
                if line.startswith("Anonymous:"):
                    return int(line.split()[1]) * 1024
        before = anon()
        m = loading.cached(tiny_modules.build, "mlp", width=2048, depth=4)
        with torch.no_grad():
            y = m(torch.ones(1, 2048))
        in_arena = all(rebuild.entry_of(p.data_ptr()) is not None for p in m.parameters())
        print(json.dumps({"growth": anon() - before, "in_arena": in_arena, "sum": float(y.double().sum()),
                          "fallbacks": loading.fallbacks()}))
    """
    miss = last_json(run_py(code, env=env))
    hit = last_json(run_py(code, env=env))
    model_bytes = 4 * (2048 * 2048 + 2048) * 4
    assert not miss["fallbacks"] and not hit["fallbacks"]
    assert hit["in_arena"] and miss["in_arena"]
    assert hit["sum"] == miss["sum"], "a hit gives bit-equal outputs"
    assert hit["growth"] < 0.05 * model_bytes, f"hit grew private memory by {hit['growth']} bytes"
    assert miss["growth"] < 0.05 * model_bytes, f"miss kept {miss['growth']} bytes of private memory"
    with Client(overmind_home, role="test") as client:
        assert [e["backing"] for e in client.request("ls")["entries"]] == [backing]


def test_a_file_arena_is_filled_from_several_threads(tmp_path: Path) -> None:
    """Note [Filling an arena]: pieces of memory copied into a file arena by several threads, a few
    pages at a time, land byte for byte where they were placed, each reported done once, in the
    calling thread, when all its bytes are there; a piece outside the arena raises instead."""
    torch.manual_seed(0)
    sources = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (5 * arena.PAGE + 17, 1, 3 * arena.PAGE)]
    offsets = [0, 6 * arena.PAGE, 7 * arena.PAGE]
    pieces = [(off, t.data_ptr(), t.numel()) for off, t in zip(offsets, sources, strict=False)]
    writer = arena.ArenaWriter(10 * arena.PAGE, backing="file", directory=tmp_path)
    try:
        writer.copy_from(pieces, threads=3, chunk=2 * arena.PAGE)
        fd = writer.seal()
        for off, t in zip(offsets, sources, strict=False):
            assert os.pread(fd, t.numel(), off) == t.numpy().tobytes()
        assert os.pread(fd, arena.PAGE - 17, 5 * arena.PAGE + 17) == bytes(arena.PAGE - 17), "gaps stay zero"
    finally:
        writer.close()

    done: list[tuple[int, bool, bool]] = []  # (piece, in the calling thread, its bytes in place then)
    copied: list[int] = []
    writer = arena.ArenaWriter(10 * arena.PAGE, backing="file", directory=tmp_path)
    try:
        def check(i: int) -> None:
            placed = os.pread(writer.fd, sources[i].numel(), offsets[i]) == sources[i].numpy().tobytes()
            done.append((i, threading.current_thread() is threading.main_thread(), placed))

        writer.copy_from(pieces, threads=2, chunk=arena.PAGE, done=check, progress=copied.append)
        assert sorted(done) == [(0, True, True), (1, True, True), (2, True, True)]
        assert sum(copied) == sum(t.numel() for t in sources)
    finally:
        writer.close()

    writer = arena.ArenaWriter(10 * arena.PAGE, backing="file", directory=tmp_path)
    memfd = arena.ArenaWriter(arena.PAGE)
    try:
        with pytest.raises(ValueError, match="outside the arena"):
            writer.copy_from([(9 * arena.PAGE, sources[0].data_ptr(), 2 * arena.PAGE)])
        with pytest.raises(ValueError, match="file arenas"):
            memfd.copy_from(pieces[1:2])
    finally:
        writer.close()
        memfd.close()


def test_a_fill_interrupted_at_any_moment_has_stopped_copying_when_it_raises(tmp_path: Path) -> None:
    """Note [An interrupted fill]: a SIGINT at a random moment of a four-thread fill, as a kernel's
    Ctrl-C comes, and the caller then unmaps the arena and frees the source, as a miss's cleanup does.
    A helper still copying then faulted: this process crashed (SIGSEGV) in every run of 60 tries."""
    proc = run_py("""
        import json, os, random, signal, sys, threading, time
        import torch
        from kernel_server import arena

        N = 64 << 20

        def attempt(delay):
            source = torch.ones(N, dtype=torch.uint8)
            writer = arena.ArenaWriter(N, backing="file", directory=os.environ["FILL_DIR"])
            timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT)) if delay is not None else None
            inside = True
            try:
                if timer:
                    timer.start()
                writer.copy_from([(0, source.data_ptr(), N)], threads=4, chunk=4 << 20)
                inside = False
                if timer:
                    timer.join()
                    time.sleep(0.05)  # the interrupt of a timer that fired after the copy lands here
            except KeyboardInterrupt:
                pass
            finally:
                writer.close()  # unmaps the arena
                del source  # frees the source
            return inside

        def timed():
            start = time.perf_counter()
            attempt(None)
            return time.perf_counter() - start

        took = min(timed() for _ in range(3))  # warm: a first, slower copy made most interrupts land after it
        inside = tries = 0
        while tries < 60 or (inside < 5 and tries < 300):  # on a loaded machine copies vary: try on
            inside += attempt(random.uniform(0, took))
            tries += 1
        print(json.dumps({"interrupted_inside": inside, "tries": tries}))
    """, env=dict(os.environ, FILL_DIR=str(tmp_path)), check=False, timeout=300)
    assert proc.returncode == 0, f"the process ended with {proc.returncode}: {proc.stderr[-2000:]}"
    out = last_json(proc)
    assert out["interrupted_inside"] >= 5, f"too few interrupts landed inside the copy to tell: {out}"


def test_auto_backing_takes_a_disk_file_and_a_memfd_on_tmpfs(overmind_home: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [Arena backing]: "auto" puts arenas in a file when their directory is on a disk filesystem,
    in a memfd when it is a tmpfs (where a file would be shmem anyway, under a size limit)."""
    monkeypatch.setattr(loading.options, "backing", "auto")
    shm = Path(tempfile.mkdtemp(prefix="om-arenas-", dir="/dev/shm"))
    disk = Path(tempfile.mkdtemp(prefix="om-arenas-", dir=Path.home()))
    try:
        for directory, kind in ((shm, "memfd"), (disk, "file")):
            monkeypatch.setenv("OVERMIND_ARENA_DIR", str(directory))
            model = loading.cached(tiny_modules.build, "mlp", width=64, depth=1, seed=len(kind))
            assert not loading.fallbacks()
            again = loading.cached(tiny_modules.build, "mlp", width=64, depth=1, seed=len(kind))
            assert_same_state(model, again)
        with Client(overmind_home, role="test") as client:
            assert sorted(e["backing"] for e in client.request("ls")["entries"]) == ["file", "memfd"]
        assert not list(disk.iterdir()), "a file arena has no name"
    finally:
        shutil.rmtree(shm)
        shutil.rmtree(disk)


def test_in_place_write_is_never_seen_by_another_kernel(env: dict[str, str], tiny_llama: Path) -> None:
    code = f"""
        import json, sys, torch
        from transformers import AutoModelForCausalLM
        from overmind_jupyter import loading
        m = loading.cached(AutoModelForCausalLM.from_pretrained, {str(tiny_llama)!r}, dtype=torch.float32)
        ids = torch.arange(12)[None]
        with torch.no_grad():
            before = m(ids).logits
            if sys.argv[-1] == "write":
                for p in m.parameters():
                    p.add_(1.0)
                after = m(ids).logits
            else:
                after = before
        print(json.dumps({{"before": before.flatten()[:64].tolist(), "after": after.flatten()[:64].tolist(),
                           "fallbacks": loading.fallbacks()}}))
    """
    first = last_json(run_py(code, env=env))  # miss: loads and publishes
    writer = start_py(code.replace('sys.argv[-1] == "write"', "True") + "\n        input()\n", env=env)
    wrote = json_line(writer)  # a hit that writes in place and stays alive
    assert wrote["before"] == first["before"] and wrote["after"] != wrote["before"]
    reader = last_json(run_py(code, env=env))  # a later hit, while the writer still runs
    assert reader["before"] == first["before"], "the writer's in-place add_ leaked into another kernel"
    writer.stdin.close()
    writer.wait(30)
    again = last_json(run_py(code, env=env))
    assert again["before"] == first["before"]
    assert not (first["fallbacks"] or reader["fallbacks"] or again["fallbacks"])


def json_line(proc) -> dict:  # type: ignore[no-untyped-def]
    import json

    line = proc.stdout.readline()
    if not line:
        raise AssertionError(proc.stderr.read())
    return json.loads(line)


def test_an_entry_built_on_another_references_its_bytes(overmind_home: Path) -> None:
    inner = loading.cached(tiny_modules.build, "mlp", width=512, depth=2)
    inner = loading.cached(tiny_modules.build, "mlp", width=512, depth=2)  # a hit: arena-backed
    outer = loading.cached(tiny_modules.wrap, inner)
    entries = {e["meta"]["label"]: e for e in loading.shared_client().request("ls")["entries"]}
    wrapped = next(e for label, e in entries.items() if label.startswith("tiny_modules.wrap"))
    assert len(wrapped["deps"]) == 1, "the wrapper's entry depends on the inner model's"
    assert wrapped["arena_bytes"] < 4096 * 4, "only the wrapper's own small layer was copied"
    again = loading.cached(tiny_modules.wrap, inner)
    assert torch.equal(again.inner.layers[0].weight, outer.inner.layers[0].weight)
    inner_key = rebuild.entry_of(inner.layers[0].weight.data_ptr())[0]
    assert rebuild.entry_of(again.inner.layers[0].weight.data_ptr())[0] == inner_key


def test_a_result_given_unchanged_to_another_load_stays_its_own_entrys(overmind_home: Path) -> None:
    """Note [References] in results.py: a cached result that a load only holds (a vae given to a pipeline)
    is still keyed by its own entry after that load, as in a process that never made it: the same call
    again is a hit, not a second entry; and once that load's result is gone, it is still a reference."""
    import gc

    inner = loading.cached(tiny_modules.build, "mlp", width=32)
    own = loading.result_key(inner)
    outer = loading.cached(tiny_modules.wrap, inner)
    assert outer.inner is inner and loading.result_key(inner) == own, "still its own entry's"
    hits = loading.calls().get("hit", 0)
    again = loading.cached(tiny_modules.wrap, inner)
    assert loading.calls().get("hit", 0) == hits + 1, "the same call: a hit of its entry"
    assert len(loading.shared_client().request("ls")["entries"]) == 2
    del outer, again
    gc.collect()
    assert loading.result_key(inner) == own
    loading.cached(tiny_modules.wrap, inner, seed=1)  # keyed by its reference: no fallback (an error here)
    assert loading.result_key(inner) == own


def test_a_changed_object_is_no_reference(overmind_home: Path) -> None:
    loading.cached(tiny_modules.build, "mlp", width=64)
    inner = loading.cached(tiny_modules.build, "mlp", width=64)
    assert loading.result_key(inner) is not None
    inner.note = "changed"
    assert loading.result_key(inner) is None, "a Python-level change makes it a different object"
    del inner.note
    assert loading.result_key(inner) is not None
    with torch.no_grad():
        inner.layers[0].bias.add_(1)
    assert loading.result_key(inner) is None, "a written page makes it a different object"
    # the first kind of change it names is the one here (a trained base read as an unchanged one's advice)
    with pytest.warns(FallbackWarning, match=r"changed since it was loaded or made \(its weights written in place"):
        loading.cached(tiny_modules.wrap, inner)


def test_a_miss_returns_a_model_that_already_lies_in_its_entry(overmind_home: Path) -> None:
    """Note [Atomic miss]: when the loading call returns, the model's bytes are the entry's (a private
    mapping of its arena), the entry serves other kernels, and nothing moves the model later."""
    model = loading.cached(tiny_modules.build, "mlp", width=128)
    plain = tiny_modules.build("mlp", width=128)
    key, _ = rebuild.entry_of(model.layers[0].weight.data_ptr())
    assert all(rebuild.entry_of(p.data_ptr())[0] == key for p in model.parameters())
    assert_same_state(model, plain)
    assert loading.result_key(model) == key
    [entry] = loading.shared_client().request("ls")["entries"]
    assert entry["key"] == key and entry["pending"] is None, "a converted model is copied whole, at once"
    assert [k["pid"] for k in entry["pinned_by"]] == [os.getpid()], "the loading kernel uses its entry"
    del model
    deadline = time.monotonic() + 10
    while loading.shared_client().request("ls")["entries"][0]["pinned_by"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert loading.shared_client().request("ls")["entries"][0]["pinned_by"] == [], "freed model: unpinned"


def test_an_entry_evicted_right_after_its_miss_leaves_the_model_whole(daemon: Client) -> None:
    model = loading.cached(tiny_modules.build, "mlp", width=64)
    [entry] = daemon.request("ls")["entries"]
    daemon.request("evict", key=entry["key"])
    assert_same_state(model, tiny_modules.build("mlp", width=64))
    reply = daemon.request("lookup", key=entry["key"], wait=False)
    assert reply["status"] == "load", "another kernel loads it now, rather than waiting on us"


def test_unpicklable_result_is_returned_and_reported(overmind_home: Path) -> None:
    with pytest.warns(FallbackWarning, match="will not be cached"):
        model = loading.cached(tiny_modules.build, "unpicklable")
    assert isinstance(model, tiny_modules.Unpicklable)
    assert loading.fallbacks()[-1]["kind"] == "unpicklable"
    assert loading.fallbacks()[-1]["reason"].startswith("the result (Unpicklable) cannot be pickled (pickle: ")
    assert loading.shared_client().request("ls")["entries"] == []


def test_exception_in_the_load_propagates_and_leaves_no_entry(overmind_home: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no checkpoint for x"):
        loading.cached(tiny_modules.failing_build, "x")
    status = loading.shared_client().request("status")
    assert status["entries"] == [] and status["loading"] == []


def test_corrupt_entry_is_evicted_and_the_call_loads_plainly(overmind_home: Path) -> None:
    from kernel_server import arena
    from overmind_jupyter import keys

    key = keys.make_key(tiny_modules.build, ("tied",), {}).key
    client = loading.shared_client()
    assert client.request("lookup", key=key, wait=False)["status"] == "load"
    graph, data = arena.ArenaWriter(32), arena.ArenaWriter(4096)
    graph.view[:] = bytes([2]) + b"\x80\x05" + b"not a pickle".ljust(29, b".")
    client.request("reserve", key=key, bytes=4096 + 32)
    client.request("publish", key=key, fds=[graph.seal(), data.seal()], graph_bytes=32, arena_bytes=4096)
    with pytest.warns(FallbackWarning, match="evicted"):
        model = loading.cached(tiny_modules.build, "tied")
    assert isinstance(model, tiny_modules.TiedWeights)
    assert loading.fallbacks()[-1]["kind"] == "corrupt"
    assert all(e["key"] != key or e["graph_bytes"] != 32 for e in client.request("ls")["entries"])


@pytest.mark.parametrize("content", [42, ("one",), (1, 2, 3), ([], [], "not a state")])
def test_a_graph_of_the_wrong_shape_is_a_corrupt_entry(overmind_home: Path, content: object) -> None:
    """Whatever an entry's graph unpickles to, a shape other than (result, arguments, random state) is a
    corrupt entry: evicted, and the call loads plainly, never another exception."""
    import pickle

    from kernel_server import arena
    from overmind_jupyter import keys

    key = keys.make_key(tiny_modules.build, ("tied",), {}).key
    client = loading.shared_client()
    assert client.request("lookup", key=key, wait=False)["status"] == "load"
    body = bytes([rebuild._FORMAT]) + pickle.dumps(content)
    graph, data = arena.ArenaWriter(len(body)), arena.ArenaWriter(0)
    graph.view[:] = body
    client.request("reserve", key=key, bytes=len(body))
    client.request("publish", key=key, fds=[graph.seal(), data.seal()], graph_bytes=len(body), arena_bytes=0)
    with pytest.warns(FallbackWarning, match="evicted"):
        model = loading.cached(tiny_modules.build, "tied")
    assert isinstance(model, tiny_modules.TiedWeights)
    assert loading.fallbacks()[-1]["kind"] == "corrupt"


def test_daemon_killed_mid_load_falls_back_and_next_call_starts_a_new_daemon(overmind_home: Path) -> None:
    client = loading.shared_client()
    old_pid = client.daemon_pid
    killer = threading.Timer(0.3, os.kill, (old_pid, signal.SIGKILL))
    os.environ["LOAD_COUNTER"] = str(overmind_home / "count")
    killer.start()
    with pytest.warns(FallbackWarning, match="not cached"):  # publishing finds the daemon gone
        model = loading.cached(tiny_modules.counted_build, "mlp", delay=1.0)
    assert isinstance(model, tiny_modules.Mlp)
    assert loading.fallbacks()[-1]["kind"] == "publish"
    model = loading.cached(tiny_modules.counted_build, "mlp", delay=0.0)
    assert isinstance(model, tiny_modules.Mlp)
    new_pid = loading.shared_client().daemon_pid
    assert new_pid != old_pid
    os.kill(new_pid, 0)


def test_single_flight_across_processes(env: dict[str, str], overmind_home: Path) -> None:
    env = env | {"LOAD_COUNTER": str(overmind_home / "count")}
    code = """
        import json, torch
        from tests.helpers import tiny_modules
        from overmind_jupyter import loading
        m = loading.cached(tiny_modules.counted_build, "tied", delay=1.0)
        print(json.dumps({"sum": float(m(torch.arange(4)).double().sum())}))
    """
    procs = [start_py(code, env=env) for _ in range(3)]
    outs = [json_line(p) for p in procs]
    for p in procs:
        p.wait(30)
    assert len({o["sum"] for o in outs}) == 1
    loads = (overmind_home / "count").read_text().split()
    assert len(loads) == 1, f"{len(loads)} processes loaded; single flight allows one"


def test_a_load_that_changes_its_argument_is_replayed_onto_the_callers_object(overmind_home: Path) -> None:
    loading.cached(tiny_modules.build, "mlp", width=32)
    first = loading.cached(tiny_modules.build, "mlp", width=32)
    original_first_layer = first.layers[0]
    extra = loading.cached(tiny_modules.attach, first)  # a miss: runs, changes `first`, publishes
    assert first.extra is extra
    second = loading.cached(tiny_modules.build, "mlp", width=32)
    layer = second.layers[0]
    parameters = list(second.parameters())
    layer.weight.grad = grad = torch.ones_like(layer.weight)
    replayed = loading.cached(tiny_modules.attach, second)  # a hit, replayed onto `second`
    assert loading.fallbacks() == []
    assert second.extra is replayed, "the result is part of the caller's object, as without the cache"
    assert isinstance(second.layers[0], torch.nn.Sequential)
    assert second.layers[0][0] is layer, "modules that existed before the call keep their identity"
    # so do their tensors, and what holds them (an optimizer, a gradient): Note [Argument replay]
    after = {id(p) for p in second.parameters()}
    assert all(id(p) in after for p in parameters), "a parameter of the caller's model was made anew"
    assert layer.weight.grad is grad and layer.weight.requires_grad
    assert torch.equal(second.extra.weight, first.extra.weight)
    assert torch.equal(second.layers[0][0].weight, original_first_layer.weight)
    status = loading.shared_client().request("status")
    assert status["stats"]["hits"] >= 3


def test_a_failed_replay_leaves_the_arguments_as_they_were(overmind_home: Path) -> None:
    from overmind_jupyter.errors import CorruptEntry

    model = tiny_modules.build("mlp", width=8)
    packed = rebuild.pack((model, [model]), substitutes={"m/": model, "m/layers": model.layers})
    other = tiny_modules.build("mlp", width=8, seed=1)
    before = dict(other.__dict__)
    with pytest.raises(CorruptEntry, match="lacks"):
        # the entry replays onto two objects; this call offers only the first
        rebuild.rebuild(packed.graph, {}, "k", arguments={"m/": other})
    assert other.__dict__ == before and other.__dict__ is not before


def test_a_failed_replay_leaves_the_arguments_tensors_as_they_were() -> None:
    """Note [Argument replay]: the tensors an entry replays onto take its bytes, `requires_grad` and
    attributes; a rebuild that fails after them puts each back, the very object."""
    from overmind_jupyter.errors import CorruptEntry
    from overmind_jupyter.results import Replay

    # empty weights: their storages need no arena, so the rebuild gets as far as the second layer
    model = torch.nn.Sequential(torch.nn.Linear(0, 0), torch.nn.Linear(0, 0)).half().requires_grad_(False)
    model[0].weight.tag = "the entry's"
    packed = rebuild.pack((model, [model]), substitutes=Replay.of({"m": model}).paths)
    other = torch.nn.Sequential(torch.nn.Linear(0, 0), torch.nn.Linear(0, 0))
    weight = other[0].weight
    arguments = Replay.of({"m": other}).paths
    del arguments["m/1"]  # this call lacks the second layer
    with pytest.raises(CorruptEntry, match="lacks"):
        rebuild.rebuild(packed.graph, {}, "k", arguments=arguments)
    assert other[0].weight is weight
    assert (weight.dtype, weight.requires_grad, vars(weight)) == (torch.float32, True, {})


def test_enable_leaves_the_first_hit_no_first_torch_call_and_no_collection_of_the_imports(
        overmind_home: Path) -> None:
    """Note [Warm rebuild] and Note [Imports ahead of the hit]: in a process forked from one that imported
    torch and ran no torch operation (a warm kernel), `prepare` (run by `enable()`) makes a rebuild's
    torch calls once and collects what its imports left young, starts no thread, and leaves no mapping
    of its own warm-up rebuild."""
    out = last_json(run_py("""
        import gc, json, mmap, os, resource, threading
        import torch

        def faults():
            return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

        def torch_calls():  # what a rebuild does per tensor (rebuild._fresh_parameter)
            page = mmap.mmap(-1, mmap.PAGESIZE)
            t = torch.frombuffer(page, dtype=torch.bfloat16, count=4, offset=8).as_strided_((2, 2), (2, 1))
            t.__class__ = torch.nn.Parameter
            t.requires_grad_()

        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            from overmind_jupyter import hit_tuning, loading, mappings
            threads = threading.active_count()
            hit_tuning.prepare()
            counts = gc.get_count()
            before = faults()
            torch_calls()
            os.write(w, json.dumps({"faults": faults() - before, "generation1": counts[1],
                                    "threads": threading.active_count() - threads,
                                    "mapped": [s.key for s in mappings._spans]}).encode())
            os._exit(0)
        os.close(w)
        print(os.read(r, 4096).decode())
        os.waitpid(pid, 0)
    """, fresh=True))
    assert out["threads"] == 0
    assert out["mapped"] == [], "the warm-up's rebuild left its arena mapped"
    assert out["generation1"] == 0, "the imports' young objects are left for the first hit to collect"
    assert out["faults"] <= 20, f"the first torch calls after enable() took {out['faults']} page faults"


def test_the_first_patch_free_cached_call_imports_nothing_of_ours(env: dict[str, str], tiny_llama: Path) -> None:
    """Note [Imports ahead of the hit]: `import overmind_jupyter` where torch is imported prepares the hit
    path, so that the first `cached()` call of the README's patch-free form (no `enable()`) is a hit that
    imports nothing of ours."""
    code = f"""
        import json, sys, torch
        from transformers import AutoModelForCausalLM
        import overmind_jupyter
        before = set(sys.modules)
        model = overmind_jupyter.cached(AutoModelForCausalLM.from_pretrained, {str(tiny_llama)!r}, dtype=torch.float32)
        ours = sorted(m for m in set(sys.modules) - before if m.split(".")[0] in ("overmind_jupyter", "kernel_server"))
        print(json.dumps({{"imported": ours, "calls": overmind_jupyter.loading.calls()}}))
    """
    from transformers import AutoModelForCausalLM

    misses = loading.calls().get("miss", 0)
    loading.cached(AutoModelForCausalLM.from_pretrained, str(tiny_llama), dtype=torch.float32)  # here
    assert loading.calls().get("miss", 0) == misses + 1
    out = last_json(run_py(code, env=env))
    assert out == {"imported": [], "calls": {"hit": 1}}, out


def test_a_hit_leaves_its_objects_old_and_young_garbage_collected(env: dict[str, str], tiny_llama: Path) -> None:
    """Note [Old at birth] in hit_tuning.py: after a hit, the rebuilt model is in the collector's oldest
    generation (no young collection visits it), a garbage cycle made just before the call was collected
    rather than promoted with it, and where something is frozen (a warm kernel's zygote froze its heap)
    it stays frozen, the hit's objects are left to the young collections, and the next hit does not count
    the frozen objects again."""
    code = f"""
        import gc, json, sys, weakref, torch
        from transformers import AutoModelForCausalLM
        from overmind_jupyter import loading

        def load():
            return loading.cached(AutoModelForCausalLM.from_pretrained, {str(tiny_llama)!r}, dtype=torch.float32)

        load()  # the miss, or a hit of an earlier run
        class Cycle:
            pass
        garbage = Cycle()
        garbage.self = garbage
        gone = weakref.ref(garbage)
        del garbage
        if sys.argv[-1] == "frozen":
            gc.freeze()
        frozen = gc.get_freeze_count()
        model = load()

        def generation(obj):
            return next(g for g in range(3) if any(o is obj for o in gc.get_objects(generation=g)))

        layer = model.model.layers[0]
        counted, count = [], gc.get_freeze_count
        gc.get_freeze_count = lambda: counted.append(1) or count()
        again = load()
        gc.get_freeze_count = count
        print(json.dumps({{"calls": loading.calls(), "model": generation(model), "layer": generation(layer),
                           "hooks": generation(layer._forward_hooks),
                           "weight": generation(layer.self_attn.q_proj.weight),
                           "garbage_alive": gone() is not None, "frozen_before": frozen,
                           "frozen_after": gc.get_freeze_count(), "enabled": gc.isenabled(),
                           "counted": len(counted)}}))
    """
    run_py(code, env=env)  # publishes
    out = last_json(run_py(code, env=env))
    assert out["calls"] == {"hit": 3}, out
    assert (out["model"], out["layer"], out["hooks"], out["weight"]) == (2, 2, 2, 2), out
    assert not out["garbage_alive"], "a young garbage cycle was promoted with the hit's objects"
    frozen = last_json(run_py(code.replace("sys.argv[-1] == \"frozen\"", "True"), env=env))
    assert frozen["calls"] == {"hit": 3}, frozen
    # (what was frozen and has since been freed leaves the count; `gc.unfreeze()` would make it 0)
    assert frozen["frozen_after"] > frozen["frozen_before"] * 0.9 > 0, "the hit unfroze what the process froze"
    assert frozen["model"] < 2, frozen
    assert frozen["enabled"]
    # counting what is frozen walks all of it: once found, it is remembered, and the next hit asks nothing
    assert frozen["counted"] == 0, frozen


def test_the_model_modules_a_cell_imported_are_read_before_the_first_hit(env: dict[str, str],
                                                                          tiny_llama: Path) -> None:
    """hit_tuning._warm_library_classes: after the cell that imported a transformers model class (the
    extension's post_run_cell runs `loading.flush_warnings`), the digest of its modules (Note [Classes
    swapped in a library] in library_classes.py) is read already: the first hit of a process reads no
    module's namespace on its clock. A miss reads again the classes its load changed (transformers' first
    load of a process puts `smart_apply` on nn.Module), and not the names of the modules that read them."""
    code = f"""
        import json, torch
        import overmind_jupyter
        from overmind_jupyter import library_classes, loading
        overmind_jupyter.enable()  # a cell: %overmind on
        from transformers import LlamaForCausalLM  # the next cell
        loading.flush_warnings()  # what its post_run_cell runs
        views = dict(library_classes._module_views)
        LlamaForCausalLM.from_pretrained({str(tiny_llama)!r}, dtype=torch.float32)
        read = sorted(name for name, view in library_classes._module_views.items() if views.get(name) is not view)
        names = sorted(name for name in read if name in views and library_classes._module_views[name].bound is not
                       views[name].bound)  # (a module's names and classes, read again)
        print(json.dumps({{"calls": loading.calls(), "read": read, "names": names}}))
    """
    first = last_json(run_py(code, env=env))
    assert first["calls"] == {"miss": 1}, first
    assert "torch.nn.modules.linear" in first["read"] and first["names"] == [], first
    again = last_json(run_py(code, env=env))
    assert again["calls"] == {"hit": 1}, again
    assert again["read"] == [], f"the first hit read {again['read']} on its clock"


def test_enable_leaves_the_young_generations_empty(env: dict[str, str]) -> None:
    """Note [Old at birth] in hit_tuning.py: `enable()` collects the young generations after its last
    step, so that the first lookup's collection visits only what the kernel made since, not the
    thousands of objects `enable()` made (its settings' classes, the patched loaders, the connection to
    the daemon it starts here)."""
    out = last_json(run_py("""
        import gc, json, torch
        import overmind_jupyter

        overmind_jupyter.enable()
        young = len(gc.get_objects(generation=0)) + len(gc.get_objects(generation=1))
        print(json.dumps({"young": young, "enabled": gc.isenabled()}))
    """, env=env))
    assert out["enabled"], out
    assert out["young"] < 100, f"enable() left {out['young']} objects in the young generations"


def test_a_miss_leaves_its_load_old_unless_the_load_kept_memory(env: dict[str, str], tiny_llama: Path,
                                                                  tmp_path: Path) -> None:
    """Note [A miss's load born old] in hit_tuning.py: a miss's load runs no collection (its objects are
    all alive after it) and they go to the oldest generation once it is published, the collector's
    threshold and state as they were; the load's small garbage waits there for a full collection. A load
    whose garbage holds more memory than the limit (a tensor of 80 MiB in a cycle) is collected as a plain
    load's would be: its tensor is gone when the call returns. A load that raises, or one with the
    collector off, leaves the collector as it found it."""
    (tmp_path / "junk_loads.py").write_text(textwrap.dedent("""
        import torch
        from tests.helpers import tiny_modules

        def build(numel, fail=False):
            junk = [torch.ones(numel)]  # touched: resident memory
            junk.append(junk)  # a cycle, garbage once this returns
            if fail:
                raise ValueError("no such checkpoint")
            return tiny_modules.build("mlp")
    """))
    code = f"""
        import gc, json, sys, torch
        from transformers import AutoModelForCausalLM
        from overmind_jupyter import loading
        import junk_loads

        def generations(objects):
            where = {{id(o): g for g in range(3) for o in gc.get_objects(generation=g)}}
            return sorted({{where.get(id(o)) for o in objects}}, key=str)

        def left(numel):  # the junk tensors of that size still alive
            return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.numel() == numel)

        threshold = gc.get_threshold()
        collections = []
        gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info["generation"]))
        model = loading.cached(AutoModelForCausalLM.from_pretrained, {str(tiny_llama)!r}, dtype=torch.float32)
        gc.callbacks.clear()
        out = {{"calls": dict(loading.calls()), "collections": collections,
               "model": generations([model, *model.modules(), *model.parameters(), model.generation_config]),
               "threshold": gc.get_threshold() == threshold, "enabled": gc.isenabled()}}
        small = loading.cached(junk_loads.build, 12345)
        out["small_left"] = left(12345)
        big = loading.cached(junk_loads.build, 21_000_000)  # 84 MB
        out["big_left"] = left(21_000_000)
        out["big"] = generations(list(big.modules()))
        try:
            loading.cached(junk_loads.build, 777, fail=True)
        except ValueError:
            out["raised"] = [gc.get_threshold() == threshold, gc.isenabled()]
        gc.disable()
        loading.cached(junk_loads.build, 999)
        out["off"] = [gc.get_threshold() == threshold, gc.isenabled()]
        gc.enable()
        out["calls_after"] = dict(loading.calls())
        print(json.dumps(out))
    """
    out = last_json(run_py(code, env=env, cwd=tmp_path))
    assert out["calls"] == {"miss": 1}, out
    # the one collection: the lookup's of the young generations, while the daemon answers (Note [Old at birth])
    assert out["collections"] == [1], f"the miss ran collections of generations {out['collections']}"
    assert out["model"] == [2], f"the miss's objects are in generations {out['model']}, not all in the oldest"
    assert out["threshold"] and out["enabled"], out
    assert out["small_left"] == 1, "the small garbage of a load promoted with it is collected by a full collection"
    assert out["big_left"] == 0, "a load's garbage holding 84 MB was promoted rather than collected"
    assert 2 not in out["big"], "a load that kept memory had its objects promoted"
    assert out["raised"] == [True, True], out
    assert out["off"] == [True, False], out
    assert out["calls_after"] == {"miss": 4}, out


def test_the_graphs_globals_come_from_their_modules_and_pickle_imports_the_others(tmp_path: Path) -> None:
    """Note [Globals]: a rebuild takes the graph's classes and functions from the modules already
    imported, without pickle's import machinery (`__import__` for each of them), still raising the
    audit event pickle raises; a module not imported yet, and a nested class, are left to pickle."""
    (tmp_path / "late_module.py").write_text(textwrap.dedent("""
        import torch

        class Block(torch.nn.Module):
            class Part:
                pass

            def __init__(self):
                super().__init__()
                self.part = Block.Part()
                self.inner = torch.nn.Identity()
    """))
    env = dict(os.environ, PYTHONPATH=str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    graph = tmp_path / "graph"
    run_py(f"""
        import late_module
        from overmind_jupyter import rebuild
        open({str(graph)!r}, "wb").write(rebuild.pack(late_module.Block()).graph)
    """, env=env)
    out = last_json(run_py(f"""
        import builtins, json, sys
        import torch
        from overmind_jupyter import rebuild

        imported, found = [], []
        sys.addaudithook(lambda event, args: found.append(".".join(args)) if event == "pickle.find_class" else None)
        plain_import = builtins.__import__
        def counting_import(name, *args, **kwargs):
            imported.append(name)
            return plain_import(name, *args, **kwargs)

        graph = open({str(graph)!r}, "rb").read()
        builtins.__import__ = counting_import
        obj = rebuild.rebuild(graph, {{}}, "k")
        builtins.__import__ = plain_import
        print(json.dumps({{"imported": imported, "found": found, "class": type(obj).__qualname__,
                          "part": type(obj.part).__qualname__, "inner": type(obj.inner).__qualname__}}))
    """, env=env))
    assert (out["class"], out["part"], out["inner"]) == ("Block", "Block.Part", "Identity")
    assert out["imported"][0] == "late_module", out["imported"]
    assert not {"torch.nn.modules.module", "torch.nn.modules.linear", "collections", "builtins",
                "overmind_jupyter.rebuild"} & set(out["imported"]), out["imported"]
    assert {"late_module.Block", "late_module.Block.Part", "torch.nn.modules.linear.Identity",
            "collections.OrderedDict"} <= set(out["found"]), out["found"]


PRESENT_PAGES = """
    def present(address, nbytes):
        page = os.sysconf("SC_PAGE_SIZE")
        first, last = address // page, (address + nbytes - 1) // page + 1
        with open("/proc/self/pagemap", "rb", buffering=0) as f:
            raw = os.pread(f.fileno(), (last - first) * 8, first * 8)
        flags = torch.frombuffer(bytearray(raw), dtype=torch.int64)
        return int(((flags >> 63) & 1).sum()), last - first
"""


def test_a_hit_maps_no_page_of_an_embedding_table_that_no_forward_read(env: dict[str, str],
                                                                       models_dir: Path) -> None:
    """A hit's populate thread maps the whole output layer ahead of the first forward, but of the input
    embedding table (untied: the forward reads only its tokens' rows) only what the forward read, so
    that kernels holding the model count no more of it in their RSS and PSS (Note [Populate what a
    forward reads] in populating.py)."""
    from overmind_jupyter.demo_models import build_llama

    path = build_llama(models_dir / "wide-vocab-llama", "tiny", vocab_size=32000, hidden_size=128,
                       intermediate_size=256, tie_word_embeddings=False)
    code = f"""
        import json, os, time, torch
        from transformers import AutoModelForCausalLM
        from overmind_jupyter import loading
        {textwrap.indent(PRESENT_PAGES, " " * 8).strip()}
        m = loading.cached(AutoModelForCausalLM.from_pretrained, {str(path)!r}, dtype=torch.float32)
        with torch.no_grad():
            m(torch.arange(8)[None])
        head, table = m.lm_head.weight, m.model.embed_tokens.weight
        span = lambda t: (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        deadline = time.monotonic() + 60
        while present(*span(head))[0] < present(*span(head))[1] and time.monotonic() < deadline:
            time.sleep(0.05)  # until the populate thread has mapped the output layer
        time.sleep(0.2)
        print(json.dumps({{"head": present(*span(head)), "table": present(*span(table)),
                           "calls": loading.calls(), "fallbacks": loading.fallbacks()}}))
    """
    from transformers import AutoModelForCausalLM

    misses, fallbacks = loading.calls().get("miss", 0), len(loading.fallbacks())
    loading.cached(AutoModelForCausalLM.from_pretrained, str(path), dtype=torch.float32)  # the miss, here
    assert (loading.calls().get("miss", 0), len(loading.fallbacks())) == (misses + 1, fallbacks)
    hit = last_json(run_py(code, env=env))
    assert hit["calls"] == {"hit": 1} and not hit["fallbacks"], hit
    assert hit["head"][0] == hit["head"][1], f"the populate thread left the output layer unmapped: {hit}"
    mapped, pages = hit["table"]
    assert pages > 1000 and mapped < 0.25 * pages, f"{mapped} of the table's {pages} pages mapped: {hit}"


def test_a_hit_on_weights_still_in_their_checkpoint_maps_none_of_the_holes_of_its_arena(
        overmind_home: Path, models_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While an entry's weights still lie in its checkpoint (compaction off here, to hold them there), a
    hit's populate thread maps the pieces in the checkpoint's mapping, and of the entry's arena only what
    lies outside them: the arena's ranges under the pieces are holes in its file, and mapping them made
    new zeroed pages, as many bytes as the weights (Note [Populate what a forward reads] in populating.py)."""
    from overmind_jupyter.demo_models import build_llama

    path = build_llama(models_dir / "wide-vocab-llama", "tiny", vocab_size=32000, hidden_size=128,
                       intermediate_size=256, tie_word_embeddings=False)
    checkpoint = str(path / "model.safetensors")
    code = f"""
        import json, os, re, time, torch
        from transformers import AutoModelForCausalLM
        from overmind_jupyter import loading
        {textwrap.indent(PRESENT_PAGES, " " * 8).strip()}
        m = loading.cached(AutoModelForCausalLM.from_pretrained, {str(path)!r}, dtype=torch.bfloat16)
        head = m.lm_head.weight
        span = lambda t: (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        deadline = time.monotonic() + 60
        while present(*span(head))[0] < present(*span(head))[1] and time.monotonic() < deadline:
            time.sleep(0.05)  # until the populate thread has mapped the output layer
        time.sleep(0.5)  # and the rest
        rss, where = {{"arena": 0, "checkpoint": 0}}, None
        for line in open("/proc/self/smaps"):
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                name = line.split(maxsplit=5)[5].strip() if len(line.split()) > 5 else ""
                where = ("checkpoint" if name == {checkpoint!r} else "arena" if name.startswith(
                    (os.environ["OVERMIND_HOME"], "/memfd:overmind")) else None)
                if where == "checkpoint" and start <= head.data_ptr() < end:
                    rss["head_in_checkpoint"] = True
            elif line.startswith("Rss:") and where:
                rss[where] += int(line.split()[1]) << 10
        print(json.dumps({{"rss": rss, "weights": sum(p.nbytes for p in m.parameters()),
                           "calls": loading.calls(), "fallbacks": loading.fallbacks()}}))
    """
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("OVERMIND_COMPACT", "0")  # for the daemon, which the miss here starts
    misses, fallbacks = loading.calls().get("miss", 0), len(loading.fallbacks())
    loading.cached(AutoModelForCausalLM.from_pretrained, str(path), dtype=torch.bfloat16)
    assert (loading.calls().get("miss", 0), len(loading.fallbacks())) == (misses + 1, fallbacks)
    hit = last_json(run_py(code))
    assert hit["calls"] == {"hit": 1} and not hit["fallbacks"], hit
    rss, weights = hit["rss"], hit["weights"]
    assert rss.get("head_in_checkpoint"), f"the hit's weights lie in the checkpoint's mapping: {hit}"
    assert rss["checkpoint"] >= weights // 3, f"the populate thread mapped the pieces: {hit}"
    # the arena's pages outside the pieces: its own storages (rotary tables), and the pages that pieces
    # start or end inside (tensors lie unaligned in a safetensors file, and keep their offsets there)
    assert rss["arena"] < weights // 16, f"{rss['arena']} bytes of the arena mapped, of {weights} in its holes: {hit}"


def test_only_untied_embedding_tables_are_left_to_the_forward(models_dir: Path) -> None:
    """What the populate thread leaves out: an input embedding table; one tied to the output layer is
    read whole by every forward, and is mapped ahead as the rest."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from overmind_jupyter.demo_models import LLAMA_SIZES

    for tied in (False, True):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_SIZES["tiny"], tie_word_embeddings=tied))
        table = model.model.embed_tokens.weight.untyped_storage()
        expected = [] if tied else [(table.data_ptr(), table.nbytes())]
        assert populating._sparse_tables(model) == expected, tied
        assert populating._sparse_tables((model, [], None)) == expected, "as a hit's graph holds it"
    assert populating._sparse_tables({"not": "a module"}) == []
    page = arena.PAGE
    spans = [(0, 10 * page), (20 * page, 10 * page)]
    assert populating._without(spans, [(2 * page + 1, 4 * page)]) == [(0, 3 * page), (6 * page, 4 * page),
                                                                    (20 * page, 10 * page)]
    assert populating._without(spans, [(5 * page, 20 * page)]) == [(0, 5 * page), (25 * page, 5 * page)]


def test_the_pages_populated_are_whole_merged_and_leave_out_every_hole() -> None:
    """A pending entry's spans: its pieces, unaligned in their file (whole pages, merged), and its arena
    less the pieces' ranges there (only the pages wholly inside a hole are left out)."""
    page = arena.PAGE
    assert populating._pages([(5 * page + 7, 10), (0, page + 1), (page + 3, page), (9 * page, 0)]) == [
        (0, 3 * page), (5 * page, page)], "rounded out to pages, overlaps merged, empty spans dropped"
    spans = [(0, 10 * page), (20 * page, 10 * page)]
    holes = [(8 * page, 14 * page), (page + 1, 2 * page), (4 * page, page - 1), (3 * page, page)]
    assert populating._without(spans, holes) == [(0, 2 * page), (4 * page, 4 * page), (22 * page, 8 * page)]
