"""`python -m kernel_server` / `overmind-daemon`: start, stop and inspect the daemon."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import lifecycle, settings
from .client import Client
from .errors import DaemonError, RemoteError
from .formats import (
    byte_text,
    disk_text,
    entries_text,
    evicted_text,
    kernel_line,
    kernel_name,
    miss_text,
    pending_text,
    progress_text,
    saved_text,
)
from .operations import Op
from .payloads import StatusReply

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="overmind-daemon", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="start the daemon (detached unless --foreground)")
    start.add_argument("--foreground", action="store_true", help="run in this process; log to stderr")
    start.add_argument("--daemonize", action="store_true", help=argparse.SUPPRESS)  # used by clients
    stop = sub.add_parser("stop", help="stop the daemon gracefully")
    stop.add_argument("--timeout", type=_wait, default=10.0, help="how long to wait for it to exit: seconds, or a "
                      "number with s, m or h (10)")
    for name, help_ in (("status", "the daemon, its budget and kernels"), ("ls", "the cache entries")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--json", action="store_true", help="print JSON")
    evict = sub.add_parser("evict", help="evict an entry (a key or a unique prefix of one) or --all")
    evict.add_argument("key", nargs="?")
    evict.add_argument("--all", action="store_true", help="evict every entry (kernels keep what they hold)")
    evict.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    command: Callable[[argparse.Namespace], int] = _COMMANDS[args.command]
    try:
        code = command(args)
        sys.stdout.flush()  # here, where a reader that left is answered, not at the interpreter's exit
        return code
    except DaemonError as exc:
        print(f"overmind-daemon: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader left (`| head`): end quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        return 1


def _start(args: argparse.Namespace) -> int:
    if args.foreground or args.daemonize:
        from .daemon import run

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
        logging.captureWarnings(True)  # a bad setting's SettingWarning goes to the log, once
        home = lifecycle.state_dir()
        if args.foreground:
            return run(home)
        read_end, write_end = os.pipe()
        if os.fork():
            os.close(write_end)
            ready = os.read(read_end, 16)  # empty when the daemon died before serving
            return 0 if ready else 1
        os.close(read_end)
        return run(home, ready_fd=write_end)
    home = lifecycle.state_dir()
    if lifecycle.running(home):  # its settings are those it started with
        with Client(home, spawn=False, role="cli") as client:
            print(f"daemon pid {client.daemon_pid} serves {home} already (with the settings it started with: "
                  "`overmind-daemon stop` first to start it with others)")
        return 0
    # The daemon starts detached, its warnings going to its log: a bad setting is said here too.
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", settings.SettingWarning)
        for setting in settings.SETTINGS:
            if setting.read_by in ("daemon", "both"):
                settings.get(setting)
    for warning in said:
        print(f"overmind-daemon: {warning.message}", file=sys.stderr)
    with Client(home, role="cli") as client:
        print(f"daemon pid {client.daemon_pid} serves {home}")
    return 0


def _wait(text: str) -> float:
    """A wait of the command line: 0, or a duration as the settings write them (10, 10s, 2m)."""
    with contextlib.suppress(ValueError):
        if float(text) == 0:
            return 0.0
    try:
        return settings.seconds(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} {exc}") from None


def _stop(args: argparse.Namespace) -> int:
    home = lifecycle.state_dir()
    if not lifecycle.running(home):
        print(f"no daemon runs at {home}")
        return 0
    try:
        with Client(home, spawn=False, role="cli") as client:
            pid: int | None = client.daemon_pid
            client.request(Op.SHUTDOWN)
    except DaemonError as exc:  # stopped (SIGSTOP) or stuck: its pid is in its lock file
        pid = lifecycle.daemon_pid(home)
        if pid is None:
            raise
        print(f"overmind-daemon: {exc}; sending pid {pid} SIGCONT and SIGTERM", file=sys.stderr)
        for sig in (signal.SIGCONT, signal.SIGTERM):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
    assert pid is not None
    # Note [Stop without waiting]
    # `--timeout 0` asks the daemon to stop and does not wait for it: the daemon ends its clients'
    # requests and exits a moment later, which is no failure of the command. So the daemon's exit is looked
    # for at least once, after the request (a daemon already gone is said stopped), and with 0 the command
    # says that the stop was asked for and exits 0; only a wait that ran out advises SIGKILL.
    deadline = time.monotonic() + args.timeout
    while True:
        if lifecycle.process_gone(pid):
            print(f"stopped daemon pid {pid}")
            return 0
        if time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    if args.timeout == 0:
        print(f"asked daemon pid {pid} to stop, without waiting for it (--timeout 0): it exits once its "
              "clients' requests end; `overmind-daemon status` says when it has")
        return 0
    print(f"daemon pid {pid} did not stop within {args.timeout:g} s: `kill -KILL {pid}` ends it (kernels load "
          "plainly until the next load starts a new one)", file=sys.stderr)
    return 1


def _read(op: str) -> Callable[[argparse.Namespace], int]:
    def command(args: argparse.Namespace) -> int:
        home = lifecycle.state_dir()
        if not lifecycle.running(home):  # nothing cached: a listing of nothing, as `evict` evicts nothing
            if args.json:
                nothing = {"running": False, "home": str(home)} if op == "status" else {"entries": [], "total": 0}
                print(json.dumps(nothing))
            else:
                print(f"no daemon runs at {home}" + ("" if op == "status" else ": nothing cached"))
            return 0
        with Client(home, spawn=False, role="cli") as client:
            if op == "status":
                status = client.request(Op.STATUS).payload
                print(json.dumps({"running": True, **status}, indent=2) if args.json
                      else _STATUS_TEXT(status, client.conn_id))
                return 0
            listing = _every_entry(client)
        print(json.dumps(listing, indent=2) if args.json else _entries_text(listing["entries"]))
        return 0

    return command


def _every_entry(client: Client) -> dict[str, Any]:
    """Every entry, page by page (Note [Status with many entries] in catalogue.py), the most recently
    used first: `{"entries": [...], "total": n}`."""
    entries: list[dict[str, Any]] = []
    after = ""
    while True:
        page = client.request(Op.LS, after=after)
        entries += page["entries"]
        if page["next"] is None:
            break
        after = page["next"]
    entries.sort(key=lambda e: e["last_used"], reverse=True)
    return {"entries": entries, "total": len(entries)}


def _evict(args: argparse.Namespace) -> int:
    if bool(args.all) == bool(args.key):
        print("overmind-daemon evict: give a KEY (or a unique prefix) or --all"
              + (", not both" if args.all else ""), file=sys.stderr)
        return 2
    home = lifecycle.state_dir()
    if not lifecycle.running(home):
        print(json.dumps({"evicted": []}) if args.json else f"no daemon runs at {home}: nothing to evict")
        return 0
    with Client(home, spawn=False, role="cli") as client:
        try:
            reply = client.request(Op.EVICT, all=True) if args.all else client.request(Op.EVICT, key=args.key)
        except RemoteError as exc:
            print(f"overmind-daemon: {exc}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps({"evicted": reply["evicted"]}))
    else:
        print(evicted_text(reply.payload))
    return 0


def _STATUS_TEXT(p: StatusReply, own: int | None = None) -> str:
    """The status as text; `own` is the connection of the command that asked, not a kernel."""
    d = p["daemon"]
    kernels = [k for k in p["kernels"] if k["conn"] != own]
    lines = [
        f"daemon pid {d['pid']}  version {d['version']}  protocol {d['protocol']}  home {d['home']}",
        f"store  {byte_text(p['used'])} used + {byte_text(p['reserved'])} reserved of "
        f"{byte_text(p['budget'])}  ("
        + "; ".join(filter(None, [entries_text(p["entries_total"]),
                                  ", ".join(f"{k} {v}" for k, v in sorted(p["stats"].items()))])) + ")",
        f"kernels {len(kernels)} connected",
    ]
    lines += [f"  {kernel_line(k)}" for k in kernels]
    if p.get("disk"):
        lines.insert(2, "       " + disk_text(p["disk"]))
    fds = p.get("descriptors")
    if fds:  # Note [Descriptor budget] in descriptors.py
        lines.insert(2, f"fds    {fds.get('open') if fds.get('open') is not None else '?'} open of the limit "
                        f"{fds['limit']}; entries hold {fds['entries']} of the {fds['cap']} kept for them")
    if p.get("errors", {}).get("internal"):
        lines.append(f"errors {p['errors']['internal']} internal (a bug: see the daemon log)")
    for dev in (p.get("units") or {}).get("devices", []):
        holders = ", ".join(f"pid {h.get('pid')} {h.get('units')}u{' busy' if h.get('busy') else ''}"
                            for h in dev.get("holders", []))
        lines.append(f"units  {dev.get('name')}{' (simulated)' if dev.get('simulated') else ''}: "
                     f"{dev.get('used')}/{dev.get('capacity')} used" + (f" by {holders}" if holders else ""))
    for load in p["loading"]:
        what = progress_text(load["progress"]) if load["progress"] else f"loading {load['key']}"
        lines.append(f"loading {what} by {kernel_name(load['loader'])[0]}, {load['waiters']} waiting")
    lines.append(f"time   {saved_text(p['time_saved'])}")  # Note [Load time saved] in store.py
    for e in p["entries"]:
        lines.append(f"entry  {e['key'][:16]} {e['meta'].get('label', '')}: missed in {miss_text(e)}"
                     + (f"; {pending_text(e['pending'])}" if e["pending"] else ""))
    if p.get("entries_more"):  # Note [Status with many entries] in catalogue.py
        lines.append(f"       ... and {p['entries_more']} more (the largest and the most recently used are shown; "
                     "`overmind-daemon ls` lists every one)")
    return "\n".join(lines)


def _entries_text(entries: Sequence[Mapping[str, Any]]) -> str:
    if not entries:
        return "no entries"
    # Nothing that tells entries apart is cut: the keys as long as it takes to tell them apart, the
    # labels whole (two loads of one model in two dtypes differ only at the end of the label).
    width = unique_prefix([e["key"] for e in entries])
    rows = [("KEY", "WHAT", "BYTES", "HITS", "USED BY", "STATE")]
    for e in entries:
        rows.append((e["key"][:width], str(e["meta"].get("label", "")), byte_text(e["bytes"]), str(e["hits"]),
                     ", ".join(kernel_name(k)[0] for k in e["pinned_by"]) or "-",
                     pending_text(e["pending"]) if e.get("pending") else "ready"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def unique_prefix(keys: list[str], least: int = 12) -> int:
    """The shortest prefix length, at least `least`, at which `keys` differ from one another."""
    width = least
    while width < max((len(k) for k in keys), default=0) and len({k[:width] for k in keys}) < len(set(keys)):
        width += 4
    return width


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "start": _start, "stop": _stop, "status": _read("status"), "ls": _read("ls"), "evict": _evict,
}
