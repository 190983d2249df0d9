"""Type checks shared by ``SamplingParams`` and ``BeamSearchParams``: a
``TypeError`` naming the field (``ValueError`` for a non-finite number), and the
value normalised to a plain Python one (numpy scalars and arrays are what users
pass). Imports nothing of encdec, so either params module can use them."""
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
