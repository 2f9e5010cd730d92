"""What a function's code reads besides its arguments and globals: module attributes, the environment,
paths written in it. keys.py keys each read (Note [What a function reads]).

# Note [What a function reads]
`cached(fn)` keys a function by its code, defaults, closure and the globals it names (Note [Never stale]
in keys.py). Three more reads decide what it returns, and each is found in its bytecode:
- an attribute reached through a module of the user's own (`helpers.SCALE`, `helpers.sub.PATH`, a module
  beside the notebook, not installed: Note [Installed code]): keyed by the value it has now, so an
  edited module, reloaded, or an attribute set in a cell, is another key. A module of the user's that the
  function imports in its own body (`from mymodels import build`) is keyed by its file instead, whether
  the process imported it yet or not (Note [Modules found by their file] in module_files.py), so that a
  kernel's first call, before the import, has the key of its later calls; and so is one used whole
  (`getattr(helpers, name)`, `vars(helpers)`: Note [The user's values by what they do] in keys.py). A
  library's or the standard library's module stays keyed by its name: its version is in the key;
- the environment: `os.environ[NAME]`, `os.environ.get(NAME)`, `os.getenv(NAME)`, `NAME in os.environ`,
  with `os` imported at the top or in the function, keyed by the variable's value or its absence. A name
  computed at run time, or the whole environment handed on, cannot be keyed: the call runs plainly, and
  the fallback names the read;
- a string constant naming a file or folder that exists: keyed by its files' identity, as a path argument
  is, so a checkpoint replaced under a literal path is a miss. Never the working directory, one of its
  ancestors or the home folder, whose files the notebook's own autosave changes.
These are read in the function keyed by its code and in every function of the notebook it calls (those are
keyed by their code too); a function of a module with a file is keyed by that file's identity instead,
and, in a module of the user's, by what the module holds that its file does not bind (Note [What a module
holds that its file does not bind] in user_modules.py).
"""

from __future__ import annotations

import dis
import functools
import hashlib
import os
import site
import sys
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = ["Read", "code_digest", "import_statements", "is_users_module", "maybe_users", "path_constants", "reads"]

_ROOTS = {"LOAD_GLOBAL", "LOAD_NAME", "LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_BORROW"}
_ATTRS = {"LOAD_ATTR", "LOAD_METHOD"}
_STORES = {"STORE_FAST", "STORE_NAME", "STORE_GLOBAL"}
# Libraries whose modules are never the user's, named without looking where their files lie (the loaders'
# own, on every key): their code is keyed by their versions.
_LIBRARIES = frozenset({"transformers", "diffusers", "peft", "torch", "accelerate", "huggingface_hub",
                        "safetensors", "sentence_transformers", "tokenizers", "numpy", "overmind_jupyter"})
_MAX_PATH = 4096


@dataclass(frozen=True)
class Read:
    """A chain of attribute loads in a function's code: `root.attrs[0].attrs[1]...`."""

    root: str  # the global name the chain starts from, or the module an `import` in the function bound
    imported: bool  # the root was bound by an `import` in the function (then `root` names the module)
    attrs: tuple[str, ...]
    constant: str | None  # the string constant that indexes or is passed to the chain's end, or tests `in` it

    @property
    def text(self) -> str:
        return ".".join((self.root, *self.attrs))


@functools.lru_cache(maxsize=1024)
def reads(code: types.CodeType) -> tuple[Read, ...]:
    """The attribute chains `code` and the code nested in it load from a global or from a module it
    imports itself, each with the string constant used on its end, if any. Kept per code object (the
    chains are the code's alone): disassembling is 0.1 ms for a small function, at every call's key."""
    found = []
    for c in _codes(code):
        ops = list(dis.get_instructions(c))
        imported = _imports(ops)
        for i, op in enumerate(ops):
            if op.opname not in _ROOTS:
                continue
            is_import = op.opname not in ("LOAD_GLOBAL", "LOAD_NAME")
            if is_import and op.argval not in imported:
                continue  # a local variable
            root, attrs = imported[op.argval] if is_import else (str(op.argval), ())
            j = i + 1
            while j < len(ops) and ops[j].opname in _ATTRS:
                attrs = (*attrs, str(ops[j].argval))
                j += 1
            after = ops[j] if j < len(ops) else None
            before = ops[i - 1] if i > 0 else None
            constant = None
            if after is not None and after.opname == "LOAD_CONST" and isinstance(after.argval, str):
                constant = after.argval
            elif (before is not None and before.opname == "LOAD_CONST" and isinstance(before.argval, str)
                  and after is not None and after.opname == "CONTAINS_OP"):
                constant = before.argval
            found.append(Read(root, is_import, attrs, constant))
    return tuple(found)


