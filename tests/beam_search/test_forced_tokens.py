"""A checkpoint's forced BOS/EOS (bart-large-cnn and distilbart carry
``forced_bos_token_id=0, forced_eos_token_id=2``) apply to requests with
explicit parameters too, as HF's ``generate`` merges the generation config
into explicit arguments; ``False`` turns them off for one request."""
from __future__ import annotations

import pytest
import torch

from encdec import ExplicitEncoderDecoderPrompt, SamplingParams, TokensPrompt
from encdec.sampling_params import BeamSearchParams
from tests.beam_search.conftest import make_beam_bart, mixed_prompts

MAX_LENGTH = 16  # HF's whole decoder sequence; ours: max_tokens after the decoder prompt
NUM_PROMPTS = 12


@pytest.fixture(scope="module")
def forced(tmp_path_factory):
    """Random BART whose generation config forces BOS and EOS and sets nothing else."""
    from transformers import BartForConditionalGeneration

    from encdec import LLM

    path = make_beam_bart(str(tmp_path_factory.mktemp("forced")), seed=3, eos_bias=0.0,
                          forced_bos_token_id=0, forced_eos_token_id=2)
    return (LLM(path, kv_cache_memory=64 << 20, swap_space=0.05),
            BartForConditionalGeneration.from_pretrained(path).eval())


def _prompts(encs):
    """Even rows: the default decoder prompt [<DEC>, <BOS>]; odd: an explicit [<DEC>]."""
    return [TokensPrompt(prompt_token_ids=e) if i % 2 == 0 else
            ExplicitEncoderDecoderPrompt(encoder_prompt=TokensPrompt(prompt_token_ids=e),
                                         decoder_prompt=TokensPrompt(prompt_token_ids=[2]))
            for i, e in enumerate(encs)]


def _hf(hf, enc, **kwargs):
    with torch.inference_mode():
        g = hf.generate(torch.tensor([enc]), max_length=MAX_LENGTH, do_sample=False,
                        return_dict_in_generate=True, output_scores=True, **kwargs)
    scores = getattr(g, "sequences_scores", None)
    return g.sequences[0].tolist(), None if scores is None else scores[0].item()


def _assert_matches_hf(llm, hf, params_for, hf_kwargs, *, forced_eos: bool):
    encs = mixed_prompts(NUM_PROMPTS, seed=17)
    prompts = _prompts(encs)
    outs = llm.generate(prompts, [params_for(len(out_prompt)) for out_prompt in
                                  ([2, 0] if i % 2 == 0 else [2] for i in range(len(encs)))],
                        use_tqdm=False)
    at_limit = ended_in_eos = 0
    for i, (enc, out) in enumerate(zip(encs, outs)):
        c = out.outputs[0]
        ours = list(out.prompt_token_ids) + list(c.token_ids)
        hf_seq, hf_score = _hf(hf, enc, **hf_kwargs)
        assert ours == hf_seq[:len(ours)] and all(t == 1 for t in hf_seq[len(ours):]), (i, ours, hf_seq)
        if hf_score is not None:
            assert c.score == pytest.approx(hf_score, abs=1e-4), (i, c.score, hf_score)
        if len(ours) == MAX_LENGTH:
            at_limit += 1
            ended_in_eos += ours[-1] == 2
    assert at_limit >= NUM_PROMPTS // 2  # the length limit, where EOS is forced, was reached
    if forced_eos:
        assert ended_in_eos == at_limit
    else:
        assert ended_in_eos < at_limit


def test_explicit_beam_params_inherit_the_checkpoint_forced_tokens(forced):
    llm, hf = forced
    _assert_matches_hf(llm, hf, lambda n: BeamSearchParams(4, MAX_LENGTH - n), dict(num_beams=4), forced_eos=True)


def test_explicit_greedy_params_inherit_the_checkpoint_forced_tokens(forced):
    llm, hf = forced
    _assert_matches_hf(llm, hf, lambda n: SamplingParams(temperature=0.0, max_tokens=MAX_LENGTH - n),
           dict(num_beams=1), forced_eos=True)


def test_forced_eos_off_per_request_matches_hf_without_it(forced):
    llm, hf = forced
    _assert_matches_hf(llm, hf, lambda n: BeamSearchParams(4, MAX_LENGTH - n, forced_eos_token_id=False),
           dict(num_beams=4, forced_eos_token_id=None), forced_eos=False)
    _assert_matches_hf(llm, hf, lambda n: SamplingParams(temperature=0.0, max_tokens=MAX_LENGTH - n,
                                             extra_args={"forced_eos_token_id": False}),
           dict(num_beams=1, forced_eos_token_id=None), forced_eos=False)


def test_bad_forced_token_is_refused_naming_the_field(forced):
    llm, _ = forced
    with pytest.raises(ValueError, match="prompt 0: forced_eos_token_id must be a token id"):
        llm.generate([TokensPrompt(prompt_token_ids=[0, 5, 2])],
                     SamplingParams(extra_args={"forced_eos_token_id": 10**6}), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
