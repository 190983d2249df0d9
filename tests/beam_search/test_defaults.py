"""``LLM.generate(prompts)`` with no params is HF's ``model.generate(input_ids)``
with no arguments: the checkpoint's generation config, read as HF reads it."""
from __future__ import annotations

import pytest
import torch

from encdec import TokensPrompt
from encdec.sampling_params import BeamSearchParams, SamplingParams
from tests.beam_search.conftest import make_beam_bart, mixed_prompts

BART_LARGE_CNN = dict(num_beams=4, length_penalty=2.0, early_stopping=True, no_repeat_ngram_size=3,
                      min_length=56, max_length=142, forced_bos_token_id=0, forced_eos_token_id=2)
GREEDY_SUMMARY = dict(num_beams=1, no_repeat_ngram_size=2, min_length=9, max_length=30,
                      forced_bos_token_id=0, forced_eos_token_id=2)


def _check_matches_hf(path: str, num_prompts: int) -> None:
    from transformers import BartForConditionalGeneration

    from encdec import LLM

    hf = BartForConditionalGeneration.from_pretrained(path).eval()
    llm = LLM(path, kv_cache_memory=64 << 20, swap_space=0.05)
    encs = mixed_prompts(num_prompts, seed=11)
    outs = llm.generate([TokensPrompt(prompt_token_ids=e) for e in encs], use_tqdm=False)
    for i, (enc, out) in enumerate(zip(encs, outs)):
        with torch.inference_mode():
            expect = hf.generate(torch.tensor([enc]))[0].tolist()
        assert out.prompt_token_ids + out.outputs[0].token_ids == expect, i


def test_bart_large_cnn_defaults_are_beam_search(tmp_path):
    from encdec import LLM

    path = make_beam_bart(str(tmp_path), seed=1, eos_bias=7.0, **BART_LARGE_CNN)
    params = LLM(path, kv_cache_memory=16 << 20, swap_space=0.01).get_default_sampling_params()
    assert params == BeamSearchParams(4, 140, min_tokens=54, length_penalty=2.0, early_stopping=True,
                                      no_repeat_ngram_size=3, forced_bos_token_id=0,
                                      forced_eos_token_id=2)
    _check_matches_hf(path, num_prompts=8)


def test_greedy_defaults_apply_ngram_min_length_and_forced_eos(tmp_path):
    from encdec import LLM

    path = make_beam_bart(str(tmp_path), seed=1, eos_bias=7.0, **GREEDY_SUMMARY)
    params = LLM(path, kv_cache_memory=16 << 20, swap_space=0.01).get_default_sampling_params()
    assert isinstance(params, SamplingParams)
    assert (params.temperature, params.max_tokens, params.min_tokens, params.no_repeat_ngram_size) == \
        (0.0, 28, 7, 2)
    assert params.extra_args == {"forced_bos_token_id": 0, "forced_eos_token_id": 2}
    _check_matches_hf(path, num_prompts=12)


def test_beam_sampling_defaults_are_refused(tmp_path):
    from encdec import LLM

    path = make_beam_bart(str(tmp_path), seed=1, eos_bias=0.0, num_beams=2, do_sample=True)
    llm = LLM(path, kv_cache_memory=16 << 20, swap_space=0.01)
    with pytest.raises(ValueError, match="beam sampling"):
        llm.get_default_sampling_params()
