"""Requests whose rows need different keys: split by key, run each part under its own admission, put back.

A per-row request (`adapter=["fr", "dora_x", "__base__"]`) whose rows cannot all be routed (switched mode, or
a DoRA adapter among routable ones) runs as one part per key: the routed rows together, then one part per
switched adapter. Each part holds the model only for itself, so other requests may run between the parts.

- `generate`: the parts' token tensors are padded on the right with the pad token (as `generate` pads rows
  that finished early) and put back in row order. Other return types (`return_dict_in_generate=True`) are
  refused.
- `forward`: every tensor field with one entry per row (`logits`, hidden states) is put back in row order;
  caches are dropped (`None`); a `loss` is refused, since a mean over parts is not the mean over rows.
"""

from __future__ import annotations

from typing import Any

from ._errors import AdapterError
from .batchable import merged
from .inputs import GateSurface, pad_id

__all__ = ["run_split"]


def _take(value: Any, index: Any, rows: int) -> Any:
    import torch

    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows:
        return value.index_select(0, index.to(value.device))
    return value


def _fill(gate: GateSurface, kwargs: dict[str, Any]) -> int:
    """What `generate` writes after a row's end, for these settings (0 where it would write nothing)."""
    options = {k: v for k, v in kwargs.items() if k not in ("input_ids", "attention_mask")}
    try:
        settings, _ = merged(gate.generation_config, options)
        pad = pad_id(settings)
    except Exception:  # noqa: BLE001 -- the parts ran, so generate took the settings; fall back on the model's
        pad = pad_id(gate.generation_config)
    return pad if pad is not None else 0


def run_split(
    gate: GateSurface, kind: str, names: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Run a per-row request one key at a time and put the rows back in order; see the module docstring."""
    import torch

    rows = len(names)
    if kind == "forward" and kwargs.get("labels") is not None:
        raise AdapterError(
            "a forward with labels cannot be split between switched adapters (the loss is a mean over rows): "
            "pass one adapter per call, or compute the loss from the returned logits"
        )
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        groups.setdefault(gate.admission_key(name), []).append(i)
    parts: list[tuple[list[int], Any]] = []
    for indices in groups.values():
        index = torch.tensor(indices, dtype=torch.long)
        part_args = tuple(_take(a, index, rows) for a in args)
        part_kwargs = {k: _take(v, index, rows) for k, v in kwargs.items()}
        part_names = tuple(names[i] for i in indices)
        parts.append((indices, gate.run(kind, part_names, part_args, part_kwargs)))

    if kind == "generate":
        if not all(isinstance(out, torch.Tensor) for _, out in parts):
            raise AdapterError(
                "per-row adapters across switched adapters support plain generate outputs only (no "
                "return_dict_in_generate): pass one adapter per call"
            )
        length = max(out.shape[1] for _, out in parts)
        first = parts[0][1]
        together = torch.full((rows, length), _fill(gate, kwargs), dtype=first.dtype, device=first.device)
        for indices, out in parts:
            together[torch.tensor(indices, dtype=torch.long, device=out.device), : out.shape[1]] = out
        return together

    first = parts[0][1]
    fields = first.keys() if hasattr(first, "keys") else None
    if fields is None:
        if not isinstance(first, torch.Tensor):
            raise AdapterError(f"cannot put back a split forward that returned {type(first).__name__}")
        return _gather([(i, out) for i, out in parts], rows)
    values: dict[str, Any] = {}
    for field in fields:
        chunks = [(indices, out[field]) for indices, out in parts]
        if all(isinstance(c, torch.Tensor) and c.dim() > 0 and c.shape[0] == len(i) for i, c in chunks):
            values[field] = _gather(chunks, rows)
        elif field == "loss":
            raise AdapterError("a split forward cannot return a loss; compute it from the returned logits")
        else:
            values[field] = None
    return type(first)(**values)


def _gather(chunks: list[tuple[list[int], Any]], rows: int) -> Any:
    import torch

    first = chunks[0][1]
    out = first.new_empty((rows, *first.shape[1:]))
    for indices, chunk in chunks:
        out[torch.tensor(indices, dtype=torch.long, device=chunk.device)] = chunk
    return out
