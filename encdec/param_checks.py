"""Type checks shared by ``SamplingParams`` and ``BeamSearchParams`` (and a
request's priority): a ``TypeError`` naming the field (``ValueError`` for a
non-finite number or a value out of range), and the value normalised to a plain
Python one (numpy scalars and arrays are what users pass). Imports nothing of
encdec, so either params module can use them."""
from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np


def check_int(name: str, value: Any, *, none_ok: bool = False) -> int | None:
    """An int (numpy integers too, not bools or floats), as a Python int."""
    if value is None and none_ok:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def check_number(name: str, value: Any) -> float:
    """A finite real number (numpy floats too, not bools), as a Python float."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def check_bool(name: str, value: Any) -> bool:
    """A bool (numpy's too); a truthy string such as "no" is a mistake, not True."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def int_list(name: str, value: Any) -> list[int] | None:
    """None stays None; any iterable of ints (a numpy array too) becomes a list."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be a list of ints, got {type(value).__name__}")
    return [check_int(f"{name} entries", v) for v in value]


def str_list(name: str, value: Any) -> list[str]:
    """None -> []; one str -> [str]."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
        raise TypeError(f"{name} must be a str or a list of str, got {value!r}")
    return list(value)


def prompt_token_logprobs(value: Any) -> dict[int, list[int]] | None:
    """{decoder-prompt position: token ids}, positions and ids as ints."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError(f"prompt_token_logprobs must be a dict, got {type(value).__name__}")
    out: dict[int, list[int]] = {}
    for position, ids in value.items():
        position = check_int("prompt_token_logprobs keys (prompt positions)", position)
        ids = int_list(f"prompt_token_logprobs[{position}]", ids)
        if not ids:
            raise ValueError(f"prompt_token_logprobs[{position}] must name at least one token id, got {ids!r}")
        out[position] = ids
    return out


TRUNCATION_SIDES = ("left", "right")


def truncation(truncate_prompt_tokens: Any, truncation_side: Any) -> int | None:
    """vLLM's ``truncate_prompt_tokens``: None (off), -1 (the model's encoder
    positions) or k >= 1; ``truncation_side`` "left" keeps the last k tokens
    (vLLM's), "right" the first (HF's tokenizer default)."""
    value = check_int("truncate_prompt_tokens", truncate_prompt_tokens, none_ok=True)
    if value is not None and value != -1 and value < 1:
        raise ValueError(f"truncate_prompt_tokens must be >= 1, or -1 for the model's encoder positions, "
                         f"got {value}")
    if truncation_side not in TRUNCATION_SIDES:
        raise ValueError(f"truncation_side must be one of {TRUNCATION_SIDES}, got {truncation_side!r}")
    return value


def check_priority(priority: Any, policy: str) -> int:
    """A request's scheduling priority under the engine's ``policy``: an int, and
    0 unless the policy is "priority" (vLLM raises too, rather than ignore it)."""
    if isinstance(priority, (bool, np.bool_)) or not isinstance(priority, numbers.Integral):
        raise TypeError(f"priority must be an int, got {type(priority).__name__} {priority!r}")
    if priority != 0 and policy != "priority":
        raise ValueError(f"got priority {priority} but priority scheduling is not enabled "
                         f"(scheduling_policy={policy!r}); pass scheduling_policy='priority' to LLM to use "
                         "priorities")
    return int(priority)
