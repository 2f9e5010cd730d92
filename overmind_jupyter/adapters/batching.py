"""The batching engine: one worker thread that coalesces concurrent `generate` requests into mixed batches.

# Note [Batch equality]

`gate.submit(...)` promises the result `gate.generate(...)` gives for the same request alone: the request's
own prompt (as given, with its own padding) followed by its new tokens, as long as a solo run would make them.
To keep that promise the engine only coalesces greedy requests (`do_sample` off, one beam, one sequence per
prompt) whose options other than `max_new_tokens` are equal; any other request runs alone, in the worker, in
turn.

- Prompts of different lengths are padded on the left with the pad token, and the attention mask is zero
  there; transformers derives the positions from the mask, so every row sees the positions it sees alone.
- A batch runs to the largest `max_new_tokens` among its requests; a request's tokens are cut at its own
  `max_new_tokens`. Greedy decoding is causal, so the cut is what a shorter run makes.
- A row that produced an end-of-sequence token gets the pad token afterwards, in a batch as alone; a request's
  tokens stop where its last row finished, as `generate` stops alone.

What is equal, measured in fp32 on CPU (tests/adapters/test_batching.py): the generated token ids are equal
(`torch.equal`) to solo runs. The logits are not bit-equal and cannot be in general: MKL's sgemm picks its
kernel by the number of rows, so one row alone and the same row among others differ by about 1e-7 (and a
decode step of one row takes a matrix-vector path). A greedy token changes only when two logits tie within
that; for bf16 the rounding of PEFT's mixed path makes differences larger (DESIGN.md section 5).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._errors import GateClosedError

if TYPE_CHECKING:
    import torch

    from .gating import AdapterGate

__all__ = ["BatchingEngine"]

# Generation options a coalesced batch can honour for every row as a solo run would.
_BATCHABLE = frozenset({"max_new_tokens", "do_sample", "pad_token_id", "eos_token_id", "use_cache"})


@dataclass(eq=False)
class _Request:
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    adapter: Any
    names: tuple[str, ...]  # one per row
    future: Future[Any]
    since: float
    input_ids: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    max_new_tokens: int = 0
    signature: tuple[Any, ...] | None = None  # None: runs alone
    keys: frozenset[str] = field(default_factory=frozenset)

    @property
    def rows(self) -> int:
        return len(self.names)


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    if hasattr(value, "tolist"):
        listed = value.tolist()
        return [int(v) for v in (listed if isinstance(listed, list) else [listed])]
    return [int(value)]


def _eos_ids(options: dict[str, Any], config: Any) -> list[int]:
    return _as_list(
        options["eos_token_id"] if "eos_token_id" in options else getattr(config, "eos_token_id", None)
    )


class BatchingEngine:
    """Coalesces `generate` requests that arrive within a short window into mixed batches.

    See Note [Batch equality] for what a coalesced result equals.

    Args:
        gate (`AdapterGate`):
            The gate whose model runs the batches (each batch is one routed request of the gate).
        window_s (`float`):
            A batch closes once no request arrived for this long (each arrival extends the window) ...
        max_window_s (`float`):
            ... or this long after its first request arrived, whichever comes first.
        max_batch (`int`):
            Most rows in one batch.
        max_adapters (`int`):
            Most distinct adapters in one batch (`"__base__"` counts).
        idle_s (`float`, *optional*, defaults to 2.0):
            The worker thread exits after this long without a request; the next `submit` starts another.
    """

    def __init__(
        self,
        gate: AdapterGate,
        *,
        window_s: float,
        max_window_s: float,
        max_batch: int,
        max_adapters: int,
        idle_s: float = 2.0,
    ) -> None:
        self._gate = gate
        self.window_s = float(window_s)
        self.max_window_s = max(float(max_window_s), self.window_s)
        self.max_batch = int(max_batch)
        self.max_adapters = int(max_adapters)
        self.idle_s = float(idle_s)
        self._cond = threading.Condition(threading.Lock())
        self._queue: list[_Request] = []
        self._worker: threading.Thread | None = None
        self._closing = False
        self._batches = 0
        self._rows = 0
        self._largest = 0
        self._most_adapters = 0
        self._alone = 0
        self._max_queue: dict[str, float] = {}

    # -- submitting ------------------------------------------------------------------------------------------

    def _prepare(self, request: _Request) -> None:
        """Decide whether the request can be coalesced, and normalise its inputs if so."""
        import torch

        gate = self._gate
        request.keys = frozenset(gate._key(n) for n in request.names)
        kwargs = dict(request.kwargs)
        input_ids = kwargs.pop("input_ids", None)
        args = request.args
        if input_ids is None and args:
            input_ids, args = args[0], args[1:]
        mask = kwargs.pop("attention_mask", None)
        config = getattr(gate._host.target, "generation_config", None)
        do_sample = kwargs.get("do_sample", getattr(config, "do_sample", False))
        greedy = (
            not do_sample
            and getattr(config, "num_beams", 1) in (1, None)
            and getattr(config, "num_return_sequences", 1) in (1, None)
        )
        if (
            args
            or not set(kwargs) <= _BATCHABLE
            or not greedy
            or len(request.keys) != 1
            or not isinstance(input_ids, torch.Tensor)
            or input_ids.dim() != 2
            or input_ids.dtype not in (torch.long, torch.int)
            or (mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != input_ids.shape))
            or input_ids.shape[0] > self.max_batch
            or len(set(request.names)) > self.max_adapters
        ):
            return
        try:
            pad = self._pad_id(kwargs)
            eos = _eos_ids(kwargs, config)
        except (TypeError, ValueError):
            return  # odd token ids: let generate itself judge them, alone
        if mask is None:
            # What generate infers for a prompt without a mask.
            mask = torch.ones_like(input_ids)
            if pad is not None and pad not in eos and bool((input_ids == pad).any()):
                mask = input_ids.ne(pad).long()
        max_new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
        if max_new is None:
            max_new = max(0, int(getattr(config, "max_length", 20) or 20) - input_ids.shape[1])
        request.input_ids = input_ids
        request.attention_mask = mask.to(input_ids.device)
        request.max_new_tokens = int(max_new)
        options = tuple(sorted((k, repr(v)) for k, v in kwargs.items() if k != "max_new_tokens"))
        request.signature = (str(input_ids.device), input_ids.dtype, next(iter(request.keys)), options)

    def _pad_id(self, kwargs: dict[str, Any]) -> int | None:
        config = getattr(self._gate._host.target, "generation_config", None)
        for candidate in (kwargs.get("pad_token_id"), getattr(config, "pad_token_id", None)):
            if candidate is not None:
                return int(candidate)
        return None

    def submit(self, args: tuple[Any, ...], kwargs: dict[str, Any], adapter: Any) -> Future[Any]:
        """Queue one request; see `AdapterGate.submit`."""
        from .gating import _rows_of

        rows = _rows_of(args, kwargs)
        names = self._gate._names(adapter, rows)
        if len(names) == 1 and rows is not None:
            names = names * rows
        request = _Request(args, kwargs, adapter, names, Future(), time.monotonic())
        self._prepare(request)
        with self._cond:
            if self._closing:
                raise GateClosedError(
                    "the adapter gate is closed; create a new one with adapters.gate(model)"
                )
            self._queue.append(request)
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._loop, name="overmind-adapter-batcher", daemon=True
                )
                self._worker.start()
            self._cond.notify_all()
        return request.future

    # -- the worker ------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            self._serve()
        finally:
            with self._cond:
                if self._worker is threading.current_thread():
                    self._worker = None
                if self._closing:
                    self._fail_queued()

    def _serve(self) -> None:
        while True:
            with self._cond:
                idle_until = time.monotonic() + self.idle_s
                while not self._queue and not self._closing:
                    left = idle_until - time.monotonic()
                    if left <= 0:
                        self._worker = None
                        return
                    self._cond.wait(left)
                if self._closing:
                    self._fail_queued()
                    return
                # The window slides: it closes once no request came for window_s, or max_window_s after the
                # first one, or when a full batch is queued.
                while not self._closing and sum(r.rows for r in self._queue) < self.max_batch:
                    deadline = min(
                        self._queue[-1].since + self.window_s, self._queue[0].since + self.max_window_s
                    )
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                if self._closing:
                    self._fail_queued()
                    return
                batch = self._take()
            if batch:
                self._run(batch)

    def _take(self) -> list[_Request]:
        """Pick the next batch from the queue (first come first, same signature, within the caps)."""
        first = self._queue[0]
        chosen: list[_Request] = []
        if first.signature is None:
            chosen.append(first)
        else:
            names: set[str] = set()
            rows = 0
            for request in self._queue:
                if request.signature != first.signature:
                    continue
                wider = names | set(request.names)
                if chosen and (rows + request.rows > self.max_batch or len(wider) > self.max_adapters):
                    continue
                chosen.append(request)
                names, rows = wider, rows + request.rows
                if rows >= self.max_batch:
                    break
        taken = set(map(id, chosen))
        self._queue = [r for r in self._queue if id(r) not in taken]
        now = time.monotonic()
        running = []
        for request in chosen:
            if not request.future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            waited = now - request.since
            for name in set(request.names):
                if waited > self._max_queue.get(name, 0.0):
                    self._max_queue[name] = waited
            running.append(request)
        return running

    def _fail_queued(self) -> None:
        queued, self._queue = self._queue, []
        self._worker = None
        for request in queued:
            if request.future.set_running_or_notify_cancel():
                request.future.set_exception(
                    GateClosedError(
                        "the adapter gate was closed before this request ran; submit it to a new gate"
                    )
                )
        self._cond.notify_all()

    def _run(self, batch: list[_Request]) -> None:
        if len(batch) == 1 or batch[0].signature is None:
            for request in batch:
                self._run_alone(request)
            return
        try:
            outputs = self._generate(batch)
        except Exception:  # noqa: BLE001 -- each request then runs alone and gets its own outcome
            # Let every request fail (or succeed) on its own, so one bad request fails only itself.
            for request in batch:
                self._run_alone(request)
            return
        for request, output in zip(batch, outputs):
            request.future.set_result(output)

    def _run_alone(self, request: _Request) -> None:
        try:
            result = self._gate.generate(*request.args, adapter=request.adapter, **request.kwargs)
        except BaseException as e:
            request.future.set_exception(e)
            if not isinstance(e, Exception):
                raise
        else:
            request.future.set_result(result)
        with self._cond:
            self._alone += 1

    def _generate(self, batch: Sequence[_Request]) -> list[torch.Tensor]:
        """Run `batch` as one left-padded mixed batch and cut each request's result out of it."""
        import torch

        first = batch[0]
        options = {k: v for k, v in first.kwargs.items() if k not in ("input_ids", "attention_mask")}
        pad = self._pad_id(options)
        fill = pad if pad is not None else 0
        width = max(r.input_ids.shape[1] for r in batch)  # type: ignore[union-attr]
        max_new = max(r.max_new_tokens for r in batch)
        ids, masks, names = [], [], []
        for r in batch:
            assert r.input_ids is not None and r.attention_mask is not None
            short = width - r.input_ids.shape[1]
            ids.append(torch.nn.functional.pad(r.input_ids, (short, 0), value=fill))
            masks.append(torch.nn.functional.pad(r.attention_mask, (short, 0), value=0))
            names.extend(r.names)
        options["max_new_tokens"] = max_new
        out = self._gate.generate(
            input_ids=torch.cat(ids), attention_mask=torch.cat(masks), adapter=names, **options
        )
        config = getattr(self._gate._host.target, "generation_config", None)
        eos = _eos_ids(options, config)
        results = []
        start = 0
        for r in batch:
            assert r.input_ids is not None
            new = out[start : start + r.rows, width : width + r.max_new_tokens]
            start += r.rows
            length = new.shape[1]
            if eos and length:
                hits = torch.isin(new, torch.tensor(eos, device=new.device))
                # Each row stops after its first end-of-sequence token; the request stops with its last row.
                ends = torch.where(hits.any(dim=1), hits.int().argmax(dim=1) + 1, length)
                length = int(ends.max())
            results.append(torch.cat([r.input_ids, new[:, :length].to(r.input_ids.dtype)], dim=1))
        with self._cond:
            self._batches += 1
            self._rows += len(names)
            self._largest = max(self._largest, len(names))
            self._most_adapters = max(self._most_adapters, len(set(names)))
        return results

    # -- closing and state -----------------------------------------------------------------------------------

    def close(self, timeout: float | None = 60.0) -> None:
        """Fail the queued requests with `GateClosedError`, let the running batch finish, join the worker."""
        with self._cond:
            self._closing = True
            worker = self._worker
            if worker is None:
                self._fail_queued()
            self._cond.notify_all()
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout)

    def state(self) -> dict[str, Any]:
        with self._cond:
            queued: Counter[str] = Counter()
            for request in self._queue:
                for name in set(request.names):
                    queued[name] += 1
            return {
                "running": self._worker is not None,
                "queued": dict(sorted(queued.items())),
                "batches": self._batches,
                "rows": self._rows,
                "mean_batch_rows": (self._rows / self._batches) if self._batches else 0.0,
                "largest_batch_rows": self._largest,
                "most_adapters": self._most_adapters,
                "alone": self._alone,
                "max_queue_s": dict(sorted(self._max_queue.items())),
                "window_s": self.window_s,
                "max_window_s": self.max_window_s,
                "max_batch": self.max_batch,
                "max_adapters_per_batch": self.max_adapters,
            }
