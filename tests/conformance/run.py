"""The conformance run: the libraries' own tests, with overmind_jupyter's cache on, against their outcomes
without it.

    .venv/bin/python tests/conformance/run.py check     # CI (make conformance): run with the cache, compare
    .venv/bin/python tests/conformance/run.py check --group peft-decoders   # one group of selection.py
    .venv/bin/python tests/conformance/run.py record    # after a library upgrade: rewrite expected.json

`record` runs the selection (selection.py) without the cache and writes each test's outcome to
`expected.json` (committed); it then runs it once with the cache to measure the hits, and writes half of
them, in all and per group, as the least a `check` must reach (`record --no-run` rewrites expected.json
from the last run's reports). `check` runs the selection with the cache and fails (exit 1) on:

- a regression: a test that passed without the cache and did not pass with it, unless `allowed.json`
  lists it with the reason;
- fewer hits than `min_hits` in expected.json (in all, or in a group): a run in which the cache never
  engaged cannot pass; nor can a group in which no load went through the cache at all;
- more loads of a group falling back to the plain call than expected.json recorded with the cache, or
  fewer hits (by more than `CALLS_SLACK`): a load the cache no longer takes, or no longer finds, changes
  no test's outcome (`record` refuses a new baseline with more plain loads, unless told
  `--allow-more-plain`);
- a selection that no longer matches: more than `TOLERANCE` of the tests differ from expected.json's
  (a library upgrade: run `record` again);
- a group whose pytest did not finish (an internal error, an interruption, the group's time limit).

Both fetch first (fetch.py; nothing is downloaded once fetched) and build the hub stand-ins
(hub_standins.py). Each group runs in its own pytest process, two at a time, offline (`HF_HUB_OFFLINE=1`,
`TRANSFORMERS_OFFLINE=1`, `HF_DATASETS_OFFLINE=1`), with `HF_HOME` and `HF_HUB_CACHE` in
`.conformance-cache/`, `-p no:cacheprovider`, and pytest-timeout's limit per test. Each group's pytest
output is in `.conformance-cache/reports/GROUP-{plain,cached}.log`, its report (plugin.py) beside it.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import fetch  # noqa: E402
import hub_standins  # noqa: E402
import selection  # noqa: E402

EXPECTED = HERE / "expected.json"
ALLOWED = HERE / "allowed.json"
PER_TEST_TIMEOUT = 120  # seconds, pytest-timeout
GROUP_TIMEOUT = 900  # seconds, a whole group's pytest process
HIT_FRACTION = 0.5  # of the hits `record` observed: the least a `check` must reach
TOLERANCE = 0.02  # of the expected tests that may be missing from the run or new in it (at least 10)
CALLS_SLACK = 2  # plain loads more, or hits fewer, than recorded that a group may have
PASSING = {"passed"}
REGRESSIONS_SHOWN = 40  # printed; all are written to REGRESSIONS_FILE
REGRESSIONS_FILE = fetch.CACHE / "reports" / "regressions.tsv"


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OVERMIND_", "PYTEST_")) and k not in ("PYTHONPATH", "HF_TOKEN")}
    env.update({
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(fetch.CACHE / "hf-home"),
        "HF_HUB_CACHE": str(fetch.CACHE / "hub"),
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",  # two groups at a time on two cores
        "MKL_NUM_THREADS": "1",
    })
    return env


def prepare() -> dict[str, str]:
    """Fetch (idempotent), build the hub stand-ins, put the transformers binding into its tree."""
    records = fetch.fetch_all()
    hub_standins.build(fetch.CACHE / "hub")
    binding = fetch.tree("transformers") / "overmind"
    binding.mkdir(exist_ok=True)
    shutil.copyfile(HERE / "transformers_models.py", binding / "transformers_models.py")
    (fetch.CACHE / "pytest.ini").write_text(
        "# the conformance run's pytest configuration (tests/conformance/run.py): the libraries' own\n"
        "# configurations are not in their sdists' tests/, and this project's pyproject.toml is not theirs\n"
        "[pytest]\naddopts =\n")
    return {name: str(record["version"]) for name, record in records.items()}


def _run_group(group: selection.Group, cached: bool, reports: Path) -> dict[str, Any]:
    root = fetch.tree(group.library)
    report = reports / f"{group.name}-{'cached' if cached else 'plain'}.json"
    log = reports / f"{group.name}-{'cached' if cached else 'plain'}.log"
    command = [sys.executable, "-m", "pytest", "-c", str(fetch.CACHE / "pytest.ini"), "--rootdir", str(root),
               "-p", "no:cacheprovider", "-p", "plugin", "--overmind-report", str(report),
               "--timeout", str(PER_TEST_TIMEOUT), "-q", "-rN", "--no-header"]
    if cached:
        command.append("--overmind")
    if group.keyword:
        command += ["-k", group.keyword]
    command += list(group.paths)
    report.unlink(missing_ok=True)
    env = _environment()
    env["PYTHONPATH"] = os.pathsep.join([str(fetch.site_dir()), str(HERE), str(root)])
    started = time.monotonic()
    with log.open("w") as out:
        try:
            proc = subprocess.run(command, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=GROUP_TIMEOUT, check=False)
            status: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            status = f"killed after {GROUP_TIMEOUT} s"
    result: dict[str, Any] = {"group": group.name, "library": group.library, "status": status, "log": str(log),
                              "wall_s": round(time.monotonic() - started, 1)}
    if report.exists():
        result["report"] = json.loads(report.read_text())
    return result


def _reports() -> Path:
    reports = fetch.CACHE / "reports"
    reports.mkdir(parents=True, exist_ok=True)
    return reports


def run_selection(groups: list[selection.Group], cached: bool, jobs: int) -> list[dict[str, Any]]:
    reports = _reports()
    print(f"conformance: running {len(groups)} groups {'with' if cached else 'without'} the cache, "
          f"{jobs} at a time (logs in {reports})", flush=True)
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(_run_group, group, cached, reports) for group in groups]
        results = []
        for future in concurrent.futures.as_completed(futures):
            result = future.result()
            totals = result.get("report", {}).get("totals", {})
            print(f"  {result['group']}: pytest exit {result['status']}, {sum(totals.values())} tests "
                  f"{dict(totals)}, {result['wall_s']} s", flush=True)
            results.append(result)
    order = [g.name for g in groups]
    return sorted(results, key=lambda r: order.index(r["group"]))


def read_reports(groups: list[selection.Group], cached: bool) -> list[dict[str, Any]]:
    """The reports the last run left, as run_selection returns them (for `record --no-run`)."""
    results = []
    for group in groups:
        report = _reports() / f"{group.name}-{'cached' if cached else 'plain'}.json"
        if not report.exists():
            raise SystemExit(f"conformance: no report {report}: run `record` without --no-run")
        data = json.loads(report.read_text())
        results.append({"group": group.name, "library": group.library, "status": data["exitstatus"],
                        "log": str(report.with_suffix(".log")), "wall_s": data["wall_s"], "report": data})
    return results


def _finished(result: dict[str, Any]) -> bool:
    """pytest ran to its end: exit 0 (all passed) or 1 (some failed), and the report was written."""
    return result["status"] in (0, 1) and "report" in result


def _outcomes(results: list[dict[str, Any]]) -> dict[str, str]:
    out = {}
    for result in results:
        for nodeid, outcome in result.get("report", {}).get("outcomes", {}).items():
            out[f"{result['library']}/{nodeid}"] = outcome
            _GROUP_OF[f"{result['library']}/{nodeid}"] = result["group"]
    return out


def _calls(results: list[dict[str, Any]]) -> dict[str, int]:
    total: collections.Counter[str] = collections.Counter()
    for result in results:
        total.update(result.get("report", {}).get("calls", {}))
    return {k: total.get(k, 0) for k in ("hit", "miss", "plain")}


def _fallbacks(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    kinds: dict[str, dict[str, Any]] = {}
    for result in results:
        for kind, entry in result.get("report", {}).get("fallbacks", {}).items():
            mine = kinds.setdefault(kind, {"count": 0, "reasons": collections.Counter()})
            mine["count"] += entry["count"]
            mine["reasons"].update(entry["reasons"])
    return {k: {"count": v["count"], "reasons": dict(v["reasons"].most_common(6))}
            for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]["count"])}


def _per_library(outcomes: dict[str, str]) -> dict[str, collections.Counter[str]]:
    table: dict[str, collections.Counter[str]] = {name: collections.Counter() for name in selection.LIBRARIES}
    for nodeid, outcome in outcomes.items():
        table[nodeid.split("/", 1)[0]][outcome] += 1
    return table


def _allowed() -> dict[str, str]:
    if not ALLOWED.exists():
        return {}
    data = json.loads(ALLOWED.read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}


def compare(expected: dict[str, str], actual: dict[str, str], allowed: dict[str, str]) -> dict[str, list[str]]:
    """regressions: passed without the cache, not with it (and not allowed); allowed: those allowed;
    fixed: did not pass without, passes with; missing / new: in one run and not the other."""
    out: dict[str, list[str]] = {"regressions": [], "allowed": [], "fixed": [], "missing": [], "new": []}
    for nodeid, before in expected.items():
        after = actual.get(nodeid)
        if after is None:
            out["missing"].append(nodeid)
        elif before in PASSING and after not in PASSING:
            out["allowed" if nodeid in allowed else "regressions"].append(nodeid)
        elif before not in PASSING and after in PASSING:
            out["fixed"].append(nodeid)
    out["new"] = sorted(set(actual) - set(expected))
    return out


def _print_table(plain: dict[str, str], cached: dict[str, str]) -> None:
    """Tests, and how many passed without and with the cache, by group and by library."""
    print(f"  {'group':<34} {'tests':>6} {'passed without':>15} {'passed with':>12}")
    for group in selection.GROUPS:
        ids = [n for n in plain if _group_of(n) == group.name]
        if ids:
            print(f"  {group.name + ' (' + group.library + ')':<34} {len(ids):>6} "
                  f"{sum(plain[n] in PASSING for n in ids):>15} {sum(cached.get(n) in PASSING for n in ids):>12}")
    for library in selection.LIBRARIES:
        ids = [n for n in plain if n.startswith(f"{library}/")]
        note = "" if ids else "   (its sdist ships no tests: see selection.py)"
        print(f"  {'all of ' + library:<34} {len(ids):>6} {sum(plain[n] in PASSING for n in ids):>15} "
              f"{sum(cached.get(n) in PASSING for n in ids):>12}{note}")
    print(f"  {'total':<34} {len(plain):>6} {sum(v in PASSING for v in plain.values()):>15} "
          f"{sum(cached.get(n) in PASSING for n in plain):>12}")


_GROUP_OF: dict[str, str] = {}  # node id -> group name, filled as outcomes are read


def _group_of(nodeid: str) -> str:
    return _GROUP_OF.get(nodeid, "")


def _print_cache(calls: dict[str, int], fallbacks: dict[str, dict[str, Any]], min_hits: int | None) -> None:
    need = f" (at least {min_hits} required)" if min_hits is not None else ""
    print(f"  cache: {calls['hit']} hits{need}, {calls['miss']} misses, {calls['plain']} plain loads")
    for kind, entry in fallbacks.items():
        print(f"  fallback {kind}: {entry['count']}")
        for reason, n in entry["reasons"].items():
            print(f"      {n} x {reason[:200]}")


def _failures(results: list[dict[str, Any]]) -> list[str]:
    problems = []
    for result in results:
        if not _finished(result):
            problems.append(f"group {result['group']} did not finish (pytest exit {result['status']}); "
                            f"see {result['log']}")
        report = result.get("report", {})
        if report.get("enable_error"):
            problems.append(f"group {result['group']}: overmind_jupyter.enable() failed: {report['enable_error']}")
        if report.get("cached") and not sum(report.get("calls", {}).values()):
            problems.append(f"group {result['group']}: no load went through the cache (no hit, miss or plain "
                            "load): the patches never engaged")
    return problems


def _recorded_calls(result: dict[str, Any], document: dict[str, Any]) -> dict[str, int]:
    """The calls expected.json recorded with the cache for `result`'s group."""
    return document["groups"].get(result["group"], {}).get("with_cache", {}).get("calls", {})


