"""Audio features as a prompt form (``multi_modal_data={"audio_features": ...}``)
on real tiny.en weights: the same output as the audio they come from; a bad
tensor is refused naming the field before anything is queued; and the live
policy's pieces (local agreement, turns) on their own."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from encdec import SamplingParams
from encdec.audio import log_mel_spectrogram
from encdec.transcription.live import Agreement, Turn, pcm16_to_float


@pytest.fixture(scope="module")
def llm(ct2_dir):
    from encdec import LLM

    return LLM(model=str(ct2_dir), num_threads=1, kv_cache_memory=128 * 2**20, swap_space=0.1)


def _prompt(mm: dict) -> dict:
    return {"encoder_prompt": {"prompt": "", "multi_modal_data": mm},
            "decoder_prompt": {"prompt_token_ids": [50257, 50362]}}  # <|startoftranscript|><|notimestamps|>


def test_features_prompt_equals_its_audio(llm, speech_clips):
    wav = speech_clips[2][0]
    feats = log_mel_spectrogram([wav], n_mels=80)[0]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    by_audio, by_feats = llm.generate([_prompt({"audio": (wav, 16000)}), _prompt({"audio_features": feats})],
                                      params, use_tqdm=False)
    assert by_feats.outputs[0].token_ids == by_audio.outputs[0].token_ids
    assert "quick" in by_feats.outputs[0].text.lower()


@pytest.mark.parametrize("bad, error, match", [
    (torch.zeros(80, 2999), ValueError, r"audio_features'\] must have shape \(80, 3000\)"),
    (torch.zeros(3000, 80), ValueError, r"must have shape"),
    (torch.zeros(80, 3000, dtype=torch.int32), TypeError, r"audio_features'\] must hold floats"),
    (torch.full((80, 3000), float("nan")), ValueError, r"NaN or infinite"),
    ([[0.0] * 3000] * 80, TypeError, r"must be a torch tensor or numpy array"),
])
def test_bad_features_are_refused_before_anything_is_queued(llm, bad, error, match):
    with pytest.raises(error, match=match):
        llm.generate([_prompt({"audio_features": bad})], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_audio_and_features_together_are_refused(llm, speech_clips):
    wav = speech_clips[2][0]
    with pytest.raises(ValueError, match="give 'audio' or 'audio_features', not both"):
        llm.generate([_prompt({"audio": (wav, 16000), "audio_features": np.zeros((80, 3000), np.float32)})],
                     SamplingParams(max_tokens=2), use_tqdm=False)


def test_local_agreement_emits_what_two_passes_share_once():
    a = Agreement()
    assert a.partial("The wig.") == ""  # one pass: nothing to agree with
    assert a.partial("The quick brown") == "The"
    assert a.partial("The quick brown fox jumps") == " quick brown"
    assert a.partial("The quick brawn fox jumps over") == ""  # disagrees with what was emitted
    assert a.partial("The quick brown fox jumps over it") == ""
    assert a.partial("The quick brown fox jumps over it.") == " fox jumps over"
    assert a.final("The quick brown fox jumps over it. Then") == " it. Then"
    assert a.text == "The quick brown fox jumps over it. Then"
    b = Agreement()
    b.partial("A b c")
    b.partial("A b d")
    assert b.final("X y") == "" and b.text == "A b"  # the final pass disagrees: no delta


def test_turn_cadence_and_input_checks():
    t = Turn(24000, partial_every=0.5)
    t.append(np.zeros(6000, np.float32))
    assert not t.partial_due()
    t.append(np.zeros(6000, np.float32))
    assert t.partial_due() and t.duration == 0.5
    with pytest.raises(ValueError, match="sample rate must be one of"):
        Turn(44100)
    with pytest.raises(ValueError, match="even number of bytes"):
        pcm16_to_float(b"\x00\x01\x02")
    assert pcm16_to_float(b"\x00\x80\xff\x7f").tolist() == [-1.0, 32767 / 32768]
