"""Benchmarks against HF ``generate``, shipped in the package so ``encdec bench
NAME`` runs from an installed wheel in any directory.

Why here and not a top-level ``benchmarks/`` mapped in by setuptools: a real
subpackage imports the same way from a wheel, an editable install and a
checkout on ``PYTHONPATH``, with no install-time path mapping to go stale. The
checkout's ``benchmarks/__init__.py`` points its ``__path__`` here, so
``python -m benchmarks.whisper_bench`` still works there; one copy of the code.

Adding a benchmark: a module ``NAME_bench.py`` in this folder with a
``main(argv: list[str] | None = None)``; it is ``encdec bench NAME`` and
``python -m benchmarks.NAME_bench`` with no other change.
"""
from __future__ import annotations

import importlib
import pkgutil

SUFFIX = "_bench"


def names() -> list[str]:
    """The benchmarks by their ``encdec bench`` name (modules ``NAME_bench`` here)."""
    return sorted(m.name[: -len(SUFFIX)] for m in pkgutil.iter_modules(__path__) if m.name.endswith(SUFFIX))


def run(name: str, argv: list[str]) -> int:
    """Runs benchmark ``name`` with its command-line arguments."""
    if name not in names():
        raise ValueError(f"unknown benchmark {name!r}; choose from {names()}")
    module = importlib.import_module(f"{__name__}.{name}{SUFFIX}")
    module.main(argv, prog=f"encdec bench {name}")
    return 0
