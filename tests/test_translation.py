"""Translation prompts per family (encdec.translation), run through LLM.generate
and compared with HF generate given the same language choice."""
from __future__ import annotations

import pytest
import torch

from encdec import SamplingParams
from encdec.sampling_params import BeamSearchParams
from encdec.translation import translation_prompts, with_forced_bos

TEXTS = ["The rain in Spain falls mainly on the plain.", "A quick brown fox", "pages of memory blocks " * 6]


def _setup(path: str, hf_cls):
    from transformers import AutoConfig

    from encdec import LLM

    llm = LLM(path, kv_cache_memory=16 << 20, swap_space=0.01)
    return llm, hf_cls.from_pretrained(path).eval(), AutoConfig.from_pretrained(path)


def _hf(hf, enc: list[int], **kwargs):
    with torch.inference_mode():
        return hf.generate(torch.tensor([enc]), return_dict_in_generate=True, output_scores=True, **kwargs)


@pytest.mark.parametrize("family", ["nllb", "m2m100"])
def test_m2m100_family_matches_hf_forced_bos(tmp_path, family):
    """``<src> text </s>`` and ``[</s>, <tgt>]``: HF's tokenizer layout and
    ``generate(forced_bos_token_id=<tgt>)``, greedy and 4-beam, scores included."""
    from transformers import M2M100ForConditionalGeneration

    from encdec.testing import make_random_m2m100, make_random_nllb

    make = make_random_nllb if family == "nllb" else make_random_m2m100
    llm, hf, cfg = _setup(make(str(tmp_path), seed=4), M2M100ForConditionalGeneration)
    tok = llm.get_tokenizer()
    src, tgt = ("eng_Latn", "deu_Latn") if family == "nllb" else ("en", "de")
    plan = translation_prompts(TEXTS, hf_config=cfg, tokenizer=tok, src_lang=src, tgt_lang=tgt)
    lang = tok.convert_tokens_to_ids("deu_Latn" if family == "nllb" else "__de__")
    assert plan.forced_bos_token_id == lang
    greedy = llm.generate(plan.prompts, with_forced_bos(SamplingParams(temperature=0, max_tokens=20),
                                                        plan.forced_bos_token_id), use_tqdm=False)
    beams = llm.generate(plan.prompts, with_forced_bos(BeamSearchParams(4, 30), plan.forced_bos_token_id),
                         use_tqdm=False)
    for text, g, b in zip(TEXTS, greedy, beams):
        assert g.encoder_prompt_token_ids == tok(text).input_ids  # the tokenizer's own src_lang is English
        assert g.prompt_token_ids == [2, lang]
        ref = _hf(hf, g.encoder_prompt_token_ids, forced_bos_token_id=lang, num_beams=1, max_new_tokens=21)
        assert [2, lang] + g.outputs[0].token_ids == ref.sequences[0].tolist()
        ref = _hf(hf, b.encoder_prompt_token_ids, forced_bos_token_id=lang, num_beams=4, max_length=32)
        seq = ref.sequences[0].tolist()
        ours = [2, lang] + b.outputs[0].token_ids
        assert seq[:len(ours)] == ours and all(t == 1 for t in seq[len(ours):])
        assert b.outputs[0].score == pytest.approx(ref.sequences_scores[0].item(), rel=1e-5, abs=1e-4)


