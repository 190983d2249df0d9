"""``LiveSession`` without a model: turns, the partial schedule, the turn length
cap and what the session keeps of its audio (no sockets, no threads)."""
from __future__ import annotations

import numpy as np
import pytest

from encdec.transcription.live import LiveSession, SpeechStarted, SpeechStopped, TurnEnded

RATE = 16000


def _chunks(wav: np.ndarray, step: int = RATE // 10):
    return [wav[i:i + step] for i in range(0, len(wav), step)]


def _noise(seconds: float, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(int(seconds * RATE)) * 0.1).astype(np.float32)


def test_a_committed_turn_holds_exactly_the_audio_fed():
    session = LiveSession(RATE)
    wav = _noise(3.0)
    events = [e for c in _chunks(wav) for e in session.feed(c)]
    assert events == [] and session.open is not None and session.open.start == 0
    (ended,) = session.commit()
    assert isinstance(ended, TurnEnded) and session.open is None
    np.testing.assert_array_equal(ended.turn.turn.audio(), wav)
    assert ended.turn.fed == len(wav)
    more = _noise(1.0, seed=1)
    session.feed(more)
    assert session.open.start == len(wav)  # the next turn starts at the first audio after the commit
    (last,) = session.finish()
    np.testing.assert_array_equal(last.turn.turn.audio(), more)


def test_partial_passes_one_at_a_time_and_only_agreed_words():
    session = LiveSession(RATE, partial_every=1.0)
    session.feed(_noise(0.5))
    assert session.partial_due() is None  # not a second of audio yet
    session.feed(_noise(0.6))
    turn = session.partial_due()
    assert turn is session.open
    session.begin_partial(turn)
    turn.turn.passed = turn.turn.num_samples  # what building its job (turn.partial_job) records
    session.feed(_noise(1.2))
    assert session.partial_due() is None  # its pass is still out
    assert session.end_partial(turn, "hello there") is None  # the first pass agrees with nothing yet
    assert session.partial_due() is turn
    session.begin_partial(turn)
    partial = session.end_partial(turn, "hello there general")
    assert partial.delta == "hello there" and partial.text == "hello there"
    (ended,) = session.commit()
    assert session.end_partial(turn, "late words") is None  # the turn ended: its final pass decides
    final = session.final_text(ended.turn, "hello there general kenobi")
    assert final.delta == " general kenobi"


def test_a_turn_at_its_length_cap_ends_at_its_quietest_point():
    session = LiveSession(RATE, max_turn_s=10)
    wav = _noise(25.0)
    wav[int(7.0 * RATE):int(7.3 * RATE)] = 0  # a pause inside the last 5 s before the cap
    events = [e for c in _chunks(wav) for e in session.feed(c)]
    ended = [e.turn for e in events if isinstance(e, TurnEnded)]
    assert len(ended) == 3 and not any(isinstance(e, (SpeechStarted, SpeechStopped)) for e in events)
    first = ended[0].turn.num_samples
    assert 7.0 * RATE < first < 7.3 * RATE  # cut in the pause
    assert ended[1].start == first and all(5 * RATE <= t.turn.num_samples <= 10 * RATE for t in ended)
    (last,) = session.finish()
    pieces = [t.turn.audio() for t in ended] + [last.turn.turn.audio()]
    np.testing.assert_array_equal(np.concatenate(pieces), wav)  # nothing lost, nothing twice
    with pytest.raises(ValueError, match="max_turn_s must be >= 10"):
        LiveSession(RATE, max_turn_s=5)


def test_the_session_keeps_no_copy_of_a_long_turn_and_clear_frees_it():
    session = LiveSession(24000)
    for c in _chunks(_noise(60.0), 2400):
        session.feed(c)
    assert session.open.turn.num_samples == 60 * RATE
    assert session.buffered_samples <= 24000 + 2400  # ~1 s for the next turn to reach back to
    dropped = session.clear()
    assert dropped is not None and session.open is None and session.buffered_samples <= 24000 + 2400