def _more_plain_loads(result: dict[str, Any], document: dict[str, Any]) -> list[str]:
    """A group whose loads fall back to the plain call more often than when expected.json was recorded
    (beyond `CALLS_SLACK`): loads the cache took then and gives up now, which no test's outcome shows."""
    recorded = _recorded_calls(result, document)
    if "plain" not in recorded:
        return []
    calls = result.get("report", {}).get("calls", {})
    got = calls.get("plain", 0)
    allowed = recorded["plain"] + CALLS_SLACK
    if got <= allowed:
        return []
    reasons = collections.Counter({f"{kind}: {reason}": n
                                   for kind, entry in result.get("report", {}).get("fallbacks", {}).items()
                                   for reason, n in entry.get("reasons", {}).items()})
    named = "; ".join(f"{n} x {reason[:160]}" for reason, n in reasons.most_common(3))
    return [f"group {result['group']}: {got} loads fell back to the plain call, {recorded['plain']} when "
            f"expected.json was recorded (the most frequent reasons now: {named})"]


def _fewer_hits(result: dict[str, Any], document: dict[str, Any]) -> list[str]:
    """A group with fewer hits than when expected.json was recorded (beyond `CALLS_SLACK`): loads that
    were hits miss now, which no test's outcome shows either (a key that no longer finds its entry)."""
    recorded = _recorded_calls(result, document)
    got = result.get("report", {}).get("calls", {}).get("hit", 0)
    if "hit" not in recorded or got >= recorded["hit"] - CALLS_SLACK:
        return []
    return [f"group {result['group']}: {got} hits, {recorded['hit']} when expected.json was recorded: loads "
            "that were hits miss now"]


