"""Marian (OPUS-MT): greedy and 4-beam outputs token-identical to HF generate
with the checkpoint's defaults (<pad> as decoder start and a bad word, forced
eos), on both CPU attention backends; logits within 1e-4."""
from __future__ import annotations

import pytest
import torch

from encdec import TokensPrompt
from tests.models.seq2seq_parity import assert_beams_match_hf, check_greedy, make_llm, mixed_prompts


@pytest.fixture(scope="module")
def marian_dir(tmp_path_factory) -> str:
    """A random Marian whose <pad> logit is raised so that, without the generation
    config's bad word, <pad> would win many steps."""
    from transformers import MarianMTModel

    from encdec.testing import make_random_marian

    path = make_random_marian(str(tmp_path_factory.mktemp("marian")), seed=0)
    model = MarianMTModel.from_pretrained(path)
    with torch.no_grad():
        model.final_logits_bias[0, model.config.pad_token_id] = 5.0
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_marian(marian_dir):
    from transformers import MarianMTModel

    return MarianMTModel.from_pretrained(marian_dir).eval()


@pytest.fixture(scope="module", params=["torch_sdpa", "xformers"])
def marian_llm(request, marian_dir):
    return make_llm(marian_dir, request.param)


def _prompts(llm, seed: int) -> list:
    pad = llm.get_tokenizer().pad_token_id
    # Explicit decoder prompts start with <pad> (the decoder start) or get it prepended.
    return mixed_prompts(llm.get_tokenizer(), seed=seed, token_range=(2, pad),
                         decoder_prompts=[[pad], [pad, 300, 41], [17, 230]])


def test_greedy_matches_hf_generate(marian_llm, hf_marian):
    outs = check_greedy(marian_llm, hf_marian, _prompts(marian_llm, seed=0))
    pad = marian_llm.get_tokenizer().pad_token_id
    assert all(o.prompt_token_ids[0] == pad for o in outs)
    assert all(pad not in o.outputs[0].token_ids for o in outs)  # the generation config's bad word


def test_beam_search_matches_hf_generate(marian_llm, hf_marian):
    assert_beams_match_hf(marian_llm, hf_marian, _prompts(marian_llm, seed=1))


def test_default_prompt_and_logits_match_hf(marian_dir, hf_marian):
    """Prefill and decode logits of a model at Marian's own init scale, and the
    sinusoidal table we compute equals HF's."""
    from encdec import SamplingParams

    llm = make_llm(marian_dir, "torch_sdpa")
    model = llm.llm_engine.model
    torch.testing.assert_close(model.encoder.sinusoids, hf_marian.model.encoder.embed_positions.weight,
                               atol=0, rtol=0)
    pad = llm.get_tokenizer().pad_token_id
    enc = list(range(5, 90))
    out = llm.generate(TokensPrompt(prompt_token_ids=enc), SamplingParams(temperature=0, max_tokens=6,
                                                                          logprobs=3), use_tqdm=False)[0]
    assert out.prompt_token_ids == [pad]
    dec = [pad] + out.outputs[0].token_ids[:-1]
    with torch.no_grad():
        ref = hf_marian(input_ids=torch.tensor([enc]), decoder_input_ids=torch.tensor([dec])).logits[0]
    ref_lp = ref.log_softmax(-1)  # raw log-probs: before the bad-word mask
    for step, (tok, lp) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
        assert lp[tok].logprob == pytest.approx(ref_lp[step, tok].item(), abs=1e-4)


def test_separate_source_and_target_vocabularies(tmp_path):
    """``share_encoder_decoder_embeddings: false`` (some OPUS-MT pairs): the encoder
    and decoder embeddings differ, the LM head is tied to the decoder's."""
    from transformers import MarianMTModel

    from encdec.testing import make_random_marian

    path = make_random_marian(str(tmp_path), seed=5, share_encoder_decoder_embeddings=False,
                              decoder_vocab_size=1000)
    hf = MarianMTModel.from_pretrained(path).eval()
    assert not torch.equal(hf.model.encoder.embed_tokens.weight, hf.model.decoder.embed_tokens.weight)
    llm = make_llm(path, "torch_sdpa")
    model = llm.llm_engine.model
    assert model.lm_head.weight is model.decoder.embed_tokens.weight
    assert model.encoder.embed_tokens is not model.decoder.embed_tokens
    check_greedy(llm, hf, _prompts(llm, seed=2))
