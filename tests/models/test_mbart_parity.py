"""mBART: greedy and 4-beam outputs token-identical to HF generate with the
checkpoint's defaults, on both CPU attention backends, in both of mBART's
language layouts: mBART-50 (decoder prompt ``[</s>, ro_RO]`` from
``forced_bos_token_id``) and cc25 / en-ro (``ro_RO`` is the decoder start)."""
from __future__ import annotations

import pytest
from encdec.testing import MBART_LANGS
from tests.models.seq2seq_parity import assert_beams_match_hf, check_greedy, make_llm, mixed_prompts


@pytest.fixture(scope="module", params=["mbart-50", "cc25"])
def mbart_dir(request, tmp_path_factory) -> tuple[str, str]:
    from encdec.testing import make_random_mbart

    return request.param, make_random_mbart(str(tmp_path_factory.mktemp("mbart")), seed=0, style=request.param)


@pytest.fixture(scope="module")
def hf_mbart(mbart_dir):
    from transformers import MBartForConditionalGeneration

    return MBartForConditionalGeneration.from_pretrained(mbart_dir[1]).eval()


@pytest.fixture(scope="module", params=["torch_sdpa", "xformers"])
def mbart_llm(request, mbart_dir):
    return make_llm(mbart_dir[1], request.param)


def _prompts(llm, style: str, seed: int) -> list:
    tok = llm.get_tokenizer()
    ro, de = tok.convert_tokens_to_ids(["ro_RO", "de_DE"])
    decoder_prompts = [[2, de], [2, ro, 500]] if style == "mbart-50" else [[de], [ro, 500]]
    return mixed_prompts(tok, seed=seed, token_range=(4, tok.convert_tokens_to_ids(MBART_LANGS[0])),
                         decoder_prompts=decoder_prompts)


def test_greedy_matches_hf_generate(mbart_dir, mbart_llm, hf_mbart):
    style = mbart_dir[0]
    outs = check_greedy(mbart_llm, hf_mbart, _prompts(mbart_llm, style, seed=0))
    ro = mbart_llm.get_tokenizer().convert_tokens_to_ids("ro_RO")
    default = [2, ro] if style == "mbart-50" else [ro]
    assert sum(o.prompt_token_ids == default for o in outs) >= len(outs) // 2


def test_beam_search_matches_hf_generate(mbart_dir, mbart_llm, hf_mbart):
    assert_beams_match_hf(mbart_llm, hf_mbart, _prompts(mbart_llm, mbart_dir[0], seed=1))


def test_language_tokens_placed_as_mbart_places_them(mbart_dir):
    """The encoder input keeps the tokenizer's language code where mBART puts it;
    the default decoder prompt is HF's start (plus the forced language for mBART-50)."""
    from encdec import SamplingParams

    style, path = mbart_dir
    llm = make_llm(path, "torch_sdpa")
    en, ro = llm.get_tokenizer().convert_tokens_to_ids(["en_XX", "ro_RO"])
    out = llm.generate("The rain in Spain", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    ids = out.encoder_prompt_token_ids
    if style == "mbart-50":
        assert (ids[0], ids[-1]) == (en, 2) and out.prompt_token_ids == [2, ro]
    else:
        assert ids[-2:] == [2, en] and out.prompt_token_ids == [ro]