def _groups(names: list[str] | None) -> list[selection.Group]:
    if not names:
        return list(selection.GROUPS)
    known = {g.name: g for g in selection.GROUPS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"conformance: no group {unknown}; the groups are {sorted(known)}")
    return [known[n] for n in names]


def record(jobs: int, run: bool = True, allow_more_plain: bool = False) -> int:
    versions = prepare()
    groups = list(selection.GROUPS)
    if run:
        plain = run_selection(groups, cached=False, jobs=jobs)
        cached = run_selection(groups, cached=True, jobs=jobs)
    else:
        plain, cached = read_reports(groups, cached=False), read_reports(groups, cached=True)
    problems = _failures(plain) + _failures(cached)
    if EXPECTED.exists() and not allow_more_plain:  # a new baseline must not hide loads the cache gave up
        before = json.loads(EXPECTED.read_text())
        more = [p for result in cached for p in _more_plain_loads(result, before)]
        if more:
            problems += [*more, "expected.json is left as it was: if a library's new release is why (a call it "
                                "now makes that has no canonical form, say), record again with --allow-more-plain"]
    if problems:
        print("\n".join(["conformance record: FAILED", *problems]))
        return 1
    expected = _outcomes(plain)
    with_cache = _outcomes(cached)
    calls = _calls(cached)
    diff = compare(expected, with_cache, _allowed())
    by_group = {r["group"]: r for r in cached}
    document = {
        "_": "Outcomes of the conformance selection without overmind_jupyter's cache; written by "
             "`tests/conformance/run.py record`, read by `check`. Do not edit: re-record.",
        "versions": versions,
        "min_hits": int(calls["hit"] * HIT_FRACTION),
        "groups": {
            g.name: {
                "library": g.library, "paths": list(g.paths), "keyword": g.keyword,
                "min_hits": int(by_group[g.name]["report"]["calls"]["hit"] * HIT_FRACTION),
                "with_cache": {"calls": by_group[g.name]["report"]["calls"], "wall_s": by_group[g.name]["wall_s"]},
                "without_cache": {"wall_s": next(r["wall_s"] for r in plain if r["group"] == g.name)},
            } for g in groups},
        "recorded_with_cache": {"calls": calls, "fallbacks": _fallbacks(cached),
                                "differences": {k: v for k, v in diff.items() if v and k != "fixed"}},
        "totals": {name: dict(sorted(c.items())) for name, c in _per_library(expected).items()},
        "outcomes": {r["group"]: dict(sorted(_outcomes([r]).items())) for r in plain},
    }
    EXPECTED.write_text(json.dumps(document, indent=1) + "\n")
    print(f"conformance record: wrote {EXPECTED} ({len(expected)} tests)")
    _print_table(expected, with_cache)
    _print_cache(calls, _fallbacks(cached), document["min_hits"])
    for nodeid in diff["regressions"]:
        print(f"  differs with the cache: {nodeid} ({expected[nodeid]} -> {with_cache.get(nodeid)}): "
              "a regression for check, unless allowed.json explains it")
    return 0


