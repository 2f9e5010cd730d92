"""A pytest plugin for the conformance run: the libraries' own tests, with the cache on or off.

Loaded with `-p plugin` (tests/conformance/run.py puts this directory on sys.path). Options:

- `--overmind-report PATH`: write a JSON report there at the end: each test's outcome, and with the cache
  on, how its loads went (`loading.calls()`) and the fallbacks' kinds and reasons.
- `--overmind`: run the session with the cache on, on a private daemon: `OVERMIND_HOME` is set to a fresh
  0700 temporary directory before any conftest or test module is imported,
  `overmind_jupyter.enable()` is called when the session starts, and the daemon is stopped and its
  directory removed when the session ends.

Outcomes: "passed", "failed" (the test's call failed, or one of its subtests did), "error" (its setup or
teardown failed), "skipped", "xfailed", "xpassed".
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

_RANK = {"passed": 0, "xpassed": 1, "skipped": 2, "xfailed": 3, "failed": 4, "error": 5}


class _Recorder:
    def __init__(self, cached: bool, report_path: str | None) -> None:
        self.cached = cached
        self.report_path = report_path
        self.home: Path | None = None
        self.outcomes: dict[str, str] = {}
        self.durations: dict[str, float] = {}
        self.calls_by_test: dict[str, dict[str, int]] = {}
        self.fallback_kinds: collections.Counter[str] = collections.Counter()
        self.fallback_reasons: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.fallbacks_by_test: dict[str, list[str]] = {}
        self._calls_before: dict[str, int] = {}
        self._last_fallback: dict[str, Any] | None = None
        self.enable_error: str | None = None
        self.started = time.monotonic()

    # -- the cache's session -------------------------------------------------------------------------

    def configure(self) -> None:
        if not self.cached:
            return
        self.home = Path(tempfile.mkdtemp(prefix="om-conf-", dir="/tmp"))  # short: the socket path limit
        os.chmod(self.home, 0o700)
        os.environ["OVERMIND_HOME"] = str(self.home)

    def start(self) -> None:
        if not self.cached:
            return
        import overmind_jupyter

        try:
            overmind_jupyter.enable()
        except Exception as exc:  # noqa: BLE001  (reported: a run whose cache never engaged must not pass)
            self.enable_error = f"{type(exc).__name__}: {exc}"

    def stop(self) -> None:
        if self.home is None:
            return
        try:
            import overmind_jupyter

            overmind_jupyter.disable()
        except Exception as exc:  # noqa: BLE001
            print(f"overmind conformance: disable() failed: {exc}", file=sys.stderr)
        from kernel_server.client import reset_shared_client

        reset_shared_client()
        _stop_daemon(self.home)
        shutil.rmtree(self.home, ignore_errors=True)

    # -- per test ------------------------------------------------------------------------------------

    def _loading(self) -> Any:
        return sys.modules.get("overmind_jupyter.loading") if self.cached else None

    def begin_test(self) -> None:
        loading = self._loading()
        if loading is not None:
            self._calls_before = loading.calls()
            seen = loading.fallbacks()
            self._last_fallback = seen[-1] if seen else None

    def end_test(self, nodeid: str) -> None:
        loading = self._loading()
        if loading is None:
            return
        after = loading.calls()
        delta = {k: after.get(k, 0) - self._calls_before.get(k, 0) for k in after}
        delta = {k: v for k, v in delta.items() if v}
        if delta:
            self.calls_by_test[nodeid] = delta
        # The newest fallbacks, after the last one seen before the test (the list keeps the newest 200:
        # a test with more has its reasons counted from those, and all its plain loads in `calls`).
        fallbacks = loading.fallbacks()
        start = 0
        for i in range(len(fallbacks) - 1, -1, -1):
            if fallbacks[i] is self._last_fallback:
                start = i + 1
                break
        kinds = set()
        for entry in fallbacks[start:]:
            self.fallback_kinds[entry["kind"]] += 1
            self.fallback_reasons[entry["kind"]][_reason(entry)] += 1
            kinds.add(entry["kind"])
        if kinds:
            self.fallbacks_by_test[nodeid] = sorted(kinds)

    def record(self, report: pytest.TestReport) -> None:
        nodeid = report.nodeid
        outcome = _outcome(report)
        if outcome is None:
            return
        previous = self.outcomes.get(nodeid)
        if previous is None or _RANK[outcome] > _RANK[previous]:
            self.outcomes[nodeid] = outcome
        if report.when == "call":
            self.durations[nodeid] = round(self.durations.get(nodeid, 0.0) + report.duration, 3)

    # -- the report ----------------------------------------------------------------------------------

    def write(self, exitstatus: int) -> None:
        if not self.report_path:
            return
        loading = self._loading()
        calls = loading.calls() if loading is not None else {}
        counts = collections.Counter(self.outcomes.values())
        report = {
            "cached": self.cached,
            "exitstatus": int(exitstatus),
            "wall_s": round(time.monotonic() - self.started, 1),
            "enable_error": self.enable_error,
            "totals": dict(sorted(counts.items())),
            "calls": {k: calls.get(k, 0) for k in ("hit", "miss", "plain")},
            "fallbacks": {
                kind: {"count": n, "reasons": dict(self.fallback_reasons[kind].most_common(5))}
                for kind, n in self.fallback_kinds.most_common()
            },
            "outcomes": dict(sorted(self.outcomes.items())),
            "calls_by_test": dict(sorted(self.calls_by_test.items())),
            "fallbacks_by_test": dict(sorted(self.fallbacks_by_test.items())),
            "durations": dict(sorted(self.durations.items())),
        }
        path = Path(self.report_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")


def _reason(entry: dict[str, Any]) -> str:
    """A fallback's reason without what differs from call to call (temporary paths, addresses)."""
    import re

    text = f"{entry['call']}: {entry['reason']}"
    text = re.sub(r"/tmp/[^\s'\",)]+", "/tmp/…", text)
    text = re.sub(r"0x[0-9a-f]+", "0x…", text)
    return text[:300]


