"""``LLM.transcribe_stream`` on real tiny.en weights: partial segments while the
chunks come (words two passes agree on, only ever extended), each turn's final
segment equal to ``LLM.transcribe`` of its samples, turns ended by ``None``."""
from __future__ import annotations

import numpy as np
import pytest

from encdec.audio import load_audio


@pytest.fixture(scope="module")
def llm(ct2_dir):
    from encdec import LLM

    return LLM(model=str(ct2_dir), num_threads=1, kv_cache_memory=128 * 2**20, swap_space=0.1)


def _chunks(wav: np.ndarray, step: int):
    return [wav[i:i + step] for i in range(0, len(wav), step)]


def test_stream_partials_then_final_equal_transcribe(llm, speech_clips):
    wavs = speech_clips[2]
    first = np.concatenate([wavs[0], np.zeros(4000, np.float32), wavs[1]])
    second = wavs[2]
    pcm24 = (np.clip(load_audio((second, 16000), 24000), -1, 32767 / 32768) * 32768).astype("<i2")
    out16 = list(llm.transcribe_stream(_chunks(first, 1600) + [None], sample_rate=16000))
    out24 = list(llm.transcribe_stream([c.tobytes() for c in _chunks(pcm24, 2400)], sample_rate=24000))
    for out, audio in ((out16, first), (out24, (pcm24.astype(np.float32) / 32768, 24000))):
        partial = [s for s in out if not s.final]
        (final,) = [s for s in out if s.final]
        assert out[-1] is final and partial, [s.text for s in out]
        texts = [s.text for s in partial]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # only ever extended
        assert "".join(s.delta for s in partial) == texts[-1]
        (want,) = llm.transcribe(audio, use_tqdm=False)
        assert final.text == want.text and final.transcription.segments
    assert out16[-1].start == 0 and out16[-1].end == pytest.approx(len(first) / 16000)


def test_stream_refuses_bad_input_before_reading(llm):
    read = []

    def chunks():
        read.append(1)
        yield np.zeros(1600, np.float32)

    with pytest.raises(ValueError, match="sample rate must be one of"):
        llm.transcribe_stream(chunks(), sample_rate=44100)
    with pytest.raises(ValueError, match="language"):
        llm.transcribe_stream(chunks(), language="klingon")
    assert not read
    with pytest.raises(ValueError, match="chunk 1 must be a 1-D float array"):
        list(llm.transcribe_stream([np.zeros(1600, np.float32), np.zeros((2, 5), np.float32)]))
    with pytest.raises(ValueError, match="chunk 0: PCM16 audio must be an even number of bytes"):
        list(llm.transcribe_stream([b"\x00\x01\x02"]))
