"""The batching engine: one worker thread that coalesces concurrent `generate` requests into mixed batches.

# Note [Batch equality]

`gate.submit(...)` promises the result `gate.generate(...)` gives for the same request alone: the request's
own prompt (as given, with its own padding) followed by its new tokens, as long as a solo run would make them.
To keep that promise the engine coalesces only greedy requests whose generation settings a left-padded batch
honours for every row (Note [Settings in a batch] in batchable.py says which, and how the length settings are
mapped onto each row); any other request runs alone, in the worker, in turn. Which, is the engine's decision,
from the settings `generate` would use (the model's generation config with the request's arguments).

- Prompts of different lengths are padded on the left with the pad token, and the attention mask is zero
  there; transformers derives the positions from the mask, so every row sees the positions it sees alone.
- A batch runs to the largest number of new tokens among its requests; a request's tokens are cut at its own.
  Greedy decoding is causal, so the cut is what a shorter run makes.
- A row that produced an end-of-sequence token gets the pad token afterwards, in a batch as alone; a request's
  tokens stop where its last row finished, as `generate` stops alone.

What is equal, measured in fp32 on CPU (tests/adapters/test_adapter_batching.py and
test_adapter_generation_settings.py): the generated token ids are equal (`torch.equal`) to solo runs. The
logits are not bit-equal and cannot be in general: MKL's sgemm picks its kernel by the number of rows, so one
row alone and the same row among others differ by about 1e-7 (and a decode step of one row takes a
matrix-vector path). A greedy token changes only when two logits tie within that; for bf16 the rounding of
PEFT's mixed path makes differences larger (measured). That is also why requests that ask for scores
or logits run alone.
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
from .batchable import Plan, batch_options, plan
from .inputs import GateSurface, rows_of

if TYPE_CHECKING:
    import torch

__all__ = ["BatchingEngine"]


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
    plan: Plan | None = None
    signature: tuple[Any, ...] | None = None  # None: runs alone
    alone: str = ""  # why it runs alone
    keys: frozenset[str] = field(default_factory=frozenset)

    @property
    def rows(self) -> int:
        return len(self.names)


class BatchingEngine:
    """Coalesces `generate` requests that arrive within a short window into mixed batches.

    See Note [Batch equality] for what a coalesced result equals.

    Args:
        gate (`AdapterGate`):
            The gate whose model runs the batches (each batch is one routed request of the gate); the engine
            uses its public surface only (`inputs.GateSurface`).
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
        gate: GateSurface,
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
        self._alone_why: Counter[str] = Counter()
        self._max_queue: dict[str, float] = {}

    # -- submitting ------------------------------------------------------------------------------------------

    def _prepare(self, request: _Request) -> None:
        """Decide whether the request can be coalesced, and how (Note [Settings in a batch] in batchable.py)."""
        import torch

        gate = self._gate
        request.keys = frozenset(gate.admission_key(n) for n in request.names)
        kwargs = dict(request.kwargs)
        input_ids = kwargs.pop("input_ids", None)
        args = request.args
        if input_ids is None and args:
            input_ids, args = args[0], args[1:]
        mask = kwargs.pop("attention_mask", None)
        if args:
            request.alone = "positional arguments"
            return
        if len(request.keys) != 1:
            request.alone = "rows of switched and routed adapters"
            return
        if (
            not isinstance(input_ids, torch.Tensor)
            or input_ids.dim() != 2
            or input_ids.dtype not in (torch.long, torch.int)
            or input_ids.shape[1] == 0
            or (mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != input_ids.shape))
        ):
            request.alone = "inputs other than a 2-D tensor of token ids (and a mask of its shape)"
            return
        if input_ids.shape[0] > self.max_batch or len(set(request.names)) > self.max_adapters:
            request.alone = "more rows or adapters than one batch holds"
            return
        decided = plan(gate.generation_config, kwargs, input_ids)
        if isinstance(decided, str):
            request.alone = decided
            return
        if mask is None:
            if decided.pad is not None and bool((input_ids == decided.pad).any()):
                # generate would infer a mask from the pad token: let it, alone
                request.alone = "no attention_mask, and the prompt holds the pad token"
                return
            mask = torch.ones_like(input_ids)
        elif not bool(mask.bool().any(dim=1).all()):
            request.alone = "a row whose attention mask is all zeros"
            return
        request.input_ids = input_ids
        request.attention_mask = mask.to(input_ids.device)
        request.plan = decided
        request.signature = (
            str(input_ids.device),
            input_ids.dtype,
            mask.dtype,
            next(iter(request.keys)),
            decided.signature,
        )

    def submit(self, args: tuple[Any, ...], kwargs: dict[str, Any], adapter: Any) -> Future[Any]:
        """Queue one request; see `AdapterGate.submit`."""
        rows = rows_of(args, kwargs)
        names = self._gate.resolve(adapter, rows)
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
        for request, output in zip(batch, outputs, strict=True):
            request.future.set_result(output)

    def _run_alone(self, request: _Request) -> None:
        try:
            result = self._gate.generate(*request.args, adapter=request.adapter, **request.kwargs)
        except BaseException as e:
            self._count_alone(request)
            request.future.set_exception(e)
            if not isinstance(e, Exception):
                raise
        else:
            self._count_alone(request)  # before the caller can see its result, and then the engine's state
            request.future.set_result(result)

    def _count_alone(self, request: _Request) -> None:
        with self._cond:
            self._alone += 1
            self._alone_why[request.alone or "no other request to share a batch with"] += 1

    def _generate(self, batch: Sequence[_Request]) -> list[torch.Tensor]:
        """Run `batch` as one left-padded mixed batch and cut each request's result out of it."""
        import torch

        first = batch[0]
        assert first.plan is not None
        fill = first.plan.pad if first.plan.pad is not None else 0
        width = max(r.input_ids.shape[1] for r in batch)  # type: ignore[union-attr]
        max_new = max(r.plan.max_new_tokens for r in batch)  # type: ignore[union-attr]
        ids: list[torch.Tensor] = []
        masks: list[torch.Tensor] = []
        names: list[str] = []
        for r in batch:
            assert r.input_ids is not None and r.attention_mask is not None
            short = width - r.input_ids.shape[1]
            ids.append(torch.nn.functional.pad(r.input_ids, (short, 0), value=fill))
            masks.append(torch.nn.functional.pad(r.attention_mask, (short, 0), value=0))
            names.extend(r.names)
        options = batch_options(first.kwargs, first.plan, width, max_new)
        out = self._gate.generate(
            input_ids=torch.cat(ids), attention_mask=torch.cat(masks), adapter=names, **options
        )
        eos = list(first.plan.eos)
        results = []
        start = 0
        for r in batch:
            assert r.input_ids is not None and r.plan is not None
            new = out[start : start + r.rows, width : width + r.plan.max_new_tokens]
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
                "alone_why": dict(sorted(self._alone_why.items())),
                "max_queue_s": dict(sorted(self._max_queue.items())),
                "window_s": self.window_s,
                "max_window_s": self.max_window_s,
                "max_batch": self.max_batch,
                "max_adapters_per_batch": self.max_adapters,
            }
