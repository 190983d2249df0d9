"""The language-detection step of ``TranscriptionJob`` on a small random
multilingual Whisper (CT2 layout, multilingual token ids): the detected language
equals HF ``detect_language`` on the same weights, and the windows' decoder
prompts carry it (or the given language, or the translate task)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

torch.set_num_threads(1)
LANG_IDS = list(range(50259, 50358))  # 99 language tokens of multilingual Whisper
SOT, TRANSCRIBE, TRANSLATE, NO_TS = 50258, 50359, 50358, 50363


def write_multilingual_ct2(out, tiny_en_dir: str):
    """A 2-layer random multilingual Whisper as a CT2 directory with a tokenizer:
    tiny.en's tokenizer with its special tokens moved one id up (multilingual
    vocabularies have one more regular token), so every multilingual id decodes.
    Returns HF's model with the same (float16-rounded) weights."""
    from transformers import WhisperConfig
    from transformers import WhisperForConditionalGeneration as HFWhisper

    from encdec.models.ct2_loader import load_ct2_whisper
    from encdec.models.ct2_writer import hf_to_ct2, write_model_bin

    cfg = WhisperConfig(vocab_size=51865, d_model=64, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                        decoder_ffn_dim=128, decoder_start_token_id=SOT, eos_token_id=50257)
    torch.manual_seed(1)
    hf = HFWhisper(cfg).eval()
    with torch.no_grad():  # weights large enough that the language depends on the audio
        for name, p in hf.named_parameters():
            p.normal_(1.0 if "layer_norm.weight" in name else 0.0, 1.0 if "embed" in name else 0.3)
    write_model_bin(out / "model.bin", hf_to_ct2(hf.state_dict(), cfg))
    tok = json.loads((tiny_en_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["<|filler|>"] = vocab.pop("<|endoftext|>")  # a regular token at 50256
    for added in tok["added_tokens"]:
        added["id"] += 1
    (out / "tokenizer.json").write_text(json.dumps(tok))
    by_id = {v: k for k, v in vocab.items()} | {a["id"]: a["content"] for a in tok["added_tokens"]}
    names = [by_id[i] for i in range(len(by_id))]
    names += [f"<|{i * 0.02:.2f}|>" for i in range(cfg.vocab_size - len(names))]
    (out / "vocabulary.txt").write_text("\n".join(names))
    (out / "config.json").write_text(json.dumps({"suppress_ids": [1, 2], "suppress_ids_begin": [220, 50257],
                                                 "lang_ids": LANG_IDS}))
    _, gen, weights = load_ct2_whisper(str(out))
    missing, _ = hf.load_state_dict(dict(weights), strict=False)
    assert set(missing) <= {"proj_out.weight"}
    return hf, gen


@pytest.fixture(scope="module")
def multilingual(tmp_path_factory, ct2_dir):
    from pathlib import Path

    from encdec import LLM

    out = tmp_path_factory.mktemp("ml_whisper")
    hf, gen = write_multilingual_ct2(out, Path(ct2_dir))
    llm = LLM(model=str(out), num_threads=1, kv_cache_memory=64 * 2**20, swap_space=0.05)
    return llm, hf, gen


def sounds() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    t = np.arange(16000 * 5) / 16000
    out = [(0.3 * np.sin(2 * np.pi * f * t)).astype(np.float32) for f in (150, 700, 2500)]
    out += [(0.1 * rng.standard_normal(16000 * n)).astype(np.float32) for n in (2, 3, 40)]
    return out


def test_detected_language_matches_hf(multilingual):
    from encdec import SamplingParams
    from encdec.audio import log_mel_spectrogram

    llm, hf, gen = multilingual
    audios = sounds()
    results = llm.transcribe([(a, 16000) for a in audios], use_tqdm=False,
                             sampling_params=SamplingParams(temperature=0.0, max_tokens=4))
    feats = log_mel_spectrogram([a[: 16000 * 30] for a in audios])  # HF sees each input's first window
    with torch.inference_mode():
        ref = hf.detect_language(feats, generation_config=gen).view(-1).tolist()
    by_id = {v: k[2:-2] for k, v in gen.lang_to_id.items()}
    assert [r.language for r in results] == [by_id[i] for i in ref]
    assert len({r.language for r in results}) >= 2  # the answer depends on the audio
    engine = llm.llm_engine
    assert engine.num_free_blocks()[0] == engine.cache_config.num_gpu_blocks


def test_job_requests_carry_the_language(multilingual):
    from encdec import SamplingParams
    from encdec.transcription import TranscribeOptions, TranscriptionJob

    llm, _, gen = multilingual
    engine = llm.llm_engine
    audio = (sounds()[5], 16000)  # 40 s: two windows
    params = SamplingParams(temperature=0.0, max_tokens=2)

    def run(job):
        """Drive one job by hand; returns the decoder prompts it asked for, step by step."""
        asked, rounds = [], 0
        while not job.done and rounds < 4:
            reqs, rounds = job.next_requests(), rounds + 1
            asked.append([r.prompt["decoder_prompt"]["prompt_token_ids"] for r in reqs])
            for r in reqs:
                engine.add_request(f"ml-{rounds}-{r.ticket}", r.prompt, r.params)
            outs = {}
            for _ in range(100):
                if not engine.has_unfinished_requests():
                    break
                outs.update({o.request_id: o for o in engine.step()})
            for r in reqs:
                job.add_output(outs[f"ml-{rounds}-{r.ticket}"], r.ticket)
        assert job.done
        return asked

    detect = TranscriptionJob(engine, audio, TranscribeOptions(sampling_params=params))
    asked = run(detect)
    lang = gen.lang_to_id[f"<|{detect.language}|>"]
    assert asked == [[[SOT]], [[SOT, lang, TRANSCRIBE, NO_TS]] * 2]
    given = TranscriptionJob(engine, audio, TranscribeOptions(language="german", task="translate",
                                                              timestamps=True, sampling_params=params))
    assert run(given) == [[[SOT, 50261, TRANSLATE]] * 2]
    assert given.result().language == "de"
