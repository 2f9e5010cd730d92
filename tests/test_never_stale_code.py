"""Never stale (docs/design.md invariant 2), the user's own code: a module beside the notebook edited, changed
in a cell or imported in a function's body, and the user's values (Enums, objects, wrappers, bound methods)
keyed by what they do. A file of its own so that the suite's workers share these kernel-heavy tests with the
rest of tests/test_never_stale.py.
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.helpers.snippets import last_json, run_py

BLOCKS = """
import torch


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, {width})
"""

# A kernel whose `load` builds a `blocks.Block`: `edit` rewrites blocks.py after the import, not reloaded.
EDITED_UNDER_IT = """
    import json, sys, warnings
    import torch
    sys.path.insert(0, {folder!r})
    import blocks
    from overmind_jupyter import loading

    def load():
        return blocks.Block()

    if {edit}:
        with open({file!r}, "w") as f:
            f.write({edited!r})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)  # its weights are drawn: seeded, one entry across restarts
        model = loading.cached(load)
    print(json.dumps({{"calls": loading.calls(), "width": model.proj.out_features,
                      "said": [str(w.message) for w in caught]}}))
"""


def test_a_module_edited_and_not_reloaded_is_not_cached_as_its_file(overmind_home: Path, tmp_path: Path) -> None:
    """A kernel that imported blocks.py, edited since and not reloaded, builds the old Block: its load runs
    plainly and says to reload (Note [A module that is not its file]). Keyed by the file, it was cached
    under the edited file's identity, and the kernel restarted on the edited file got the old model."""
    file = tmp_path / "blocks.py"
    file.write_text(BLOCKS.format(width=8))
    edited = BLOCKS.format(width=16)

    def kernel(edit: bool) -> dict:
        return last_json(run_py(EDITED_UNDER_IT.format(folder=str(tmp_path), file=str(file), edit=edit,
                                                       edited=edited)))

    stale = kernel(edit=True)
    assert (stale["calls"], stale["width"]) == ({"plain": 1}, 8), stale
    (said,) = [w for w in stale["said"] if "blocks.Block is not what" in w]
    assert "importlib.reload(blocks)" in said, said
    restarted = [kernel(edit=False) for _ in range(2)]
    assert [(r["calls"], r["width"]) for r in restarted] == [({"miss": 1}, 16), ({"hit": 1}, 16)], restarted


MYMODELS = """
import torch

WIDTH = {width}


class Block:
    WIDTH = 8


def build():
    return {{"w": torch.ones(WIDTH)}}


def build_block():
    return {{"w": torch.ones(Block.WIDTH)}}


def make():
    return build()
"""

# A kernel that imports mymodels.py, runs `change` (a cell), then caches a `load` that calls `mymodels.<call>()`.
CHANGED_UNDER_IT = """
    import json, sys
    import torch
    sys.dont_write_bytecode = True  # (the file's edit is read again by the next kernel, whatever its size and time)
    sys.path.insert(0, {folder!r})
    import mymodels
    from overmind_jupyter import loading
{change}

    def load():
        return mymodels.{call}()

    result = loading.cached(load)
    print(json.dumps({{"calls": loading.calls(), "width": result["w"].shape[0]}}))
"""
EDIT_WIDTH = "with open(mymodels.__file__, 'w') as f:\n    f.write({text!r})"
MY_BUILD = "def my_build():\n    return {'w': torch.ones(16)}\nmymodels.build = my_build"


@pytest.mark.parametrize(("change", "call", "stale", "twin"), [
    ("mymodels.WIDTH = 16", "build", 16, None),
    (EDIT_WIDTH.format(text=MYMODELS.format(width=16)), "build", 8, "mymodels.WIDTH = 8"),
    ("mymodels.Block.WIDTH = 16", "build_block", 16, None),
    (MY_BUILD, "make", 16, None),
], ids=["a module value set at run time", "a module value edited in the file, not reloaded",
        "a class attribute set at run time", "a module function replaced by a notebook function"])
