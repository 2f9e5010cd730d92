"""The public functions: turning the cache on and off in any Python process, and asking it what it holds.

`enable()` patches the loaders of targets.py and starts the daemon; `disable()` restores every original.
The IPython side (the magic, the event callback) is overmind_jupyter/extension.py's.
"""

from __future__ import annotations

import sys
import threading
import warnings
from typing import Any

from kernel_server.operations import Op

from .errors import DaemonError, FallbackWarning

__all__ = ["disable", "enable", "evict", "evict_reply", "format_status", "is_enabled", "start", "status"]

_lock = threading.Lock()
_enabled = False


def enable(config: Any = None) -> None:
    """Route `from_pretrained` of transformers, diffusers and peft through the cache, and start the
    daemon if none runs. Libraries imported later are patched when they are imported.

    Args:
        config: an `overmind_jupyter.config.Overmind` (default: one read from the environment).
    """
    failed = start(config)
    if failed is not None:
        warnings.warn(f"overmind: {failed}", FallbackWarning, stacklevel=2)


def start(config: Any = None) -> str | None:
    """`enable`, saying rather than warning why no daemon could be started (`%overmind on` prints it in
    its one line): None where one runs."""
    global _enabled
    from kernel_server import descriptors

    from . import hit_tuning, loading, targets
    from .config import Overmind

    (config or Overmind()).apply()
    descriptors.raise_limit()  # each cached model this kernel holds keeps descriptors (Note [Descriptor budget])
    with _lock:
        targets.install(loading.patched_call)
        _enabled = True
    hit_tuning.prepare()  # what a hit imports, if torch is imported (Note [Imports ahead of the hit])
    try:
        from kernel_server.client import shared_client

        shared_client()
    except DaemonError as exc:
        return f"no daemon could be started ({exc}); loads run plainly until one can"
    hit_tuning.collect_young()  # what enable() made, not the first lookup's to visit (Note [Old at birth])
    return None


def disable() -> None:
    """Restore every patched loader exactly (identity of the original descriptors)."""
    global _enabled
    from . import progress, targets

    with _lock:
        _enabled = False
        errors = targets.uninstall()
        progress.remove_hook()  # the loads' named bars (Note [Load progress] in progress.py)
    if errors:
        raise errors[0]


def is_enabled() -> bool:
    return _enabled


def status() -> dict[str, Any]:
    """The cache as this kernel sees it: `daemon`, the daemon's status reply (kernel_server/payloads.py
    `StatusReply`; None without a daemon, and `daemon_error` says why), `conn`, this kernel's connection to
    it, `fallbacks`, this process's, what is `patched`, and `warmed`, the devices this kernel warmed while
    it was started ahead (a warm kernel's; Note [Devices warmed ahead] in warm/warmup.py). `format_status`
    words it; view.py's `state_view` shapes its `daemon` for the panel and the widgets."""
    from kernel_server import lifecycle
    from kernel_server.client import shared_client

    from . import loading, patching, progress, results
    from .warm import warmup

    unmapped = sys.modules.get(f"{__package__}.mappings")  # (imported by the first hit or miss)
    if unmapped is not None:  # the unpins of mappings whose cleanup a Ctrl-C delayed, first (Note
        unmapped.finish_unmapped()  # [Cleanup that Ctrl-C cannot cut short] in mappings.py)
    results.send_unpins()
    out: dict[str, Any] = {
        "enabled": _enabled,
        "patched": patching.patched(),
        "fallbacks": loading.fallbacks(),
        "warmed": warmup.warmed(),
    }
    try:
        out["home"] = str(lifecycle.state_dir(create=False))
        client = shared_client(spawn=False)
        progress.flush_hit_times(client)  # this kernel's hit times, for the time-saved figures (progress.py)
        out["daemon"] = client.request(Op.STATUS, timeout=10).payload
        out["conn"] = client.conn_id
    except (DaemonError, OSError) as exc:
        out["daemon"] = None
        out["daemon_error"] = str(exc)
    return out


def evict(key: str | None = None) -> list[str]:
    """Evict the entry `key` (or a unique prefix of it), or every entry when `key` is None. Kernels
    that use an evicted model keep it; the memory goes with the last of them. Returns evicted keys.

    Raises:
        ValueError: `key` is empty or longer than a key, or TypeError: it is not a string.
    """
    return list(evict_reply(key)["evicted"])


