"""The hit path's tuning of the collector, the allocators and the imports: none of it changes what a hit
returns, and each part takes from 0.15 ms to a few ms off a hit, most of them off the first hit of a process
(the figures, with the runs that gave them, are in benchmarks/RESULTS.md).

`prepare` runs once a process, as soon as torch is imported: it imports what a hit imports (Note [Imports
ahead of the hit]) and makes a rebuild's first calls and allocations (Note [Warm rebuild]). Every hit
then collects the young generations while the daemon answers (`collect_young`) and moves what it rebuilt
to the oldest generation (`born_old`, `promote`: Note [Old at birth]). A miss's load is
born old too, where that is safe (`LoadCollections`: Note [A miss's load born old]). `loading` calls
these; `rebuild` knows nothing of them.

This module imports nothing heavy: `loading` imports it before torch is imported, and it imports
`rebuild` (and torch) only in `prepare`, once torch is (docs/design.md, invariant 8).
"""

from __future__ import annotations

import collections
import gc
import mmap
import os
import sys
import threading
from typing import Any

from . import keys, randomness

__all__ = ["LoadCollections", "born_old", "collect_young", "heap_frozen", "prepare", "promote"]


# Note [Imports ahead of the hit]
# A hit imports `rebuild` (and `mappings`): 1 ms with bytecode, 5-9 ms without (PYTHONDONTWRITEBYTECODE=1
# and a checkout without __pycache__); a miss imports `publishing` and `staging` besides, 2-3 ms more
# without bytecode. `prepare` imports them as soon as torch is imported: at `enable()`
# (api.py), after each cell (loading.flush_warnings, from the extension's post_run_cell), so the cell after
# the one that imported transformers pays nothing, and at `import overmind_jupyter` where torch is already
# imported, so that the patch-free `cached()` pays nothing either. Never before torch is imported
# (docs/design.md, invariant 8: nothing heavy at import, and `rebuild` imports torch).
#
# Then it runs the young collection that the imports made due (`gc.collect(1)`, 1-2 ms). Imports leave
# thousands of young objects and bump the count of generation 1 past its threshold, so the next
# automatic collection is a generation-1 one over all of them; a hit pauses the collector while it
# unpickles, and the first allocation after it paid that collection: 2-3 ms of the first hit of a
# process (measured in a child forked from a parent that imported torch and transformers, as
# benchmarks/load.py --hit-calls makes them). Collected here, the hit's own young collection is of
# what was made since, while the daemon answers, and its objects skip the young generations (Note [Old
# at birth]). Never `gc.collect()` of everything: in a forked kernel that visits the whole heap (0.35 s)
# and writes to every object's page, unsharing them. The figures: benchmarks/RESULTS.md, "The hit call"
# and "A converting miss writes its weights once; the first patch-free call".
_prepared = False


def prepare(ahead: bool = True) -> None:
    """Import what a hit imports, once torch is imported (Note [Imports ahead of the hit]), and make a
    rebuild's first calls (Note [Warm rebuild]). Runs once a process; before torch is imported, not at all.
    `ahead`: also read the library modules imported since (off a load's clock: at `enable()` and after
    a cell, not at a call)."""
    global _prepared
    if ahead:
        _warm_library_classes()
    if _prepared or "torch" not in sys.modules:
        return
    _prepared = True
    try:
        from . import publishing  # noqa: F401 (what a miss imports besides: staging with it)

        _warm_rebuild()
        _warm_miss()
        _warm_allocator()
        # the key's first calls too (sha256's setup, inspect's), of a function called with a function
        keys.make_key(keys.owner_name, (prepare,), {})
        # and a checkpoint folder's, as a loader's first argument (this package's smallest folder)
        keys.make_key(_Warm.from_pretrained, (os.path.join(os.path.dirname(__file__), "units"),),
                      {"dtype": sys.modules["torch"].float32})
        # and the generators' states, which a miss reads before and after its load (numpy's first read
        # of its state costs 0.1-0.2 ms more than the next)
        randomness.random_state()
    except Exception:  # noqa: BLE001 (the hit imports it again, and falls back there: Note [Never worse] in loading.py)
        pass
    except BaseException:  # a Ctrl-C: prepared at the next cell or call
        _prepared = False  # (Note [A Ctrl-C after the cell] in extension.py)
        raise
    gc.collect(1)


