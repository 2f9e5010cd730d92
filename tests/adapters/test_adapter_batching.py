"""The batching engine: coalesced mixed batches give what each request gives alone (fp32 token ids).

See Note [Batch equality] in overmind_jupyter/adapters/batching.py for what is equal and why logits are not.
"""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError
from typing import Any

import pytest
import torch

from overmind_jupyter import adapters
from overmind_jupyter.adapters import BASE

from .adapter_models import CHOICES, build_peft


def _prompts(n: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(2, 128, (1, int(torch.randint(3, 9, (1,), generator=gen))), generator=gen)
        for _ in range(n)
    ]


def test_engine_results_equal_solo_runs(peft_model: Any) -> None:
    prompts = _prompts(24)
    jobs = [(p, CHOICES[i % 4], 3 + i % 4) for i, p in enumerate(prompts)]
    with adapters.gate(peft_model, window_s=0.05) as g:
        solo = [g.generate(input_ids=p, adapter=a, max_new_tokens=n, do_sample=False) for p, a, n in jobs]
        results: list[Any] = [None] * len(jobs)

        def client(t: int) -> None:
            mine = range(t, len(jobs), 6)
            futures = {
                i: g.submit(
                    input_ids=jobs[i][0], adapter=jobs[i][1], max_new_tokens=jobs[i][2], do_sample=False
                )
                for i in mine
            }
            for i, f in futures.items():
                results[i] = f.result(timeout=60)

        workers = [threading.Thread(target=client, args=(t,)) for t in range(6)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        engine = g.state()["engine"]
    for i, (expected, got) in enumerate(zip(solo, results, strict=True)):
        assert torch.equal(got, expected), i
    assert engine["batches"] >= 1 and engine["largest_batch_rows"] > 1
    assert engine["largest_batch_rows"] <= 64 and engine["most_adapters"] <= 4


def test_caps_on_rows_and_adapters(peft_model: Any) -> None:
    prompts = _prompts(12, seed=1)
    with adapters.gate(peft_model, window_s=0.2, max_batch=5, max_adapters_per_batch=2) as g:
        futures = [
            g.submit(input_ids=p, adapter=CHOICES[i % 4], max_new_tokens=2) for i, p in enumerate(prompts)
        ]
        got = [f.result(timeout=60) for f in futures]
        engine = g.state()["engine"]
        solo = [
            g.generate(input_ids=p, adapter=CHOICES[i % 4], max_new_tokens=2) for i, p in enumerate(prompts)
        ]
    assert all(torch.equal(a, b) for a, b in zip(got, solo, strict=True))
    assert engine["largest_batch_rows"] <= 5 and engine["most_adapters"] <= 2
    assert engine["batches"] >= 3


def test_end_of_sequence_stops_rows_as_alone() -> None:
    model = build_peft()
    prompts = _prompts(8, seed=2)
    with adapters.gate(model) as g:
        # make a token the model does produce the end-of-sequence token, so that some rows stop early
        first = g.generate(input_ids=prompts[0], adapter="fr", max_new_tokens=6, do_sample=False)
        eos = int(first[0, prompts[0].shape[1] + 2])
        options = {"max_new_tokens": 6, "do_sample": False, "eos_token_id": eos, "pad_token_id": 0}
        solo = [g.generate(input_ids=p, adapter=CHOICES[i % 4], **options) for i, p in enumerate(prompts)]
        futures = [g.submit(input_ids=p, adapter=CHOICES[i % 4], **options) for i, p in enumerate(prompts)]
        got = [f.result(timeout=60) for f in futures]
    assert any(s.shape[1] < p.shape[1] + 6 for s, p in zip(solo, prompts, strict=True)), "no row stopped early"
    for expected, result in zip(solo, got, strict=True):
        assert torch.equal(result, expected)


def test_multi_row_requests_and_user_padding(peft_model: Any) -> None:
    ids = torch.tensor([[0, 0, 5, 6, 7], [9, 8, 7, 6, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with adapters.gate(peft_model) as g:
        solo = g.generate(input_ids=ids, attention_mask=mask, adapter=["de", BASE], max_new_tokens=4)
        f1 = g.submit(input_ids=ids, attention_mask=mask, adapter=["de", BASE], max_new_tokens=4)
        f2 = g.submit(input_ids=_prompts(1)[0], adapter="es", max_new_tokens=4)
        assert torch.equal(f1.result(timeout=60), solo)
        f2.result(timeout=60)


def test_requests_that_cannot_be_coalesced_run_alone(peft_model: Any) -> None:
    prompt = _prompts(1)[0]
    with adapters.gate(peft_model) as g:
        out = g.submit(
            input_ids=prompt, adapter="fr", max_new_tokens=3, return_dict_in_generate=True, output_scores=True
        ).result(timeout=60)
        assert out.sequences.shape[1] == prompt.shape[1] + 3
        torch.manual_seed(0)
        sampled = g.submit(input_ids=prompt, adapter="de", max_new_tokens=3, do_sample=True).result(
            timeout=60
        )
        assert sampled.shape[1] == prompt.shape[1] + 3
        assert g.state()["engine"]["alone"] >= 2


def test_cancelled_and_failed_requests(peft_model: Any) -> None:
    prompts = _prompts(4)
    with adapters.gate(peft_model, window_s=0.3) as g:
        cancelled = g.submit(input_ids=prompts[0], adapter="fr", max_new_tokens=2)
        assert cancelled.cancel()
        # a request whose inputs break generate fails alone; the others of its batch still answer
        bad = g.submit(input_ids=torch.tensor([[5, 999, 7]]), adapter="de", max_new_tokens=2)  # vocab is 128
        odd = g.submit(input_ids=prompts[1], adapter="de", max_new_tokens=2, eos_token_id="not a token")
        good = [g.submit(input_ids=p, adapter="es", max_new_tokens=2) for p in prompts[2:]]
        with pytest.raises(CancelledError):
            cancelled.result()
        with pytest.raises(IndexError):
            bad.result(timeout=60)
        with pytest.raises(TypeError):
            odd.result(timeout=60)
        for p, f in zip(prompts[2:], good, strict=True):
            assert torch.equal(f.result(timeout=60), g.generate(input_ids=p, adapter="es", max_new_tokens=2))
        assert g.state()["in_flight"] == {}


def test_close_fails_pending_futures(peft_model: Any) -> None:
    g = adapters.gate(peft_model, window_s=5.0)
    futures = [g.submit(input_ids=p, adapter="fr", max_new_tokens=2) for p in _prompts(3)]
    g.close()
    for f in futures:
        with pytest.raises(adapters.GateClosedError, match="closed before this request ran"):
            f.result(timeout=10)
    assert g.state()["engine"] is None
    assert not any(t.name == "overmind-adapter-batcher" and t.is_alive() for t in threading.enumerate())
