"""Whisper (real tiny.en weights): audio prompts that can never run are refused
before anything of the call is queued, naming the prompt's index; the types
users pass (paths, float sample rates) work; a call's audio becomes features in
one batched log-mel call."""
from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest
import soundfile as sf

from encdec import LLM, ExplicitEncoderDecoderPrompt, SamplingParams, TextPrompt, TokensPrompt

SPEECH = pathlib.Path(__file__).parent.parent / "data" / "speech"
SOT, NOTS, EOT = 50257, 50362, 50256
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
# tiny.en: 4 decoder layers x (self + cross) x 2 x 16 tokens x 384 x 4 bytes per block.
BLOCK_BYTES = 196608


@pytest.fixture(scope="module")
def llm(ct2_dir):
    """130 blocks: one request of 448 decoder positions (28 blocks) and its
    1500-position cross table (94 blocks) fits; two sampled sequences do not."""
    llm = LLM(str(ct2_dir), num_threads=1, kv_cache_memory=130 * BLOCK_BYTES, swap_space=0.1)
    assert llm.llm_engine.cache_config.num_gpu_blocks == 130
    return llm


@pytest.fixture(scope="module")
def wav():
    return sf.read(SPEECH / "s00.wav", dtype="float32")[0]


def audio_prompt(audio, dec: list[int] | None = None):
    if dec is None:
        return TextPrompt(prompt="", multi_modal_data={"audio": audio})
    return ExplicitEncoderDecoderPrompt(encoder_prompt=TextPrompt(prompt="", multi_modal_data={"audio": audio}),
                                        decoder_prompt=TokensPrompt(prompt_token_ids=dec))


def all_free(llm: LLM) -> bool:
    engine = llm.llm_engine
    cfg = engine.cache_config
    return (engine.num_free_blocks() == (cfg.num_gpu_blocks, cfg.num_cpu_blocks)
            and not engine.scheduler.get_seq_groups() and not engine.has_unfinished_requests())


@pytest.fixture(scope="module")
def ref(llm, wav):
    return llm.generate(audio_prompt((wav, 16000)), GREEDY, use_tqdm=False)[0].outputs[0].token_ids


VIA = pytest.mark.parametrize("via", ["generate", "process_requests"])


@VIA
@pytest.mark.parametrize("bad, match", [
    ("just text", "this model reads audio: the prompt needs multi_modal_data"),
    (TokensPrompt(prompt_token_ids=[SOT, NOTS]), "this model reads audio"),
    (ExplicitEncoderDecoderPrompt(encoder_prompt="text", decoder_prompt=None), "this model reads audio"),
    ("decoder-oov", r"decoder_prompt token ids \[60000\] are outside the vocabulary \(size 51864\)"),
    ("long", r"audio is 31.00 s long, but a prompt's audio is one encoder window of at most 30 s; "
             r"use LLM.transcribe"),
    ("missing", r"audio: audio file '.*missing.wav' does not exist"),
    ("rate", r"audio: audio sample_rate must be a positive integer number of Hz, got 16000.5"),
    ("n=2", r"the request can never fit the KV cache: it needs up to 152 blocks of 16 tokens \(56 for "
            r"decoder self-attention: a 2-token prompt \+ max_tokens=446, best_of=2; 94 for "
            r"cross-attention over 1500 encoder positions; 2 the scheduler keeps in reserve\) but the "
            r"cache has 130 blocks"),
])
def test_prompts_that_can_never_run_are_refused(llm, wav, ref, via, bad, match, tmp_path):
    params = [GREEDY] * 3
    if bad == "decoder-oov":  # checked although the encoder side is audio
        bad = audio_prompt((wav, 16000), [SOT, 60000])
    elif bad == "long":
        bad = audio_prompt((np.zeros(31 * 16000, np.float32), 16000))
    elif bad == "missing":
        bad = audio_prompt(str(tmp_path / "missing.wav"))
    elif bad == "rate":
        bad = audio_prompt((wav, 16000.5))
    elif bad == "n=2":
        bad = audio_prompt((wav, 16000))
        params[1] = SamplingParams(n=2, temperature=1.0, max_tokens=None)
    prompts = [audio_prompt((wav, 16000)), bad, audio_prompt((wav, 16000))]
    if via == "generate":
        done_before = llm.llm_engine.num_generated_tokens
        with pytest.raises(ValueError, match=f"^(prompt 1: )?{match}"):
            llm.generate(prompts, params, use_tqdm=False)
        assert llm.llm_engine.num_generated_tokens == done_before
    else:
        with pytest.raises(ValueError, match=f"^prompt 1: {match}"):
            llm.llm_engine.process_requests(prompts, params)
    assert all_free(llm)
    again = llm.generate(audio_prompt((wav, 16000)), GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == ref and again.outputs[0].text.strip()
    assert all_free(llm)


def test_user_types_give_the_same_tokens(llm, wav, ref):
    """pathlib.Path audio, float and numpy sample rates, numpy decoder ids, and a
    decoder text prompt tokenized without added special tokens (as vLLM does)."""
    forms = [
        audio_prompt(SPEECH / "s00.wav"),
        audio_prompt((wav, 16000.0)),
        audio_prompt((wav, np.int64(16000))),
        audio_prompt((wav, np.float32(16000))),
        audio_prompt((wav, 16000), list(np.array([SOT, NOTS]))),
        TextPrompt(prompt="<|startoftranscript|><|notimestamps|>", multi_modal_data={"audio": (wav, 16000)}),
        TokensPrompt(prompt_token_ids=np.array([SOT, NOTS]), multi_modal_data={"audio": (wav, 16000)}),
    ]
    outs = llm.generate(forms, GREEDY, use_tqdm=False)
    for form, out in zip(forms, outs):
        assert out.prompt_token_ids == [SOT, NOTS], form
        assert out.outputs[0].token_ids == ref, form
    assert all_free(llm)


def test_a_call_computes_its_log_mel_in_one_batched_call(llm, wav, monkeypatch):
    """The audio processor decodes and checks every input first, then runs one
    log-mel call for the batch; its features equal one-at-a-time ones."""
    import encdec.audio
    from encdec.models.whisper import make_audio_processor

    calls = []
    real = encdec.audio.log_mel_spectrogram

    def spy(audios, *args, **kwargs):
        calls.append(len(audios))
        return real(audios, *args, **kwargs)

    monkeypatch.setattr(encdec.audio, "log_mel_spectrogram", spy)
    process = make_audio_processor(llm.llm_engine.hf_config)
    inputs = [(wav, 16000), SPEECH / "s01.wav", str(SPEECH / "s02.wav"), (wav[:8000], 8000.0)]
    batch = process(inputs)
    assert calls == [4]
    singles = [process([a])[0] for a in inputs]
    assert calls == [4, 1, 1, 1, 1]
    for (f, n), (g, m) in zip(batch, singles):
        assert n == m == 1500 and f.shape == (80, 3000)
        np.testing.assert_allclose(f.numpy(), g.numpy(), atol=1e-5)
    calls.clear()
    with pytest.raises(ValueError, match=r"^x 1: audio file '.*nope.wav' does not exist"):
        process([(wav, 16000), os.path.join(SPEECH, "nope.wav")], labels=["x 0", "x 1"])
    assert calls == []  # checked before any features are computed