# The modules whose classes most models derive from: the digest of a graph's library modules (Note [Methods
# patched into a library's classes] in library_classes.py) reads each class's namespace once a process, 1.5-2
# ms of a 1.1B Llama's first miss or hit in a fresh process, most of it these. Read ahead, once transformers is
# imported, at `enable()` and after each cell (not at a call: that is the load's clock), with the model and
# configuration modules of transformers and diffusers imported by then (a cell's `from transformers import
# LlamaForCausalLM`: 0.5 ms more of the first hit of a Llama), looked for only where the process imported
# something since. A module is read again only where its namespace changed since (`enable()` patches
# loaders into some that `import overmind_jupyter` read), and the miss or the hit compares it anyway.
_BASES = ("torch.nn.modules.module", "torch.nn.modules.linear", "torch.nn.modules.container", "torch.nn.modules.sparse",
          "transformers.modeling_utils", "transformers.generation.utils", "transformers.configuration_utils",
          "transformers.generation.configuration_utils", "transformers.activations")
_modules_seen = 0  # len(sys.modules) at the last look


def _warm_library_classes() -> None:
    global _modules_seen
    if len(sys.modules) == _modules_seen or "transformers.modeling_utils" not in sys.modules:
        return
    _modules_seen = len(sys.modules)
    names = [name for name in list(sys.modules) if name in _BASES or _a_model_module(name)]
    try:
        from . import library_classes

        library_classes.bindings(names)
    except Exception:  # noqa: BLE001 (the miss or the hit reads them again)
        pass


def _a_model_module(name: str) -> bool:
    if name.startswith("transformers.models."):
        return name.rpartition(".")[2].startswith(("modeling_", "configuration_"))
    return name.startswith("diffusers.models.")


class _Warm:
    """A loader's shape, keyed once by `prepare`."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str, *args: Any, **kwargs: Any) -> None:
        """Loads nothing."""


# Note [Warm rebuild]
# The first torch operations of a process pay for torch's lazy setup (the CPU allocator, the
# dispatcher's first lookups, Parameter's first subclass instance), and in a process forked from one
# that ran no torch operation (a warm kernel, benchmarks/load.py --hit-calls) they also write to
# pages still shared with the parent, a copy-on-write fault (3-6 us here) per page: about 1 ms and a
# hundred faults of the first hit, for nothing of the model. `_warm_rebuild` makes a rebuild's torch
# calls once, on a page of anonymous memory, from `enable()` (`prepare`, Note [Imports ahead of the hit]),
# and rebuilds a one-module graph over a one-page arena (the rebuild's own first calls: the mapping
# registry, the pin, the module and hook-dict opcodes, a parameter made over the arena and one on a
# storage made before). It runs no parallel operation and starts no thread: a forked kernel stays safe
# to fork.
#
# Then `_warm_allocator` makes and drops the objects of twice a 1B-parameter model's modules, and
# 0.6 MB of glibc's small chunks. In a forked process the allocators' partly used pages are still the
# parent's, and the first object placed in each copies it: about 150 of the 260 faults (5 us each here)
# of the 0.1B model's first hit came from there. Made and dropped at enable(), those pages are this
# process's own when the hit's objects go there.
# This moves that cost to enable() (a few ms, once a process) rather than removing it; any code
# that allocates as much between enable() and the first hit does the same. The figures:
# benchmarks/RESULTS.md, "The hit call" (stops 28 and 30).
def _warm_rebuild() -> None:
    """Make the calls of a rebuild once, so that the first hit pays no first-call costs."""
    import torch

    from . import mappings, rebuild

    page = mmap.mmap(-1, mmap.PAGESIZE)
    mappings.address_of(page)
    torch.frombuffer(page, dtype=torch.float32, count=2, offset=0).as_strided_((1,), (1,), 1)
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.zeros(2, 2))  # a 2-D parameter that requires grad, as most do
    # and a parameter on its storage, with an attribute (a tied weight's way: `_parameter` in rebuild.py)
    row = torch.nn.Parameter(module.weight.detach()[1], requires_grad=False)
    row.__dict__["warm"] = True
    module.row = row
    packed = rebuild.pack((module, [], None))
    fd = os.memfd_create("overmind-warm", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, packed.arena_bytes)
        rebuild.rebuild(packed.graph, {"": rebuild.ArenaRef("", fd, packed.arena_bytes)}, "", populate=False)
    finally:
        os.close(fd)


def _warm_miss() -> None:
    """Ask the kernel once what a same-dtype miss asks of its checkpoint's mapping (Note [Warm
    rebuild]): which file it maps (PROCMAP_QUERY) and whether this process wrote a page of it
    (PAGEMAP_SCAN), of a page of this file; ctypes' first calls cost a miss 0.15 ms. And which filesystem
    its arena would go on (read once per directory: `arena._filesystem_of`), 0.1-0.2 ms."""
    from kernel_server import arena, lifecycle

    from . import mappings

    with open(__file__, "rb") as f:
        page = arena.map_private(f.fileno(), mmap.PAGESIZE)
    try:
        mappings.file_mapping_of(mappings.ProcessMaps(), mappings.WrittenPages(), mappings.address_of(page), 1)
    finally:
        page.close()
    directory = arena.arena_directory(lifecycle.state_dir(create=False))
    arena.choose_backing("auto", directory)


# A 1.1B Llama has about 290 modules, and its hit makes more than their objects (the parameters, the
# graph's own): twice that many halved the page faults of its forked first hit (270 -> 130, 0.07 ms),
# for 0.9 ms more of enable() (1.8 ms). Not its tensors: torch's own allocations for 256 of them saved
# about 40 faults of a hit, for 2-3 ms more of enable().
_WARM_MODULES = 640
# Where the package was imported from bytecode (no compiler's garbage freed before the hit), about 80
# faults more came from glibc's malloc, in the chunks its free lists still shared with the parent:
# 1,000 chunks of 600 bytes (past pymalloc's 512), made and dropped, took them to 117-119 faults and
# 0.15-0.2 ms off the hit (1.1B and 0.1B), for 0.4 ms of enable(). 520-800 bytes did as well, 1,200
# bytes nothing, 500 chunks half.
_WARM_CHUNK = 600
_WARM_CHUNKS = 1000


class _Warmed:
    """Stands for a module in `_warm_allocator`."""


def _warm_allocator() -> None:
    """Make and drop the objects of a 1B-parameter model's hit (Note [Warm rebuild])."""
    import torch

    from . import rebuild

    new_module = vars(torch.nn.Module())  # what a new nn.Module holds, and its empty hook dicts
    hook_dicts = [k for k, v in new_module.items() if type(v) is collections.OrderedDict and not v]
    made: list[Any] = []
    with rebuild.gc_paused():  # none of it is garbage for the collector to find
        for _ in range(_WARM_MODULES):
            state = dict(new_module)  # its hook dicts replaced below, as a rebuild makes its own
            for name in hook_dicts:
                state[name] = collections.OrderedDict()
            state["_non_persistent_buffers_set"] = set()
            module = _Warmed()
            object.__setattr__(module, "__dict__", state)
            made.append(module)
        made.extend(bytes(_WARM_CHUNK) for _ in range(_WARM_CHUNKS))  # glibc's chunks, not pymalloc's
        del made


