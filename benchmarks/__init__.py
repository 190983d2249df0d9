"""Checkout alias: the benchmarks live in ``encdec/benchmarks`` (shipped in the
wheel, see its ``__init__``); this makes ``python -m benchmarks.NAME_bench``
run them from the repository root."""
import encdec.benchmarks as _pkg

__path__ = _pkg.__path__
