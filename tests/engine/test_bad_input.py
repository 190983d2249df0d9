"""Bad input gets a clear error naming the field or the prompt's index, before
anything of the call is queued; it leaks no block and leaves the engine serving.
Each case runs through ``LLM.generate`` and through ``LLMEngine.process_requests``."""
from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from encdec import LLM, ExplicitEncoderDecoderPrompt, SamplingParams, TokensPrompt

GOOD = "The rain in spain"
# Tiny BART: 2 decoder layers, d_model 64, float32: bytes of one 16-token KV block.
BLOCK_BYTES = 2 * 2 * 16 * 64 * 4


def _all_free(llm: LLM) -> bool:
    engine = llm.llm_engine
    gpu, cpu = engine.num_free_blocks()
    cfg = engine.cache_config
    return (gpu == cfg.num_gpu_blocks and cpu == cfg.num_cpu_blocks and not engine.scheduler.get_seq_groups()
            and not engine.has_unfinished_requests())


def refuse(llm: LLM, via: str, prompts: list, params, error, match: str, **kwargs) -> str:
    """The call raises ``error`` matching ``match``; nothing of it ran or stays
    queued, every block is free, and the next good call gives the same tokens.
    Returns the error's message."""
    greedy = SamplingParams(temperature=0, max_tokens=5)
    ref = llm.generate(GOOD, greedy, use_tqdm=False)[0].outputs[0].token_ids
    done_before = llm.llm_engine.num_generated_tokens
    if via == "generate" and match.startswith("^prompt "):
        # LLM.generate may validate through process_request (no index) or process_requests.
        match = "^(" + match[1:].split(": ", 1)[0] + ": )?" + match[1:].split(": ", 1)[1]
    with pytest.raises(error, match=match) as refused:
        if via == "generate":
            llm.generate(prompts, params, use_tqdm=False, **kwargs)
        else:
            params_list = params if isinstance(params, list) else [params] * len(prompts)
            llm.llm_engine.process_requests(prompts, params_list, **kwargs)
    assert llm.llm_engine.num_generated_tokens == done_before  # no prompt of the call ran
    assert _all_free(llm)
    assert llm.generate(GOOD, greedy, use_tqdm=False)[0].outputs[0].token_ids == ref
    assert _all_free(llm)
    return str(refused.value)


VIA = pytest.mark.parametrize("via", ["generate", "process_requests"])


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
    """T5 runs now; Pegasus does not: the error names the architectures that run."""
    from transformers import PegasusConfig

    PegasusConfig(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                  decoder_attention_heads=2, vocab_size=100,
                  architectures=["PegasusForConditionalGeneration"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unsupported architecture 'PegasusForConditionalGeneration'; "
                                         "encdec runs .*'M2M100ForConditionalGeneration'.*'T5ForConditionalGeneration'"):
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


@pytest.fixture(scope="module")
def small_llm(tiny_bart):
    """40 blocks of 16 tokens: room for any one-sequence request of this model
    (256 decoder and 256 encoder positions need 32), not for every n > 1."""
    llm = LLM(tiny_bart, kv_cache_memory=40 * BLOCK_BYTES, swap_space=0.01, max_num_seqs=4)
    assert llm.llm_engine.cache_config.num_gpu_blocks == 40
    return llm


@VIA
def test_request_that_can_never_fit_is_refused_at_entry(small_llm, via):
    # n=3 x (2 + 200 tokens) = 3 x 13 self blocks + 1 cross block + 3 spare > 40.
    big = SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=200, ignore_eos=True)
    small = SamplingParams(temperature=0, max_tokens=4)
    msg = refuse(small_llm, via, ["short one", TokensPrompt(prompt_token_ids=[0, 9, 8, 2]), "third"],
           [small, big, small], ValueError,
           r"^prompt 1: the request can never fit the KV cache: it needs up to 43 blocks of 16 tokens "
           r"\(39 for decoder self-attention: a 2-token prompt \+ max_tokens=200, best_of=3; 1 for "
           r"cross-attention over 4 encoder positions; 3 the scheduler keeps in reserve\) but the "
           r"cache has 40 blocks; lower max_tokens or raise kv_cache_memory$")
    assert "max_tokens=200" in msg  # names the field to change


@VIA
def test_more_sequences_than_max_num_seqs_is_refused_at_entry(small_llm, via):
    msg = refuse(small_llm, via, ["a", "b"], [SamplingParams(max_tokens=2), SamplingParams(n=5, max_tokens=2)],
                 ValueError, r"^prompt 1: best_of \(or n\) is 5, more sequences than max_num_seqs=4")
    assert "best_of" in msg and "max_num_seqs" in msg


