"""``LiveSession``: the turn state machine of live transcription, without I/O.

Audio goes in (``feed``, ``commit``, ``clear``, ``finish``) and events come out;
the session never runs a pass, opens a socket, starts a thread or reads a clock.
A driver (``LLM.transcribe_stream``, the Realtime WebSocket handler) runs the
passes it asks for and gives their text back::

    for event in session.feed(samples):       # or commit() / finish()
        SpeechStarted(turn, ms)               server VAD: a turn starts at speech
        SpeechStopped(turn, ms)               server VAD: its speech stopped
        TurnEnded(turn)                       run turn.final_job(...), then
                                              session.final_text(turn, text) -> Final
    turn = session.partial_due()              the open turn, when a partial pass is due
    session.begin_partial(turn)               one partial pass out per turn at a time
    job = turn.partial_job(engine, options)
    session.end_partial(turn, text) -> Partial | None   (text None: the pass failed)

Without a voice detector a turn starts at the first audio after the previous
one ended and ends at ``commit``/``finish``; with one (``set_vad``: OpenAI's
``server_vad``, ``encdec.transcription.vad.SpeechTurns``) it starts at speech,
``prefix_padding_ms`` earlier, and ends at the speech's end or a commit. With
``max_turn_s`` a turn that reaches that length ends there as if committed, at
the quietest 100 ms of its last 5 s (where ``cut_windows`` cuts a file), and
the next turn starts at once with the rest (under a detector: ``SpeechStopped``
and ``SpeechStarted`` at the cut). Times in events are milliseconds of the
session's audio. Memory: the session keeps only the audio a turn starting now
could reach back to (a list of the appended chunks, never one growing array),
and each open turn its own samples, merged only when a pass needs them.
"""
from __future__ import annotations

import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from encdec.audio import resample_stream_chunk
from encdec.transcription.live.turn import INPUT_RATES, PARTIAL_EVERY_S, Turn
from encdec.transcription.options import TranscribeOptions
from encdec.transcription.windows import quietest_cut

CUT_SEARCH_S = 5  # a turn at its length cap ends at the quietest 100 ms of its last seconds
MIN_TURN_CAP_S = 10  # the smallest max_turn_s taken (twice the search, and more than a sentence)


@dataclass(eq=False)
class LiveTurn:
    """One turn of a session: where it lies in the session's audio and its ``Turn``."""

    turn: Turn  # its samples, partial schedule and agreement
    start: int  # session sample where it starts
    fed: int  # session sample up to which it has audio
    item_id: str = field(default_factory=lambda: f"item_{uuid.uuid4().hex[:20]}")
    passes: int = 0  # partial passes begun
    partial_out: bool = False  # a partial pass is out (between begin_partial and end_partial)

    def partial_job(self, engine: Any, options: TranscribeOptions) -> Any:
        return self.turn.partial_job(engine, options)

    def final_job(self, engine: Any, options: TranscribeOptions) -> Any:
        return self.turn.final_job(engine, options)


@dataclass
class SpeechStarted:
    turn: LiveTurn
    audio_start_ms: int  # session ms where the turn starts (prefix padding included)


@dataclass
class SpeechStopped:
    turn: LiveTurn
    audio_end_ms: int  # session ms where the turn ends (the closing silence included)


@dataclass
class TurnEnded:
    turn: LiveTurn  # complete: its final pass is due


@dataclass
class Partial:
    turn: LiveTurn
    delta: str  # the words newly agreed on (never '')
    text: str  # every word agreed on so far


@dataclass
class Final:
    turn: LiveTurn
    delta: str  # the final text's words after those already given ('' when it disagrees)
    text: str  # the turn's transcript


