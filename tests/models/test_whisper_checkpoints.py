"""Whisper checkpoints as they are found in the wild load and decode token-identically to HF:
no ``generation_config.json``, a minimal one, the one ``save_pretrained`` writes for a fresh
model, and a CTranslate2 directory written by the current converter (extra ALiBi scalars).

The models are tiny and random, with the real tokenizers (tiny.en's, and multilingual base's)
so that every special token sits where Whisper puts it. HF gets the same weights and the
ids we resolved from the tokenizer, set on its generation config from the tokenizer here,
independently; its suppress rules are the checkpoint's own, as ours are.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

torch.set_num_threads(1)
MAX_NEW = 24
CLIPS = 4


@pytest.fixture(scope="module")
def wavs(speech_clips) -> list[np.ndarray]:
    return speech_clips[2][:CLIPS]


def _tokenizer_dir(request, which: str) -> str:
    return request.getfixturevalue("ct2_dir" if which == "en" else "whisper_base_dir")


def make_random_whisper(out: str, tokenizer_dir: str, *, seed: int = 0) -> str:
    """A random 2-layer Whisper saved with ``save_pretrained`` (so with the generation
    config a fresh model writes), with the tokenizer of the CT2 directory
    ``tokenizer_dir``. Large weights keep greedy outputs dependent on the audio."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    from encdec.models.ct2_loader import load_ct2_tokenizer

    tok = load_ct2_tokenizer(tokenizer_dir)
    vocab = len(tok)
    sot = tok.convert_tokens_to_ids("<|startoftranscript|>")
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = WhisperConfig(vocab_size=vocab, d_model=64, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                        decoder_ffn_dim=128, decoder_start_token_id=sot, eos_token_id=eot,
                        bos_token_id=eot, pad_token_id=eot, architectures=["WhisperForConditionalGeneration"])
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "layer_norm.weight" in name else 0.0, 1.0 if "embed" in name else 0.3)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def hf_reference(path: str, tokenizer_dir: str, wavs: list[np.ndarray], **generate_kw) -> list[list[int]]:
    """HF greedy on the checkpoint, with the ids the generation config lacks taken
    from the tokenizer (independently of encdec); generated tokens, eos stripped."""
    from transformers import WhisperFeatureExtractor
    from transformers import WhisperForConditionalGeneration as HFWhisper
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    from encdec.models.ct2_loader import load_ct2_tokenizer

    model = HFWhisper.from_pretrained(path).eval()
    gc, tok = model.generation_config, load_ct2_tokenizer(tokenizer_dir)
    ids = tok.convert_tokens_to_ids
    for attr, token in (("no_timestamps_token_id", "<|notimestamps|>"), ("prev_sot_token_id", "<|startofprev|>")):
        if getattr(gc, attr, None) is None:
            setattr(gc, attr, ids(token))
    if model.config.vocab_size >= 51865 and getattr(gc, "lang_to_id", None) is None:
        gc.lang_to_id = {f"<|{c}|>": ids(f"<|{c}|>") for c in LANGUAGES if f"<|{c}|>" in tok.get_vocab()}
        gc.task_to_id = {"transcribe": ids("<|transcribe|>"), "translate": ids("<|translate|>")}
        gc.is_multilingual = True
    feats = WhisperFeatureExtractor()(wavs, sampling_rate=16000, return_tensors="pt").input_features
    with torch.inference_mode():
        seqs = model.generate(feats, max_new_tokens=MAX_NEW, do_sample=False, num_beams=1, **generate_kw)
    eos, out = gc.eos_token_id, []
    for s in seqs.tolist():
        s = s[s.index(gc.no_timestamps_token_id) + 1:] if gc.no_timestamps_token_id in s else s
        out.append(s[: s.index(eos)] if eos in s else s)
    return out


def ours(path: str, wavs: list[np.ndarray], prompt: str | None = None) -> tuple[list[list[int]], object]:
    from encdec import LLM, SamplingParams

    llm = LLM(model=path, num_threads=1, kv_cache_memory=64 * 2**20, swap_space=0.05)
    eos = llm.llm_engine.generation_config.eos_token_id
    # An empty text prompt takes the model's default decoder prompt.
    prompts = [{"prompt": prompt or "", "multi_modal_data": {"audio": (w, 16000)}} for w in wavs]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW), use_tqdm=False)
    free, _ = llm.llm_engine.num_free_blocks()
    assert free == llm.llm_engine.cache_config.num_gpu_blocks
    tokens = [[t for t in o.outputs[0].token_ids if t != eos] for o in outs]
    return tokens, llm


def _check_varied(tokens: list[list[int]]) -> None:
    assert len({tuple(t) for t in tokens}) >= 2 and max(len(t) for t in tokens) >= 5, tokens


