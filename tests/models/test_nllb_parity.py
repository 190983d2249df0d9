"""NLLB (an M2M100 checkpoint with NLLB's language codes): the target language
as the forced first token. A checkpoint whose generation config forces it
(default decoder prompt ``[</s>, fra_Latn]``) matches HF generate greedy and with
4 beams on both CPU backends; an explicit decoder prompt ``[</s>, <tgt>]`` with
``forced_bos_token_id=<tgt>`` matches HF ``generate(forced_bos_token_id=<tgt>)``,
scores included."""
from __future__ import annotations

import pytest
import torch

from encdec import ExplicitEncoderDecoderPrompt, TokensPrompt
from encdec.sampling_params import BeamSearchParams
from encdec.testing import NLLB_LANGS
from tests.models.seq2seq_parity import assert_beams_match_hf, check_greedy, make_llm, mixed_prompts

FORCED = NLLB_LANGS[1]  # fra_Latn


@pytest.fixture(scope="module")
def nllb_dir(tmp_path_factory) -> str:
    from transformers import AutoTokenizer, GenerationConfig

    from encdec.testing import make_random_nllb

    path = make_random_nllb(str(tmp_path_factory.mktemp("nllb")), seed=2)
    fra = AutoTokenizer.from_pretrained(path).convert_tokens_to_ids(FORCED)
    GenerationConfig(bos_token_id=0, decoder_start_token_id=2, eos_token_id=2, pad_token_id=1, max_length=40,
                     num_beams=4, forced_bos_token_id=fra).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_nllb(nllb_dir):
    from transformers import M2M100ForConditionalGeneration

    return M2M100ForConditionalGeneration.from_pretrained(nllb_dir).eval()


@pytest.fixture(scope="module", params=["torch_sdpa", "xformers"])
def nllb_llm(request, nllb_dir):
    return make_llm(nllb_dir, request.param)


def _prompts(llm, seed: int) -> list:
    tok = llm.get_tokenizer()
    fra = tok.convert_tokens_to_ids(FORCED)
    return mixed_prompts(tok, seed=seed, token_range=(4, tok.convert_tokens_to_ids(NLLB_LANGS[0])),
                         decoder_prompts=[[2, fra], [2]])


def test_greedy_matches_hf_generate(nllb_llm, hf_nllb):
    fra = nllb_llm.get_tokenizer().convert_tokens_to_ids(FORCED)
    outs = check_greedy(nllb_llm, hf_nllb, _prompts(nllb_llm, seed=0))
    assert all(o.prompt_token_ids == [2, fra] or o.outputs[0].token_ids[0] == fra for o in outs)


def test_beam_search_matches_hf_generate(nllb_llm, hf_nllb):
    assert_beams_match_hf(nllb_llm, hf_nllb, _prompts(nllb_llm, seed=1))


@pytest.mark.parametrize("tgt", NLLB_LANGS[2:])
def test_target_language_prompt_matches_forced_bos(nllb_dir, hf_nllb, tgt):
    """A language the checkpoint does not force: the explicit decoder prompt
    ``[</s>, <tgt>]`` with ``forced_bos_token_id=<tgt>`` is HF's
    ``generate(forced_bos_token_id=<tgt>)`` from ``[</s>]``."""
    llm = make_llm(nllb_dir, "torch_sdpa")
    tok = llm.get_tokenizer()
    lang = tok.convert_tokens_to_ids(tgt)
    texts = ["The rain in Spain falls mainly on the plain.", "A quick brown fox", "pages of memory " * 9]
    prompts = [ExplicitEncoderDecoderPrompt(encoder_prompt=t, decoder_prompt=TokensPrompt(
        prompt_token_ids=[2, lang])) for t in texts]
    params = BeamSearchParams(4, 38, forced_bos_token_id=lang)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out in outs:
        assert out.encoder_prompt_token_ids[0] == tok.convert_tokens_to_ids(NLLB_LANGS[0])  # src_lang first
        with torch.inference_mode():
            g = hf_nllb.generate(torch.tensor([out.encoder_prompt_token_ids]), forced_bos_token_id=lang,
                                 num_beams=4, max_length=40, return_dict_in_generate=True, output_scores=True)
        seq = g.sequences[0].tolist()
        ours = [2, lang] + out.outputs[0].token_ids
        assert seq[:len(ours)] == ours and all(t == 1 for t in seq[len(ours):])
        assert out.outputs[0].score == pytest.approx(g.sequences_scores[0].item(), rel=1e-5, abs=1e-4)