_KERNELS_FILES = ("/proc/", "/sys/", "/dev/")


def path_constants(code: types.CodeType, cwd: str) -> dict[str, str]:
    """The string constants of `code` (nested code included) that name an existing file or folder, as
    {constant: its real path}; never the working directory, its ancestors, or the home folder, nor what
    lies in the kernel's own file systems (/proc, /sys, /dev: a process's state, never a checkpoint; an
    f-string's "/proc/" is a constant of its code)."""
    skip = {os.path.realpath(cwd), os.path.realpath(os.path.expanduser("~"))}
    parent = os.path.realpath(cwd)
    while parent != os.path.dirname(parent):
        parent = os.path.dirname(parent)
        skip.add(parent)
    found = {}
    for c in _codes(code):
        for const in c.co_consts:
            if not isinstance(const, str) or not const or len(const) > _MAX_PATH or "\n" in const or "\0" in const:
                continue
            path = os.path.join(cwd, os.path.expanduser(const))
            if os.path.exists(path):
                real = os.path.realpath(path)
                if real not in skip and not (real + "/").startswith(_KERNELS_FILES):
                    found[const] = real
    return found


def is_users_module(module: str, places: Sequence[str] | None = None) -> bool:
    """Whether `module` is the user's own code: the notebook (`__main__`), or a module that is neither the
    standard library's nor installed (a module beside the notebook, a package of the user's installed in
    place); see Note [Installed code]. `places`: where its top-level package lies (its file, or a namespace
    package's folders), for one not imported yet (module_files.py); else the imported package's."""
    top = module.split(".")[0]
    if top == "__main__":
        return True
    if not maybe_users(top):
        return False
    installed = _installed_folders(tuple(sys.path))
    where = _places(sys.modules.get(top)) if places is None else places
    return not any(os.path.realpath(place).startswith(installed) for place in where)


def maybe_users(top: str) -> bool:
    """Whether the top-level package `top` may be the user's: it is named neither as one of the libraries
    nor as the standard library's (Note [Installed code] then asks where its files lie)."""
    return not (top in _LIBRARIES or top in sys.stdlib_module_names or top in sys.builtin_module_names)


# Note [Installed code]
# Installed code is what lies in a folder of installed packages: site-packages (the environment's, the
# user's, or one on sys.path, as Debian's dist-packages). That is where pip, conda and the system's packages
# put a distribution's modules. A module elsewhere is the user's, and is keyed by what it holds: one beside
# the notebook, a package installed in place (`pip install -e`, whose files stay in the user's folder),
# one on PYTHONPATH, one made in memory. Being the user's is the safe side of a wrong answer: its
# attributes are keyed by value (Note [What a function reads]), where an installed module's are keyed by
# its name alone.
# It used to be asked of the installed distributions' metadata (`importlib.metadata.packages_distributions`),
# whose parse of every distribution's METADATA and RECORD took 0.1-0.3 s of the first call that keyed a
# module of the user's (about 0.7 s in CI), and which also counted as installed a name some
# distribution declared, whatever file was imported under it.
def _places(module: types.ModuleType | None) -> list[str]:
    """The file `module` was imported from, or else the folders of a namespace package; none for one
    made in memory."""
    if module is None:
        return []
    file = getattr(module, "__file__", None)
    if isinstance(file, str):
        return [file]
    return [p for p in getattr(module, "__path__", ()) if isinstance(p, str)]


