"""Which generation settings a left-padded batch honours for every row as a solo `generate` would.

# Note [Settings in a batch]

The engine decides from the settings `generate` would use: the model's `generation_config` updated with the
request's keyword arguments (`merged`). Each setting that is not at its neutral value is one of:

- as is: it reads nothing that padding moves, so a row gets from it what it gets alone (the token ids, the
  cache, `min_new_tokens`, `suppress_tokens`, `begin_suppress_tokens`, `exponential_decay_length_penalty`,
  `renormalize_logits`, `remove_invalid_values`; `repetition_penalty` where transformers skips each row's
  left padding, as 5.x does from the attention mask). Those counted from the end of the prompt count, in a
  batch, from the end of the padded prompt, which is each row's own end.
- mapped onto each row: `max_new_tokens` / `max_length` (the number of new tokens: `max_length` minus the
  row's own length), `min_length` (which counts the prompt: it becomes the row's own minimum of new tokens,
  `min_length` minus its length, and requests of one such minimum share a batch, run with `min_length` set to
  that minimum plus the batch's width).
- rows of one width only: `no_repeat_ngram_size`, `sequence_bias`, `bad_words_ids`,
  `encoder_repetition_penalty`, `encoder_no_repeat_ngram_size` (they read the token ids, padding included),
  and `repetition_penalty` where transformers would count the padding. Such requests share a batch only with
  requests of the same prompt width: nothing is padded.
- requests of one length only: `forced_eos_token_id` (forced at the batch's last step).
- one-token prompts apart: `forced_bos_token_id` forces the first new token of a one-token prompt only (and
  moves `begin_suppress_tokens` one step there), so one-token prompts share batches only with each other.
- alone: anything else that is set. Other decoding modes than greedy search (sampling, beams, contrastive,
  assisted), `logits_processor`, `stopping_criteria`, a streamer or any other argument that is not a
  generation setting, `return_dict_in_generate` and every `output_*` (scores and logits of a batch are not
  bit-equal to a row's alone), `num_return_sequences`, `max_time`, `stop_strings`, cache settings,
  `guidance_scale`, watermarking, token healing, `prefix_allowed_tokens_fn`, `generation_config=`, a request
  that sets no length at all (generate picks its own default), and any setting this table does not know
  (a newer transformers). Such a request runs in a batch of its own: exactly the solo call.

Settings read only by another decoding mode (`temperature`, `top_k`, beam and assistant settings) change
nothing in greedy search and are ignored. tests/adapters/test_adapter_generation_settings.py checks every row
of this table against solo runs on rows of different lengths.
"""

from __future__ import annotations

import copy
import functools
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .inputs import eos_ids, pad_id

if TYPE_CHECKING:
    import torch

__all__ = ["Plan", "batch_options", "merged", "plan"]

# Neutral values: a setting at its neutral value (or None) does nothing.
_NEUTRAL: dict[str, Any] = {
    "min_length": 0,
    "do_sample": False,
    "num_beams": 1,
    "num_return_sequences": 1,
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "output_attentions": False,
    "output_hidden_states": False,
    "output_scores": False,
    "output_logits": False,
    "return_dict_in_generate": False,
    "remove_invalid_values": False,
    "renormalize_logits": False,
    "guidance_scale": 1.0,
    "token_healing": False,
    "is_assistant": False,
    "use_mtp": False,
    "disable_compile": False,
}
# Read only by decoding modes other than greedy search, which the engine requires.
_OTHER_MODES = frozenset(
    {
        "temperature", "top_k", "top_p", "min_p", "top_h", "typical_p", "epsilon_cutoff", "eta_cutoff",
        "length_penalty", "early_stopping", "num_beam_groups", "diversity_penalty", "low_memory",
        "penalty_alpha", "num_assistant_tokens", "num_assistant_tokens_schedule",
        "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind",
        "max_matching_ngram_size", "assistant_ensemble_weight",
    }
)  # fmt: skip
_AS_IS = frozenset(
    {
        "pad_token_id", "eos_token_id", "bos_token_id", "decoder_start_token_id", "use_cache",
        "min_new_tokens", "suppress_tokens", "begin_suppress_tokens", "exponential_decay_length_penalty",
        "renormalize_logits", "remove_invalid_values", "disable_compile", "compile_config",
    }
)  # fmt: skip
_MAPPED = frozenset({"max_new_tokens", "max_length", "min_length"})
_SAME_WIDTH = frozenset(
    {"no_repeat_ngram_size", "sequence_bias", "bad_words_ids", "encoder_repetition_penalty",
     "encoder_no_repeat_ngram_size"}
)  # fmt: skip
_SAME_LENGTH = frozenset({"forced_eos_token_id"})
_ONE_TOKEN_APART = frozenset({"forced_bos_token_id"})


