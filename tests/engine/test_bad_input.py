"""Bad input gets a clear error, leaks no block, and leaves the engine serving."""
from __future__ import annotations

import json
import os

import pytest

from encdec import LLM, ExplicitEncoderDecoderPrompt, SamplingParams, TokensPrompt


def _all_free(llm: LLM) -> bool:
    gpu, cpu = llm.llm_engine.num_free_blocks()
    cfg = llm.llm_engine.cache_config
    return gpu == cfg.num_gpu_blocks and cpu == cfg.num_cpu_blocks and not llm.llm_engine.groups


@pytest.mark.parametrize(
    "prompt, match",
    [
        ("", "encoder prompt is empty"),
        (TokensPrompt(prompt_token_ids=[]), "encoder prompt is empty"),
        (TokensPrompt(prompt_token_ids=list(range(4, 400))), "longer than the model's 256"),
        (ExplicitEncoderDecoderPrompt(encoder_prompt="hi", decoder_prompt=TokensPrompt(
            prompt_token_ids=[5] * 300)), "decoder prompt is 301 tokens"),
        (TokensPrompt(prompt_token_ids=[5, 10**6]), "outside the vocabulary"),
        ({"prompt": 5}, "prompt must be a str"),
        ({"encoder_prompt": "x", "decoder_prompt": None, "bogus": 1}, "unknown keys"),
        ({"nothing": 1}, "needs 'prompt' or 'prompt_token_ids'"),
    ],
)
def test_bad_prompts_are_refused_and_engine_keeps_serving(bart_llm, prompt, match):
    good = "The rain in spain"
    ref = bart_llm.generate(good, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    with pytest.raises((ValueError, TypeError), match=match):
        bart_llm.generate([good, prompt, good], SamplingParams(temperature=0, max_tokens=5),
                          use_tqdm=False)
    assert _all_free(bart_llm)
    again = bart_llm.generate(good, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    assert again.outputs[0].token_ids == ref.outputs[0].token_ids


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=0), "n"),
        (dict(logit_bias={10**7: 1.0}), "logit_bias"),
        (dict(stop_token_ids=[-3]), "stop_token_ids"),
    ],
)
def test_invalid_sampling_params_name_the_field(bart_llm, kwargs, field):
    with pytest.raises(ValueError, match=field):
        bart_llm.generate("hello", SamplingParams(**kwargs), use_tqdm=False)
    assert _all_free(bart_llm)


def test_wrong_sampling_params_type(bart_llm):
    with pytest.raises(TypeError, match="SamplingParams"):
        bart_llm.generate("hello", {"temperature": 0}, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        bart_llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_unknown_model_path():
    with pytest.raises(ValueError, match="does not exist"):
        LLM("/nonexistent/model/dir")


def test_unsupported_architecture(tmp_path):
    from transformers import T5Config

    T5Config(d_model=16, num_layers=1, num_heads=2, d_ff=32, vocab_size=100,
             architectures=["T5ForConditionalGeneration"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unsupported architecture 'T5ForConditionalGeneration'"):
        LLM(str(tmp_path))


def test_directory_without_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(tmp_path))


def test_missing_weights(tmp_path, tiny_bart):
    cfg = json.load(open(os.path.join(tiny_bart, "config.json")))
    json.dump(cfg, open(tmp_path / "config.json", "w"))
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        LLM(str(tmp_path))


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_size=0), "block_size"),
    (dict(kv_cache_memory=10), "holds no KV block"),
    (dict(preemption_mode="never"), "preemption_mode"),
    (dict(attention_backend="flash"), "attention_backend"),
    (dict(dtype="int8"), "dtype"),
])
def test_bad_engine_options(tiny_bart, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_bart, **kwargs)


def test_request_that_never_fits_gets_an_error_and_others_complete(tiny_bart):
    # 8 blocks of 16 tokens: a 200-token encoder prompt needs 13 cross blocks.
    llm = LLM(tiny_bart, kv_cache_memory=8 * 2 * 2 * 16 * 64 * 4, swap_space=0.001)
    assert llm.llm_engine.cache_config.num_gpu_blocks == 8
    outs = llm.generate([TokensPrompt(prompt_token_ids=[5] * 200), "short one"],
                        SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert outs[0].error and "KV cache" in outs[0].error
    assert outs[0].finished and outs[0].outputs[0].token_ids == []
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) >= 1
    assert _all_free(llm)