def test_a_module_that_holds_what_its_file_does_not_bind_is_keyed_by_what_it_holds(
        overmind_home: Path, tmp_path: Path, change: str, call: str, stale: int, twin: str | None) -> None:
    """A kernel whose module beside the notebook holds another value than its file binds (set in a cell, or
    the file edited since and not reloaded), or another function, builds another result than a kernel on
    the file: its entry has a key of its own (Note [What a module holds that its file does not bind]). Keyed
    by the file alone, the next kernel on the file got the first kernel's width (a stale hit). A kernel that
    makes the same change shares the entry."""
    (tmp_path / "mymodels.py").write_text(MYMODELS.format(width=8))

    def kernel(change: str) -> tuple[dict, int]:
        got = last_json(run_py(CHANGED_UNDER_IT.format(folder=str(tmp_path), change=textwrap.indent(change, "    "),
                                                       call=call)))
        return got["calls"], got["width"]

    assert kernel(change) == ({"miss": 1}, stale), "its own entry, with what its module holds"
    on_the_file = 16 if twin else 8  # (the edited file binds 16)
    assert [kernel(""), kernel("")] == [({"miss": 1}, on_the_file), ({"hit": 1}, on_the_file)], "not the first's"
    assert kernel(twin or change) == ({"hit": 1}, stale), "the same change: the same entry"


ZOO = """
import dataclasses, enum, functools, os, time
from typing import NamedTuple

WIDTH = 8
SIZES: tuple = (1, 2.0, "x", None, [True], {"k": {3}})
DEVICE = "cuda" if os.environ.get("ZOO_DEVICE") else "cpu"
STARTED = time.time()
COUNT = 1
COUNT += 1
MODELS = {}
_client = None
SCALE = 1


def register(cls):
    MODELS[cls.__name__] = cls
    return cls


def client():
    global _client
    _client = _client or object()
    return _client


def configure(scale):
    global SCALE
    SCALE = scale


@register
class Color(enum.Enum):
    RED = 1


@dataclasses.dataclass(slots=True)
class Slotted:
    x: int = 3


class Pair(NamedTuple):
    x: int = 1


class Block:
    WIDTH = 8


@functools.cache
def cached_width():
    return WIDTH


def build():
    return (WIDTH * SCALE, SIZES, DEVICE, STARTED, COUNT, Color.RED, Slotted(), Pair(), Block.WIDTH, cached_width(),
            MODELS, client())
"""


HELD = """
import torch

CFG = dict(w=8)
logger = None


class Block:
    def width(self):
        return 8


def build_cfg():
    return {{"w": torch.ones(CFG["w"])}}


def build_block():
    return {{"w": torch.ones(Block().width())}}
"""


@pytest.mark.parametrize(("change", "call", "stale"), [
    ("mymodels.CFG['w'] = 16", "build_cfg", 16),
    ("mymodels.Block.width = lambda self: 16", "build_block", 16),
    ("import logging\nmymodels.logger = logging.getLogger('notebook')", "build_cfg", 8),
], ids=["a dict the file makes, changed in a cell", "a method a cell put on the file's class",
        "an object a cell put under a name no code of the module reads"])
def test_what_a_cell_changes_in_a_module_is_keyed_where_the_module_reads_it(
        overmind_home: Path, tmp_path: Path, change: str, call: str, stale: int) -> None:
    """Found by an attack on Note [What a module holds that its file does not bind]: `CFG = dict(w=8)` (a
    builtin container of literals) changed in a cell, and a method a cell put on the file's class, were
    keyed by the file alone (the next kernel on the file got the changed width); a logger a cell put under a
    name the file binds to None, which none of its code reads, made every load of the module uncacheable
    ("no canonical form"). Now the first two are keyed by what the module holds, and the third changes
    nothing the module does: one entry for both kernels."""
    (tmp_path / "mymodels.py").write_text(HELD.format())

    def kernel(change: str) -> tuple[dict, int]:
        got = last_json(run_py(CHANGED_UNDER_IT.format(folder=str(tmp_path), change=textwrap.indent(change, "    "),
                                                       call=call)))
        return got["calls"], got["width"]

    if stale == 8:  # the change is none the module sees: cached, and the same entry as without it
        assert [kernel(change), kernel("")] == [({"miss": 1}, 8), ({"hit": 1}, 8)]
        return
    assert [kernel(change), kernel(""), kernel(change)] == [({"miss": 1}, stale), ({"miss": 1}, 8),
                                                            ({"hit": 1}, stale)]


