"""Beam search inside continuous batching, token for token as Hugging Face's
``_beam_search`` (transformers 5.x).

    params.py      BeamSearchParams (the user's), BeamSearchOutput (vLLM's shape)
    scorer.py      HF's rules: running beams, the finished pool, early stopping
    manager.py     decides each step's beams for ``Scheduler.update``, which applies
                   them; builds outputs; candidates: encdec/sample/beam_candidates.py
    defaults.py    a checkpoint's generation defaults, read as HF reads them

This package's ``__init__`` imports nothing, so ``encdec.sampling_params`` can
re-export ``BeamSearchParams`` without an import cycle. ``BeamRowParams``, the
``SamplingParams`` every beam row runs with (``SamplingType.BEAM``), lives in
``encdec.sampling_params``.
"""