@pytest.mark.parametrize("style", ["mbart-50", "cc25"])
def test_mbart_layouts_match_hf(tmp_path, style):
    """mBART-50: ``en_XX text </s>``, target forced after </s>; cc25 / en-ro:
    ``text </s> en_XX``, the target language as the decoder start."""
    from transformers import MBartForConditionalGeneration

    from encdec.testing import make_random_mbart

    llm, hf, cfg = _setup(make_random_mbart(str(tmp_path), seed=4, style=style), MBartForConditionalGeneration)
    tok = llm.get_tokenizer()
    en, ro = tok.convert_tokens_to_ids(["en_XX", "ro_RO"])
    plan = translation_prompts(TEXTS, hf_config=cfg, tokenizer=tok, src_lang="en_XX", tgt_lang="ro_RO")
    outs = llm.generate(plan.prompts, with_forced_bos(SamplingParams(temperature=0, max_tokens=20),
                                                      plan.forced_bos_token_id), use_tqdm=False)
    for text, out in zip(TEXTS, outs):
        ids = tok(text, add_special_tokens=False).input_ids
        if style == "mbart-50":
            assert plan.forced_bos_token_id == ro
            assert out.encoder_prompt_token_ids == [en] + ids + [2] and out.prompt_token_ids == [2, ro]
            ref = _hf(hf, out.encoder_prompt_token_ids, forced_bos_token_id=ro, num_beams=1, max_new_tokens=21)
        else:
            assert plan.forced_bos_token_id is None
            assert out.encoder_prompt_token_ids == ids + [2, en] and out.prompt_token_ids == [ro]
            ref = _hf(hf, out.encoder_prompt_token_ids, decoder_start_token_id=ro, num_beams=1, max_new_tokens=20)
        assert out.prompt_token_ids + out.outputs[0].token_ids == ref.sequences[0].tolist()


def test_t5_prefix(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    from encdec.testing import make_random_t5

    path = make_random_t5(str(tmp_path), seed=1)
    tok, cfg = AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path)
    plan = translation_prompts(TEXTS[:1], hf_config=cfg, tokenizer=tok, src_lang="English", tgt_lang="German")
    assert plan.forced_bos_token_id is None
    assert plan.prompts[0]["encoder_prompt"]["prompt_token_ids"] == tok(
        "translate English to German: " + TEXTS[0]).input_ids
    assert plan.prompts[0]["decoder_prompt"] is None  # the model's default, [<pad>]
    with pytest.raises(ValueError, match="language names"):
        translation_prompts(TEXTS, hf_config=cfg, tokenizer=tok, src_lang=None, tgt_lang="German")


def test_refusals(tmp_path, tiny_bart):
    from transformers import AutoConfig, AutoTokenizer

    from encdec.testing import make_random_marian, make_random_nllb

    def plan(path, **langs):
        return translation_prompts(TEXTS, hf_config=AutoConfig.from_pretrained(path),
                                   tokenizer=AutoTokenizer.from_pretrained(path), **langs)

    with pytest.raises(ValueError, match="translate needs a model with languages .* 'bart'"):
        plan(tiny_bart, src_lang="en", tgt_lang="de")
    nllb = make_random_nllb(str(tmp_path / "nllb"), seed=0)
    with pytest.raises(ValueError, match="tgt_lang='xx_Yyyy': the m2m_100 tokenizer has no such language token"):
        plan(nllb, src_lang="eng_Latn", tgt_lang="xx_Yyyy")
    with pytest.raises(ValueError, match="needs src_lang and tgt_lang"):
        plan(nllb, src_lang=None, tgt_lang="fra_Latn")
    marian = make_random_marian(str(tmp_path / "marian"), seed=0)
    with pytest.raises(ValueError, match="one fixed source language"):
        plan(marian, src_lang="en", tgt_lang=None)
    with pytest.raises(ValueError, match="no such language token"):
        plan(marian, src_lang=None, tgt_lang="fra")  # a single-target model has no >>fra<<
    single = plan(marian, src_lang=None, tgt_lang=None)
    assert single.prompts[0]["encoder_prompt"]["prompt_token_ids"] == AutoTokenizer.from_pretrained(
        marian)(TEXTS[0]).input_ids


