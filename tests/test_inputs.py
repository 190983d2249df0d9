"""Prompts as vLLM tokenizes them (seed 002), and the Python types users pass."""
from __future__ import annotations

import numpy as np
import pytest

from encdec import ExplicitEncoderDecoderPrompt, SamplingParams, TextPrompt, TokensPrompt
from encdec.inputs import normalize_prompts
from tests.models.test_bart_parity import hf_greedy

ENCODER = "The rain in spain falls mainly on the plain"


def test_bart_decoder_prompts_as_vllm_and_hf(bart_llm, hf_bart):
    """Done-when 4: decoder None, "", a custom string and token ids give vLLM's
    decoder ids, and greedy outputs token-identical to HF generate on them."""
    tok = bart_llm.get_tokenizer()
    hello = tok.encode("Hello", add_special_tokens=False)
    spain = tok.encode(" in spain", add_special_tokens=False)
    assert hello and spain and tok.encode("") == [0, 2]
    cases = [
        (None, [2, 0]),  # the default decoder prompt <DEC><BOS>
        ("", [2, 0, 2]),  # tokenized with the tokenizer's defaults: <s></s>, then <DEC>
        ("Hello", [2, 0, *hello, 2]),
        (TextPrompt(prompt="Hello"), [2, 0, *hello, 2]),
        (TokensPrompt(prompt_token_ids=[0, *spain]), [2, 0, *spain]),  # ids as given, <DEC> prepended
        (TokensPrompt(prompt_token_ids=[2, 0, *spain]), [2, 0, *spain]),  # already starts with <DEC>
        (TokensPrompt(prompt_token_ids=np.array([0, *spain], dtype=np.int64)), [2, 0, *spain]),
    ]
    prompts = [ExplicitEncoderDecoderPrompt(encoder_prompt=ENCODER, decoder_prompt=d) for d, _ in cases]
    outs = bart_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    enc_ids = tok(ENCODER).input_ids
    for out, (dec, want) in zip(outs, cases):
        assert out.prompt_token_ids == want, dec
        assert out.encoder_prompt_token_ids == enc_ids
        assert out.outputs[0].token_ids, dec
        assert out.outputs[0].token_ids == hf_greedy(hf_bart, enc_ids, want, 12), dec
    assert outs[2].prompt == "Hello" and outs[0].prompt is None
    # The outputs differ with the decoder prompt (the comparison proves something).
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) >= 3


def test_numpy_token_ids_and_seeds_are_accepted(bart_llm):
    ids = [0, 713, 16, 10, 129, 2]
    params = SamplingParams(temperature=0.8, seed=np.int64(7), max_tokens=np.int64(6),
                            stop_token_ids=np.array([5]), logit_bias={np.int32(11): np.float32(-2.0)})
    assert type(params.seed) is int and params.logit_bias == {11: -2.0}
    want = bart_llm.generate(TokensPrompt(prompt_token_ids=ids), SamplingParams(
        temperature=0.8, seed=7, max_tokens=6, stop_token_ids=[5], logit_bias={11: -2.0}), use_tqdm=False)
    forms = [np.array(ids), [np.int64(t) for t in ids], TokensPrompt(prompt_token_ids=np.array(ids, np.int32)),
             ExplicitEncoderDecoderPrompt(encoder_prompt=TokensPrompt(prompt_token_ids=tuple(ids)),
                                          decoder_prompt=TokensPrompt(prompt_token_ids=np.array([2, 0])))]
    for form in forms:
        out = bart_llm.generate(form, params, use_tqdm=False)
        assert len(out) == 1 and out[0].encoder_prompt_token_ids == ids
        assert out[0].outputs[0].token_ids == want[0].outputs[0].token_ids


@pytest.mark.parametrize("prompt, error, match", [
    (TokensPrompt(prompt_token_ids=np.array([[1, 2]])), TypeError, "1-D array of integers"),
    (TokensPrompt(prompt_token_ids=np.array([1.0, 2.0])), TypeError, "1-D array of integers"),
    (TokensPrompt(prompt_token_ids=[1, True]), TypeError, "list of ints"),
    (TokensPrompt(prompt_token_ids="12"), TypeError, "list of ints"),
    ({"prompt": "x", "multi_modal_data": ["audio"]}, TypeError, "multi_modal_data must be a dict"),
    ({"prompt": "x", "extra": 1}, ValueError, "unknown keys"),
])
def test_bad_prompt_types_name_the_prompt(bart_llm, prompt, error, match):
    with pytest.raises(error, match=f"^prompt 1: .*{match}"):
        bart_llm.llm_engine.process_requests(["fine", prompt], [None, None])


def test_normalize_prompts():
    assert normalize_prompts(np.array([5, 6])) == [TokensPrompt(prompt_token_ids=[5, 6])]
    assert normalize_prompts([np.int64(5), 6]) == [TokensPrompt(prompt_token_ids=[5, 6])]
    assert normalize_prompts(["a", "b"]) == ["a", "b"]
    with pytest.raises(TypeError, match="prompts must be"):
        normalize_prompts(5)
