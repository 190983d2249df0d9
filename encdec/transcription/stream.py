"""``LLM.transcribe_stream``: the live policy (``encdec.transcription.live``)
offline, as a generator over an iterator of audio chunks.

Chunks are 1-D float arrays or PCM16 ``bytes`` at ``sample_rate`` (16 or 24
kHz); a ``None`` chunk ends the turn there (a client's commit), and the end of
the iterator ends the last one. While a turn grows, a partial pass runs every
``partial_every`` seconds of new audio and the words two passes agree on come
out as a partial ``StreamSegment``; at the turn's end the final pass (the
session's options, ``LLM.transcribe``'s result for the turn's samples) comes out
as a final one. Offline, each pass runs to its end before the next chunk is
read, so the output depends on the audio alone, not on timing.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from encdec.transcription.driver import run_jobs
from encdec.transcription.live import PARTIAL_EVERY_S, LiveSession, TurnEnded, pcm16_to_float
from encdec.transcription.options import TranscribeOptions
from encdec.transcription.result import Transcription


@dataclass
class StreamSegment:
    final: bool  # the turn's final text (True) or partial text agreed so far (False)
    text: str  # partial: the agreed text of the turn so far; final: the turn's transcript
    delta: str  # what this segment adds to the turn's text already given ('' for a final that disagrees)
    start: float  # seconds into the stream where the turn starts
    end: float  # seconds into the stream the turn reaches (its end, for a final segment)
    transcription: Transcription | None = None  # final: the whole result (times from the turn's start)


def transcribe_stream(llm: Any, chunks: Iterable[Any], options: TranscribeOptions, *, sample_rate: int = 16000,
                      partial_every: float = PARTIAL_EVERY_S) -> Iterator[StreamSegment]:
    """Drive a ``LiveSession`` (no voice detector: ``None`` chunks commit) over ``chunks``."""
    engine = llm.llm_engine
    session = LiveSession(sample_rate, partial_every=partial_every)

    def run(job: Any) -> Transcription:
        with llm.engine_lock():  # between passes the LLM is free for other calls
            (result,) = run_jobs(engine, [job], use_tqdm=False)
        return result

    def finals(events: list[Any]) -> Iterator[StreamSegment]:
        for event in events:
            turn = event.turn
            if isinstance(event, TurnEnded) and turn.turn.num_samples:
                result = run(turn.final_job(engine, options))
                final = session.final_text(turn, result.text)
                yield StreamSegment(True, result.text, final.delta, turn.start / sample_rate,
                                    turn.fed / sample_rate, result)

    for i, chunk in enumerate(chunks):
        if chunk is None:
            yield from finals(session.commit())
            continue
        yield from finals(session.feed(_samples(chunk, i)))
        turn = session.partial_due()
        if turn is not None:
            session.begin_partial(turn)
            partial = session.end_partial(turn, run(turn.partial_job(engine, options)).text)
            if partial is not None:
                yield StreamSegment(False, partial.text, partial.delta, turn.start / sample_rate,
                                    session.total / sample_rate)
    yield from finals(session.finish())


def _samples(chunk: Any, index: int) -> np.ndarray:
    if isinstance(chunk, (bytes, bytearray, memoryview)):
        try:
            return pcm16_to_float(bytes(chunk))
        except ValueError as e:
            raise ValueError(f"chunk {index}: {e}") from None
    arr = np.asarray(chunk)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"chunk {index} must be a 1-D float array or PCM16 bytes, got "
                         f"{arr.dtype} of shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"chunk {index} holds NaN or infinite samples")
    return arr.astype(np.float32, copy=False)
