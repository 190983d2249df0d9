"""Comparison harnesses, run from a checkout as ``python -m benchmarks.NAME``:
encdec against HF ``generate``, CTranslate2 and faster-whisper, and WER with
jiwer. The wheel leaves this package out; the benchmarks of encdec alone ship as
``encdec.bench`` (``encdec bench NAME``), and the ``NAME_bench`` modules here
that share their name run those."""
