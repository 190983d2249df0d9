"""``hallucination_silence_threshold`` on real tiny.en weights: digital silence,
where tiny.en says "you" over and over, gives no text with it; speech keeps its
transcript. Run with -s to see the figures."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from encdec.transcription import TranscribeOptions

SPEECH = Path(__file__).resolve().parents[1] / "data" / "speech"


@pytest.fixture(scope="module")
def llm(ct2_dir):
    from encdec import LLM

    return LLM(str(ct2_dir), kv_cache_memory=256 << 20, swap_space=0.1)


def timed(llm, audio, **options):
    start = time.perf_counter()
    (result,) = llm.transcribe(audio, use_tqdm=False, **options)
    return result, time.perf_counter() - start


@pytest.mark.slow
def test_ten_minutes_of_digital_silence(llm, tmp_path):
    path = tmp_path / "silence.wav"
    sf.write(path, np.zeros(16000 * 600, np.int16), 16000, subtype="PCM_16")
    plain, t_plain = timed(llm, str(path), word_timestamps=True)
    skipped, t_skipped = timed(llm, str(path), word_timestamps=True, hallucination_silence_threshold=2)
    print(f"\n10 min of digital silence, tiny.en, sequential, word timestamps: "
          f"without the option {len(plain.segments)} segments {plain.text[:60]!r}... in {t_plain:.1f} s; "
          f"hallucination_silence_threshold=2: {skipped.text!r} in {t_skipped:.1f} s")
    assert plain.text.count("you") > 10  # the hallucination this option is for
    assert skipped.text == "" and skipped.segments == []


def test_speech_around_silence_is_kept(llm):
    """Two clips 25 s apart (digital silence): with the option, both clips are
    transcribed, with about as many words as without it (the second clip's
    window may start elsewhere: decoding resumes where the sound does), and no
    word lies in the silence."""
    a, _ = sf.read(SPEECH / "s00.wav", dtype="float32")
    b, _ = sf.read(SPEECH / "s05.wav", dtype="float32")
    gap_start, gap_end = len(a) / 16000, len(a) / 16000 + 25
    wav = np.concatenate([a, np.zeros(16000 * 25, np.float32), b, np.zeros(16000 * 3, np.float32)])
    plain, _ = timed(llm, (wav, 16000), word_timestamps=True)
    skipped, _ = timed(llm, (wav, 16000), word_timestamps=True, hallucination_silence_threshold=2)
    assert "lazy dog" in plain.text and "lazy dog" in skipped.text

    def words(t, first: bool) -> list:
        return [w for s in t.segments for w in s.words if (w.end <= gap_start + 0.5) == first]

    for first in (True, False):
        assert abs(len(words(skipped, first)) - len(words(plain, first))) <= 2, (skipped.text, plain.text)
    assert all(w.end <= gap_start + 0.5 or w.start >= gap_end - 0.5 for s in skipped.segments for w in s.words)


@pytest.mark.parametrize("options, match", [
    (dict(hallucination_silence_threshold=2.0), "needs word_timestamps=True"),
    (dict(hallucination_silence_threshold=0, word_timestamps=True), "> 0"),
    (dict(hallucination_silence_threshold="2", word_timestamps=True), "number of seconds"),
    (dict(hallucination_silence_threshold=2.0, word_timestamps=True, mode="independent"), "mode='sequential'"),
])
def test_bad_values_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        TranscribeOptions(**options)
