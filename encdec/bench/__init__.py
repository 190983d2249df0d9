"""``encdec bench NAME``: benchmarks that measure encdec alone (serve, realtime,
swap, encoder cache, Ray scale-out), shipped in the wheel so they run from any
directory.

The comparisons with HF ``generate``, CTranslate2 and faster-whisper (``bart``,
``whisper``, ``gpu``, the long-form and WER harnesses) need those libraries and
the checkout's clips: they live in the checkout's top-level ``benchmarks/``
(``python -m benchmarks.NAME``), which the wheel leaves out.

Adding a benchmark: a module ``NAME_bench.py`` in this folder with a
``main(argv: list[str] | None = None, *, prog: str | None = None)``; it is
``encdec bench NAME`` with no other change, and a three-line
``benchmarks/NAME_bench.py`` makes it ``python -m benchmarks.NAME_bench``.
"""
from __future__ import annotations

import importlib
import pkgutil

SUFFIX = "_bench"

# ``encdec bench`` names of the comparison harnesses -> the checkout module that runs them.
CHECKOUT_ONLY = {"bart": "benchmarks.bart_bench", "whisper": "benchmarks.whisper_bench",
                 "gpu": "benchmarks.gpu_bench"}


def names() -> list[str]:
    """The benchmarks by their ``encdec bench`` name (modules ``NAME_bench`` here)."""
    return sorted(m.name[: -len(SUFFIX)] for m in pkgutil.iter_modules(__path__) if m.name.endswith(SUFFIX))


def run(name: str, argv: list[str]) -> int:
    """Runs benchmark ``name`` with its command-line arguments; a comparison
    harness's name raises ValueError saying how to run it from a checkout."""
    if name in CHECKOUT_ONLY:
        raise ValueError(f"{name!r} compares with HF generate, CTranslate2 or faster-whisper, which the "
                         f"wheel does not ship; from a checkout run: python -m {CHECKOUT_ONLY[name]}")
    if name not in names():
        raise ValueError(f"unknown benchmark {name!r}; choose from {names()}")
    module = importlib.import_module(f"{__name__}.{name}{SUFFIX}")
    module.main(argv, prog=f"encdec bench {name}")
    return 0
