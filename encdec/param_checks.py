"""Type checks shared by ``SamplingParams`` and ``BeamSearchParams``: a
``TypeError`` naming the field. No imports, so either params module can use
them without an import cycle."""
from __future__ import annotations

from typing import Any


def check_int(name: str, value: Any, *, none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def check_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")


def int_list(name: str, value: Any) -> list[int] | None:
    """None stays None; any iterable of ints becomes a list."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be a list of ints, got {type(value).__name__}")
    out = list(value)
    for v in out:
        check_int(f"{name} entries", v)
    return out


def str_list(name: str, value: Any) -> list[str]:
    """None -> []; one str -> [str]."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
        raise TypeError(f"{name} must be a str or a list of str, got {value!r}")
    return list(value)
