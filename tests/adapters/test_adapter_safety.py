"""An exception inside any gate context leaves the model and the gate clean."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from overmind_jupyter import adapters
from overmind_jupyter.adapters import BASE, GateClosedError, GateDeadlockError
from overmind_jupyter.adapters.routing import current_route, route
from overmind_jupyter.adapters.switching import ROUTED, KeyedSemaphore

from .adapter_models import CHOICES, hooks_on, serial_logits


class Boom(Exception):
    pass


def _clean(g: adapters.AdapterGate) -> None:
    state = g.state()
    assert state["in_flight"] == {} and state["queued"] == {} and not state["exclusive"]
    assert current_route() is None


def _answers_right(
    g: adapters.AdapterGate, model: Any, expected: dict[str, torch.Tensor], ids: torch.Tensor
) -> None:
    for c in CHOICES:
        assert torch.equal(g(input_ids=ids, adapter=c).logits, expected[c]), c


@pytest.fixture
def setup(peft_model: Any) -> Any:
    ids = torch.randint(2, 128, (1, 4))
    expected = {c: serial_logits(peft_model, c, input_ids=ids) for c in CHOICES}
    peft_model.set_adapter("fr")
    return peft_model, ids, expected


@pytest.mark.parametrize("mode", ["auto", "switched"])
def test_exception_inside_exclusive(setup: Any, mode: str) -> None:
    model, ids, expected = setup
    with adapters.gate(model, mode=mode) as g:
        hooks = hooks_on(model)
        with pytest.raises(Boom), g.exclusive():
            model.set_adapter("de")  # leave the model in another state than the gate set
            raise Boom
        _clean(g)
        assert hooks_on(model) == hooks
        _answers_right(g, model, expected, ids)


@pytest.mark.parametrize("mode", ["auto", "switched"])
def test_exception_inside_use(setup: Any, mode: str) -> None:
    model, ids, expected = setup
    with adapters.gate(model, mode=mode) as g:
        with pytest.raises(Boom), g.use("de"):
            raise Boom
        _clean(g)
        with g.exclusive():  # nothing is left holding the model
            pass
        _answers_right(g, model, expected, ids)


@pytest.mark.parametrize("mode", ["auto", "switched"])
def test_exception_inside_a_request(setup: Any, mode: str) -> None:
    model, ids, expected = setup
    bad = torch.tensor([[5, 999]])  # out of the vocabulary
    with adapters.gate(model, mode=mode) as g:
        with pytest.raises(IndexError):
            g(input_ids=bad, adapter="es")
        with pytest.raises(IndexError):
            g.generate(input_ids=bad, adapter=["fr"], max_new_tokens=2)
        with pytest.raises(IndexError):
            g(input_ids=torch.cat([bad, bad]), adapter=["fr", BASE])
        _clean(g)
        _answers_right(g, model, expected, ids)


def test_exception_inside_a_switch(setup: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    model, ids, expected = setup
    with adapters.gate(model, mode="switched") as g:
        real = g._host.set_active
        calls = []

        def failing_once(names: Any) -> None:  # a fault in our own code, not in torch or PEFT
            calls.append(names)
            if len(calls) == 1:
                raise Boom
            real(names)

        monkeypatch.setattr(g._host, "set_active", failing_once)
        with pytest.raises(Boom):
            g(input_ids=ids, adapter="de")
        _clean(g)
        assert g._sem.state()["applied"] is None
        _answers_right(g, model, expected, ids)


def test_exception_inside_route_and_hold() -> None:
    sem = KeyedSemaphore(lambda previous, key: None)
    with pytest.raises(Boom), route(["fr"]):
        assert current_route() == ("fr",)
        raise Boom
    assert current_route() is None
    with pytest.raises(Boom), sem.hold(ROUTED, ("fr",)):
        raise Boom
    assert sem.idle and sem.state()["in_flight"] == {}
    with pytest.raises(Boom), sem.exclusive():
        raise Boom
    assert sem.idle and not sem.state()["exclusive"]


def test_exception_inside_the_gate_context(setup: Any) -> None:
    model, _, _ = setup
    bare = hooks_on(model)
    with pytest.raises(Boom), adapters.gate(model) as g:
        assert hooks_on(model) > bare
        raise Boom
    assert g.closed and hooks_on(model) == bare


def test_failed_mix_leaves_no_partial_adapter(setup: Any) -> None:
    model, ids, expected = setup
    with adapters.gate(model) as g:
        hooks = hooks_on(model)
        with pytest.raises(ValueError):
            g.mix({"fr": 0.5, "de": "half"}, name="broken")  # type: ignore[dict-item]
        assert "broken" not in g.adapters and "broken" not in model.peft_config
        assert hooks_on(model) == hooks
        _clean(g)
        _answers_right(g, model, expected, ids)


def test_exclusive_inside_a_request_is_refused(setup: Any) -> None:
    model, ids, expected = setup
    with adapters.gate(model) as g:
        with g.use("fr"), pytest.raises(GateDeadlockError):
            g.delete_adapter("es")
        _clean(g)
        with g.exclusive(), g.exclusive():  # reentrant in its thread
            pass
        _answers_right(g, model, expected, ids)


def test_close_fails_waiting_requests(setup: Any) -> None:
    model, ids, _ = setup
    g = adapters.gate(model, mode="switched")
    holding, release = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    def holder() -> None:
        with g.use("fr"):
            holding.set()
            release.wait(10)

    def waiter() -> None:
        try:
            g(input_ids=ids, adapter="de")
            outcome["waiter"] = "answered"
        except GateClosedError as e:
            outcome["waiter"] = e

    threads = [threading.Thread(target=holder)]
    threads[0].start()
    assert holding.wait(10)
    threads.append(threading.Thread(target=waiter))
    threads[1].start()
    for _ in range(200):
        if g.state()["queued"]:
            break
        time.sleep(0.005)
    assert g.state()["queued"] == {"de": 1}
    closer = threading.Thread(target=g.close)
    closer.start()
    time.sleep(0.05)
    assert not g.closed  # close waits for the request in flight
    release.set()
    for t in [*threads, closer]:
        t.join(10)
    assert g.closed
    assert isinstance(outcome["waiter"], GateClosedError)
    assert model.active_adapter == "fr"


def test_close_inside_the_gate_contexts(setup: Any) -> None:
    model, ids, expected = setup
    bare = hooks_on(model)
    g = adapters.gate(model)
    with g.use("fr"), pytest.raises(GateDeadlockError):
        g.close()
    assert not g.closed
    _answers_right(g, model, expected, ids)
    with g.exclusive():
        g.close()  # from the exclusive side: allowed, and nothing is re-installed on the way out
    assert g.closed and hooks_on(model) == bare