class LiveSession:
    """One live stream: its recent audio, the open turn and the voice detector."""

    def __init__(self, rate: int = 16000, *, partial_every: float = PARTIAL_EVERY_S,
                 max_turn_s: float | None = None) -> None:
        if rate not in INPUT_RATES:
            raise ValueError(f"sample rate must be one of {INPUT_RATES}, got {rate}")
        if not partial_every > 0:
            raise ValueError(f"partial_every must be > 0 seconds, got {partial_every}")
        if max_turn_s is not None and not max_turn_s >= MIN_TURN_CAP_S:
            raise ValueError(f"max_turn_s must be >= {MIN_TURN_CAP_S} seconds (or None), got {max_turn_s}")
        self.rate, self.partial_every = rate, partial_every
        self.max_turn_s = max_turn_s
        self._max_turn = None if max_turn_s is None else int(max_turn_s * rate)  # samples
        self.vad: Any = None  # SpeechTurns, or None: turns end at commits
        self._vad_origin = 0  # session sample where the detector's clock starts
        self._chunks: deque[tuple[int, np.ndarray]] = deque()  # (first session sample, samples), recent audio
        self._base = 0  # session sample of the first kept sample
        self.total = 0  # samples received since the session began
        self.open: LiveTurn | None = None

    # -- audio in ----------------------------------------------------------------------
    def set_vad(self, detector: Any) -> None:
        """Use ``detector`` (``SpeechTurns``, fresh) from now on, or None for committed turns."""
        self.vad, self._vad_origin = detector, self.total

    def feed(self, samples: np.ndarray) -> list[Any]:
        """Append float32 samples at ``rate``; the events they cause, in order."""
        start = self.total
        if len(samples):
            self._chunks.append((start, samples))
            self.total += len(samples)
        events: list[Any] = []
        if self.vad is None:
            if self.open is None:
                self.open = self._new_turn(start)
        else:
            for kind, ms in self.vad.feed(resample_stream_chunk(samples, self.rate)):
                ms += self._vad_origin * 1000 // self.rate
                at = min(max(ms * self.rate // 1000, self._base), self.total)
                if kind == "started":
                    self.open = self._new_turn(at)
                    events.append(SpeechStarted(self.open, ms))
                elif self.open is not None:
                    events += [SpeechStopped(self.open, ms), *self._end(at)]
        if self.open is not None:
            self._feed(self.open, self.total)
            while self._max_turn is not None and self.open.turn.num_samples >= self._max_turn:
                events += self._split()
        self._trim()  # the open turn holds its own samples
        return events

    def commit(self) -> list[Any]:
        """The client ends the turn here (the detector starts over)."""
        self._reset_vad()
        return self._end(self.total)

    def finish(self) -> list[Any]:
        """The stream ends: the open turn ends if it holds audio."""
        if self.open is not None and self.open.turn.num_samples:
            return self._end(self.total)
        return []

    def clear(self) -> LiveTurn | None:
        """Drop the open turn (returned: its partial pass is moot) and the audio before now."""
        turn, self.open = self.open, None
        self._trim()
        self._reset_vad()
        return turn

    @property
    def buffered_samples(self) -> int:
        """Samples the session holds for a turn to reach back to (the open turn's are its own)."""
        return sum(len(c) for _, c in self._chunks)

    # -- passes ----------------------------------------------------------------------------
    def partial_due(self) -> LiveTurn | None:
        """The open turn, when its next partial pass is due and none of its own is out."""
        turn = self.open
        if turn is None or turn.partial_out or not turn.turn.partial_due():
            return None
        return turn

    def begin_partial(self, turn: LiveTurn) -> None:
        turn.partial_out, turn.passes = True, turn.passes + 1

    def end_partial(self, turn: LiveTurn, text: str | None) -> Partial | None:
        """A partial pass is back with ``text`` (None: it failed or was cancelled);
        the words it newly agrees on, while the turn is still open."""
        turn.partial_out = False
        if text is None or self.open is not turn:  # an ended turn's final pass has the last word
            return None
        delta = turn.turn.agreement.partial(text)
        return Partial(turn, delta, turn.turn.agreement.text) if delta else None

    def final_text(self, turn: LiveTurn, text: str) -> Final:
        return Final(turn, turn.turn.agreement.final(text), text)

    # -- internals --------------------------------------------------------------------------
    def _new_turn(self, start: int) -> LiveTurn:
        return LiveTurn(Turn(self.rate, partial_every=self.partial_every), start, start)

    def _end(self, end: int) -> list[Any]:
        turn, self.open = self.open, None
        if turn is None:
            return []
        self._feed(turn, end)
        self._trim()
        return [TurnEnded(turn)]

    def _split(self) -> list[Any]:
        """End the open turn at its length cap (module docstring); the rest opens the next."""
        turn = self.open
        search = CUT_SEARCH_S * self.rate
        cut = quietest_cut(turn.turn.audio()[self._max_turn - search:self._max_turn], self._max_turn - search)
        rest = turn.turn.truncate(cut)
        turn.fed = at = turn.start + cut
        ms = at * 1000 // self.rate
        self.open = nxt = self._new_turn(at)
        nxt.turn.append(rest)
        nxt.fed = self.total
        if self.vad is None:
            return [TurnEnded(turn)]
        return [SpeechStopped(turn, ms), TurnEnded(turn), SpeechStarted(nxt, ms)]

    def _feed(self, turn: LiveTurn, end: int) -> None:
        """Give the turn the session's audio from ``turn.fed`` up to sample ``end``."""
        if end <= turn.fed:
            return
        for first, chunk in self._chunks:
            lo, hi = max(turn.fed, first), min(end, first + len(chunk))
            if lo < hi:
                turn.turn.append(chunk[lo - first:hi - first])
        turn.fed = end

    def _trim(self) -> None:
        """Keep only what a turn starting now could reach back to (its prefix padding)."""
        keep = self.total - self.rate  # 1 s: more than any prefix padding used in practice
        if self.vad is not None:
            keep = self.total - (self.vad.prefix_ms + 500) * self.rate // 1000
        keep = max(keep, self._base)
        while self._chunks and self._chunks[0][0] + len(self._chunks[0][1]) <= keep:
            self._chunks.popleft()
        self._base = keep

    def _reset_vad(self) -> None:
        if self.vad is not None:
            self.vad.reset()
            self._vad_origin = self.total
