"""``LLM.beam_search`` (vLLM's shape), beam and sampled requests in the same
steps, bad input refused before anything is queued, and encoder truncation."""
from __future__ import annotations

import pytest

from encdec import SamplingParams, TokensPrompt
from encdec.beam_search.params import BeamSearchOutput
from encdec.sampling_params import BeamSearchParams
from tests.beam_search.conftest import mixed_prompts


@pytest.fixture(scope="module")
def llm(beam_barts):
    from encdec import LLM

    return LLM(beam_barts["eosy"], kv_cache_memory=64 << 20, swap_space=0.05)


def test_beam_search_returns_every_hypothesis_best_first(llm):
    prompts = [TokensPrompt(prompt_token_ids=e) for e in mixed_prompts(6, seed=5)]
    # The checkpoint forces BOS and EOS (bart-large-cnn's defaults); off here, so
    # HF's length counts the generated tokens alone (the score check below).
    off = dict(forced_bos_token_id=False, forced_eos_token_id=False)
    params = BeamSearchParams(4, 20, length_penalty=1.5, **off)
    outs = llm.beam_search(prompts, params)
    gens = llm.generate(prompts, BeamSearchParams(4, 20, length_penalty=1.5, num_return_sequences=4, **off),
                        use_tqdm=False)
    for out, gen in zip(outs, gens):
        assert isinstance(out, BeamSearchOutput) and len(out.sequences) == 4
        scores = [s.score for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
        for s, c in zip(out.sequences, gen.outputs):
            assert s.tokens == [2, 0] + c.token_ids and s.score == c.score and s.text == c.text
            assert s.score == pytest.approx(s.cum_logprob / len(c.token_ids) ** 1.5, rel=1e-5)
            assert s.finish_reason in ("stop", "length")
    assert not llm.llm_engine.has_unfinished_requests()


def test_beam_and_sampled_requests_share_steps(llm):
    prompts = [TokensPrompt(prompt_token_ids=e) for e in mixed_prompts(8, seed=6)]
    beam = BeamSearchParams(3, 16, no_repeat_ngram_size=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, no_repeat_ngram_size=2)
    alone_beam = llm.generate(prompts, beam, use_tqdm=False)
    alone_greedy = llm.generate(prompts, greedy, use_tqdm=False)
    sched = llm.llm_engine.scheduler
    kinds_per_step = []
    orig = sched.schedule

    def spy():
        metas, out = orig()
        kinds_per_step.append({type(m.sampling_params).__name__ for m in metas})
        return metas, out

    sched.schedule = spy
    try:
        mixed = llm.generate(prompts, [beam if i % 2 else greedy for i in range(8)], use_tqdm=False)
    finally:
        del sched.schedule
    assert any(kinds == {"BeamRowParams", "SamplingParams"} for kinds in kinds_per_step)
    for i, out in enumerate(mixed):
        expect = (alone_beam if i % 2 else alone_greedy)[i]
        assert out.outputs[0].token_ids == expect.outputs[0].token_ids


def test_bad_beam_request_queues_nothing(llm):
    prompts = ["fine", "also fine"]
    params = [BeamSearchParams(2, 8), BeamSearchParams(2, 8, stop_token_ids=[10**6])]
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(prompts, params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_long_encoder_prompt_is_refused_or_truncated_as_hf(llm):
    tok = llm.get_tokenizer()
    text = " ".join(["rain in spain"] * 200)
    long_ids = tok(text)["input_ids"]
    assert len(long_ids) > 256  # the tiny model has 256 encoder positions
    with pytest.raises(ValueError, match="truncation=True"):
        llm.generate(text, BeamSearchParams(2, 8), use_tqdm=False)
    out = llm.generate(text, BeamSearchParams(2, 8), use_tqdm=False, truncation=True)[0]
    hf_ids = tok(text, truncation=True, max_length=256)["input_ids"]
    assert out.encoder_prompt_token_ids == hf_ids
    same = llm.generate(TokensPrompt(prompt_token_ids=hf_ids), BeamSearchParams(2, 8), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == same.outputs[0].token_ids
