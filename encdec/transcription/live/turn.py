"""One turn of live transcription: its samples, when its partial passes are
due, and the words two passes agree on (``LiveSession`` drives turns).

One turn (an utterance: from speech start to speech stop, or between a
client's commits) grows as audio arrives. Every ``partial_every`` seconds of
new audio its last <= 30 s are decoded again (a *partial pass*: a sequential
job with one temperature, so one request per window), and only the words two
successive passes agree on are emitted (whisper_streaming's local agreement:
the words a pass adds at the edge of the audio are often wrong, the ones two
passes share rarely change). At the end of the turn a *final pass* decodes the
whole turn with the session's options, exactly as ``LLM.transcribe`` would the
same samples at the same rate; its text is the turn's transcript, and the words
it adds after those emitted are the last delta.

Passes are ordinary jobs (``encdec.transcription``): drivers queue them in the
engine's continuous batch beside every other stream and offline job. A stream
asks for its next partial pass only when the previous one is back (a stream
never queues passes behind its own), and the final pass supersedes a partial
still in flight (the driver aborts it). The final pass of a turn that got no
new audio since its last partial encodes the same features, which the engine's
encoder cache serves without a second encoder pass.

A turn longer than 30 s gets no partial past its 30th second (passes are
compared from the turn's start); its final pass covers all of it.

Under the engine's priority policy passes rank ahead of other work: a final
pass first (its text is what a listener waits for), then partial passes (stale
a second later), then everything else at the default 0 (offline uploads, whose
clients care about throughput, not about the next second).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from encdec.audio import SAMPLE_RATE
from encdec.transcription.options import TranscribeOptions

PARTIAL_EVERY_S = 1.0  # seconds of new audio between a turn's partial passes
MAX_PARTIAL_S = 30.0  # one encoder window: passes are compared from the turn's start
INPUT_RATES = (16000, 24000)  # sample rates a live stream may send
FINAL_PRIORITY = -2  # engine priority of a final pass (smaller runs first, as vLLM)
PARTIAL_PRIORITY = -1  # of a partial pass; every other request has the default 0


class Agreement:
    """The words successive partial passes agree on, emitted once each."""

    def __init__(self) -> None:
        self.previous: list[str] | None = None  # the last pass's words
        self.emitted: list[str] = []  # words emitted so far, in order

    def partial(self, text: str) -> str:
        """Fold a partial pass's text in; returns the newly agreed text ('' if none)."""
        words = text.split()
        delta = ""
        if self.previous is not None:
            n = 0
            while n < min(len(words), len(self.previous)) and words[n] == self.previous[n]:
                n += 1
            if n > len(self.emitted) and words[:len(self.emitted)] == self.emitted:
                delta = self._emit(words[len(self.emitted):n])
        self.previous = words
        return delta

    def final(self, text: str) -> str:
        """The final text's words after those emitted, when it starts with them ('' otherwise)."""
        words = text.split()
        if words[:len(self.emitted)] != self.emitted or len(words) == len(self.emitted):
            return ""
        return self._emit(words[len(self.emitted):])

    def _emit(self, words: list[str]) -> str:
        delta = (" " if self.emitted else "") + " ".join(words)
        self.emitted += words
        return delta

    @property
    def text(self) -> str:
        return " ".join(self.emitted)


class Turn:
    """One utterance of a live stream: its samples at the input rate, when its
    partial passes are due, and the agreement between them."""

    def __init__(self, rate: int, *, partial_every: float = PARTIAL_EVERY_S) -> None:
        if rate not in INPUT_RATES:
            raise ValueError(f"sample rate must be one of {INPUT_RATES}, got {rate}")
        if not partial_every > 0:
            raise ValueError(f"partial_every must be > 0 seconds, got {partial_every}")
        self.rate = rate
        self.partial_every = partial_every
        self._chunks: list[np.ndarray] = []
        self.num_samples = 0
        self.passed = 0  # samples the last partial pass covered
        self.agreement = Agreement()

    def append(self, samples: np.ndarray) -> None:
        if len(samples):
            self._chunks.append(np.asarray(samples, np.float32))
            self.num_samples += len(samples)

    @property
    def duration(self) -> float:
        return self.num_samples / self.rate

    def audio(self) -> np.ndarray:
        """The turn's samples, merged into one array here (appends only add to a list)."""
        if len(self._chunks) > 1:
            self._chunks = [np.concatenate(self._chunks)]
        return self._chunks[0] if self._chunks else np.zeros(0, np.float32)

    def truncate(self, n: int) -> np.ndarray:
        """Keep the first ``n`` samples; returns a copy of the rest (the next turn's)."""
        audio = self.audio()
        rest = audio[n:].copy()
        self._chunks, self.num_samples = [audio[:n]], n
        return rest

    def partial_due(self) -> bool:
        """Enough new audio since the last partial pass, and the turn still fits one window."""
        return (self.num_samples - self.passed >= self.partial_every * self.rate
                and self.num_samples <= MAX_PARTIAL_S * self.rate)

    def partial_job(self, engine: Any, options: TranscribeOptions) -> Any:
        """The next partial pass: the turn so far, one temperature."""
        from encdec.transcription import make_job

        self.passed = self.num_samples
        return make_job(engine, self._input(), partial_options(options))

    def final_job(self, engine: Any, options: TranscribeOptions) -> Any:
        """The final pass: the whole turn, the session's options (``LLM.transcribe``'s job)."""
        from encdec.transcription import make_job

        return make_job(engine, self._input(), options)

    def _input(self) -> Any:
        audio = self.audio()
        return audio if self.rate == SAMPLE_RATE else (audio, self.rate)


def partial_options(options: TranscribeOptions) -> TranscribeOptions:
    """A partial pass decodes once per window: the first temperature, no fallback."""
    return dataclasses.replace(options, temperature=options.temperature[:1])


def pcm16_to_float(data: bytes) -> np.ndarray:
    """Little-endian 16-bit PCM -> float32 in [-1, 1)."""
    if len(data) % 2:
        raise ValueError(f"PCM16 audio must be an even number of bytes, got {len(data)}")
    return np.frombuffer(data, "<i2").astype(np.float32) / 32768.0