def test_requests_at_the_capacity_limit_run_to_completion(small_llm):
    """The entry check is not stricter than the cache: at the boundary a request
    is accepted and finishes in full; one encoder block more and it is refused."""
    tok = small_llm.get_tokenizer()
    # n=2 x 16 self blocks (2 + 254 tokens) + 2 spare + 6 cross blocks (96 tokens) = 40.
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=None, ignore_eos=True)
    fits = TokensPrompt(prompt_token_ids=tok("rain " * 94).input_ids[:96])
    assert len(fits["prompt_token_ids"]) == 96
    (out,) = small_llm.generate(fits, params, use_tqdm=False)
    assert out.error is None and [len(c.token_ids) for c in out.outputs] == [254, 254]
    assert all(c.finish_reason == "length" for c in out.outputs)
    assert _all_free(small_llm)
    too_big = TokensPrompt(prompt_token_ids=fits["prompt_token_ids"] + [5])
    with pytest.raises(ValueError, match="needs up to 41 blocks"):
        small_llm.generate(too_big, params, use_tqdm=False)
    assert _all_free(small_llm)


@VIA
@pytest.mark.parametrize("prompts, match, culprit", [
    ([GOOD, ExplicitEncoderDecoderPrompt(encoder_prompt="hi", decoder_prompt=TokensPrompt(
        prompt_token_ids=[0, 5, 4000]))], r"^prompt 1: decoder_prompt token ids \[4000\] are outside the vocabulary",
     "[4000]"),
    ([GOOD, GOOD, TokensPrompt(prompt_token_ids=np.array([5, -1]))], r"^prompt 2: prompt token ids \[-1\]", "[-1]"),
    ([GOOD, {"prompt": "x", "multi_modal_data": {"audio": (np.zeros(160, np.float32), 16000)}}],
     "^prompt 1: prompt carries audio, but this model takes no audio input", "audio"),
])
def test_bad_token_ids_and_audio_for_a_text_model(bart_llm, via, prompts, match, culprit):
    msg = refuse(bart_llm, via, prompts, SamplingParams(temperature=0, max_tokens=5), ValueError, match)
    assert culprit in msg  # the message shows what was wrong


@VIA
def test_priority_under_fcfs_is_refused_as_vllm_does(bart_llm, via):
    params = SamplingParams(temperature=0, max_tokens=3)
    if via == "process_requests":  # priority travels with the request: checked where it is queued
        with pytest.raises(TypeError, match="priority must be an int"):
            bart_llm.llm_engine.add_request("p", GOOD, params, priority=1.5)
    else:
        refuse(bart_llm, via, [GOOD, GOOD], params, ValueError, r"^prompt 1: got priority 3 but priority "
               r"scheduling is not enabled \(scheduling_policy='fcfs'\)", priority=[0, 3])
        refuse(bart_llm, via, [GOOD], params, TypeError, r"^prompt 0: priority must be an int", priority=[1.5])
        refuse(bart_llm, via, [GOOD, GOOD], params, ValueError,
               "got priority 3 but priority scheduling is not enabled", priority=[3, 3])
    engine = bart_llm.llm_engine
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        engine.add_request("p", GOOD, params, priority=2)
    assert _all_free(bart_llm)


@VIA
@pytest.mark.parametrize("kwargs, error, match", [
    (dict(skip_special_tokens="no"), TypeError, "^skip_special_tokens must be a bool, got str 'no'"),
    (dict(ignore_eos=1), TypeError, "^ignore_eos must be a bool"),
    (dict(detokenize=None), TypeError, "^detokenize must be a bool"),
    (dict(max_tokens=True), TypeError, "^max_tokens must be an int"),
    (dict(n=2.0), TypeError, "^n must be an int"),
    (dict(logit_bias={5: math.nan}), ValueError, r"^logit_bias\[5\] must be a finite number, got nan"),
    (dict(logit_bias={"x": 1.0}), ValueError, "^logit_bias keys must be token ids"),
    (dict(temperature=math.inf), ValueError, "^temperature must be a finite number, got inf"),
    (dict(repetition_penalty=math.inf), ValueError, "^repetition_penalty must be a finite number"),
    (dict(detokenize=False, stop=["."]), ValueError, "^stop strings are only supported when detokenize is True"),
    (dict(seed=2**64), ValueError, r"^seed must be a 64-bit integer, in \[-2\*\*63, 2\*\*64 - 1\]"),
    (dict(seed=-(2**63) - 1), ValueError, "^seed must be a 64-bit integer"),
])
def test_invalid_sampling_params_are_refused_before_the_call(bart_llm, via, kwargs, error, match):
    """Raised while building the params, so the call never starts; the engine
    re-checks params at entry too (a field set after construction)."""
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)
    late = SamplingParams(temperature=0.5, max_tokens=3)
    for name, value in kwargs.items():
        setattr(late, name, value)
    refuse(bart_llm, via, [GOOD, GOOD], [SamplingParams(max_tokens=3), late], error, "^prompt 1: " + match[1:])


def test_extreme_valid_seeds_run(bart_llm):
    outs = bart_llm.generate([GOOD] * 3, [SamplingParams(seed=s, n=2, max_tokens=3)
                                          for s in (2**64 - 1, -(2**63), np.uint64(2**64 - 1))],
                             use_tqdm=False)
    assert all(len(c.token_ids) == 3 for o in outs for c in o.outputs)
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids  # numpy seed == int seed
    assert _all_free(bart_llm)
