"""Load: 4 kernel processes x 200 loads of 5 models through one daemon whose budget forces eviction.

Every load is bit-compared with a plain load of the same model (tests/faults_load.py), a sampler polls
the daemon's status throughout (used + reserved never above the budget), and the daemon must be the
same process at the end, with no traceback in its log. benchmarks/soak.py runs the same load for minutes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kernel_server import Client
from tests.helpers import faults_load


def test_four_kernels_load_at_random_through_a_full_budget(overmind_home: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    refs = faults_load.references()
    budget = faults_load.budget_for(refs)
    assert budget < sum(r["entry_bytes"] for r in refs.values()), "the budget must not hold every model"
    monkeypatch.setenv("OVERMIND_BUDGET", str(budget))
    with Client(overmind_home, role="test") as client:
        assert client.budget == budget
        result = faults_load.run_load(overmind_home, refs, workers=4, loads=200, timeout=240)
    print(json.dumps(result, indent=1))  # shown with -s, and on failure

    assert result["lost"] == [], "every load returned a model"
    assert result["loads"] == 800
    assert result["wrong"] == [], "a load returned tensors that differ from a plain load's"
    assert result["daemon"]["restarts"] == 0 and result["daemon"]["pid_after"] == client.daemon_pid
    assert result["daemon"]["tracebacks"] == 0, "the daemon logged a traceback"
    assert result["sampler_error"] is None
    assert result["budget_samples"] >= 100
    assert result["over_budget"] == [], "used + reserved went above the budget"
    assert result["max_used_plus_reserved"] <= budget and result["budgets_seen"] == [budget]
    stats = result["store"]["stats"]
    assert stats.get("evicted", 0) > 0, "the budget was meant to force eviction"
    assert result["hits"] > 200 and stats["hits"] == result["hits"]
    assert result["writes_in_place"] > 0, "hits written in place (copy-on-write) were part of the load"
    # The only fallback a healthy daemon may cause here is a full budget (entries pinned by live models).
    assert set(result["fallbacks"]) <= {"budget"}, result["fallback_reasons"]
