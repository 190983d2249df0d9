"""Whisper's temperature fallback on demand: a long clip that triggers it (the
shipped spoken sentences, tests/data/speech, espeak-ng, back to back, mixed
with white noise) and a transcription that counts the re-decodes it caused.

Clean espeak-ng speech decodes at temperature 0 in every window; noise at an
SNR around 0 dB makes tiny.en's greedy output either unlikely (average
log-prob under -1) or repetitive (compression ratio over 2.4) in some windows,
so those windows are decoded again at higher temperatures, as happens on real
noisy recordings. The noise is seeded: the same arguments give the same clip.

A re-decode is the same window with the same decoder prompt (with
``condition_on_previous_text``: ``<|startofprev|>`` + the earlier windows'
text + the start tokens) at the next temperature: with the prefix cache on,
its full prompt blocks are found cached (``benchmarks.prefix_cache_bench``).
"""
from __future__ import annotations

import glob
import os
from typing import Any

import numpy as np

from encdec.bench.common import SPEECH

SAMPLE_RATE = 16000


def speech_clips(speech_dir: str = SPEECH) -> list[np.ndarray]:
    """The shipped sentences ``s*.wav`` as 16 kHz float32 arrays, in name order."""
    import soundfile as sf

    files = sorted(glob.glob(os.path.join(speech_dir, "s*.wav")))
    if not files:
        raise ValueError(f"speech_dir has no s*.wav clips: {speech_dir!r} (a source checkout ships them)")
    return [sf.read(f, dtype="float32")[0] for f in files]


def noisy_long_clip(num_clips: int = 16, *, snr_db: float = 0.0, gap_s: float = 1.0, seed: int = 0,
                    speech_dir: str = SPEECH) -> np.ndarray:
    """``num_clips`` sentences, each followed by ``gap_s`` of silence, plus white
    noise ``snr_db`` below the speech's power (measured over its non-silent
    samples): 16 kHz float32 samples."""
    if num_clips < 1:
        raise ValueError(f"num_clips must be >= 1, got {num_clips}")
    clips = speech_clips(speech_dir)
    if num_clips > len(clips):
        raise ValueError(f"num_clips must be <= {len(clips)} (the shipped sentences), got {num_clips}")
    gap = np.zeros(int(SAMPLE_RATE * gap_s), np.float32)
    speech = np.concatenate([x for w in clips[:num_clips] for x in (w, gap)])
    power = float(np.mean(speech[speech != 0] ** 2))
    noise = np.random.default_rng(seed).standard_normal(len(speech)) * np.sqrt(power / 10 ** (snr_db / 10))
    return (speech + noise).astype(np.float32)


def transcribe_counted(llm: Any, audio: np.ndarray, *, seed: int = 0) -> tuple[list[tuple[float, list[int]]], dict]:
    """Transcribe ``audio`` (16 kHz) on ``llm`` as ``LLM.transcribe`` does by
    default (sequential long-form, faster-whisper's thresholds and temperatures,
    ``condition_on_previous_text``), with seeded sampling so that two engines
    draw the same numbers. Returns (temperature, tokens) per segment and the
    requests asked: ``requests``, and of those ``retries``, the fallback
    re-decodes (temperature > 0). The params given only seed the sampling:
    ``max_tokens=None`` keeps the decoder's own limit (``SamplingParams``'
    default of 16 would cut every window short)."""
    from encdec import SamplingParams
    from encdec.transcription import SequentialJob, TranscribeOptions
    from encdec.transcription.driver import run_jobs

    engine = llm.llm_engine
    options = TranscribeOptions(sampling_params=SamplingParams(seed=seed, max_tokens=None))
    job = SequentialJob(engine, (audio, SAMPLE_RATE), options)
    retries = 0
    asked = job.next_requests

    def counted() -> list:  # every request the job asks, tallied by its temperature
        nonlocal retries
        requests = asked()
        retries += sum(getattr(r.params, "temperature", 0.0) > 0.0 for r in requests)
        return requests

    job.next_requests = counted
    (t,) = run_jobs(engine, [job], use_tqdm=False)
    return [(s.temperature, list(s.tokens)) for s in t.segments], dict(requests=job.num_requests, retries=retries)