def evict_reply(key: str | None = None) -> dict[str, Any]:
    """`evict`, returning the daemon's whole reply: `evicted` (the keys) and, from a daemon of this version,
    `entries` (each `key`, `label`, `bytes`) and `bytes`, which `kernel_server.formats.evicted_text` words
    as `%overmind evict` prints it."""
    from kernel_server.client import shared_client

    if key is not None:
        _check_key(key)
    client = shared_client(spawn=False)
    reply = client.request(Op.EVICT, all=True) if key is None else client.request(Op.EVICT, key=key)
    return dict(reply.payload)


def _check_key(key: object) -> None:
    """Refuse, with what to pass instead, a key no entry can have: an empty one would otherwise reach the
    daemon as a bad request, and be read by no one as "every entry"."""
    from kernel_server.payloads import MAX_KEY

    what = ("pass the key of an entry or a unique prefix of it, as `%overmind status` and `overmind-daemon ls` "
            "list them, or no key at all (`evict()`) to evict every entry")
    if not isinstance(key, str):
        raise TypeError(f"evict takes a key as a string, not {type(key).__name__}: {what}")
    if not 1 <= len(key) <= MAX_KEY:
        raise ValueError(f"evict got {'an empty key' if not key else f'a key of {len(key)} characters'}: {what}")


def _patched_text(s: dict[str, Any]) -> str:
    if s["patched"]:
        return f"{len(s['patched'])} loaders patched"
    if s["enabled"]:  # nothing imported yet: the import hook patches each library when it is imported
        return "transformers, diffusers and peft are patched when they are imported"
    return "nothing patched"


def format_status(s: dict[str, Any]) -> str:
    """`status()` as text, for terminals: the view every other one shows (view.state_view)."""
    from kernel_server.formats import entries_text, kernel_line

    from .view import state_view

    lines = [f"overmind {'on' if s['enabled'] else 'off'}; " + _patched_text(s)]
    if s.get("daemon") is None:
        lines.append(f"daemon: not running ({s.get('daemon_error', '')})")
    else:
        v = state_view(s["daemon"], my_conn=s.get("conn"))
        stats = ", ".join(f"{k} {n}" for k, n in sorted(v["stats"].items()))  # none before the first load
        lines.append(f"daemon pid {v['daemon']['pid']} at {v['daemon']['home']}: {v['texts']['used']} of "
                     f"{v['texts']['budget']} in {entries_text(v['entries_total'])}" + (f"; {stats}" if stats else ""))
        if v["texts"]["disk"]:
            lines.append(v["texts"]["disk"])
        lines.append(f"time: {v['texts']['saved_detail']}")  # Note [Load time saved] in kernel_server/store.py
        for e in v["entries"]:
            users = ", ".join(k["name"] + (" (this kernel)" if k["mine"] else "") for k in e["pinned_by"]) or "-"
            lines.append(f"  {e['key'][:12]}  {e['label']}  {e['bytes_text']}  hits {e['hits']}  "
                         f"missed in {e['miss_text']}  used by {users}"
                         + (f"  {e['pending']['text']}" if e["pending"] else ""))
        if v["entries_more"]:  # Note [Status with many entries] in kernel_server/catalogue.py
            lines.append(f"  ... and {v['entries_more']} more (the largest and the most recently used are "
                         "shown; `overmind-daemon ls` lists every one)")
        for load in v["loading"]:
            what = load["progress"]["text"] if load["progress"] else f"{load['key'][:12]} loading"
            lines.append(f"  {what}  by {load['loader']['name']}")
        lines += [f"kernel {kernel_line(k)}" for k in v["kernels"]]  # as the CLI lists it
    for f in s["fallbacks"][-10:]:
        lines.append(f"fallback: {f['call']}: {f['reason']}")
    lines += [_warmed_text(w) for w in s.get("warmed", ())]
    return "\n".join(lines)


def _warmed_text(w: dict[str, Any]) -> str:
    """One device a warm kernel warmed while it was started ahead (Note [Devices warmed ahead])."""
    if w["finished_at"] is None:
        return f"warming {w['device']} ahead of this kernel's start: still running"
    if w["error"]:
        return f"warming {w['device']} ahead of this kernel's start failed: {w['error']}"
    return f"warmed {w['device']} ahead of this kernel's start (context and matrix products, {w['seconds']:.2f} s)"
