"""Devices warmed ahead: a warm kernel started ahead creates its CUDA context and cuBLAS handles while it
waits for the restart, so that the restarted kernel's first model pays for neither (Note [Devices warmed
ahead]).

`start` runs in a kernel started ahead (zygote.py's `_bind_when_started`), never in the spare; `warmed()`
is what this process warmed, which `%overmind status` shows. Importing this module imports nothing beyond
the standard library; torch is used only where the spare preloaded it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypedDict

__all__ = ["Warmed", "start", "warmed"]

# Note [Devices warmed ahead]
# A kernel's first CUDA call creates its CUDA context (0.24-0.37 s measured on an H200), and its first
# matrix products load their kernels and create torch's cuBLAS and cuBLASLt handles and workspace (another
# 0.45-0.65 s of the first token after a restart). A warm kernel started ahead (Note [Kernels started ahead]
# in zygote.py) has time to spare: it waits, built but for its ports, until the restart asks for it. So just
# before it waits, it starts a daemon thread that, for each device of OVERMIND_WARM_DEVICES
# (`c.Overmind.warm_devices` in the kernel's IPython config wins, as traitlets' order says), creates the
# context (`torch.empty(1, device=d)`), runs `torch.nn.functional.linear` of a (16, 256) input and a
# (256, 256) weight, without and with a bias, in bfloat16, float16 and float32 (as a model's first forward
# would), then the other kernels a decoder's first token launches (`_block`: an embedding, an RMS norm,
# causal attention, a gated activation, a softmax, an argmax; CUDA loads each kernel's code at its first
# launch), and synchronises. The tensors are zeros: no random generator is drawn from. `auto` (the default)
# is the first visible CUDA device, when the spare preloaded torch and CUDA is available in the kernel;
# `cpu` runs the same steps on the CPU (what the tests run here, without a GPU).
# - Only in a kernel started ahead, never in the spare: a CUDA context does not survive fork, and a child
#   forked after CUDA was initialised cannot use CUDA (Note [Fork safety]); the spare checks before every
#   fork that neither torch nor anything else has initialised CUDA in it, and refuses (and exits, to be
#   replaced) if something did. Not in a kernel forked for a start either: that one's user is waiting, and
#   the warm-up would compete with the first cell instead of running before it.
# - A restart during the warm-up does not wait for it: the thread runs on, and the first CUDA call of the
#   user's waits on torch's own lazy-initialisation lock, as it must. torch keeps cuBLAS handles in a pool
#   its threads share: the thread's handles go back to the pool when it ends, and the kernel's thread takes
#   them from there. A failure (no driver, a device that does not exist, a dtype the device lacks) is
#   recorded in `warmed()` and never breaks the kernel; the thread prints nothing (a kernel started ahead
#   has no one to print to).
# - The cost: each waiting kernel started ahead holds a CUDA context on each device it warmed, device memory
#   of its own (about 0.5 GiB), one per running warm kernel, shown by nvidia-smi as a process. The units
#   ledger does not count it while the kernel waits: the kernel has no connection to the daemon until it
#   runs, and its context is counted from its first units on the device (Note [CUDA contexts] in
#   kernel_server/ledger.py, Note [Context units] in overmind_jupyter/units/devices.py); until then it is
#   part of what OVERMIND_GPU_RESERVE keeps out of the ledger.
# - What the kernel's user can no longer change: variables CUDA reads when it initialises
#   (`CUDA_VISIBLE_DEVICES`, `PYTORCH_CUDA_ALLOC_CONF`, ...) were read with the start's environment before
#   the first cell, so setting them from the notebook (`%env`, `os.environ`) has no effect after a restart
#   (it still has in a kernel's first start, which warms nothing). The kernel says so once, on stderr,
#   after the cell that changed one (`check_environment`, a post-cell hook), rather than leave a model on
#   the device the user meant to avoid. Set them in the kernelspec's `env` or the server's environment,
#   or turn the warm-up off.
# - Turning it off: OVERMIND_WARM_DEVICES=off (or `c.Overmind.warm_devices = "off"`), or `start_ahead:
#   false` in the kernelspec's provisioner config (no kernel is started ahead at all). The variable may
#   differ between kernels without a new spare, since only the kernels read it (Note [Per-kernel
#   environment] in spares.py).
DTYPES = ("bfloat16", "float16", "float32")
SHAPE = (16, 256)  # the input; the weight is (256, 256)


class Warmed(TypedDict):
    """One device warmed ahead: `started_at` and `finished_at` (None while it runs) are `time.time()`,
    `seconds` its duration, `error` what failed (None if nothing did), `pid` the process that warmed it."""

    device: str
    pid: int
    started_at: float
    finished_at: float | None
    seconds: float | None
    error: str | None


_lock = threading.Lock()
_records: list[Warmed] = []
# What CUDA read when the warm-up initialised it: changing these afterwards changes nothing (Note [Devices
# warmed ahead]), so the kernel says so once, after the cell that changed them.
READ_AT_INIT = ("CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF", "CUDA_DEVICE_ORDER")
_environment: dict[str, str | None] = {}
_told: set[str] = set()


def check_environment(*_: Any) -> str | None:
    """After a cell (an IPython `post_run_cell` hook): if the warm-up initialised CUDA and the cell changed a
    variable CUDA read then, say once, on stderr, that the change has no effect in this kernel; returns what
    it said."""
    with _lock:  # (the `cpu` stand-in counts too: the tests' way to see it)
        warmed_here = any(r["error"] is None for r in _records)
    if not warmed_here:
        return None
    changed = [name for name in READ_AT_INIT if name not in _told and os.environ.get(name) != _environment.get(name)]
    if not changed:
        return None
    _told.update(changed)
    message = (f"overmind: {', '.join(changed)} changed after this warm kernel initialised CUDA ahead of its start "
               "(Note [Devices warmed ahead]): the change has no effect in this kernel. Set it in the kernelspec's "
               "env or the server's environment, or set OVERMIND_WARM_DEVICES=off and restart")
    print(message, file=sys.stderr, flush=True)
    return message


def warmed() -> list[Warmed]:
    """What this process warmed ahead of its start, one record per device, in order (see Note [Devices
    warmed ahead]); empty in a kernel that was not started ahead, or where nothing was to be warmed."""
    with _lock:
        return [record.copy() for record in _records]


def _setting(config: Any) -> str:
    """OVERMIND_WARM_DEVICES, or `c.Overmind.warm_devices` where the kernel's config sets it. A bad value
    gives the default here, silently: a kernel started ahead has no one to tell, and the extension reports
    it when it loads (Note [Bad settings] in kernel_server/settings.py)."""
    from kernel_server import settings

    setting = settings.WARM_DEVICES
    try:
        section = config["Overmind"] if config is not None and "Overmind" in config else {}
        if setting.name in section:
            return str(setting.parse(section[setting.name], source=f"c.Overmind.{setting.name}"))
        return str(setting.read())
    except settings.SettingError:
        return str(setting.default_value())


def start(config: Any = None, report: Callable[[list[Warmed]], None] | None = None) -> threading.Thread | None:
    """Warm the devices the setting names in a daemon thread (see Note [Devices warmed ahead]); only a kernel
    started ahead calls this, just before it waits for its restart. Never raises.

    Args:
        config: the kernel app's traitlets config, where `c.Overmind.warm_devices` may be set.
        report: called with `warmed()` once the warm-up is over (at once when there is nothing to warm),
            from whichever thread finished it.

    Returns:
        The thread, or None when there was nothing to warm.
    """
    try:
        value = _setting(config)
    except Exception:  # noqa: BLE001 - a kernel started ahead must wait for its restart whatever happens
        value = "off"
    if value == "off" or (value == "auto" and "torch" not in sys.modules):
        if report is not None:
            report([])
        return None
    _environment.update({name: os.environ.get(name) for name in READ_AT_INIT})
    thread = threading.Thread(target=_run, args=(value, report), name="overmind-warm-devices", daemon=True)
    thread.start()
    return thread


def _run(value: str, report: Callable[[list[Warmed]], None] | None) -> None:
    try:
        for device in _devices(value):
            _warm(device)
    finally:
        if report is not None:
            report(warmed())


def _devices(value: str) -> list[str]:
    """The devices `value` names; for `auto`, the first visible CUDA device if CUDA is available."""
    if value != "auto":
        return value.split(",")
    try:
        return ["cuda:0"] if sys.modules["torch"].cuda.is_available() else []
    except Exception as exc:  # noqa: BLE001 - recorded: the driver's own error, say
        _finish(_begin("cuda:0"), 0.0, [f"{type(exc).__name__}: {exc}"])
        return []


def _begin(device: str) -> Warmed:
    record = Warmed(device=device, pid=os.getpid(), started_at=time.time(), finished_at=None, seconds=None,
                    error=None)
    with _lock:
        _records.append(record)
    return record


def _block(torch: Any, x: Any, weight: Any) -> None:
    """The other kernels a decoder's first forward and first token launch, once each in `x`'s dtype (CUDA
    loads a kernel's code at its first launch): an embedding lookup, an RMS norm, rotary-style halves, causal
    attention, a gated activation, a softmax and the argmax of greedy decoding."""
    functional = torch.nn.functional
    ids = torch.zeros((1, SHAPE[0]), dtype=torch.long, device=x.device)
    h = functional.embedding(ids, weight)
    h = h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype)
    half = SHAPE[1] // 2
    h = torch.cat((-h[..., half:], h[..., :half]), dim=-1) * h + h
    q = h.view(1, SHAPE[0], 2, half).transpose(1, 2)
    attended = functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    h = functional.silu(attended.transpose(1, 2).reshape(1, SHAPE[0], SHAPE[1])) * h
    torch.softmax(functional.linear(h, weight).float(), dim=-1).argmax(-1)


def _finish(record: Warmed, seconds: float, errors: list[str]) -> None:
    with _lock:
        record["finished_at"], record["seconds"], record["error"] = time.time(), seconds, "; ".join(errors) or None


def _warm(device: str) -> None:
    """Create `device`'s context, run the first products of a forward in each dtype, synchronise; record it."""
    record = _begin(device)
    started = time.perf_counter()
    errors: list[str] = []
    try:
        torch = sys.modules.get("torch")
        if torch is None:
            raise RuntimeError("torch is not preloaded by this kernel's spare, so nothing is warmed")
        where = torch.device(device)
        cuda = where.type == "cuda"
        if cuda:
            torch.cuda.init()
        with torch.cuda.device(where) if cuda else contextlib.nullcontext():
            torch.empty(1, device=where)
            for name in DTYPES:
                try:
                    dtype = getattr(torch, name)
                    x = torch.zeros(SHAPE, dtype=dtype, device=where)
                    weight = torch.zeros((SHAPE[1], SHAPE[1]), dtype=dtype, device=where)
                    bias = torch.zeros(SHAPE[1], dtype=dtype, device=where)
                    torch.nn.functional.linear(x, weight)  # cuBLAS
                    torch.nn.functional.linear(x, weight, bias)  # cuBLASLt's product with a bias
                    _block(torch, x, weight)
                except Exception as exc:  # noqa: BLE001 - recorded; the other dtypes go on
                    errors.append(f"{name}: {type(exc).__name__}: {exc}")
            if cuda:
                torch.cuda.synchronize(where)
    except Exception as exc:  # noqa: BLE001 - recorded: a kernel is never broken by its warm-up
        errors.insert(0, f"{type(exc).__name__}: {exc}")
    _finish(record, time.perf_counter() - started, errors)
