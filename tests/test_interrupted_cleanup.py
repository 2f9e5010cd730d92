"""A Ctrl-C that lands in the cleanup of a cached model's mappings, as the model is freed, cuts none of it
short: the entry is unpinned and the descriptors closed, at once or by the next sweep, and the Ctrl-C is
raised or warned of (Note [Cleanup that Ctrl-C cannot cut short] in overmind_jupyter/mappings.py).

The Ctrl-C is a real SIGINT raised in the process by Python's own machinery, timed by no clock: a weak
reference whose callback is `_thread.interrupt_main`, made after ours, is called first when its object dies
(the callbacks of an object's weak references run newest first), so the interrupt is pending as our
finalizer starts, and Python raises it at the finalizer's first instruction.
"""

from __future__ import annotations

import _thread
import gc
import json
import mmap
import os
import signal
import sys
import warnings
import weakref
from pathlib import Path

import pytest

from overmind_jupyter import mappings
from overmind_jupyter.errors import OvermindWarning
from tests.helpers.snippets import last_json, run_py


class _Interrupting(weakref.ref):  # type: ignore[type-arg]
    """A weak reference whose callback `_thread.interrupt_main` takes it for SIGINT's number: called
    from C with no Python frame of its own, it leaves the interrupt pending for the next callback."""

    __slots__ = ()

    def __index__(self) -> int:
        return int(signal.SIGINT)


# What the kernels below start with: a connection, who it pins, and its descriptors once a first hit warmed
# up what a load opens (`fds`).
KERNEL = """
    import _thread, gc, json, os, sys
    from kernel_server.client import shared_client
    from overmind_jupyter import loading, mappings
    from tests.helpers import tiny_modules

    client = shared_client()
    def pinned():
        return [e["key"] for e in client.request("status")["entries"]
                if any(p["conn"] == client.conn_id for p in e["pinned_by"])]

    model = loading.cached(tiny_modules.build, "mlp", width=64)  # warms up what a load opens
    del model
    gc.collect()
    loading.flush_warnings()
    fds = len(os.listdir("/proc/self/fd"))
"""

# A kernel's cell: a hit of a tiny model (the entry published by an earlier process), then the model let
# go of with a Ctrl-C pending as its mapping's finalizer starts. Python prints the interrupt as ignored
# in the finalizer; the next call (here `status`) finishes what it left. The last line is JSON.
FREED_UNDER_CTRL_C = KERNEL + """
    import signal, weakref
    import overmind_jupyter
    from tests.test_interrupted_cleanup import _Interrupting
    model = loading.cached(tiny_modules.build, "mlp", width=64)
    held = pinned()
    mapped = [ref() for records in mappings._by_key.values() for ref, *_ in records]
    interrupting = [_Interrupting(m, _thread.interrupt_main) for m in mapped if m is not None]
    del mapped
    ignored = []
    sys.unraisablehook = lambda u: ignored.append(type(u.exc_value).__name__)
    del model  # the Ctrl-C lands in the finalizer, which Python reports and goes on from
    gc.collect()
    sys.unraisablehook = sys.__unraisablehook__
    overmind_jupyter.status()
    print(json.dumps({"calls": loading.calls(), "held": held, "ignored": ignored, "fds": fds,
                      "fds_after": len(os.listdir("/proc/self/fd")), "interrupting": len(interrupting)}))
    sys.stdout.flush()
    import time
    deadline = time.monotonic() + 10
    while pinned() and time.monotonic() < deadline:  # the unpin goes by the unpinner thread
        time.sleep(0.05)
    print(json.dumps({"pinned": pinned()}))
"""


def test_a_model_freed_as_ctrl_c_lands_is_unpinned_and_its_descriptors_closed(daemon: Path) -> None:
    """The hit's arena mapping dies with a Ctrl-C pending as its finalizer starts: the interrupt is
    reported as ignored there (the finalizer did nothing), and `status`, the next call, finishes the
    cleanup: the descriptors the hit opened are closed and the entry is no longer pinned by the kernel,
    so eviction for the budget can free it."""
    env = dict(os.environ, OVERMIND_POPULATE="0")  # the mapping dies on the main thread, with the model
    run_py("""
        from overmind_jupyter import loading
        from tests.helpers import tiny_modules
        loading.cached(tiny_modules.build, "mlp", width=64)
    """, env=env)
    proc = run_py(FREED_UNDER_CTRL_C, env=env)
    first, last = json.loads(proc.stdout.strip().splitlines()[-2]), last_json(proc)
    assert first["calls"] == {"hit": 2}, (first, proc.stderr)
    assert first["held"] and first["interrupting"] == 1, first
    assert first["ignored"] == ["KeyboardInterrupt"], "the Ctrl-C landed in the finalizer"
    assert first["fds_after"] == first["fds"], (first, "the arena's descriptor closed")
    assert last["pinned"] == [], "the entry unpinned"


def test_a_ctrl_c_during_the_cleanup_waits_for_its_end_and_is_warned_of(tmp_path: Path) -> None:
    """A Ctrl-C that comes while a mapping's cleanup runs (here: as what it kept is let go of, in its
    middle) is held until the cleanup is done: the pin released, the descriptor closed, the registry
    emptied; and since a finalizer cannot raise it to the cell, it is warned of."""
    released: list[str] = []
    pin = mappings.Pin("an-entry", released.append)
    m = mmap.mmap(-1, mmap.PAGESIZE)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)

    class Kept:
        pass

    kept = Kept()
    interrupting = _Interrupting(kept, _thread.interrupt_main)
    mappings.register(m, "an-entry", pin, arena_file=mappings.ArenaFile(fd, True), keep=[kept])
    del kept
    ignored: list[str] = []
    hook = sys.unraisablehook
    sys.unraisablehook = lambda u: ignored.append(type(u.exc_value).__name__)
    try:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            del m
            gc.collect()
    finally:
        sys.unraisablehook = hook
    assert interrupting() is None
    assert released == ["an-entry"], "the pin released"
    assert "an-entry" not in mappings._by_key
    with pytest.raises(OSError):
        os.fstat(fd)
    assert ignored == [], "no exception left the finalizer"
    assert [(w.category, "Interrupt again" in str(w.message)) for w in warned] == [(OvermindWarning, True)]


