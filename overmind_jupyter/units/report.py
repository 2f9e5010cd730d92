"""What `%overmind units` shows: every device's capacity and holders, as a dict and as text."""

from __future__ import annotations

from typing import Any

from kernel_server.formats import kernel_name
from kernel_server.settings import GiB

from .residency import instance

__all__ = ["format_state", "state"]


def state() -> dict[str, Any]:
    """The units ledger of all kernels of this user, seen from this kernel.

    Returns:
        A dict with `devices` (each with `name`, `here` (how this kernel addresses it), `capacity`, `used`,
        `free`, `simulated`, and `holders`, least recently used first, each with `kernel`, `model`, `units`,
        `busy`, `idle_s`, `release_requested`, `context` (the kernel's CUDA context: Note [CUDA contexts] in
        kernel_server/ledger.py) and `mine`), `waiters`, `simulated`, `unit_bytes`,
        `reserve_gib`, `stats`, and `kernel` (this kernel's placements and its recent placement events).
    """
    return instance().state()


def format_state(state: dict[str, Any]) -> str:
    """Render `state()` as the text table of `%overmind units` in a terminal.

    Args:
        state: what `state()` returned.
    """
    gib = state.get("unit_bytes", GiB) / GiB
    head = f"GPU units (1 unit = {gib:g} GiB; {state.get('reserve_gib', 1):g} GiB of each device reserved)"
    if state.get("simulated"):
        head += f" - simulated devices (OVERMIND_FAKE_GPUS={state.get('fake_gpus')})"
    lines = [head]
    if state.get("config_error"):
        lines.append(f"  ledger disabled: {state['config_error']}")
    if not state.get("devices"):
        lines.append("  no GPU known yet (a kernel reports its devices when it first uses units)")
    for dev in state.get("devices", []):
        name = dev.get("here") or dev["name"]
        kind = "simulated" if dev["simulated"] else dev.get("model", "")
        size = dev["total_bytes"] / GiB
        lines.append(f"{name:<8} {kind} {size:.1f} GiB  capacity {dev['capacity']}  used {dev['used']}  "
                     f"free {dev['free']}")
        if not dev["holders"]:
            lines.append("    (no holders)")
            continue
        rows = [("kernel", "model", "units", "state")]
        for h in dev["holders"]:
            who = f"pid {h['kernel'].get('pid')} (this kernel)" if h.get("mine") else kernel_name(h["kernel"])[0]
            if h.get("context"):
                status = "held while its kernel runs"  # Note [CUDA contexts] in kernel_server/ledger.py
            elif h["busy"]:
                status = "busy"
            else:
                status = f"idle {h['idle_s']:.0f} s"
                if h.get("release_requested"):
                    status += ", asked to release"
            rows.append((who, h["model"] or "?", str(h["units"]), status))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        for r in rows:
            cells = [r[0].ljust(widths[0]), r[1].ljust(widths[1]), r[2].rjust(widths[2]), r[3]]
            lines.append(("    " + "  ".join(cells)).rstrip())
    for w in state.get("waiters", []):
        who = f"{kernel_name(w['kernel'])[0]} {w['model'] or 'a model'}"
        lines.append(f"waiting: {who} for {w['units']} units on {' or '.join(w['devices'])} "
                     f"since {w['waited_s']:.1f} s")
    return "\n".join(lines)
