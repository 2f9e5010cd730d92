"""Every generation setting that depends on the prompt's length or position, through the batching engine, on
rows of different lengths: each request gets the tokens of a solo `generate` with the same arguments.

The reference is serial PEFT without the gate: a second copy of the model (same seeds, same weights), one
request at a time, its adapter set by PEFT's own `set_adapter`. Every row of the table also says what the
engine must decide (coalesce, or run the request alone: Note [Settings in a batch] in
overmind_jupyter/adapters/batchable.py), checks that the setting changes some solo answer (so that the row can
see a bug), and, for the settings the engine maps onto each row, that a naive left-padded batch of the same
requests does differ from the solo runs (what issue 20 saw with `min_length`). fp32.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from overmind_jupyter import adapters

from .adapter_models import CHOICES, build_peft, serial_generate

LENGTHS = (1, 2, 4, 4, 6, 7, 9, 9)  # one-row requests; a two-row request with its own padding comes last


@dataclass
class Workload:
    gated: Any
    twin: Any  # the reference: same weights, no gate
    requests: list[dict[str, Any]]  # input_ids (and attention_mask), adapter, max_new_tokens
    eos: int  # a token the model produces early: the end-of-sequence token of the rows that need one
    first: int  # the token most rows produce first


def _requests() -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(11)
    out: list[dict[str, Any]] = []
    for i, length in enumerate(LENGTHS):
        ids = torch.randint(2, 128, (1, length), generator=gen)
        out.append({"input_ids": ids, "adapter": CHOICES[i % len(CHOICES)], "max_new_tokens": 4 + i % 3})
    ids = torch.randint(2, 128, (2, 5), generator=gen)
    ids[0, :2] = 0  # the request's own left padding
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    out.append({"input_ids": ids, "attention_mask": mask, "adapter": "de", "max_new_tokens": 5})
    return out


@pytest.fixture(scope="module")
def workload() -> Workload:
    gated, twin = build_peft(), build_peft()
    requests = _requests()
    firsts: Counter[int] = Counter()
    early: Counter[int] = Counter()
    for r in requests:
        out = _solo(twin, r, {"max_new_tokens": 6})
        new = out[:, r["input_ids"].shape[1] :]
        firsts.update(new[:, 0].tolist())
        early.update(new[:, :3].flatten().tolist())
    return Workload(gated, twin, requests, eos=early.most_common(1)[0][0], first=firsts.most_common(1)[0][0])


def _inputs(request: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in request.items() if k in ("input_ids", "attention_mask")}


def _solo(model: Any, request: dict[str, Any], options: dict[str, Any]) -> Any:
    return serial_generate(model, request["adapter"], **_inputs(request), **options)


def _options(request: dict[str, Any], row: Row, w: Workload) -> dict[str, Any]:
    options = dict(row.kwargs(w))
    if not row.no_max_new and "max_length" not in options:
        options.setdefault("max_new_tokens", request["max_new_tokens"])
    return options


@dataclass
class Row:
    """One setting: the request's keyword arguments, a change of the model's generation config, what the engine
    must decide, and what the row checks besides the equality with solo runs."""

    kwargs: Callable[[Workload], dict[str, Any]]
    decision: str  # "batched": at least one batch of several rows; "alone": every request alone
    config: Callable[[Workload], dict[str, Any]] = field(default=lambda w: {})
    matters: bool = True  # the setting changes some solo answer
    naive_differs: bool = False  # a naive left-padded batch gives some other answer
    alone_because: str = ""  # a word of the engine's reason (state()["engine"]["alone_why"])
    no_max_new: bool = False


class CountingProcessor:
    """A logits processor that reads the current length: it bans the end-of-sequence token at even lengths."""

    def __init__(self, eos: int) -> None:
        self.eos = eos

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] % 2 == 0:
            scores = scores.clone()
            scores[:, self.eos] = -float("inf")
        return scores


def _processor(w: Workload) -> dict[str, Any]:
    from transformers import LogitsProcessorList

    return {"logits_processor": LogitsProcessorList([CountingProcessor(w.eos)])}


def _criteria(w: Workload) -> dict[str, Any]:
    from transformers import StoppingCriteriaList
    from transformers.generation.stopping_criteria import MaxLengthCriteria

    return {"stopping_criteria": StoppingCriteriaList([MaxLengthCriteria(max_length=8)]), "max_new_tokens": 6}


TABLE: dict[str, Row] = {
    "min_length": Row(lambda w: {"min_length": 6, "eos_token_id": w.eos}, "batched", naive_differs=True),
    "min_length in generation_config": Row(
        lambda w: {}, "batched", config=lambda w: {"min_length": 6, "eos_token_id": w.eos}, naive_differs=True
    ),
    "min_length with min_new_tokens": Row(
        lambda w: {"min_length": 9, "min_new_tokens": 2, "eos_token_id": w.eos}, "batched"
    ),
    "min_new_tokens": Row(lambda w: {"min_new_tokens": 3, "eos_token_id": w.eos}, "batched"),
    "max_length": Row(lambda w: {"max_length": 11}, "batched", naive_differs=True, no_max_new=True),
    "max_length in generation_config": Row(
        lambda w: {}, "batched", config=lambda w: {"max_length": 12}, naive_differs=True, no_max_new=True
    ),
    "exponential_decay_length_penalty": Row(
        lambda w: {"exponential_decay_length_penalty": (1, 3.0), "eos_token_id": w.eos}, "batched"
    ),
    "begin_suppress_tokens": Row(lambda w: {"begin_suppress_tokens": [w.first]}, "batched"),
    "forced_bos_token_id": Row(lambda w: {"forced_bos_token_id": 5}, "batched", naive_differs=True),
    "forced_bos_token_id with begin_suppress_tokens": Row(
        lambda w: {"forced_bos_token_id": 5, "begin_suppress_tokens": [w.first]}, "batched"
    ),
    "suppress_tokens": Row(lambda w: {"suppress_tokens": [w.first, w.eos]}, "batched"),
    "forced_eos_token_id": Row(lambda w: {"forced_eos_token_id": w.eos}, "batched", naive_differs=True),
    "repetition_penalty": Row(lambda w: {"repetition_penalty": 3.0}, "batched"),
    "no_repeat_ngram_size": Row(lambda w: {"no_repeat_ngram_size": 1}, "batched"),
    "sequence_bias": Row(lambda w: {"sequence_bias": {(w.first,): -20.0}}, "batched"),
    "bad_words_ids": Row(lambda w: {"bad_words_ids": [[w.first]]}, "batched"),
    "encoder_repetition_penalty": Row(lambda w: {"encoder_repetition_penalty": 0.2}, "batched"),
    "renormalize_logits": Row(lambda w: {"renormalize_logits": True}, "batched", matters=False),
    "sampling settings under greedy": Row(
        lambda w: {"do_sample": False, "temperature": 0.3, "top_k": 3}, "batched", matters=False
    ),
    "use_cache off": Row(lambda w: {"use_cache": False}, "batched", matters=False),
    "logits_processor": Row(_processor, "alone", alone_because="logits_processor"),
    "stopping_criteria": Row(_criteria, "alone", alone_because="stopping_criteria"),
    "return_dict_in_generate with scores": Row(
        lambda w: {"return_dict_in_generate": True, "output_scores": True},
        "alone",
        matters=False,
        alone_because="output_scores",
    ),
    "num_beams": Row(lambda w: {"num_beams": 2}, "alone", alone_because="beam"),
    "no length at all": Row(lambda w: {}, "alone", matters=False, alone_because="length", no_max_new=True),
}


@contextlib.contextmanager
def _configured(w: Workload, changes: dict[str, Any]) -> Iterator[None]:
    """Set `changes` on the generation config of both models (the one requests run on), and put it back."""
    configs = [m.get_base_model().generation_config for m in (w.gated, w.twin)]
    absent = object()
    saved = [{k: getattr(c, k, absent) for k in changes} for c in configs]
    for c in configs:
        for k, v in changes.items():
            setattr(c, k, v)
    try:
        yield
    finally:
        for c, before in zip(configs, saved, strict=True):
            for k, v in before.items():
                if v is absent:
                    delattr(c, k)
                else:
                    setattr(c, k, v)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if not torch.equal(a.sequences, b.sequences) or len(a.scores) != len(b.scores):
        return False
    # a request that asks for scores runs alone: the same one-row path as the reference's, bit for bit
    return all(torch.equal(x, y) for x, y in zip(a.scores, b.scores, strict=True))


def _naive(g: adapters.AdapterGate, w: Workload, options: list[dict[str, Any]], solo: list[Any]) -> list[bool]:
    """The same requests as one left-padded batch through `gate.generate` (the engine before issue 20), run to the
    longest request; for each request, whether its tokens differ from its solo run."""
    width = max(r["input_ids"].shape[1] for r in w.requests)
    ids, masks, names = [], [], []
    for r in w.requests:
        short = width - r["input_ids"].shape[1]
        mask = r.get("attention_mask", torch.ones_like(r["input_ids"]))
        ids.append(torch.nn.functional.pad(r["input_ids"], (short, 0), value=0))
        masks.append(torch.nn.functional.pad(mask, (short, 0), value=0))
        names += [r["adapter"]] * r["input_ids"].shape[0]
    common = dict(options[0])
    if "max_new_tokens" in common:
        common["max_new_tokens"] = max(o["max_new_tokens"] for o in options)
    out = g.generate(input_ids=torch.cat(ids), attention_mask=torch.cat(masks), adapter=names, **common)
    differs, start = [], 0
    for r, expected in zip(w.requests, solo, strict=True):
        rows, own = r["input_ids"].shape
        new = out[start : start + rows, width : width + expected.shape[1] - own]
        start += rows
        differs.append(not torch.equal(torch.cat([r["input_ids"], new], dim=1), expected))
    return differs


@pytest.mark.parametrize("name", list(TABLE))
def test_setting_through_the_engine_equals_solo_runs(workload: Workload, name: str) -> None:
    w, row = workload, TABLE[name]
    with _configured(w, row.config(w)):
        options = [_options(r, row, w) for r in w.requests]
        solo = [_solo(w.twin, r, o) for r, o in zip(w.requests, options, strict=True)]
        with adapters.gate(w.gated, window_s=0.3, max_window_s=2.0) as g:
            futures = [
                g.submit(**_inputs(r), adapter=r["adapter"], **o) for r, o in zip(w.requests, options, strict=True)
            ]
            got = [f.result(timeout=120) for f in futures]
            engine = g.state()["engine"]
            naive = _naive(g, w, options, solo) if row.naive_differs else []
    wrong = [i for i, (a, b) in enumerate(zip(got, solo, strict=True)) if not _same(a, b)]
    assert wrong == [], f"{name}: requests {wrong} differ from their solo runs (engine {engine})"

    if row.decision == "batched":
        assert engine["batches"] >= 1 and engine["largest_batch_rows"] >= 2, engine
    else:
        assert engine["batches"] == 0 and engine["alone"] == len(w.requests), engine
        assert any(row.alone_because in why for why in engine["alone_why"]), engine["alone_why"]
    if row.matters:
        plain = [_solo(w.twin, r, {"max_new_tokens": r["max_new_tokens"]}) for r in w.requests]
        assert any(not _same(a, b) for a, b in zip(plain, solo, strict=True)), f"{name} changes no answer"
    if row.naive_differs:
        assert any(naive), f"a naive batch gives the solo answers for {name}: the row cannot see the bug"


@pytest.mark.parametrize(
    ("change", "because"), [({"max_time": 30.0}, "max_time"), ({"a_newer_setting": 3}, "a_newer_setting")]
)
def test_a_setting_the_table_does_not_batch_makes_the_request_run_alone(
    workload: Workload, change: dict[str, Any], because: str
) -> None:
    """From the model's generation config too; and a setting the table does not know (a newer transformers)."""
    w = workload
    requests = w.requests[2:4]
    with _configured(w, change), adapters.gate(w.gated, window_s=0.2) as g:
        futures = [g.submit(**_inputs(r), adapter=r["adapter"], max_new_tokens=3) for r in requests]
        got = [f.result(timeout=60) for f in futures]
        engine = g.state()["engine"]
        solo = [_solo(w.twin, r, {"max_new_tokens": 3}) for r in requests]
    assert all(torch.equal(a, b) for a, b in zip(got, solo, strict=True))
    assert engine["batches"] == 0 and any(because in why for why in engine["alone_why"]), engine