@functools.cache
def _penalty_skips_padding() -> bool:
    """Whether transformers' repetition penalty leaves each row's left padding out (5.x: from the mask)."""
    try:
        from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
    except ImportError:  # pragma: no cover - transformers without it: treat the penalty as reading padding
        return False
    return "prompt_ignore_length" in inspect.signature(RepetitionPenaltyLogitsProcessor.__init__).parameters


def merged(config: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The settings `generate` would use: a copy of the model's generation config updated with `kwargs`.

    Returns:
        `(settings, rest)`: the merged config (`None` if the model has none), and the keyword arguments that are
        no generation setting (`logits_processor`, a streamer, model inputs, ...).
    """
    if config is None:
        return None, dict(kwargs)
    settings = copy.deepcopy(config)
    rest = settings.update(**kwargs)
    return settings, rest


def _inert(name: str, value: Any) -> bool:
    if value is None:
        return True
    if name not in _NEUTRAL or not isinstance(value, (bool, int, float)):
        return False
    neutral = _NEUTRAL[name]
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)


@dataclass(frozen=True)
class Plan:
    """How one request joins a batch.

    Attributes:
        signature: requests with equal signatures may share a batch.
        max_new_tokens: the request's own number of new tokens.
        length_by: `"max_new_tokens"` or `"max_length"`: how the batch is told its length.
        min_new_tokens: the request's own minimum of new tokens when it came from `min_length` (else `None`).
        eos: the end-of-sequence ids (a row stops after the first).
        pad: what `generate` writes after a row's end; also what the engine pads prompts with.
    """

    signature: tuple[Any, ...]
    max_new_tokens: int
    length_by: str
    min_new_tokens: int | None
    eos: tuple[int, ...]
    pad: int | None


def plan(config: Any, kwargs: dict[str, Any], input_ids: torch.Tensor) -> Plan | str:
    """How a request with these settings and this prompt joins a batch, or why it runs alone (a `str`).

    Args:
        config: the model's `generation_config`.
        kwargs: the request's generation keyword arguments (without `input_ids` and `attention_mask`).
        input_ids: the prompt (rows x width), as the request gave it.
    """
    try:
        settings = _greedy_settings(config, kwargs)
        width = int(input_ids.shape[1])
        options, needs = _shared_options(settings)
        length_by, max_new = _length(settings, width)
        min_new = _min_new(settings, width)
        eos, pad = _token_ids(settings)
    except _Alone as alone:
        return str(alone)
    extras: list[tuple[str, Any]] = [("length_by", length_by)]
    if min_new is not None:
        extras.append(("min_new", min_new))
    if "width" in needs:
        extras.append(("width", width))
    if "length" in needs:
        extras.append(("max_new", max_new))
    if "one_token" in needs:
        extras.append(("one_token", width == 1))
    return Plan((options, tuple(extras)), max_new, length_by, min_new, eos, pad)


class _Alone(Exception):
    """Raised by a step of `plan`: the request runs alone, for the reason that is the message."""


def _greedy_settings(config: Any, kwargs: dict[str, Any]) -> Any:
    """The settings `generate` would use (`merged`), where they are greedy search's with nothing else."""
    try:
        settings, rest = merged(config, kwargs)
    except Exception as e:  # generate will judge the settings itself, alone
        raise _Alone(f"settings generate would refuse ({type(e).__name__})") from e
    if settings is None:
        raise _Alone("the model has no generation_config")
    if rest:
        raise _Alone(f"{sorted(rest)[0]} (not a generation setting the engine can share)")
    try:
        mode = settings.get_generation_mode()
    except Exception as e:
        raise _Alone(f"settings generate would refuse ({type(e).__name__})") from e
    mode = str(getattr(mode, "value", mode))
    if mode != "greedy_search":
        raise _Alone(f"decoding mode {mode}")
    return settings


def _shared_options(settings: Any) -> tuple[tuple[tuple[str, str], ...], set[str]]:
    """The settings that are set (name and repr, what requests of one batch share), and what they ask of
    the batch's rows: `"width"`, `"length"`, `"one_token"` (Note [Settings in a batch])."""
    options: list[tuple[str, str]] = []
    needs: set[str] = set()
    for name, value in sorted(vars(settings).items()):
        if name.startswith("_") or name == "transformers_version" or name in _MAPPED or name in _OTHER_MODES:
            continue
        if _inert(name, value):
            continue
        need = _need(name)
        if need is None:
            raise _Alone(f"{name}={value!r}")
        if need:
            needs.add(need)
        options.append((name, repr(value)))
    return tuple(options), needs


def _need(name: str) -> str | None:
    """What a set setting asks of a batch's rows: nothing (`""`), one width, one length or one-token prompts
    apart; None: it runs alone."""
    if name in _AS_IS:
        return ""
    if name == "repetition_penalty":
        return "" if _penalty_skips_padding() else "width"
    if name in _SAME_WIDTH:
        return "width"
    if name in _SAME_LENGTH:
        return "length"
    if name in _ONE_TOKEN_APART:
        return "one_token"
    return None


def _length(settings: Any, width: int) -> tuple[str, int]:
    """How the request gives its length (`"max_new_tokens"` or `"max_length"`), and its own number of new
    tokens."""
    if settings.max_new_tokens is not None:
        length_by, length = "max_new_tokens", settings.max_new_tokens
    elif settings.max_length is not None:
        length_by, length = "max_length", settings.max_length
    else:
        raise _Alone("no max_new_tokens or max_length (generate picks its own default length)")
    if not _int(length):
        raise _Alone(f"{length_by}={length!r}")
    max_new: int = length if length_by == "max_new_tokens" else length - width
    if max_new < 1:
        raise _Alone("fewer than one new token (generate refuses it)")
    return length_by, max_new


def _min_new(settings: Any, width: int) -> int | None:
    """The request's own minimum of new tokens where `min_length` sets it (it counts the prompt), else None."""
    if settings.min_new_tokens is None and not _inert("min_length", settings.min_length):
        if not _int(settings.min_length):
            raise _Alone(f"min_length={settings.min_length!r}")
        minimum: int = max(0, settings.min_length - width)
        return minimum
    return None


def _token_ids(settings: Any) -> tuple[tuple[int, ...], int | None]:
    """The end-of-sequence ids and the padding id."""
    try:
        return tuple(eos_ids(settings)), pad_id(settings)
    except (TypeError, ValueError) as e:
        raise _Alone("odd token ids (generate judges them alone)") from e


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def batch_options(kwargs: dict[str, Any], plan: Plan, width: int, max_new_tokens: int) -> dict[str, Any]:
    """The keyword arguments of a batch: those of one of its requests (all share their settings), with the
    lengths mapped onto the batch's `width` (see Note [Settings in a batch])."""
    options = {
        k: v for k, v in kwargs.items() if k not in ("input_ids", "attention_mask", "max_new_tokens", "max_length")
    }
    if plan.length_by == "max_new_tokens":
        options["max_new_tokens"] = max_new_tokens
    else:
        options["max_length"] = width + max_new_tokens
    if plan.min_new_tokens is not None:
        options["min_length"] = plan.min_new_tokens + width if plan.min_new_tokens else 0
    return options
