"""Silence on real tiny.en weights. By default, windows of digital silence are
not decoded (``silence_gate``), so a sentence after a long silence is kept.
``hallucination_silence_threshold``: near-silent noise, where tiny.en says "you"
over and over, gives no text with it; speech keeps its transcript. Run with -s
to see the figures."""
from __future__ import annotations

import re
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


def test_a_sentence_after_two_minutes_of_digital_silence_is_kept(llm):
    """A clip, 120 s of zeros, a clip, default options: without the gate tiny.en
    repeats the first sentence through the silence, each window conditioned on
    the last (at 300 s it loses the second clip, at 600 s it ends in "you"s);
    with it both clips are there, once each, and no text lies in the silence."""
    a, _ = sf.read(SPEECH / "s03.wav", dtype="float32")  # "... when you leave the room."
    b, _ = sf.read(SPEECH / "s05.wav", dtype="float32")
    gap_start, gap_end = len(a) / 16000, len(a) / 16000 + 120
    wav = np.concatenate([a, np.zeros(16000 * 120, np.float32), b])
    result, seconds = timed(llm, (wav, 16000))
    print(f"\nclip, 120 s of digital silence, clip: {result.text!r} in {seconds:.2f} s")
    text = result.text.lower()
    assert text.count("please remember") == 1 and "morning" in text, result.text
    assert len(re.findall(r"\byou\b", text)) == 1, result.text  # the clip's own
    assert all(s.end <= gap_start + 1 or s.start >= gap_end - 1.5 for s in result.segments), result.segments


def test_digital_silence_alone_gives_no_text(llm):
    """95 s of zeros: no window is decoded. ``skip_digital_silence=False`` decodes
    them as HF does, and tiny.en says "you"."""
    result, _ = timed(llm, (np.zeros(16000 * 95, np.float32), 16000))
    assert result.text == "" and result.segments == []
    (short,) = llm.transcribe((np.zeros(16000 * 5, np.float32), 16000), use_tqdm=False)
    assert short.text == ""
    (hf,) = llm.transcribe((np.zeros(16000 * 5, np.float32), 16000), skip_digital_silence=False, use_tqdm=False)
    assert "you" in hf.text.lower()
    with pytest.raises(TypeError, match="skip_digital_silence must be a bool"):
        TranscribeOptions(skip_digital_silence="no")


@pytest.mark.slow
def test_ten_minutes_of_near_silent_noise(llm, tmp_path):
    """Noise at -75 dBFS: sound to the digital-silence gate (its peaks are over
    -70 dBFS), silence to this option (every frame under -60 dBFS RMS)."""
    path = tmp_path / "noise.wav"
    noise = np.random.default_rng(0).standard_normal(16000 * 600) * 10 ** (-75 / 20) * 32767
    sf.write(path, np.round(noise).astype(np.int16), 16000, subtype="PCM_16")
    plain, t_plain = timed(llm, str(path), word_timestamps=True)
    skipped, t_skipped = timed(llm, str(path), word_timestamps=True, hallucination_silence_threshold=2)
    print(f"\n10 min of noise at -75 dBFS, tiny.en, sequential, word timestamps: "
          f"without the option {len(plain.segments)} segments {plain.text[:60]!r}... in {t_plain:.1f} s; "
          f"hallucination_silence_threshold=2: {skipped.text!r} in {t_skipped:.1f} s")
    assert plain.text.lower().count("you") > 10  # the hallucination this option is for
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