def _m2m100_spm_checkpoint(out_dir: str, *, seed: int = 0, max_positions: int = 48) -> str:
    """A tiny random M2M100 with HF's own ``M2M100Tokenizer`` as the hub ships it:
    ``vocab.json`` and a SentencePiece model (trained here, seeded), the language
    codes in the tokenizer's table (ids after the vocabulary), not among its
    added tokens."""
    import io
    import json
    import os

    import sentencepiece as spm
    from transformers import GenerationConfig, M2M100Config, M2M100ForConditionalGeneration, M2M100Tokenizer

    os.makedirs(out_dir, exist_ok=True)
    corpus = TEXTS + ["Der schnelle braune Fuchs springt über den faulen Hund.",
                      "Le renard brun rapide saute par-dessus le chien paresseux.",
                      "Encoder and decoder share the memory of the batch."]
    model = io.BytesIO()
    spm.set_random_generator_seed(seed)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus * 10), model_writer=model, vocab_size=120,
                                   model_type="bpe", character_coverage=1.0, bos_id=-1, eos_id=-1, unk_id=0,
                                   num_threads=1, minloglevel=2)
    with open(os.path.join(out_dir, "sentencepiece.bpe.model"), "wb") as f:
        f.write(model.getvalue())
    pieces = spm.SentencePieceProcessor(model_proto=model.getvalue())
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for i in range(pieces.get_piece_size()):
        vocab.setdefault(pieces.id_to_piece(i), len(vocab))
    with open(os.path.join(out_dir, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    tok = M2M100Tokenizer(os.path.join(out_dir, "vocab.json"), os.path.join(out_dir, "sentencepiece.bpe.model"))
    tok.save_pretrained(out_dir)
    size = max(tok.lang_token_to_id.values()) + 1 + tok.num_madeup_words
    cfg = M2M100Config(vocab_size=size, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                       decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                       max_position_embeddings=max_positions, init_std=1.0, activation_function="relu",
                       scale_embedding=True, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                       architectures=["M2M100ForConditionalGeneration"])
    torch.manual_seed(seed)
    M2M100ForConditionalGeneration(cfg).eval().save_pretrained(out_dir)
    GenerationConfig(bos_token_id=0, decoder_start_token_id=2, eos_token_id=2, pad_token_id=1,
                     max_length=40).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def m2m100_spm(tmp_path_factory):
    from transformers import AutoTokenizer, M2M100ForConditionalGeneration

    from encdec import LLM

    path = _m2m100_spm_checkpoint(str(tmp_path_factory.mktemp("m2m100_spm")))
    llm = LLM(path, kv_cache_memory=16 << 20, swap_space=0.01)
    return llm, M2M100ForConditionalGeneration.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def test_m2m100_tokenizer_language_table_matches_hf(m2m100_spm):
    """HF's ``M2M100Tokenizer`` keeps its codes in ``lang_token_to_id`` (not the
    added vocabulary): ``translate(src_lang="en", tgt_lang="de")`` equals HF's
    ``tokenizer.src_lang = "en"`` and ``generate(forced_bos_token_id=get_lang_id("de"))``,
    greedy and 4 beams."""
    llm, hf, tok = m2m100_spm
    assert type(llm.get_tokenizer()).__name__ == "M2M100Tokenizer"
    de = tok.get_lang_id("de")
    assert "__de__" not in tok.get_added_vocab() and de >= tok.vocab_size  # the case the added vocabulary misses
    tok.src_lang = "en"
    greedy = llm.translate(TEXTS, SamplingParams(temperature=0, max_tokens=20), src_lang="en", tgt_lang="de",
                           use_tqdm=False)
    beams = llm.translate(TEXTS, BeamSearchParams(4, 20), src_lang="__en__", tgt_lang="__de__", use_tqdm=False)
    for text, g, b in zip(TEXTS, greedy, beams):
        enc = tok(text).input_ids
        assert enc[0] == tok.get_lang_id("en") and g.encoder_prompt_token_ids == enc == b.encoder_prompt_token_ids
        ref = _hf(hf, enc, forced_bos_token_id=de, num_beams=1, do_sample=False, max_new_tokens=21)
        assert g.prompt_token_ids + g.outputs[0].token_ids == ref.sequences[0].tolist()
        ref = _hf(hf, enc, forced_bos_token_id=de, num_beams=4, do_sample=False, max_new_tokens=21)
        seq, ours = ref.sequences[0].tolist(), [2, de] + b.outputs[0].token_ids
        assert seq[:len(ours)] == ours and all(t == 1 for t in seq[len(ours):])
        assert b.outputs[0].score == pytest.approx(ref.sequences_scores[0].item(), rel=1e-5, abs=1e-4)
    assert len({tuple(g.outputs[0].token_ids) for g in greedy}) > 1


@pytest.mark.parametrize("code", ["</s>", "<mask>", "<pad>", "<madeupword0>", "xx", "__xx__"])
def test_m2m100_only_language_codes_are_languages(m2m100_spm, tmp_path_factory, code):
    """Special tokens and unknown codes are refused for both tokenizer kinds
    (HF's table, the added vocabulary), the message listing real codes."""
    from transformers import AutoConfig, AutoTokenizer

    from encdec.testing import make_random_m2m100

    llm = m2m100_spm[0]
    with pytest.raises(ValueError, match=rf"tgt_lang={code!r}: .*no such language token; .*'de'"):
        llm.translate(TEXTS, src_lang="en", tgt_lang=code, use_tqdm=False)
    with pytest.raises(ValueError, match=rf"src_lang={code!r}: .*no such language token"):
        llm.translate(TEXTS, src_lang=code, tgt_lang="de", use_tqdm=False)
    path = make_random_m2m100(str(tmp_path_factory.mktemp("m2m100_added")), seed=0)
    with pytest.raises(ValueError, match=rf"tgt_lang={code!r}: .*no such language token; .*'__de__'"):
        translation_prompts(TEXTS, hf_config=AutoConfig.from_pretrained(path),
                            tokenizer=AutoTokenizer.from_pretrained(path), src_lang="en", tgt_lang=code)


def test_translate_refuses_bad_input_naming_it(m2m100_spm, tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    from encdec.testing import make_random_t5

    llm = m2m100_spm[0]
    cases = [
        (dict(texts=None), TypeError, "texts must be a str or a list of str, got NoneType"),
        (dict(texts=b"bytes"), TypeError, "texts must be a str or a list of str, got bytes"),
        (dict(texts=["fine", 3]), TypeError, r"texts\[1\] must be a str, got int 3"),
        (dict(texts=[]), ValueError, "texts is empty"),
        (dict(texts="hi", src_lang=5), TypeError, "src_lang must be a str"),
        (dict(texts="hi", tgt_lang=["de"]), TypeError, "tgt_lang must be a str"),
        (dict(texts="hi", sampling_params="greedy"), TypeError, "sampling_params must be SamplingParams"),
        (dict(texts="hi", sampling_params=[None]), TypeError, "sampling_params must be SamplingParams"),
        (dict(texts="hi", truncation="yes"), TypeError, "truncation must be a bool"),
    ]
    for kwargs, error, match in cases:
        kwargs = {"src_lang": "en", "tgt_lang": "de", **kwargs}
        with pytest.raises(error, match=match):
            llm.translate(kwargs.pop("texts"), use_tqdm=False, **kwargs)
    path = make_random_t5(str(tmp_path), seed=1)
    t5 = dict(hf_config=AutoConfig.from_pretrained(path), tokenizer=AutoTokenizer.from_pretrained(path),
              src_lang="English", tgt_lang="German")
    with pytest.raises(TypeError, match=r"texts\[0\] must be a str, got int 1"):
        translation_prompts([1, 2], **t5)
    assert not llm.llm_engine.has_unfinished_requests()


def test_translate_truncation(m2m100_spm):
    """An input longer than the model's 48 positions is refused with a message
    naming the option that exists; ``truncation=True`` keeps ``<src>``, the
    first tokens and ``</s>`` (HF's ``tokenizer(truncation=True)``)."""
    llm, _, tok = m2m100_spm
    long = " ".join(TEXTS * 4)
    tok.src_lang = "en"
    assert len(tok(long).input_ids) > 48
    with pytest.raises(ValueError, match=r"pass truncation=True \(LLM.generate, LLM.translate"):
        llm.translate(long, SamplingParams(max_tokens=3), src_lang="en", tgt_lang="de", use_tqdm=False)
    out = llm.translate(long, SamplingParams(temperature=0, max_tokens=3), src_lang="en", tgt_lang="de",
                        use_tqdm=False, truncation=True)[0]
    assert out.encoder_prompt_token_ids == tok(long, truncation=True, max_length=48).input_ids
    assert len(out.outputs[0].token_ids) == 3