def test_a_counter_of_the_module_keeps_its_loads_one_entry(overmind_home: Path, tmp_path: Path) -> None:
    """A module beside the notebook that counts its loads (`global calls; calls += 1`): the count is its own,
    not what the load builds from (found by an attack: compared as a value set since the import, each call
    of the cell was a miss, and another copy of the model)."""
    (tmp_path / "counting.py").write_text("import torch\n\ncalls = 0\n\n\ndef build():\n    global calls\n"
                                          "    calls += 1\n    return {'w': torch.ones(8)}\n")
    got = last_json(run_py(f"""
        import json, sys
        sys.path.insert(0, {str(tmp_path)!r})
        import counting
        from overmind_jupyter import loading

        def load():
            return counting.build()

        widths = [loading.cached(load)["w"].shape[0] for _ in range(3)]
        print(json.dumps({{"calls": loading.calls(), "widths": widths, "counted": counting.calls}}))
    """))
    assert got == {"calls": {"miss": 1, "hit": 2}, "widths": [8, 8, 8], "counted": 1}, got


def test_a_module_is_compared_with_the_literals_its_file_binds_by_type_and_value(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What each change of a module of the user's does to the key of a function that reaches it (Note [What a
    module holds that its file does not bind]): a literal is compared by type and value, a value computed
    at import is not compared (one read from the environment is keyed by what it holds: Note [What a module
    reads when it is imported]), nor is one bound twice; an enum, a slotted dataclass, a named tuple and a
    cached function, as their file makes them, are no change: the key is what it was before the comparison.
    Nor is what the module's own functions put in a name it binds to a literal (a registry filled, a client
    made), but for a literal (`configure(2)`)."""
    from overmind_jupyter import keys, user_modules

    (tmp_path / "zoo_of_bindings.py").write_text(ZOO)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "zoo_of_bindings", raising=False)
    import zoo_of_bindings as zoo  # type: ignore[import-not-found]

    namespace: dict[str, object] = {"__name__": "__main__", "zoo": zoo}  # a notebook's cell, which imported zoo
    exec(compile("def load():\n    return zoo.build()\ndef my_width():\n    return 16\n", "<cell>", "exec"), namespace)

    def key() -> str:
        return keys.make_key(namespace["load"], (), {}).key  # type: ignore[arg-type]

    zoo.client()  # the module's own state, made by its own function
    as_imported = key()
    changes = [("WIDTH", 16, True), ("WIDTH", 8.0, True), ("WIDTH", True, True), ("WIDTH", 8, False),
               ("SIZES", (1, 2.0, "x", None, [True], {"k": {3}}), False),
               ("SIZES", (1, 2, "x", None, [True], {"k": {3}}), True), ("SIZES", [1, 2.0, "x", None, [True]], True),
               ("DEVICE", "cuda", True), ("STARTED", 0.0, False), ("COUNT", 7, False),
               ("cached_width", namespace["my_width"], True)]
    seen = []
    for name, value, differs in changes:
        with monkeypatch.context() as m:
            m.setattr(zoo, name, value)
            seen.append(key())
        assert (seen[-1] != as_imported) == differs, (name, value)
    assert len(set(seen[:3])) == 3, "16, 8.0 and True: three keys"
    zoo.SIZES[4].append(False)  # a literal changed in place
    assert key() != as_imported
    zoo.SIZES[4].pop()
    with monkeypatch.context() as m:
        m.setattr(zoo.Block, "WIDTH", 16)
        assert key() != as_imported
    zoo.configure(2)
    assert key() != as_imported, "a literal the module's own function set"
    zoo.configure(1)
    assert key() == as_imported
    assert keys._Canonical(os.getcwd(), None)._differences("zoo_of_bindings", user_modules.stat_identity(
        os.stat(zoo.__file__)), 0) == {"DEVICE": "cpu"}, "the file's own values: nothing differs, the key holds " \
        "what the module read from the environment"


def test_a_path_into_the_kernels_own_file_systems_is_no_checkpoint() -> None:
    """A function whose code names /proc, /sys or /dev (an f-string's "/proc/" is a constant of its code) is
    keyed: those hold a process's state, never a checkpoint; keyed as a folder, /proc made the call
    uncacheable ("/proc holds more than 100000 files")."""
    from overmind_jupyter import keys, reads

    def load(pid: int) -> object:
        return open(f"/proc/{pid}/stat").read(), open("/sys/kernel/mm/transparent_hugepage/enabled").read()

    assert reads.path_constants(load.__code__, os.getcwd()) == {}
    assert keys.make_key(load, (os.getpid(),), {}).key


# -- 3c. the user's values keyed by what they do: Enums, objects, wrappers, bound methods, modules ----------

# A kernel: `make` of its notebook ({prelude}), through the cache and plainly, and what each gave.
VALUES = """
    import dataclasses, enum, functools, json, os, sys
    import torch
    sys.path.insert(0, os.getcwd())  # a module beside the notebook, as a kernel's cwd is on its path
    from overmind_jupyter import loading
{prelude}
    def digest(x):
        return x.tolist() if isinstance(x, torch.Tensor) else [p.tolist() for p in x.parameters()]
    cached = digest(loading.cached({cached}))
    plain = digest({plain})
    print(json.dumps({{"cached": cached, "plain": plain, "calls": loading.calls(),
                       "fallbacks": [f["reason"] for f in loading.fallbacks()]}}))
"""

# name: (the notebook's code, the files beside it, the call's arguments), each with {v}: its first, then its
# second version, which the first kernel's entry must not answer
USERS_VALUES = {
    "an Enum member's value": ("""
        class Size(enum.Enum):
            SMALL = {v}

        def make(s):
            return torch.ones(s.value)
        """, {}, "Size.SMALL"),
    "an Enum of a module beside the notebook": ("""
        from sizes import Size

        def make(s):
            return torch.ones(s.value)
        """, {"sizes.py": "import enum\n\n\nclass Size(enum.Enum):\n    SMALL = {v}\n"}, "Size.SMALL"),
    "a dataclass's method": ("""
        @dataclasses.dataclass
        class Spec:
            n: int

            def dim(self):
                return self.n * {v}

        def make(s):
            return torch.ones(s.dim())
        """, {}, "Spec(2)"),
    "a dataclass's method in a module beside the notebook": ("""
        from specs import Spec

        def make(s):
            return torch.ones(s.dim())
        """, {"specs.py": "import dataclasses\n\n\n@dataclasses.dataclass\nclass Spec:\n    n: int\n\n"
                          "    def dim(self):\n        return self.n * {v}\n"}, "Spec(2)"),
    "a method of an object keyed by its to_dict": ("""
        class Options:
            def __init__(self, n):
                self.n = n

            def to_dict(self):
                return {{"n": self.n}}

            def dim(self):
                return self.n * {v}

        def make(o):
            return torch.ones(o.dim())
        """, {}, "Options(2)"),
    "a functools.lru_cache helper": ("""
        @functools.lru_cache
        def width():
            return {v}

        def make():
            return torch.ones(width())
        """, {}, ""),
    "the cached function itself a functools.cache": ("""
        @functools.cache
        def make():
            return torch.ones({v})
        """, {}, ""),
    "a class as the cached callable": ("""
        class make(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.w = torch.nn.Parameter(torch.ones({v}))
        """, {}, ""),
    "the object of a bound method": ("""
        @dataclasses.dataclass
        class Scaler:
            k: int

            def apply(self, x):
                return x * self.k

        scale = Scaler({v}).apply

        def make():
            return scale(torch.ones(3))
        """, {}, ""),
    "a module beside the notebook read with getattr": ("""
        import helpers

        def make():
            return torch.ones(getattr(helpers, "SCALE"))
        """, {"helpers.py": "SCALE = {v}\n"}, ""),
    "a module beside the notebook read with vars": ("""
        import helpers

        def make():
            return torch.ones(vars(helpers)["SCALE"])
        """, {"helpers.py": "SCALE = {v}\n"}, ""),
}


@pytest.mark.parametrize("case", list(USERS_VALUES))
def test_a_users_value_is_keyed_by_what_it_does(overmind_home: Path, tmp_path: Path, case: str) -> None:
    """Note [The user's values by what they do] in keys.py: a kernel caches `make`, then what it is given or
    reads is edited (its notebook's code, a file beside it); the next kernel gets what its plain call makes,
    not the first kernel's entry, and a third kernel, unchanged, gets the second's entry."""
    code, files, arguments = USERS_VALUES[case]

    def kernel(v: int) -> dict:
        for name, template in files.items():
            file, text = tmp_path / name, template.format(v=v)
            if not file.exists() or file.read_text() != text:  # (rewritten only where it changes)
                file.write_text(text)
        prelude = textwrap.indent(textwrap.dedent(code).format(v=v), "    ")
        cached = f"make, {arguments}" if arguments else "make"
        return last_json(run_py(VALUES.format(prelude=prelude, cached=cached, plain=f"make({arguments})"),
                                cwd=tmp_path))

    got = [kernel(v) for v in (2, 3, 3)]
    assert [(g["calls"], g["fallbacks"]) for g in got] == [({"miss": 1}, []), ({"miss": 1}, []),
                                                          ({"hit": 1}, [])], got
    assert all(g["cached"] == g["plain"] for g in got) and got[0]["plain"] != got[1]["plain"], got


LAZY_MYMODELS = "import torch\n\n\ndef build():\n    return {{'w': torch.ones(WIDTH)}}\n\n\nWIDTH = {width}\n"

# A kernel whose `load` imports a module of the user's in its body (the common notebook pattern); {before}: the
# notebook's own imports, run before the call; the call made {times} times.
LAZY = """
    import json, os, sys
    sys.path.insert(0, os.getcwd())
    from overmind_jupyter import loading
    {before}

    def load():
        from mymodels import build
        return build()

    imported = "mymodels" in sys.modules
    widths = [loading.cached(load)["w"].shape[0] for _ in range({times})]
    print(json.dumps({{"calls": loading.calls(), "widths": widths, "imported": imported}}))
"""


def test_a_helper_decorated_with_no_grad_is_keyed_by_its_code() -> None:
    """`@torch.no_grad()` wraps a helper in a function whose closure holds `no_grad().clone`, a library
    object's bound method with no canonical form: the rule that keys a bound method by its object made
    every load through such a helper uncacheable (found by an attack). It is keyed by its name again, and
    the helper by its code: an edit of the helper is another key."""
    from overmind_jupyter import keys

    def cell(scale: float) -> object:
        namespace: dict[str, object] = {"__name__": "__main__", "torch": torch}
        source = (f"@torch.no_grad()\ndef shrink(t):\n    return t * {scale!r}\n\n"
                  "def load(width):\n    return shrink(torch.ones(width))\n")
        exec(compile(source, "<cell>", "exec"), namespace)
        return namespace["load"]

    one, again, other = (keys.make_key(cell(scale), (4,), {}).key for scale in (0.5, 0.5, 0.25))
    assert one == again != other



def lazy_kernel(folder: Path, before: str = "", times: int = 1) -> dict:
    return last_json(run_py(LAZY.format(before=before, times=times), cwd=folder))


def test_a_module_the_function_imports_in_its_body_is_keyed_by_its_file(overmind_home: Path, tmp_path: Path) -> None:
    """`def load(): from mymodels import build`: each kernel's first call finds mymodels not imported yet, and
    the key holds mymodels.py's file all the same (Note [Modules found by their file] in module_files.py): an
    edit of it is a miss, with the edited width. Keyed without it, the edited file got the old entry."""
    mymodels = tmp_path / "mymodels.py"
    got = []
    for width in (8, None, 16, None):
        if width is not None:
            mymodels.write_text(LAZY_MYMODELS.format(width=width))
        got.append(lazy_kernel(tmp_path))
    assert not any(g["imported"] for g in got)
    assert [(g["calls"], g["widths"]) for g in got] == [({"miss": 1}, [8]), ({"hit": 1}, [8]), ({"miss": 1}, [16]),
                                                         ({"hit": 1}, [16])], got


def test_a_value_set_on_a_module_the_function_imports_in_its_body_is_keyed(overmind_home: Path,
                                                                            tmp_path: Path) -> None:
    """A notebook that imported mymodels and set `mymodels.WIDTH = 16` in a cell, then calls a `load` that
    imports mymodels in its body: the value it holds is keyed as for a module reached as a global (Note [What
    a module holds that its file does not bind]), so a kernel on the file's value is not served its entry."""
    (tmp_path / "mymodels.py").write_text(LAZY_MYMODELS.format(width=8))
    got = [lazy_kernel(tmp_path, before=before) for before in
           ("import mymodels\n    mymodels.WIDTH = 16", "", "", "import mymodels\n    mymodels.WIDTH = 16")]
    assert [(g["calls"], g["widths"]) for g in got] == [({"miss": 1}, [16]), ({"miss": 1}, [8]), ({"hit": 1}, [8]),
                                                         ({"hit": 1}, [16])], got


def test_a_module_the_function_imports_by_a_name_written_out_is_keyed_by_its_file(overmind_home: Path,
                                                                                tmp_path: Path) -> None:
    """`importlib.import_module("mymodels")` (and `__import__`) with the name written out is an import as
    `from mymodels import build` is (found by an attack: keyed without mymodels.py, an edit of it was a stale
    hit)."""
    code = LAZY.replace("from mymodels import build\n        return build()",
                        "import importlib\n        return importlib.import_module('mymodels').build()")
    mymodels = tmp_path / "mymodels.py"
    got = []
    for width in (8, 16):
        mymodels.write_text(LAZY_MYMODELS.format(width=width))
        got.append(last_json(run_py(code.format(before="", times=1), cwd=tmp_path)))
    assert [(g["calls"], g["widths"]) for g in got] == [({"miss": 1}, [8]), ({"miss": 1}, [16])], got


def test_a_module_in_a_folder_without_init_inside_a_package_is_keyed_by_its_file(overmind_home: Path,
                                                                                 tmp_path: Path) -> None:
    """`from mypkg.sub.tiny import build` in the body, `sub` a folder without __init__.py in a package not
    imported yet (found by an attack): finding it raised KeyError from the finders (a namespace portion asks
    sys.modules for its parent), and each kernel's first call ran plainly. Now it is found by its file."""
    tiny = tmp_path / "mypkg" / "sub" / "tiny.py"
    tiny.parent.mkdir(parents=True)
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    code = LAZY.replace("from mymodels import build", "from mypkg.sub.tiny import build")
    got = []
    for width in (8, 16):
        tiny.write_text(LAZY_MYMODELS.format(width=width))
        got.append(last_json(run_py(code.format(before="", times=1), cwd=tmp_path)))
    assert [(g["calls"], g["widths"]) for g in got] == [({"miss": 1}, [8]), ({"miss": 1}, [16])], got


def test_a_module_imported_before_the_call_or_by_it_is_one_key(overmind_home: Path, tmp_path: Path) -> None:
    """The module a function imports in its body is keyed alike whether the process imported it already (the
    kernel's second call, a notebook that imports it at the top too) or not: one entry for all."""
    (tmp_path / "mymodels.py").write_text(LAZY_MYMODELS.format(width=8))
    first = lazy_kernel(tmp_path, times=2)  # the first call imports it, the second finds it imported
    other = lazy_kernel(tmp_path, before="import mymodels\n    from mymodels import build")
    assert (first["imported"], other["imported"]) == (False, True)
    assert (first["calls"], first["widths"]) == ({"miss": 1, "hit": 1}, [8, 8]), first
    assert (other["calls"], other["widths"]) == ({"hit": 1}, [8]), other


LAZY_BLOCK = """
import torch


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from attention import Attention
        self.attention = Attention()
"""
ATTENTION = """
import torch


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, {width})
"""
# A kernel whose `load` builds a `blocks.Block`, which imports attention.py in its `__init__`.
BLOCK_KERNEL = """
    import json, os, sys
    import torch
    sys.path.insert(0, os.getcwd())
    import blocks
    from overmind_jupyter import loading

    def load():
        return blocks.Block()

    torch.manual_seed(0)  # its weights are drawn: seeded, one entry across restarts
    model = loading.cached(load)
    print(json.dumps({"calls": loading.calls(), "width": model.attention.proj.out_features}))
"""


def test_a_module_a_method_of_the_users_module_imports_is_keyed_by_its_file(overmind_home: Path,
                                                                           tmp_path: Path) -> None:
    """Note [The user's modules a module imports] in user_modules.py: blocks.py's `Block.__init__` imports
    attention.py when it runs; an edit of attention.py alone is a miss that builds the edited Attention."""
    (tmp_path / "blocks.py").write_text(LAZY_BLOCK)
    got = []
    for width in (8, 16, None):
        if width is not None:
            (tmp_path / "attention.py").write_text(ATTENTION.format(width=width))
        got.append(last_json(run_py(BLOCK_KERNEL, cwd=tmp_path)))
    assert [(g["calls"], g["width"]) for g in got] == [({"miss": 1}, 8), ({"miss": 1}, 16), ({"hit": 1}, 16)], got


def test_a_module_the_function_imports_that_is_not_there_yet_is_keyed_as_missing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A module the function would import that no file provides (an optional part, `try: import ...`) is keyed
    as missing: creating its file later, in the same process too, is another key, and removing it again the
    first one."""
    from overmind_jupyter import keys

    monkeypatch.syspath_prepend(str(tmp_path))

    def load() -> object:
        try:
            import optional_part_of_the_notebook  # type: ignore[import-not-found]
        except ImportError:
            return None
        return optional_part_of_the_notebook

    missing = keys.make_key(load, (), {}).key
    assert keys.make_key(load, (), {}).key == missing
    (tmp_path / "optional_part_of_the_notebook.py").write_text("SCALE = 2\n")
    there = keys.make_key(load, (), {}).key
    (tmp_path / "optional_part_of_the_notebook.py").unlink()
    assert there != missing and keys.make_key(load, (), {}).key == missing


# name: mymodels.py, which reads {v} at import from the environment (WIDTH) or config.json, and whose
# `build` makes ones of that width (Note [What a module reads when it is imported])
READ_AT_IMPORT = {
    "a constant from the environment": (
        "import os\nimport torch\n\nWIDTH = int(os.environ.get('WIDTH', '2'))\n\n\n"
        "def build():\n    return torch.ones(WIDTH)\n"),
    "a config file read in a with block, and a name made from it": (
        "import json\nimport os\nimport torch\n\n"
        "with open(os.path.join(os.path.dirname(__file__), 'config.json')) as f:\n    CFG = json.load(f)\n"
        "WIDTH = CFG['width'] + 1\n\n\ndef build():\n    return torch.ones(WIDTH)\n"),
    "a branch on the environment": (
        "import os\nimport torch\n\nif os.getenv('WIDTH') == '3':\n    WIDTH = 3\nelse:\n    WIDTH = 2\n\n\n"
        "def build():\n    return torch.ones(WIDTH)\n"),
    "a settings module the model's module imports from": (
        "import torch\nfrom settings import WIDTH\n\n\ndef build():\n    return torch.ones(WIDTH)\n"),
}
SETTINGS = "import os\n\nWIDTH = int(os.environ['WIDTH'])\n"  # (read by no function of its own)
# The notebook's loader calls the module's `build`: a function of a module with a file is keyed by its name
# and the file's identity (Note [The user's modules a module imports] in overmind_jupyter/user_modules.py).
READ_AT_IMPORT_NOTEBOOK = """
    import mymodels

    def make():
        return mymodels.build()
"""


@pytest.mark.parametrize("case", list(READ_AT_IMPORT))
def test_what_a_module_read_at_import_is_keyed_by_what_it_holds(overmind_home: Path, tmp_path: Path,
                                                                case: str) -> None:
    """A module beside the notebook binds a name to what it read from the environment or a file when it
    was imported; the next kernel, started with another value there, gets what its plain call makes, not
    the first kernel's entry, and a third kernel with the same value gets the second's entry."""
    (tmp_path / "mymodels.py").write_text(READ_AT_IMPORT[case])
    (tmp_path / "settings.py").write_text(SETTINGS)

    def kernel(v: int) -> dict:
        (tmp_path / "config.json").write_text(f'{{"width": {v - 1}}}')
        return last_json(run_py(VALUES.format(prelude=READ_AT_IMPORT_NOTEBOOK, cached="make", plain="make()"),
                                cwd=tmp_path, env=dict(os.environ, WIDTH=str(v))))

    got = [kernel(v) for v in (2, 3, 3)]
    assert [(g["calls"], g["fallbacks"]) for g in got] == [({"miss": 1}, []), ({"miss": 1}, []),
                                                          ({"hit": 1}, [])], got
    assert [g["cached"] for g in got] == [g["plain"] for g in got] == [[1.0] * 2, [1.0] * 3, [1.0] * 3], got


def test_a_file_a_module_keeps_open_from_its_import_is_keyed_by_that_file(overmind_home: Path,
                                                                         tmp_path: Path) -> None:
    """A module opened a file at import and its loader reads it (`SOURCE = open("widths.txt")`): the next
    kernel, after the file was edited, gets what its plain call makes; a file it only writes to (a log) is
    no part of the key, so a third kernel, the file as the second left it, hits the second's entry."""
    (tmp_path / "mymodels.py").write_text(
        "import os\nimport torch\n\nHERE = os.path.dirname(__file__)\n"
        "SOURCE = open(os.path.join(HERE, 'widths.txt'))\nLOG = open(os.path.join(HERE, 'train.log'), 'a')\n\n\n"
        "def build():\n    SOURCE.seek(0)\n    LOG.write('built\\n')\n    return torch.ones(int(SOURCE.read()))\n")

    def kernel(v: int) -> dict:
        if not (tmp_path / "widths.txt").exists() or (tmp_path / "widths.txt").read_text() != f"{v}\n":
            (tmp_path / "widths.txt").write_text(f"{v}\n")
        return last_json(run_py(VALUES.format(prelude=READ_AT_IMPORT_NOTEBOOK, cached="make", plain="make()"),
                                cwd=tmp_path))

    got = [kernel(v) for v in (2, 3, 3)]
    assert [(g["calls"], g["fallbacks"]) for g in got] == [({"miss": 1}, []), ({"miss": 1}, []),
                                                          ({"hit": 1}, [])], got
    assert [g["cached"] for g in got] == [g["plain"] for g in got] == [[1.0] * 2, [1.0] * 3, [1.0] * 3], got


def test_what_a_module_read_at_import_that_no_key_holds_loads_plainly_and_says_which(
        overmind_home: Path, tmp_path: Path) -> None:
    """A name bound at import to what a key cannot hold (a buffer in memory made from a file), read by the
    module's code: the load runs plainly, and says which name holds what and what to do."""
    (tmp_path / "widths.txt").write_text("3\n")
    (tmp_path / "mymodels.py").write_text(
        "import io\nimport os\nimport torch\n\n"
        "SOURCE = io.StringIO(open(os.path.join(os.path.dirname(__file__), 'widths.txt')).read())\n\n\n"
        "def build():\n    SOURCE.seek(0)\n    return torch.ones(int(SOURCE.read()))\n")
    got = last_json(run_py(VALUES.format(prelude=READ_AT_IMPORT_NOTEBOOK, cached="make", plain="make()"),
                           cwd=tmp_path))
    assert got["cached"] == got["plain"] == [1.0] * 3 and "miss" not in got["calls"], got
    assert len(got["fallbacks"]) == 1 and "mymodels.SOURCE holds _io.StringIO" in got["fallbacks"][0] \
        and "read from the environment or a file when it was imported" in got["fallbacks"][0], got