# Note [Old at birth]
# A hit's objects (about 5,000 for a 1.1B Llama: modules, their hook dicts, parameters) are made while
# the collector is paused (rebuild.gc_paused), and they outlive the call. Left in generation 0, the
# first allocation after the hit ran a young collection over all of them (0.4-0.5 ms of a 1.1B hit),
# and a generation-1 collection visited them again later, to find them all alive both times. So they go
# to the oldest generation at once (`promote`): `gc.freeze()` then `gc.unfreeze()` moves every tracked
# object there without visiting one. For that to promote nothing but live objects, the young generations
# are collected first (`collect_young`, from loading's lookup), while the daemon answers (the thread would
# only wait; 0.2 ms here), and once at the end of `enable()`, which left 3,700 objects young (its
# settings' traitlets classes, the patched loaders, its connection), whose visit took 0.3-0.5 ms of the
# first lookup, twice its round trip (RESULTS.md, "Stop 70"); between that and the promotion runs only
# the hit's own code (and whatever another thread makes, whose garbage then waits for a full collection
# rather than a young one). Not where something is frozen: a warm kernel's zygote froze its heap before
# forking it (Note [Frozen imports] in warm/zygote.py), and `gc.unfreeze()` would hand all of it back to
# the collector, whose next full collection would write to every page of it; there, and where the user
# disabled the collector, the hit's objects stay young (`born_old` is False), and the first young
# collection after the hit visits them.
# Asking whether something is frozen costs a walk over all of it (`gc.get_freeze_count()` counts the
# permanent generation object by object: 21 ms per call over a warm kernel's 400,000 objects), so the spare
# says it froze (`heap_frozen`), and a count found above zero is remembered: the walk runs at most once,
# and over nothing where nothing is frozen. The figures: benchmarks/RESULTS.md, "The hit call" (stop 30)
# and "Warm restart to model-ready" (the walk).
_heap_frozen = False


def heap_frozen() -> None:
    """Say that this process's heap is frozen for good (gc.freeze): a hit then leaves its objects young
    (Note [Old at birth])."""
    global _heap_frozen
    _heap_frozen = True


