"""Cutting a file into <= 30 s windows, and a window's tokens into segments.

Pure functions of samples and token ids (no model), so they are tested alone.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from encdec.audio import N_SAMPLES, SAMPLE_RATE
from encdec.transcription.result import Segment

TIME_PRECISION = 0.02  # seconds per timestamp token
SEARCH_SAMPLES = 5 * SAMPLE_RATE  # window cuts are placed in the last 5 s of a window
SILENCE_PEAK = 1e-4  # a window whose |sample| never exceeds this is digital silence


def cut_windows(wav: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(start sample, samples) per window of at most 30 s. A window that does not
    reach the end is cut at the quietest 100 ms of its last 5 s, so that cuts
    fall between words; windows of digital silence after the first are dropped
    (Whisper hallucinates on them). Windows are views of ``wav``, not copies."""
    out: list[tuple[int, np.ndarray]] = []
    start = 0
    while start < len(wav) or not out:
        end = min(start + N_SAMPLES, len(wav))
        if end < len(wav):
            end = start + quietest_cut(wav[start + N_SAMPLES - SEARCH_SAMPLES: start + N_SAMPLES],
                                       N_SAMPLES - SEARCH_SAMPLES)
        chunk = wav[start:end]
        if not out or np.abs(chunk).max() > SILENCE_PEAK:
            out.append((start, chunk))
        start = end
    return out


def quietest_cut(tail: np.ndarray, base: int) -> int:
    """Offset (from the window start) of the middle of the quietest 100 ms frame in ``tail``."""
    frame, hop = SAMPLE_RATE // 10, SAMPLE_RATE // 50
    n = (len(tail) - frame) // hop + 1
    idx = np.arange(frame)[None, :] + hop * np.arange(n)[:, None]  # (n, frame)
    energy = np.square(tail[idx]).mean(axis=1)
    best = int(np.argmin(energy[::-1]))  # ties -> the latest frame, for the longest window
    return base + hop * (n - 1 - best) + frame // 2


def segments_from_tokens(tokens: list[int], offset: float, window_end: float, ts_begin: int, eot: int,
                         tokenizer: Any, timestamps: bool) -> list[Segment]:
    """A window's output ids -> segments in seconds of the input. With timestamps,
    each ``<|t0|> text <|t1|>`` pair is a segment (times offset by the window
    start and clamped to its end); without, the window is one segment."""
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    if not timestamps:
        text = decode([t for t in tokens if t < eot])
        return [Segment(offset, window_end, text)] if text.strip() else []
    segs: list[Segment] = []
    start: float | None = None
    text_ids: list[int] = []
    for t in tokens:
        if t >= ts_begin:
            time_s = min(offset + (t - ts_begin) * TIME_PRECISION, window_end)
            if start is None:
                start = time_s
            else:
                if text_ids:
                    segs.append(Segment(start, max(time_s, start), decode(text_ids)))
                start, text_ids = (time_s if not text_ids else None), []
        elif t < eot:
            if start is None:  # text before any timestamp: starts where the last ended
                start = segs[-1].end if segs else offset
            text_ids.append(t)
    if text_ids:  # an unclosed segment runs to the window end
        segs.append(Segment(start if start is not None else offset, window_end, decode(text_ids)))
    return [s for s in segs if s.text.strip()]
