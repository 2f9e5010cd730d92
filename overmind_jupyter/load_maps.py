"""The checkpoint files a miss's load maps, mapped by us so that the registry can hold the mappings.

# Note [Files the load maps]
safetensors and `torch.load(mmap=True)` map a checkpoint with `torch.UntypedStorage.from_file(path,
shared=False, nbytes=size)`: a private mapping of the whole file that only torch holds. A same-dtype
miss publishes the tensors that lie there as pieces of the file (Note [Atomic miss] in publishing.py),
and the registry must hold the mapping they lie on (Note [Mapping registry] in mappings.py). Without
this, the publish maps the file a second time and moves every tensor onto that mapping (203 `set_`
calls, 0.6 ms of a 1.1B miss), the library's mapping kept beside it for the model's life.

So while a miss loads (`files_mapped`), a `from_file` call of its context with `shared=False` and the
file's own size makes that same mapping here: `arena.map_private` of the file (what torch makes: private,
readable and writable, from offset 0), as a storage over the mmap object (`torch.frombuffer`), which the
registry can hold and whose end it sees. The tensors lie on a mapping of ours from the start; the publish
registers it and moves nothing. Every other call (another thread's, a call after the load, shared=True,
another size, a path that is not a regular file) is torch's own. The patch is made for the load and
undone after it (docs/design.md invariant 6), and the load's context is where the mappings are
recorded (invariant 7).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import mmap
import os
import stat
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kernel_server import arena

from . import patching
from .mappings import FileMapping

__all__ = ["LoadMap", "files_mapped"]


@dataclass(frozen=True)
class LoadMap:
    """A file the load mapped through us: the mmap object its tensors' storages lie on (weakly: the
    mapping goes with the last of them, as torch's would, such as those a conversion read and dropped),
    and where."""

    mapping: weakref.ref[mmap.mmap]
    file: FileMapping


_made: contextvars.ContextVar[list[LoadMap] | None] = contextvars.ContextVar("overmind_load_maps", default=None)
_lock = threading.Lock()
_loads = 0  # the loads in progress, in every thread: the patch stays while there is one


@contextlib.contextmanager
def files_mapped() -> Iterator[list[LoadMap]]:
    """While the block runs (a miss's load), the files this context maps with `from_file` are mapped here
    and listed in the list yielded (Note [Files the load maps])."""
    import torch

    global _loads
    made: list[LoadMap] = []
    token = _made.set(made)
    try:
        with _lock:
            if _loads == 0:
                patching.patch(torch.UntypedStorage, "from_file", _patched)
            _loads += 1
        try:
            yield made
        finally:
            with _lock:
                _loads -= 1
                if _loads == 0:
                    patching.unpatch(torch.UntypedStorage, "from_file")
    finally:
        _made.reset(token)


def _patched(original: Any) -> staticmethod[..., Any]:
    """`from_file` made by `_from_file` over `original` (torch's staticmethod, as the patch engine hands it)."""
    function = original.__func__ if isinstance(original, staticmethod) else original
    return staticmethod(functools.partial(_from_file, function))


def _from_file(original: Any, *args: Any, **kwargs: Any) -> Any:
    """`from_file`: mapped here where a miss of this context loads (Note [Files the load maps]), else torch's."""
    made = _made.get()
    if made is not None:
        try:
            filename, shared, nbytes = _arguments(*args, **kwargs)
        except TypeError:
            pass
        else:
            if not shared and type(nbytes) is int and nbytes > 0:
                found = _map(filename, nbytes)
                if found is not None:
                    storage, load_map = found
                    made.append(load_map)
                    return storage
    return original(*args, **kwargs)


def _arguments(filename: Any, shared: Any = False, nbytes: Any = 0) -> tuple[Any, Any, Any]:
    """`from_file`'s arguments by name (its signature)."""
    return filename, shared, nbytes


def _map(filename: Any, nbytes: int) -> tuple[Any, LoadMap] | None:
    """A storage over a private mapping of the whole file `filename`, and its record; None where torch's
    own `from_file` should answer (not a regular file of `nbytes` bytes, or no mapping to be had)."""
    import torch

    try:
        path = os.path.abspath(os.fspath(filename))
        if not isinstance(path, str):  # (a bytes path: torch's own)
            return None
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except (TypeError, ValueError, OSError):
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != nbytes:
            return None
        mapping = arena.map_private(fd, nbytes)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    storage = torch.frombuffer(mapping, dtype=torch.uint8).untyped_storage()
    start = storage.data_ptr()
    return storage, LoadMap(weakref.ref(mapping), FileMapping(start, start + nbytes, 0, st.st_dev, st.st_ino, path,
                                                               True))