def _print_differences(diff: dict[str, list[str]], expected: dict[str, str], actual: dict[str, str],
                       allowed: dict[str, str]) -> None:
    """The outcomes that differ from expected.json: allowed, fixed, and the first regressions."""
    for nodeid in diff["allowed"]:
        print(f"  allowed: {nodeid} ({expected[nodeid]} -> {actual[nodeid]}): {allowed[nodeid]}")
    for nodeid in sorted(set(allowed) - set(diff["allowed"])):
        if nodeid in expected:
            print(f"  note: allowed.json lists {nodeid}, which did not differ this time")
    if diff["fixed"]:
        print(f"  {len(diff['fixed'])} tests that did not pass without the cache passed with it")
    print(f"  regressions: {len(diff['regressions'])}")
    for nodeid in diff["regressions"][:REGRESSIONS_SHOWN]:
        print(f"    REGRESSION {nodeid}: {expected[nodeid]} without the cache, {actual[nodeid]} with it")
    if len(diff["regressions"]) > REGRESSIONS_SHOWN:
        print(f"    ... and {len(diff['regressions']) - REGRESSIONS_SHOWN} more (all in {REGRESSIONS_FILE})")


def check(jobs: int, names: list[str] | None = None) -> int:
    if not EXPECTED.exists():
        print(f"conformance: {EXPECTED} is missing: run `{sys.executable} {__file__} record` first")
        return 1
    document = json.loads(EXPECTED.read_text())
    groups = _groups(names)
    versions = prepare()
    started = time.monotonic()
    cached = run_selection(groups, cached=True, jobs=jobs)
    wall = time.monotonic() - started
    expected: dict[str, str] = {}
    for group in groups:
        expected.update(document["outcomes"].get(group.name, {}))
        _GROUP_OF.update(dict.fromkeys(document["outcomes"].get(group.name, {}), group.name))
    actual = _outcomes(cached)
    allowed = _allowed()
    diff = compare(expected, actual, allowed)
    calls = _calls(cached)
    problems = _failures(cached)
    whole = len(groups) == len(selection.GROUPS)
    min_hits = int(document["min_hits"]) if whole else sum(
        int(document["groups"].get(g.name, {}).get("min_hits", 0)) for g in groups)

    print(f"conformance check: {', '.join(f'{k} {v}' for k, v in versions.items())}; "
          f"{len(groups)} of {len(selection.GROUPS)} groups; {wall:.0f} s")
    _print_table(expected, actual)
    _print_cache(calls, _fallbacks(cached), min_hits)
    if calls["hit"] < min_hits:
        problems.append(f"{calls['hit']} cache hits, fewer than the {min_hits} required: the cache did not "
                        "engage as it did when expected.json was recorded")
    for result in cached:
        need = int(document["groups"].get(result["group"], {}).get("min_hits", 0))
        got = result.get("report", {}).get("calls", {}).get("hit", 0)
        if got < need:
            problems.append(f"group {result['group']}: {got} hits, fewer than its {need}")
        problems += _more_plain_loads(result, document) + _fewer_hits(result, document)
    if versions != document["versions"]:
        print(f"  note: expected.json was recorded with {document['versions']}, this is {versions}")
    changed = len(diff["missing"]) + len(diff["new"])
    if changed > max(10, TOLERANCE * len(expected)):
        problems.append(f"the selection changed: {len(diff['missing'])} expected tests did not run, "
                        f"{len(diff['new'])} ran that expected.json lacks (a library upgrade?): run "
                        "`.venv/bin/python tests/conformance/run.py record` and commit expected.json")
    elif changed:
        print(f"  {len(diff['missing'])} expected tests did not run, {len(diff['new'])} are new (within tolerance)")
    _print_differences(diff, expected, actual, allowed)
    REGRESSIONS_FILE.write_text("".join(f"{n}\t{expected[n]}\t{actual[n]}\n" for n in diff["regressions"]))
    if diff["regressions"]:
        problems.append(f"{len(diff['regressions'])} tests pass without the cache and not with it (their "
                        f"tracebacks: {fetch.CACHE / 'reports'}/GROUP-cached.log)")
    if problems:
        print("conformance: FAILED\n" + "\n".join(f"  - {p}" for p in problems))
        return 1
    print(f"conformance: OK: {sum(1 for v in actual.values() if v in PASSING)} passed with the cache, "
          f"no regression, {calls['hit']} hits")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("check", "record"))
    parser.add_argument("--jobs", type=int, default=2, help="groups run at once (default 2)")
    parser.add_argument("--group", action="append", metavar="NAME",
                        help="check: only this group of selection.py (repeatable; default all)")
    parser.add_argument("--no-run", action="store_true",
                        help="record: rewrite expected.json from the last run's reports, running nothing")
    parser.add_argument("--allow-more-plain", action="store_true",
                        help="record: write expected.json even where a group falls back to the plain call "
                             "more often than the last recording")
    args = parser.parse_args(argv)
    if args.command == "record":
        if args.group:
            parser.error("record runs every group")
        return record(args.jobs, run=not args.no_run, allow_more_plain=args.allow_more_plain)
    return check(args.jobs, args.group)


if __name__ == "__main__":
    sys.exit(main())
