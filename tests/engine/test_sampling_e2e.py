"""Sampling features end to end through LLM.generate on the tiny BART."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from encdec import LLM, SamplingParams, TokensPrompt

DUMMY = "tests.sample.dummy_processor:DummyLogitsProcessor"


def test_prompt_logprobs_match_hf(bart_llm, hf_bart):
    p = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, logprobs=2)
    from encdec import ExplicitEncoderDecoderPrompt

    out = bart_llm.generate(ExplicitEncoderDecoderPrompt(
        encoder_prompt="The rain in spain", decoder_prompt=TokensPrompt(prompt_token_ids=[0, 51, 178, 9])),
        p, use_tqdm=False)[0]
    dec = out.prompt_token_ids
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(dec)
    with torch.no_grad():
        ref = hf_bart(input_ids=torch.tensor([out.encoder_prompt_token_ids]),
                      decoder_input_ids=torch.tensor([dec])).logits[0].log_softmax(-1)
    for i in range(1, len(dec)):
        lp = out.prompt_logprobs[i]
        assert math.isclose(lp[dec[i]].logprob, ref[i - 1, dec[i]].item(), abs_tol=1e-4)
        assert len(lp) in (3, 4)  # the target plus the top 3 (the target may be among them)
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids)
    assert all(len(d) in (2, 3) and c.token_ids[i] in d for i, d in enumerate(c.logprobs))
    assert c.cumulative_logprob == pytest.approx(sum(d[t].logprob for d, t in zip(c.logprobs, c.token_ids)))


def test_prompt_token_logprobs_are_raw_and_match_hf(bart_llm, hf_bart):
    """Chosen tokens' raw log-probs at chosen prompt positions: an interior one and
    the last (the first generated token's distribution, before any processor),
    here beside a batch neighbour that asks nothing; what the row samples is unchanged."""
    from encdec import ExplicitEncoderDecoderPrompt

    banned = [5, 17]
    prompt = ExplicitEncoderDecoderPrompt(encoder_prompt="The rain in spain",
                                          decoder_prompt=TokensPrompt(prompt_token_ids=[0, 51, 178, 9]))
    asked = {1: [7, 178, 300], -1: [5, 17, 42]}
    p = SamplingParams(temperature=0, max_tokens=3, prompt_token_logprobs=asked,
                       logit_bias={t: -100.0 for t in banned})  # a processor on the asked row
    out, other = bart_llm.generate([prompt, "hello world"], [p, SamplingParams(temperature=0, max_tokens=3)],
                                   use_tqdm=False)
    plain = bart_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3,
                                                     logit_bias={t: -100.0 for t in banned}), use_tqdm=False)[0]
    dec = out.prompt_token_ids  # the decoder start token, then the four given
    assert len(dec) == 5
    inputs = {"input_ids": torch.tensor([out.encoder_prompt_token_ids]), "decoder_input_ids": torch.tensor([dec])}
    with torch.no_grad():
        ref = hf_bart(**inputs).logits[0].log_softmax(-1)
        truth = copy.deepcopy(hf_bart).double()(**inputs).logits[0].log_softmax(-1)
    assert set(out.prompt_token_logprobs) == {1, -1}
    for pos, ids in asked.items():
        got = out.prompt_token_logprobs[pos]
        assert list(got) == ids
        # As close to the float64 answer as HF's float32 one, within twice HF's
        # own float32 error on the row (~4e-5 on a -10.6 log-prob here): the
        # kernels sum in another order than HF's (short prompts' prefill runs the
        # paged C attention), so each float32 answer has its own rounding.
        tol = 2 * (ref[pos] - truth[pos]).abs().max().item()
        for t in ids:
            assert math.isclose(got[t], truth[pos, t].item(), abs_tol=tol), (pos, t, tol)
    assert out.prompt_token_logprobs[-1][5] > -50  # raw: the bias is not in it
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids and plain.prompt_token_logprobs is None
    assert other.prompt_token_logprobs is None
    from encdec import BeamSearchParams

    beam = bart_llm.generate(prompt, BeamSearchParams(3, 3, prompt_token_logprobs=asked), use_tqdm=False)[0]
    assert set(beam.prompt_token_logprobs) == set(asked)  # beam groups report them too
    for pos in asked:
        assert beam.prompt_token_logprobs[pos] == pytest.approx(out.prompt_token_logprobs[pos], abs=1e-5)
    with pytest.raises(ValueError, match="at least one token id"):
        BeamSearchParams(3, 3, prompt_token_logprobs={0: []})
    for bad, match in (({9: [1]}, "positions \\[9\\] are outside the 5-token"), ({0: []}, "at least one token id"),
                       ({0: [10**9]}, "prompt_token_logprobs token ids"), ({"a": [1]}, "prompt_token_logprobs keys"),
                       ([1], "prompt_token_logprobs must be a dict")):
        with pytest.raises((ValueError, TypeError), match=match):
            bart_llm.generate([prompt, prompt], [SamplingParams(max_tokens=1),
                                                 SamplingParams(max_tokens=1, prompt_token_logprobs=bad)],
                              use_tqdm=False)
    assert not bart_llm.llm_engine.has_unfinished_requests()


def test_dummy_processor_three_ways(tiny_bart):
    from tests.sample.dummy_processor import DummyLogitsProcessor

    prompts = ["The rain in spain", "A quick brown fox", "hello world"]
    params = [SamplingParams(temperature=0, max_tokens=5, extra_args={"target_token": 67}),
              SamplingParams(temperature=0, max_tokens=5),
              SamplingParams(temperature=0.8, seed=1, max_tokens=5, extra_args={"target_token": 99})]
    plain = LLM(tiny_bart, kv_cache_memory=16 << 20, swap_space=0.01)
    base = plain.generate(prompts, params, use_tqdm=False)
    for spec in (DUMMY, DummyLogitsProcessor):
        llm = LLM(tiny_bart, kv_cache_memory=16 << 20, swap_space=0.01, logits_processors=[spec])
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert outs[0].outputs[0].token_ids == [67] * 5
        assert outs[1].outputs[0].token_ids == base[1].outputs[0].token_ids
        assert outs[2].outputs[0].token_ids == [99] * 5
        with pytest.raises(ValueError, match="target_token"):
            llm.generate(prompts, [params[0], SamplingParams(extra_args={"target_token": -5}), params[1]],
                         use_tqdm=False)
        again = llm.generate(prompts[1], params[1], use_tqdm=False)[0]
        assert again.outputs[0].token_ids == base[1].outputs[0].token_ids


def test_dummy_processor_from_entry_point(tiny_bart, monkeypatch):
    from importlib import metadata

    from tests.sample.dummy_processor import DummyLogitsProcessor

    ep = metadata.EntryPoint(name="dummy", value=DUMMY, group="encdec.logits_processors")
    real = metadata.entry_points

    def fake(**kw):
        if kw.get("group") == "encdec.logits_processors":
            return metadata.EntryPoints([ep])
        return real(**kw)

    monkeypatch.setattr(metadata, "entry_points", fake)
    llm = LLM(tiny_bart, kv_cache_memory=16 << 20, swap_space=0.01)
    assert any(isinstance(p, DummyLogitsProcessor) for p in llm.llm_engine.worker.input_batch.logitsprocs.all)
    out = llm.generate("x y z", SamplingParams(temperature=0, max_tokens=3, extra_args={"target_token": 42}),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [42] * 3


def test_seed_is_independent_of_batch(bart_llm):
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=12)
    alone = bart_llm.generate("A quick brown fox", p, use_tqdm=False)[0].outputs[0].token_ids
    batch = bart_llm.generate(["other", "A quick brown fox", "more text here"],
                              [SamplingParams(temperature=1.0, max_tokens=20), p,
                               SamplingParams(temperature=0.5, seed=7, max_tokens=3)], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone


def test_n_and_best_of(bart_llm):
    outs = bart_llm.generate("The rain in spain", SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8),
                             use_tqdm=False)[0]
    assert [c.index for c in outs.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in outs.outputs}) >= 2
    best = bart_llm.generate("The rain in spain", SamplingParams(n=2, best_of=4, temperature=1.0, seed=3,
                                                                max_tokens=8, logprobs=0), use_tqdm=False)[0]
    assert len(best.outputs) == 2
    assert best.outputs[0].cumulative_logprob >= best.outputs[1].cumulative_logprob
    free_gpu, _ = bart_llm.llm_engine.num_free_blocks()
    assert free_gpu == bart_llm.llm_engine.cache_config.num_gpu_blocks


def test_stop_strings_and_token_ids(bart_llm):
    ref = bart_llm.generate("The rain in spain", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    tok3 = ref.token_ids[3]
    out = bart_llm.generate("The rain in spain", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                               stop_token_ids=[tok3]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref.token_ids[:ref.token_ids.index(tok3) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == tok3
    text = ref.text
    if len(text) > 6:
        stop = text[3:6]
        out = bart_llm.generate("The rain in spain", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                                   stop=[stop]), use_tqdm=False)[0].outputs[0]
        assert out.text == text[: text.index(stop)] and out.stop_reason == stop
