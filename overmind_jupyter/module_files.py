"""Where an import would find a module, found without importing it: keys.py keys a module of the user's by
its file whether or not the process imported it yet (Note [Modules found by their file]).

# Note [Modules found by their file]
A function of the notebook often imports a module of the user's in its body (`def load(): from mymodels
import build`), and a module's function may too (`Block.__init__` doing `from attention import Attention`).
Such a module is keyed by the file an import of it would run now (Note [The user's modules a module imports]
in user_modules.py), found as the import finds it: a module the process imported is the one in `sys.modules`; one it
did not is looked for as `importlib.util.find_spec` does (sys.path, the finders of packages installed in
place), and a submodule of a package not imported yet in that package's folders, so that nothing is
imported: a package's `__init__` runs no code of the user's at key time. The same module, imported or not, so
has one key part, and a kernel's first call (before the import) is keyed as its later calls are, and as
another kernel that imported the module at the top. A name no module answers to is keyed as missing (an
optional part behind `try: import ...`), so that creating its file is another key.
What was found is kept by name, with sys.path and the mtime of each folder that decides it (those up to the
one it was found in, since an import takes the first; all of them for a name not found): a file created,
removed or renamed in one of them changes that folder's mtime, and the name is looked for again. So a later
key stats a folder or a few for each module not imported yet, where `find_spec` would scan sys.path again.
Not seen: an `__init__.py` put into a folder that was a namespace package's portion (its own folder's mtime
changes, not that of the folder on sys.path).
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import os
import sys
import types
from dataclasses import dataclass
from typing import Any

__all__ = ["Finder", "Found", "named"]


@dataclass(frozen=True)
class Found:
    """Where an import of a module finds it."""

    file: str | None  # the file the import runs; None for a namespace package or a module without one
    places: tuple[str, ...]  # its file, or else a namespace package's folders (reads' Note [Installed code])
    search: tuple[str, ...] | None  # a package's folders, where its submodules are found; None for a module


# name -> ((sys.path, the folders looked in), the mtimes of those that decide it, what was found): Note [Modules
# found by their file]
_found: dict[str, tuple[tuple[tuple[str, ...], tuple[str, ...]], tuple[tuple[str, int | None], ...], Found | None]] = {}
_MAX_KEPT = 4096


class Finder:
    """Finds modules for one key: each folder's mtime is read once."""

    def __init__(self) -> None:
        self._mtimes: dict[str, int | None] = {}
        self._seen: dict[str, Found | None] = {}
        self._path: tuple[str, ...] | None = None  # sys.path's folders (a relative one in the working directory)
        self.memo: dict[Any, Any] = {}  # what keys.py found of the modules for this key

    def find(self, name: str) -> Found | None:
        """Where an import of `name` would find it now, or None where no module has that name (Note
        [Modules found by their file])."""
        if name in self._seen:
            return self._seen[name]
        found = self._seen[name] = self._find(name)
        return found

    def _find(self, name: str) -> Found | None:
        if name in sys.modules:
            module = sys.modules[name]
            return None if module is None else _of_module(module)  # (None: an import blocked on purpose)
        parent = name.rpartition(".")[0]
        if parent:
            above = self.find(parent)
            if above is None or above.search is None:
                return None  # no package to hold it
            folders = above.search
        else:
            if self._path is None:
                self._path = _folders(os.getcwd(), tuple(sys.path))
            folders = self._path
        path = tuple(sys.path)
        kept = _found.get(name)
        if kept is not None and kept[0] == (path, folders) and all(self._mtime(f) == m for f, m in kept[1]):
            return kept[2]
        looked = tuple((folder, self._mtime(folder)) for folder in folders)
        found = _spec(name, parent, folders)
        if len(_found) >= _MAX_KEPT:
            _found.clear()
        _found[name] = ((path, folders), looked[:_decisive(found, folders)], found)
        return found

    def _mtime(self, folder: str) -> int | None:
        if folder not in self._mtimes:
            try:
                self._mtimes[folder] = os.stat(folder).st_mtime_ns
            except OSError:
                self._mtimes[folder] = None
        return self._mtimes[folder]


@functools.lru_cache(maxsize=16)
def _folders(cwd: str, path: tuple[Any, ...]) -> tuple[str, ...]:
    """The folders of sys.path `path`, a relative one (as "") in the working directory `cwd`."""
    return tuple(os.path.join(cwd, entry) for entry in path if isinstance(entry, str))


def _decisive(found: Found | None, folders: tuple[str, ...]) -> int:
    """How many of `folders` decide where `found` is found: those up to the one holding it (an import takes
    the first), or all of them for a module found in none of them, a namespace package's portions, or none."""
    if found is None or found.file is None:
        return len(folders)
    holder = os.path.dirname(found.file if found.search is None else os.path.dirname(found.file))
    for i, folder in enumerate(folders):
        if os.path.normpath(folder) == holder:
            return i + 1
    return len(folders)


def _of_module(module: types.ModuleType) -> Found:
    file = getattr(module, "__file__", None)
    file = file if isinstance(file, str) and os.path.isfile(file) else None
    path = getattr(module, "__path__", None)
    search = tuple(p for p in path if isinstance(p, str)) if path is not None else None
    places = (file,) if file is not None else tuple(search or ())
    return Found(file, places, search)


def _spec(name: str, parent: str, folders: tuple[str, ...]) -> Found | None:
    """What the finders say of `name`, imported nothing: a submodule of a package not imported yet is
    looked for in the package's folders alone (`find_spec` would import the package)."""
    try:
        if not parent or parent in sys.modules:
            spec = importlib.util.find_spec(name)
        else:
            spec = importlib.machinery.PathFinder.find_spec(name, list(folders))
    except KeyError:  # a folder without __init__.py in a package not imported: a namespace portion, whose
        # spec asks sys.modules for its parent; its places are the folders of that name
        last = name.rpartition(".")[2]
        portions = tuple(path for folder in folders if os.path.isdir(path := os.path.join(folder, last)))
        return Found(None, portions, portions) if portions else None
    except (ImportError, ValueError, AttributeError):  # a package without __path__, a name no finder takes
        return None
    if spec is None:
        return None
    origin = spec.origin if spec.has_location else None
    file = origin if isinstance(origin, str) and os.path.isfile(origin) else None
    locations = spec.submodule_search_locations
    search = tuple(p for p in locations if isinstance(p, str)) if locations is not None else None
    return Found(file, (file,) if file is not None else tuple(search or ()), search)


def named(package: str, module: str, level: int, names: tuple[str, ...]) -> list[str]:
    """The modules an import statement may import, resolved against `package` (the importing module's):
    `import a.b` names `a` and `a.b`; `from a import b, c` names `a`, and `a.b` and `a.c` (each a submodule,
    or an attribute of `a`); `from . import x` names the package and `package.x`. None for a relative
    import outside a package."""
    base = module
    if level:
        parts = package.split(".") if package else []
        if not parts or level - 1 >= len(parts):
            return []
        base = ".".join([*parts[:len(parts) - level + 1], *([module] if module else [])])
    if not base:
        return []
    pieces = base.split(".")
    out = [".".join(pieces[:i]) for i in range(1, len(pieces) + 1)]
    return out + [f"{base}.{name}" for name in names if name != "*"]
