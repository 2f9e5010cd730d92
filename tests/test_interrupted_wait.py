"""A cell interrupted while it waits for another kernel's load of the same model (issue 38): its request and
everything the daemon would grant it go before the KeyboardInterrupt reaches the cell (Note [Interrupted
waits] in kernel_server/client.py).

The interrupted kernel is a real process, interrupted by a real SIGINT while it waits in `loading.cached`,
and it stays alive afterwards with its connection open, as a kernel does after an interrupted cell: its
connection's end would release everything anyway (docs/design.md invariant 5) and hide the leak.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kernel_server import Client
from overmind_jupyter import keys, loading, rebuild
from overmind_jupyter.errors import FallbackWarning
from tests.helpers import faults_helpers, tiny_modules
from tests.helpers.faults_helpers import Gate, digest, wait_until
from tests.helpers.snippets import at_a_call, start_py

# A kernel whose cell loads a model through the cache, is interrupted, and lives on: it says "waiting" once
# its lookup is sent, "interrupted" from the except clause (the cell), and holds its connection until stdin ends.
INTERRUPTED_KERNEL = """
    import sys
    from kernel_server.client import shared_client
    from overmind_jupyter import loading
    from tests.helpers import faults_helpers, tiny_modules

    shared_client()  # connected before the cell, as a kernel with overmind on
    {prelude}
    print("waiting", flush=True)
    try:
        loading.cached({fn}, "mlp", 42, width=64)
        print("loaded", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    sys.stdin.read()
"""


def waiters(client: Client) -> list[int]:
    return [load["waiters"] for load in client.request("status")["loading"]]


def interrupt_while_waiting(fn: str, watcher: Client, already_waiting: int, prelude: str = "") -> subprocess.Popen[str]:
    """Start a kernel that waits for the load in flight of `fn`'s model, SIGINT it once the daemon lists it
    among the waiters, and return it alive once its cell got the KeyboardInterrupt. `prelude` runs in
    the kernel before its cell."""
    kernel = start_py(INTERRUPTED_KERNEL.format(fn=fn, prelude=prelude), env=dict(os.environ))
    assert kernel.stdout is not None
    assert kernel.stdout.readline().strip() == "waiting", kernel.stderr.read() if kernel.stderr else ""
    wait_until(lambda: waiters(watcher) == [already_waiting + 1], 30, "the kernel waits for the load in flight")
    kernel.send_signal(signal.SIGINT)
    line = kernel.stdout.readline().strip()
    assert line == "interrupted", f"the cell said {line!r}: {kernel.stderr.read() if kernel.stderr else ''}"
    return kernel


def test_an_interrupted_wait_leaves_no_waiter_and_the_next_waiter_loads_when_the_loader_fails(
        overmind_home: Path, daemon: Client) -> None:
    """The loader fails (abandons) after a kernel waiting before a third one was interrupted: the third one
    is made the loader and loads, instead of the interrupted kernel, which would never load."""
    key = keys.make_key(tiny_modules.build, ("mlp", 42), {"width": 64}).key
    assert daemon.request("lookup", key=key, wait=False)["status"] == "load"  # the load in flight
    results: list[torch.nn.Module] = []
    third = threading.Thread(target=lambda: results.append(loading.cached(tiny_modules.build, "mlp", 42, width=64)))
    kernel = start_py(INTERRUPTED_KERNEL.format(fn="tiny_modules.build", prelude=""), env=dict(os.environ))
    try:
        assert kernel.stdout is not None and kernel.stdout.readline().strip() == "waiting"
        wait_until(lambda: waiters(daemon) == [1], 30, "the kernel waits for the load in flight")
        third.start()  # waits after the kernel: the kernel would be the next loader
        wait_until(lambda: waiters(daemon) == [2], 30, "the third kernel waits too")
        kernel.send_signal(signal.SIGINT)
        assert kernel.stdout.readline().strip() == "interrupted"
        assert waiters(daemon) == [1], "the interrupted kernel's wait is gone from the daemon before its cell goes on"

        daemon.request("abandon", key=key)  # the load fails
        third.join(30)
        assert not third.is_alive(), "the third kernel was served: it became the loader and loaded"
        assert len(results) == 1 and digest(results[0]) == digest(tiny_modules.build("mlp", 42, width=64))
        assert [e["key"] for e in daemon.request("ls")["entries"]] == [key]
        assert loading.fallbacks() == []
        assert kernel.poll() is None, "the interrupted kernel lives on with its connection"
    finally:
        kernel.kill()
        kernel.wait()
        third.join(5)


def test_an_interrupted_wait_takes_no_pin_when_the_load_succeeds(
        overmind_home: Path, daemon: Client, gate: Gate) -> None:
    """The loader publishes after the interrupt: the entry is pinned by nobody but the loader (its model), so
    that the budget can evict it once the loader lets it go; the interrupted kernel was not served a hit."""
    gate.close()
    loaded: list[torch.nn.Module] = []
    loader = threading.Thread(target=lambda: loaded.append(
        loading.cached(faults_helpers.gated_build, "mlp", 42, width=64)))
    loader.start()
    gate.wait_for("started")
    kernel = interrupt_while_waiting("faults_helpers.gated_build", daemon, already_waiting=0)
    try:
        assert waiters(daemon) == [0], "the interrupted kernel's wait is gone from the daemon before its cell goes on"
        gate.open()
        loader.join(60)
        assert len(loaded) == 1 and all(rebuild.entry_of(p.data_ptr()) is not None for p in loaded[0].parameters())
        [entry] = daemon.request("status")["entries"]
        assert [k["pid"] for k in entry["pinned_by"]] == [os.getpid()], "only the loader's model pins it"
        assert kernel.poll() is None, "the interrupted kernel lives on with its connection"
    finally:
        gate.open()
        kernel.kill()
        kernel.wait()
        loader.join(5)


def test_a_cell_interrupted_while_it_caches_leaves_no_load_in_flight(
        overmind_home: Path, daemon: Client, gate: Gate) -> None:
    """The user stops the cell after the load, while the miss caches its result (here: packing it): the
    load is given up before the KeyboardInterrupt reaches the cell, so no other kernel waits for it and
    its reservation is freed; the next call loads and caches."""
    gate.close()
    kernel = start_py(INTERRUPTED_KERNEL.format(fn="faults_helpers.packing_gated_build", prelude=""),
                      env=dict(os.environ))
    try:
        assert kernel.stdout is not None and kernel.stdout.readline().strip() == "waiting"
        gate.wait_for("packing")
        assert len(daemon.request("status")["loading"]) == 1
        kernel.send_signal(signal.SIGINT)
        line = kernel.stdout.readline().strip()
        assert line == "interrupted", f"the cell said {line!r}: {kernel.stderr.read() if kernel.stderr else ''}"
        status = daemon.request("status")
        assert status["loading"] == [] and status["reserved"] == 0, status["loading"]
        assert status["entries"] == []
        gate.open()
        model = loading.cached(faults_helpers.packing_gated_build, "mlp", 42, width=64)
        assert digest(model) == digest(tiny_modules.build("mlp", 42, width=64))
        assert len(daemon.request("status")["entries"]) == 1 and loading.fallbacks() == []
        assert kernel.poll() is None, "the interrupted kernel lives on with its connection"
    finally:
        gate.open()
        kernel.kill()
        kernel.wait()


# An interrupt that lands as the lookup is sent: the kernel sends itself SIGINT the moment `submit` of the
# lookup returns (a profile hook of the process, not a change to any of its code), as a real SIGINT did on a
# loaded machine, where the test's signal came while the kernel was still between the send and the wait.
AT_THE_SEND = """
import os, signal, sys
from kernel_server.client import Client

def _at_return(frame, event, arg):
    if event == "return" and frame.f_code is Client.submit.__code__ and frame.f_locals.get("op") == "lookup":
        sys.setprofile(None)
        os.kill(os.getpid(), signal.SIGINT)

sys.setprofile(_at_return)
"""


def test_an_interrupt_as_the_lookup_is_sent_still_withdraws_the_wait(overmind_home: Path, daemon: Client,
                                                                     gate: Gate) -> None:
    """Note [Interrupted waits]: a SIGINT that comes while the lookup is being sent (the daemon has it, the
    wait's protection is not in place yet) is held and raised inside the wait, which withdraws it: the
    daemon keeps no waiter that would never load."""
    gate.close()
    loader = threading.Thread(target=lambda: loading.cached(faults_helpers.gated_build, "mlp", 42, width=64))
    loader.start()
    gate.wait_for("started")
    prelude = "\n    ".join(AT_THE_SEND.strip().splitlines())
    kernel = start_py(INTERRUPTED_KERNEL.format(fn="faults_helpers.gated_build", prelude=prelude),
                      env=dict(os.environ))
    try:
        assert kernel.stdout is not None and kernel.stdout.readline().strip() == "waiting"
        line = kernel.stdout.readline().strip()
        assert line == "interrupted", f"the cell said {line!r}: {kernel.stderr.read() if kernel.stderr else ''}"
        time.sleep(0.5)  # a lookup left behind would be the daemon's waiter by now
        assert waiters(daemon) == [0], "the interrupted kernel's wait is gone from the daemon"
        assert kernel.poll() is None, "the interrupted kernel lives on with its connection"
    finally:
        gate.open()
        kernel.kill()
        kernel.wait()
        loader.join(60)


@contextlib.contextmanager
def interrupted_at(imports: str, code: str) -> Iterator[subprocess.Popen[str]]:
    """A kernel whose cell loads the model of `tiny_modules.build` through the cache and is interrupted as the
    function `code` is called: yielded once the cell got the KeyboardInterrupt, and checked alive after."""
    kernel = start_py(INTERRUPTED_KERNEL.format(fn="tiny_modules.build", prelude=at_a_call(imports, code)),
                      env=dict(os.environ))
    try:
        assert kernel.stdout is not None and kernel.stdout.readline().strip() == "waiting"
        line = kernel.stdout.readline().strip()
        assert line == "interrupted", f"the cell said {line!r}: {kernel.stderr.read() if kernel.stderr else ''}"
        yield kernel
        assert kernel.poll() is None, "the interrupted kernel lives on with its connection"
    finally:
        kernel.kill()
        kernel.wait()


def test_an_interrupt_between_the_lookup_and_the_load_leaves_no_load_in_flight(overmind_home: Path,
                                                                               daemon: Client) -> None:
    """Note [Interrupted caching] in loading.py: the daemon made the kernel the loader, and the cell is
    interrupted before the load starts (as the miss's stage is entered). The load is abandoned before the
    KeyboardInterrupt reaches the cell, so that another kernel asking for the model loads it at once, instead
    of waiting for a load that the interrupted kernel, alive and idle, never makes (OVERMIND_WAIT_TIMEOUT:
    ten minutes)."""
    with interrupted_at("from overmind_jupyter import staging", "staging.staged.__wrapped__.__code__"):
        assert daemon.request("status")["loading"] == [], "no load in flight for the interrupted kernel"


def test_an_interrupt_between_a_hits_answer_and_its_rebuild_keeps_no_pin(overmind_home: Path,
                                                                         daemon: Client) -> None:
    """Note [Interrupted caching] in loading.py: the daemon answered a hit (pinned, descriptors sent), and the
    cell is interrupted before the rebuild takes them: the pin goes back before the KeyboardInterrupt reaches
    the cell, so that the entry can still be evicted while the kernel lives."""
    loading.cached(tiny_modules.build, "mlp", 42, width=64)  # the entry
    with interrupted_at("from overmind_jupyter import loading", "loading._from_hit.__code__") as kernel:
        wait_until(lambda: all(kernel.pid not in [k["pid"] for k in e["pinned_by"]]
                               for e in daemon.request("ls")["entries"]), 5, "the interrupted hit's pin given back")


def test_a_wait_longer_than_the_wait_timeout_loads_plainly_and_says_what_ran_out(
        overmind_home: Path, daemon: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another kernel's load outlasts OVERMIND_WAIT_TIMEOUT: the call loads plainly, saying that the wait ran
    out after that long and which setting to raise; not that the daemon, which answered all along, did not
    answer "within 0 s"."""
    key = keys.make_key(tiny_modules.build, ("mlp", 42), {"width": 64}).key
    assert daemon.request("lookup", key=key, wait=False)["status"] == "load"  # a load in flight, never done
    monkeypatch.setattr(loading.options, "wait_timeout", 1.5)
    started = time.monotonic()
    with pytest.warns(FallbackWarning) as said:
        model = loading.cached(tiny_modules.build, "mlp", 42, width=64)
    assert 1.5 <= time.monotonic() - started < 30
    assert digest(model) == digest(tiny_modules.build("mlp", 42, width=64))
    [message] = [str(w.message) for w in said]
    assert "another kernel's load of it was still running after 1.5 s" in message, message
    assert "OVERMIND_WAIT_TIMEOUT" in message and "raise it" in message, message
    wait_until(lambda: waiters(daemon) == [0], 10, "its wait withdrawn from the daemon (the cancel is not waited for)")


def test_a_miss_that_waited_for_a_load_that_failed_says_how_long_it_waited(
        overmind_home: Path, daemon: Client, capsys: pytest.CaptureFixture[str]) -> None:
    """The kernel loading the model is killed (here: its load abandoned) while this one waits: this one loads,
    and its line says how much of the "caching" was that wait, not only that caching took seconds."""
    key = keys.make_key(tiny_modules.build, ("mlp", 42), {"width": 64}).key
    assert daemon.request("lookup", key=key, wait=False)["status"] == "load"  # the other kernel's load
    abandon = threading.Timer(1.5, lambda: daemon.request("abandon", key=key))
    abandon.start()
    try:
        model = loading.cached(tiny_modules.build, "mlp", 42, width=64)
    finally:
        abandon.join()
    assert digest(model) == digest(tiny_modules.build("mlp", 42, width=64))
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("overmind: cached")]
    waited = re.search(r"caching includes ([\d.]+) s of waiting for another load of it, which ended without a "
                       r"result\)$", line)
    assert waited is not None and 1.4 <= float(waited.group(1)) < 30, line


# An interrupt as the reply to the lookup is read: the kernel sends itself SIGINT the moment the socket hands it
# the body of the first frame read after the lookup is sent (a profile hook of the process on the C call
# `recv`, not a change to any of its code), as random Ctrl-Cs during hits did (2 in 800 in a stress run): the
# frame's bytes are out of the socket and not yet the request's reply.
AS_THE_REPLY_IS_READ = """
import os, signal, sys
from kernel_server import transport
from kernel_server.client import Client

_sent = []

def _at_the_reply(frame, event, arg):
    if event == "return" and frame.f_code is Client.submit.__code__ and frame.f_locals.get("op") == "lookup":
        _sent.append(True)
    elif (event == "c_return" and _sent and frame.f_code is transport._recv_exact.__code__
          and getattr(arg, "__name__", "") == "recv"):
        sys.setprofile(None)
        os.kill(os.getpid(), signal.SIGINT)

sys.setprofile(_at_the_reply)
"""


def assert_an_interrupted_hit_keeps_no_pin(daemon: Client, prelude: str) -> None:
    """A kernel's cell hits the entry of `tiny_modules.build`'s model, `prelude` (run in the kernel before the
    cell) interrupts it: the cell gets the KeyboardInterrupt, the kernel lives on with its connection, and
    the hit's pin is given back."""
    loading.cached(tiny_modules.build, "mlp", 42, width=64)  # the entry
    prelude = "\n    ".join(prelude.strip().splitlines())
    kernel = start_py(INTERRUPTED_KERNEL.format(fn="tiny_modules.build", prelude=prelude), env=dict(os.environ))
    try:
        assert kernel.stdout is not None and kernel.stdout.readline().strip() == "waiting"
        line = kernel.stdout.readline().strip()
        assert line == "interrupted", f"the cell said {line!r}: {kernel.stderr.read() if kernel.stderr else ''}"
        assert kernel.pid in [c["pid"] for c in daemon.request("status")["kernels"]], "its connection lives on"
        wait_until(lambda: all(kernel.pid not in [k["pid"] for k in e["pinned_by"]]
                               for e in daemon.request("ls")["entries"]), 5, "the interrupted hit's pin given back")
        assert kernel.poll() is None, "the interrupted kernel lives on with its connection"
    finally:
        kernel.kill()
        kernel.wait()


def test_an_interrupt_as_a_hits_reply_is_read_keeps_no_pin(overmind_home: Path, daemon: Client) -> None:
    """Note [Replies read whole] in kernel_server/client.py: a SIGINT that comes as the hit's reply is read
    (its bytes and descriptors taken from the socket, the frame not yet the lookup's reply) is held until the
    frame is the lookup's, then raised inside the wait's protection, which gives the pin back. Before, the
    reply was lost: the withdrawal waited 3 s for it, and the entry stayed pinned by the live connection for
    as long as the kernel lived (never evicted for the budget)."""
    assert_an_interrupted_hit_keeps_no_pin(daemon, AS_THE_REPLY_IS_READ)


# Two Ctrl-Cs: the first as the hit's reply is read (as in AS_THE_REPLY_IS_READ), which the withdrawal of the
# lookup answers by giving the reply's pin back; the second as that giving back sends its unpin.
AS_THE_REPLY_IS_READ_AND_GIVEN_BACK = """
import os, signal, sys
from kernel_server import transport
from kernel_server.client import Client

_seen = []

def _twice(frame, event, arg):
    if event == "return" and frame.f_code is Client.submit.__code__ and frame.f_locals.get("op") == "lookup":
        _seen.append("sent")
    elif (event == "c_return" and _seen == ["sent"] and frame.f_code is transport._recv_exact.__code__
          and getattr(arg, "__name__", "") == "recv"):
        _seen.append("read")
        os.kill(os.getpid(), signal.SIGINT)
    elif event == "call" and _seen == ["sent", "read"] and frame.f_code is Client._fire_and_forget.__code__:
        sys.setprofile(None)
        os.kill(os.getpid(), signal.SIGINT)

sys.setprofile(_twice)
"""


def test_a_second_interrupt_as_the_pin_is_given_back_keeps_no_pin(overmind_home: Path, daemon: Client) -> None:
    """Note [Interrupted waits]: the withdrawal of an interrupted hit gives its pin back with SIGINT held, so
    a second Ctrl-C that lands as it sends the unpin (after it took the reply's status out, which makes it
    run once) is raised after the unpin is sent. Before, the second KeyboardInterrupt cut it there, the reply
    left to the reader had nothing more to give back, and the entry stayed pinned by the live connection."""
    assert_an_interrupted_hit_keeps_no_pin(daemon, AS_THE_REPLY_IS_READ_AND_GIVEN_BACK)


# A kernel without helper threads (HF_DEACTIVATE_ASYNC_LOAD=1: its finalizers' unpins wait for its next load or
# cell, Note [Helper threads] in threads.py) drops the model it cached, and its next cell is interrupted as the
# unpin waiting in the queue is sent: the kernel sends itself SIGINT as `Client.submit` is called (`at_a_call`).
UNPIN_INTERRUPTED = """
    import gc
    from kernel_server.client import shared_client
    from overmind_jupyter import loading, results
    from tests.helpers import tiny_modules

    shared_client()  # connected before the cell, as a kernel with overmind on
    model = loading.cached(tiny_modules.build, "mlp", 42, width=64)
    del model
    gc.collect()  # its entry's unpin waits in the queue
    {interrupt}
    try:
        results.send_unpins()
        print("sent", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    sys.stdin.read()
"""


def test_a_ctrl_c_as_a_queued_unpin_is_sent_loses_no_unpin(overmind_home: Path, daemon: Client) -> None:
    """`results.send_unpins` took the unpin off its queue and the Ctrl-C landed before it was sent: the entry
    stayed pinned by the live kernel, never evicted for the budget. The unpin is now taken and sent with SIGINT
    held, and the KeyboardInterrupt still reaches the cell."""
    interrupt = at_a_call("from kernel_server.client import Client", "Client.submit.__code__")
    kernel = start_py(UNPIN_INTERRUPTED.format(interrupt=interrupt), env=dict(os.environ, HF_DEACTIVATE_ASYNC_LOAD="1"))
    try:
        assert kernel.stdout is not None
        line = kernel.stdout.readline().strip()
        assert line == "interrupted", f"the cell said {line!r}: {kernel.stderr.read() if kernel.stderr else ''}"
        assert kernel.pid in [c["pid"] for c in daemon.request("status")["kernels"]], "its connection lives on"
        assert len(daemon.request("ls")["entries"]) == 1
        wait_until(lambda: not daemon.request("ls")["entries"][0]["pinned_by"], 5, "the dropped model's unpin sent")
        assert kernel.poll() is None, "the interrupted kernel lives on with its connection"
    finally:
        kernel.kill()
        kernel.wait()
