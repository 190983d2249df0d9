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