# A kernel's cell: a hit of a tiny model with a Ctrl-C landing as the hit maps the entry's arena (a real
# SIGINT, made pending by an audit hook on the mmap's creation, and raised at Python's next check), then
# the exception let go of. The last line is JSON.
INTERRUPTED_AS_IT_MAPS = KERNEL + """
    import time, traceback
    armed = [True]
    def interrupt_at_the_mapping(event, args):
        if event == "mmap.__new__" and armed:
            armed.clear()
            _thread.interrupt_main()
    sys.addaudithook(interrupt_at_the_mapping)
    try:
        loading.cached(tiny_modules.build, "mlp", width=64)
        frames = []
    except KeyboardInterrupt as exc:
        frames = [f.name for f in traceback.extract_tb(exc.__traceback__)]
        del exc
    gc.collect()
    deadline = time.monotonic() + 10
    while pinned() and time.monotonic() < deadline:  # the unpin goes by the unpinner thread
        time.sleep(0.05)
    print(json.dumps({"calls": loading.calls(), "frames": frames, "armed": armed, "pinned": pinned(),
                      "registered": list(mappings._by_key), "fds": fds,
                      "fds_after": len(os.listdir("/proc/self/fd"))}))
"""


def test_a_ctrl_c_as_a_hit_maps_its_entry_leaves_no_pin_and_no_descriptor(daemon: Path) -> None:
    """A Ctrl-C that lands as a hit maps the entry's arena, before the mapping is registered with the pin
    it holds, stops the call; once the exception is let go of, the entry is no longer pinned by the
    process and the hit's descriptors are closed (Note [Pins a Ctrl-C cannot leave] in loading.py). It
    stayed pinned, never evicted for the budget, for as long as the kernel lived."""
    env = dict(os.environ, OVERMIND_POPULATE="0")
    run_py("""
        from overmind_jupyter import loading
        from tests.helpers import tiny_modules
        loading.cached(tiny_modules.build, "mlp", width=64)
    """, env=env)
    proc = run_py(INTERRUPTED_AS_IT_MAPS, env=env)
    out = last_json(proc)
    assert out["armed"] == [] and "_map" in out["frames"], (out, "the Ctrl-C landed as the hit mapped the arena")
    assert out["calls"] == {"hit": 1}, (out, proc.stderr)
    assert out["registered"] == [], out
    assert out["pinned"] == [], (out, "the entry unpinned")
    assert out["fds_after"] == out["fds"], (out, "the hit's descriptors closed")


def test_uninterrupted_work_runs_whole_and_raises_the_ctrl_c_after(tmp_path: Path) -> None:
    """A Ctrl-C that lands inside `mappings.uninterrupted`'s work (here: as an object the work lets go
    of dies) is held until the work is done, then raised to the caller."""

    class Kept:
        pass

    done: list[str] = []

    def work(kept: list[Kept]) -> str:
        kept.clear()  # the Ctrl-C is pending from here on
        done.append("after the Ctrl-C")
        return "returned"

    kept = [Kept()]
    interrupting = _Interrupting(kept[0], _thread.interrupt_main)
    with pytest.raises(KeyboardInterrupt):
        mappings.uninterrupted(work, kept)
    assert interrupting() is None
    assert done == ["after the Ctrl-C"]
    assert mappings.uninterrupted(work, []) == "returned"


def test_a_connection_that_ended_out_of_step_is_closed_and_its_lease_ends(daemon: Path) -> None:
    """A Ctrl-C inside a read, between a frame's header and its body, leaves the stream out of step: the
    next read fails and the connection ends. The next call opens another; the ended one is closed, so
    that the daemon ends its lease too (its pins: docs/design.md invariant 5) and no socket is left open.
    Before, the daemon listed the old connection, with the pins of the models it had mapped, as long as
    the kernel lived (its entries never evicted for the budget)."""
    proc = run_py("""
        import json, time
        from kernel_server import Client
        from kernel_server.client import shared_client
        from kernel_server.errors import DaemonLost
        from overmind_jupyter import loading
        from tests.helpers import tiny_modules

        model = loading.cached(tiny_modules.build, "mlp", width=64)
        old = shared_client()
        old._end(DaemonLost("lost the daemon: bad magic"))  # where a read cut inside a frame leads
        new = shared_client()
        with Client(role="test") as probe:
            def pinned_by_old():
                return [e["key"] for e in probe.request("status")["entries"]
                        if any(p["conn"] == old.conn_id for p in e["pinned_by"])]
            deadline = time.monotonic() + 10
            while pinned_by_old() and time.monotonic() < deadline:
                time.sleep(0.05)
            print(json.dumps({"calls": loading.calls(), "replaced": new is not old,
                              "old_socket": old._sock.fileno(), "pinned_by_old": pinned_by_old(),
                              "model": model is not None}))
    """)
    out = last_json(proc)
    assert out["calls"] == {"miss": 1} and out["replaced"] and out["model"], out
    assert out["old_socket"] == -1, "the ended connection's socket is closed"
    assert out["pinned_by_old"] == [], "the daemon ended the old connection's lease: no pin left"