@pytest.mark.parametrize("layout", ["no_generation_config", "minimal_generation_config", "save_pretrained"])
@pytest.mark.parametrize("which", ["en", "multilingual"])
def test_hf_checkpoint_layouts_match_hf(request, tmp_path, wavs, layout, which):
    tok_dir = _tokenizer_dir(request, which)
    path = make_random_whisper(str(tmp_path / "ckpt"), tok_dir, seed=1 if which == "en" else 2)
    gen_file = os.path.join(path, "generation_config.json")
    if layout == "no_generation_config":
        os.remove(gen_file)
    elif layout == "minimal_generation_config":
        with open(gen_file) as f:
            full = json.load(f)
        with open(gen_file, "w") as f:  # what many fine-tunes carry: the start and end ids only
            json.dump({k: full[k] for k in ("decoder_start_token_id", "eos_token_id")}, f)
    multilingual = which == "multilingual"
    prompt = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>" if multilingual else None
    got, llm = ours(path, wavs, prompt)
    ref = hf_reference(path, tok_dir, wavs, **({"language": "en", "task": "transcribe"} if multilingual else {}))
    assert got == ref
    _check_varied(got)
    gc, tok = llm.llm_engine.generation_config, llm.get_tokenizer()
    assert gc.no_timestamps_token_id == tok.convert_tokens_to_ids("<|notimestamps|>")
    assert gc.prev_sot_token_id == tok.convert_tokens_to_ids("<|startofprev|>")
    assert gc.is_multilingual is multilingual
    if multilingual:
        assert gc.lang_to_id["<|de|>"] == tok.convert_tokens_to_ids("<|de|>") and len(gc.lang_to_id) == 99
        assert gc.task_to_id == {"transcribe": 50359, "translate": 50358}


def test_ct2_from_current_converter_matches_hf(ct2_dir, tmp_path, wavs):
    """ctranslate2's own TransformersConverter writes ``decoder/alibi_use_positive_positions``
    and ``decoder/scale_alibi``; the directory loads and decodes as HF does on the same weights."""
    ctranslate2 = pytest.importorskip("ctranslate2", reason="needs pip install ctranslate2")
    from ctranslate2.converters import TransformersConverter

    from encdec.models.ct2_loader import read_model_bin

    hf_dir = make_random_whisper(str(tmp_path / "hf"), ct2_dir, seed=3)
    out = str(tmp_path / "ct2")
    TransformersConverter(hf_dir, copy_files=["tokenizer.json"]).convert(out, quantization="float32")
    _, _, variables = read_model_bin(os.path.join(out, "model.bin"))
    assert {"decoder/alibi_use_positive_positions", "decoder/scale_alibi"} <= set(variables), \
        f"ctranslate2 {ctranslate2.__version__} no longer writes the scalars this test is about"
    got, _ = ours(out, wavs)
    assert got == hf_reference(hf_dir, ct2_dir, wavs)
    _check_varied(got)


def test_ct2_scalars_we_do_not_run_are_refused(ct2_dir, tmp_path):
    from encdec.models.ct2_loader import load_ct2_whisper
    from encdec.models.ct2_writer import hf_to_ct2, write_model_bin

    cfg, _, weights = load_ct2_whisper(ct2_dir)
    weights = dict(weights)
    for name, value in (("decoder/alibi", 1), ("decoder/scale_embeddings", 1), ("decoder/activation", 1)):
        out = tmp_path / name.replace("/", "_")
        out.mkdir()
        for f in ("config.json", "vocabulary.txt", "tokenizer.json"):
            (out / f).write_bytes(open(os.path.join(ct2_dir, f), "rb").read())
        variables = hf_to_ct2(weights, cfg)
        variables[name] = np.array(value, dtype=np.int8)
        write_model_bin(out / "model.bin", variables)
        with pytest.raises(ValueError, match=f"{name} = {value} is not Whisper's architecture"):
            load_ct2_whisper(str(out))


def test_missing_ids_without_tokenizer_is_a_clear_error(ct2_dir, tmp_path):
    from encdec import LLM

    path = make_random_whisper(str(tmp_path / "ckpt"), ct2_dir)
    os.remove(os.path.join(path, "generation_config.json"))
    for f in os.listdir(path):
        if f.startswith(("tokenizer", "vocab", "merges", "special_tokens", "added_tokens")):
            os.remove(os.path.join(path, f))
    with pytest.raises(ValueError, match=r"no_timestamps_token_id \(<\|notimestamps\|>\)|no tokenizer could be read"):
        LLM(model=path, num_threads=1, kv_cache_memory=64 * 2**20, swap_space=0.05)


def test_special_tokens_resolution_rules():
    from transformers import GenerationConfig, WhisperConfig

    from encdec.models.whisper_tokens import WhisperSpecialTokens

    ids = {"<|startoftranscript|>": 50257, "<|endoftext|>": 50256, "<|notimestamps|>": 50362,
           "<|startofprev|>": 50360, "<|transcribe|>": 50358, "<|translate|>": 50357}
    cfg = WhisperConfig(vocab_size=51864)
    gc = GenerationConfig(no_timestamps_token_id=7)  # the config wins over the tokenizer
    tokens = WhisperSpecialTokens.resolve(cfg, gc, ids)
    assert (tokens.sot, tokens.eot, tokens.no_timestamps, tokens.prev_sot) == (50257, 50256, 7, 50360)
    assert not tokens.is_multilingual and dict(tokens.lang_to_id) == {}
    assert tokens.fill(gc) == ["decoder_start_token_id", "eos_token_id", "prev_sot_token_id", "is_multilingual"]
    assert not hasattr(gc, "lang_to_id")  # HF would take it as a cue to detect the language
    assert WhisperSpecialTokens.of(gc) == tokens
    with pytest.raises(ValueError, match=r"no_timestamps_token_id \(<\|notimestamps\|>\)"):
        WhisperSpecialTokens.resolve(cfg, GenerationConfig(), {k: v for k, v in ids.items()
                                                                if k != "<|notimestamps|>"})
    with pytest.raises(ValueError, match="lang_to_id"):  # multilingual, and no language tokens anywhere
        WhisperSpecialTokens.resolve(WhisperConfig(vocab_size=51865), GenerationConfig(), ids)