@functools.cache
def _installed_folders(path: tuple[str, ...]) -> tuple[str, ...]:
    """The folders of installed packages, real paths ending in a separator, for sys.path `path`."""
    folders = {*site.getsitepackages(), site.getusersitepackages()}
    folders.update(p for p in path if os.path.basename(os.path.normpath(p)) in ("site-packages", "dist-packages"))
    return tuple(os.path.join(os.path.realpath(folder), "") for folder in folders if folder)


@functools.lru_cache(maxsize=1024)
def import_statements(code: types.CodeType) -> tuple[tuple[tuple[str, int, tuple[str, ...]], ...], frozenset[str]]:
    """The import statements of `code` and the code nested in it, as (module, level, names taken from it):
    `from ..a import b` is ("a", 2, ("b",)), `import a.b as c` is ("a.b", 0, ()), and a call of
    `importlib.import_module` or `__import__` with the name written out is one too; and the names of the code
    that only those statements use (`from mymodels import build` names `mymodels` and `build`): a module or
    what is taken from it, never a global the code reads. Kept per code object, as `reads`."""
    statements, imported, loaded = [], set(), set()
    for c in _codes(code):
        ops = list(dis.get_instructions(c))
        for i, op in enumerate(ops):
            if op.opname in _GLOBAL_LOADS:
                loaded.add(str(op.argval))
            elif op.opname == "IMPORT_FROM":
                imported.add(str(op.argval))
            elif op.opname == "IMPORT_NAME":
                level, names = (ops[i - 2].argval, ops[i - 1].argval) if i >= 2 else (0, None)
                statements.append((str(op.argval), level if isinstance(level, int) else 0,
                                   tuple(str(n) for n in names) if isinstance(names, tuple) else ()))
                imported.add(str(op.argval))
            if op.argval in _IMPORTERS and op.opname in _IMPORTER_LOADS and i + 1 < len(ops):
                # `importlib.import_module("mymodels")`, `__import__("mymodels")`: a name written out is an import
                name = ops[i + 1].argval
                if ops[i + 1].opname == "LOAD_CONST" and isinstance(name, str) and name and not name.startswith("."):
                    statements.append((name, 0, ()))
    return tuple(dict.fromkeys(statements)), frozenset(imported - loaded)


_GLOBAL_LOADS = {"LOAD_GLOBAL", "LOAD_NAME", "LOAD_FROM_DICT_OR_GLOBALS"}
_IMPORTERS = {"import_module", "__import__"}  # importlib's, and the builtin
_IMPORTER_LOADS = {*_GLOBAL_LOADS, "LOAD_ATTR", "LOAD_METHOD"}


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _imports(ops: list[dis.Instruction]) -> dict[str, tuple[str, tuple[str, ...]]]:
    """The local names an `import` in this code binds: name -> (module, attributes taken from it).
    `import a.b` binds `a`; `import a as x` binds `x` to `a`; `from a import b` binds `b` to `a.b`."""
    bound: dict[str, tuple[str, tuple[str, ...]]] = {}
    for i, op in enumerate(ops):
        if op.opname != "IMPORT_NAME":
            continue
        module = str(op.argval)
        nxt = ops[i + 1] if i + 1 < len(ops) else None
        if nxt is not None and nxt.opname in _STORES:
            bound[str(nxt.argval)] = (module.split(".")[0], ())
        j = i + 1
        while j + 1 < len(ops) and ops[j].opname == "IMPORT_FROM":
            if ops[j + 1].opname in _STORES:
                bound[str(ops[j + 1].argval)] = (module, (str(ops[j].argval),))
            j += 2 if ops[j + 1].opname in _STORES else 1
    return bound


def code_digest(code: types.CodeType) -> str:
    """What a code object does, without where it was compiled: bytecode, constants (nested code by
    its own digest), names, argument layout."""
    h = hashlib.sha256()
    for part in (code.co_code, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars,
                 (code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags)):
        h.update(repr(part).encode())
    for const in code.co_consts:
        text = code_digest(const) if isinstance(const, types.CodeType) else repr((type(const), const))
        h.update(text.encode())
    return h.hexdigest()
