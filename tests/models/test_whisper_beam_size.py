"""``transcribe(beam_size=5)`` is HF ``generate(num_beams=5)`` token for token on
tiny.en: a short clip (one window) and a long file (long-form: timestamps,
conditioning on previous tokens, the fallback thresholds), plus the independent
mode and the CLI flag."""
from __future__ import annotations

import numpy as np
import pytest

from tests.models.test_whisper_longform import hf_longform, long_file, ours, tiny, tiny_hf  # noqa: F401

BEAMS = 5


# "long" and "silence" take 25-35 s each: `make test-all` runs them
@pytest.mark.parametrize("which", ["short", pytest.param("long", marks=pytest.mark.slow),
                                   pytest.param("silence", marks=pytest.mark.slow)])
def test_beam_size_matches_hf_num_beams(tiny, tiny_hf, speech_clips, which):  # noqa: F811
    """"silence": 35 s of digital silence, then a sentence, at temperature 0 only,
    decoded as HF does (``skip_digital_silence=False``). Whether the silent window
    is kept depends on its average log-prob, which HF takes over each step's
    processed log-probs renormalised."""
    _, _, wavs = speech_clips
    audio = {"short": wavs[3], "long": long_file(wavs[:14]),
             "silence": np.concatenate([np.zeros(16000 * 35, np.float32), wavs[3]])}[which]
    assert (len(audio) > 30 * 16000) == (which != "short")
    # "silence": beams repeat a phrase there, which the ratio rule would retry by sampling
    temps = {"temperature": (0.0,)} if which == "silence" else {}
    gate = {"skip_digital_silence": False} if which == "silence" else {}
    got, t = ours(tiny, audio, beam_size=BEAMS, **temps, **gate)  # asserts temperature 0 everywhere: no sampled retry
    assert got == hf_longform(tiny_hf, audio, num_beams=BEAMS, **temps)
    (greedy,) = tiny.transcribe((audio, 16000), use_tqdm=False)
    print(f"\n{which}: {len(got)} segments; beams differ from greedy in "
          f"{sum(a[2] != b.tokens for a, b in zip(got, greedy.segments))} of them")
    engine = tiny.llm_engine
    assert engine.num_free_blocks()[0] == engine.cache_config.num_gpu_blocks


def test_beam_size_in_independent_mode(tiny, speech_clips):  # noqa: F811
    """One beam search per window; on a one-window clip that is the sequential
    mode's first attempt (without timestamps: the same text)."""
    _, _, wavs = speech_clips
    (ind,) = tiny.transcribe((wavs[3], 16000), beam_size=BEAMS, mode="independent", use_tqdm=False)
    (seq,) = tiny.transcribe((wavs[3], 16000), beam_size=BEAMS, use_tqdm=False)
    assert ind.text and ind.text == seq.text


def test_beam_size_options_refused():
    from encdec import SamplingParams
    from encdec.transcription import TranscribeOptions

    with pytest.raises(ValueError, match="beam_size"):
        TranscribeOptions(beam_size=0)
    with pytest.raises(ValueError, match="sampling_params.temperature must be 0"):
        TranscribeOptions(beam_size=2, mode="independent", sampling_params=SamplingParams(temperature=0.5))
    assert TranscribeOptions(beam_size=5).beam_size == 5


def test_cli_beam_size(ct2_dir, speech_clips, tiny, capsys):  # noqa: F811
    from encdec.entrypoints.transcribe_cli import main

    paths, _, _ = speech_clips
    (want,) = tiny.transcribe(paths[3], beam_size=BEAMS, use_tqdm=False)
    rc = main(["transcribe", paths[3], "--model", str(ct2_dir), "--beam-size", str(BEAMS), "--no-progress",
               "--kv-cache-memory", str(256 << 20), "--swap-space", "0.1"])
    assert rc == 0 and capsys.readouterr().out == want.text + "\n"
