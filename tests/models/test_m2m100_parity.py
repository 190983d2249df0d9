"""M2M100: greedy and 5-beam (M2M100's default) outputs token-identical to HF
generate, with the default decoder prompt ``[</s>]`` and explicit target-language
prompts ``[</s>, __fr__]``, on both CPU attention backends. Encoder inputs and
decoder prompts holding <pad> exercise the padding-offset positions."""
from __future__ import annotations

import pytest
import torch

from encdec import TokensPrompt
from encdec.testing import M2M100_LANGS
from tests.models.seq2seq_parity import assert_beams_match_hf, check_greedy, make_llm, mixed_prompts


@pytest.fixture(scope="module")
def m2m_dir(tmp_path_factory) -> str:
    from encdec.testing import make_random_m2m100

    return make_random_m2m100(str(tmp_path_factory.mktemp("m2m100")), seed=0)


@pytest.fixture(scope="module")
def hf_m2m(m2m_dir):
    from transformers import M2M100ForConditionalGeneration

    return M2M100ForConditionalGeneration.from_pretrained(m2m_dir).eval()


@pytest.fixture(scope="module", params=["torch_sdpa", "xformers"])
def m2m_llm(request, m2m_dir):
    return make_llm(m2m_dir, request.param)


def _prompts(llm, seed: int) -> list:
    tok = llm.get_tokenizer()
    fr, de = tok.convert_tokens_to_ids([M2M100_LANGS[1], M2M100_LANGS[2]])
    first_lang = tok.convert_tokens_to_ids(M2M100_LANGS[0])
    # Raw encoder ids from 1 (<pad>) up: some inputs hold <pad>, </s> and <unk>.
    return mixed_prompts(tok, seed=seed, token_range=(1, first_lang),
                         decoder_prompts=[[2, fr], [2, de, 1, 300], [2, fr, 57]])


def test_greedy_matches_hf_generate(m2m_llm, hf_m2m):
    outs = check_greedy(m2m_llm, hf_m2m, _prompts(m2m_llm, seed=0))
    assert any(1 in o.encoder_prompt_token_ids for o in outs)  # a <pad> inside an encoder input


def test_beam_search_matches_hf_generate(m2m_llm, hf_m2m):
    assert_beams_match_hf(m2m_llm, hf_m2m, _prompts(m2m_llm, seed=1))


def test_positions_and_logits_match_hf(tmp_path):
    """Our sinusoidal table is HF's; prefill and decode log-probs within 1e-4 on a
    decoder sequence holding <pad> (positions skip it at prefill, count it after),
    on weights at a small scale (logits of order 1, where 1e-4 means something)."""
    from transformers import M2M100ForConditionalGeneration

    from encdec import ExplicitEncoderDecoderPrompt, SamplingParams
    from encdec.testing import make_random_m2m100

    path = make_random_m2m100(str(tmp_path), seed=3, init_std=0.05)
    hf_m2m = M2M100ForConditionalGeneration.from_pretrained(path).eval()
    llm = make_llm(path, "torch_sdpa")
    model = llm.llm_engine.model
    torch.testing.assert_close(model.decoder.sinusoids, hf_m2m.model.decoder.embed_positions.weights,
                               atol=0, rtol=0)
    fr = llm.get_tokenizer().convert_tokens_to_ids(M2M100_LANGS[1])
    enc = [fr] + list(range(5, 60)) + [1, 7, 2]
    prompt = ExplicitEncoderDecoderPrompt(encoder_prompt=TokensPrompt(prompt_token_ids=enc),
                                          decoder_prompt=TokensPrompt(prompt_token_ids=[2, fr, 1, 40]))
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == [2, fr, 1, 40]
    with torch.inference_mode():
        g = hf_m2m.generate(torch.tensor([enc]), decoder_input_ids=torch.tensor([[2, fr, 1, 40]]),
                            max_new_tokens=6, min_new_tokens=6, num_beams=1, do_sample=False,
                            return_dict_in_generate=True, output_logits=True)
    assert out.outputs[0].token_ids == g.sequences[0, 4:].tolist()
    ref = torch.stack(g.logits)[:, 0].log_softmax(-1)  # (steps, vocab): HF's cached decode steps
    for step, (tok, lp) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
        assert lp[tok].logprob == pytest.approx(ref[step, tok].item(), abs=1e-4)