def born_old() -> bool:
    """Whether a hit's objects go to the oldest generation (Note [Old at birth]): asked before the hit
    pauses the collector, which it would otherwise find disabled."""
    if _heap_frozen or not gc.isenabled():
        return False
    if gc.get_freeze_count():
        heap_frozen()
        return False
    return True


def collect_young() -> None:
    """Collect the young generations, where a hit's objects will be promoted (Note [Old at birth]): run
    while the daemon answers the lookup."""
    if born_old():
        gc.collect(1)


def promote() -> None:
    """Move every tracked object to the oldest generation, visiting none (Note [Old at birth]): run by
    a hit right after its rebuild, with the collector still paused, where `born_old()` was True."""
    gc.freeze()
    gc.unfreeze()


# Note [A miss's load born old]
# The plain load of a 1.1B Llama spends 4-6 ms of its call in the collector (33 young collections over
# the 14,000 objects it builds: modules, their hook dicts, parameters), which all outlive it, each
# visited in generation 0 and again in generation 1. Those visits find nothing: the load's cyclic garbage
# is a few hundred small objects (a JSON encoder's closures, cells; none holding a tensor, in every
# loader of the suite's checkpoints: a Llama in safetensors, sharded and .bin, a tokenizer, an image
# processor, ViT, BERT, a diffusers pipeline, a VAE from one file). So a miss's load runs with the young
# threshold raised to `_LOAD_YOUNG` objects (a load that makes fewer runs no collection), and once the
# entry is published its objects go to the oldest generation without a visit (`promote`), as a hit's do
# (Note [Old at birth]): the miss then spends less of the call in the collector than the plain load, not
# more. (Stops 57 and 59 paused the collector through the load and then collected all of it at once, or
# raised the threshold alone: one large collection cost more than the load's small ones.) The young
# generations are empty as the load starts (the lookup collected them while the daemon answered), so
# what is promoted is what was made since: the load's objects, what the pack and publish keep, and what
# another thread made meanwhile. Its garbage then waits for a full collection. Where that could hold
# memory it is collected instead: when the process's anonymous memory (RssAnon: not the checkpoint's
# mapped pages, nor the memfd a conversion is staged in) grew by more than `_KEPT_BYTES` during the load,
# the young generations are collected while the daemon answers the publish, as a plain load's
# collections would have freed a tensor held in a cycle. Not bounded that way: a tensor in a cycle made
# early in a load waits for the load's end, where a plain load's next young collection would free it
# (none of the loaders above makes one). The threshold bounds what a long load leaves uncollected (a young
# collection runs at `_LOAD_YOUNG` objects, about 10 MB of them). Nothing changes where the collector is
# off, where something is frozen (`born_old`: a warm kernel), for a load that raises, or for a second load
# while one is in flight. Figures: benchmarks/RESULTS.md, "Stop 68: a miss's load born old".
_LOAD_YOUNG = 50_000
_KEPT_BYTES = 64 << 20
_tuning = threading.Lock()  # held by the load being tuned


def _anonymous_bytes() -> int:
    """The process's resident anonymous memory (RssAnon), or -1 where it cannot be read."""
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return -1


class LoadCollections:
    """The collector around a miss's load and its publish (Note [A miss's load born old]): entered around
    the load; `promoting` is then whether the young generations are left uncollected (the collector
    paused until `end`), which `end`, called once the entry is published or given up, promotes."""

    def __init__(self) -> None:
        self.found: tuple[int, ...] | None = None  # the threshold found, where this load raised it
        self.raised = 0
        self.anonymous = -1
        self.promoting = False

    def __enter__(self) -> LoadCollections:
        found = gc.get_threshold()
        if found[0] and born_old() and _tuning.acquire(blocking=False):
            self.found, self.raised, self.anonymous = found, max(found[0], _LOAD_YOUNG), _anonymous_bytes()
            gc.set_threshold(self.raised, *found[1:])
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: Any) -> None:
        found, self.found = self.found, None
        if found is None:
            return
        after = _anonymous_bytes()
        if kind is None and gc.isenabled() and min(self.anonymous, after) >= 0 and \
                after - self.anonymous <= _KEPT_BYTES:
            gc.disable()  # until `end`: what the load made stays young, unvisited
            self.promoting = True
        if gc.get_threshold()[0] == self.raised:  # (not set again meanwhile by the user)
            gc.set_threshold(*found)
        if not self.promoting:
            _tuning.release()

    def end(self) -> None:
        """Promote what the load made, if it is left young (`promoting`); called whatever the miss became."""
        if not self.promoting:
            return
        self.promoting = False
        try:
            promote()
        finally:
            gc.enable()
            _tuning.release()
