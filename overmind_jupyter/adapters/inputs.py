"""What a request carries, read the same way everywhere: its rows, its pad and end-of-sequence tokens; and the
surface of the gate that the batching engine (batching.py) and the splitter (splitting.py) use.

The gate imports the engine and the splitter, never the other way round: they see the gate only through
`GateSurface`, so the arrow between the three modules points one way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["GateSurface", "eos_ids", "pad_id", "rows_of"]


def rows_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The number of rows of a call: of `input_ids`, `inputs_embeds`, the first positional argument, or else the
    first keyword argument with a shape (a layer's hidden states, for the routing hook)."""
    candidates = (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), args[0] if args else None, *kwargs.values())
    for value in candidates:
        shape = getattr(value, "shape", None)
        if shape:
            return int(shape[0])
    return None


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    if hasattr(value, "tolist"):
        listed = value.tolist()
        return [int(v) for v in (listed if isinstance(listed, list) else [listed])]
    return [int(value)]


def eos_ids(config: Any) -> list[int]:
    """The end-of-sequence ids of a (merged) generation config; raises `TypeError`/`ValueError` on odd ones."""
    return _as_ids(getattr(config, "eos_token_id", None))


def pad_id(config: Any) -> int | None:
    """The token `generate` writes after a row's end: the pad token, else the first end-of-sequence token (as
    `generate` falls back), else `None`."""
    pad = getattr(config, "pad_token_id", None)
    if pad is not None:
        ids = _as_ids(pad)
        return ids[0] if ids else None
    eos = eos_ids(config)
    return eos[0] if eos else None


class GateSurface(Protocol):
    """What the engine and the splitter need of an `AdapterGate` (its public methods of the same names)."""

    @property
    def generation_config(self) -> Any: ...

    def resolve(self, adapter: str | Sequence[str] | None, rows: int | None) -> tuple[str, ...]: ...

    def admission_key(self, name: str) -> str: ...

    def run(self, kind: str, names: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...

    def generate(self, *args: Any, adapter: str | Sequence[str] | None = None, **kwargs: Any) -> Any: ...