def _outcome(report: pytest.TestReport) -> str | None:
    if hasattr(report, "wasxfail"):
        if report.skipped:
            return "xfailed"
        if report.passed:
            return "xpassed"
    if report.when == "call":
        return "passed" if report.passed else "failed" if report.failed else "skipped"
    if report.failed:
        return "error"
    if report.skipped:
        return "skipped"
    return None  # a setup or teardown that passed says nothing of the test


def _stop_daemon(home: Path) -> None:
    from kernel_server.lifecycle import kill_daemon

    kill_daemon(home)


# -- hooks -------------------------------------------------------------------------------------------

_recorder: _Recorder | None = None


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("overmind", "overmind_jupyter conformance run")
    group.addoption("--overmind", action="store_true", default=False,
                    help="run with overmind_jupyter's cache on, on a private daemon")
    group.addoption("--overmind-report", default=None, metavar="PATH",
                    help="write each test's outcome and the cache's counts there (JSON)")


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser, args: list[str]) -> None:
    """The first hook with the options parsed, before any conftest or test module is imported."""
    global _recorder
    options = early_config.known_args_namespace
    _recorder = _Recorder(bool(options.overmind), options.overmind_report)
    _recorder.configure()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    assert _recorder is not None
    _recorder.start()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    assert _recorder is not None
    _recorder.begin_test()
    try:
        return (yield)
    finally:
        _recorder.end_test(item.nodeid)


class _AlwaysSeen(collections.defaultdict):  # type: ignore[type-arg]
    """PEFT's record of the hub ids its tests have fetched, claiming every id: see _offline_peft."""

    def __contains__(self, key: object) -> bool:
        return True


def _offline_peft() -> None:
    """PEFT's `hub_online_once` goes online for the first load of each hub id, even with HF_HUB_OFFLINE=1
    (it patches the flag off), and only then offline. This run is offline: with every id taken as fetched
    already, PEFT's tests load from the local cache (hub_standins.py) without trying the network."""
    testing_utils = sys.modules.get("tests.testing_utils")
    if testing_utils is not None and isinstance(getattr(testing_utils, "_HUB_MODEL_ACCESSES", None), dict):
        testing_utils._HUB_MODEL_ACCESSES = _AlwaysSeen(int)


def pytest_collection_finish(session: pytest.Session) -> None:
    _offline_peft()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _recorder is not None:
        _recorder.record(report)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    assert _recorder is not None
    try:
        _recorder.write(exitstatus)
    finally:
        _recorder.stop()
