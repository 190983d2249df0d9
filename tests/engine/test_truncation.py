"""Truncation travels on the request: vLLM's ``truncate_prompt_tokens`` (k
tokens, -1 the model's encoder positions; ``truncation_side`` "left" keeps the
last k, "right" the first k and the final eos), on ``SamplingParams`` and
``BeamSearchParams``; ``LLM.generate(..., truncation=True)`` sets it (HF's
``tokenizer(truncation=True)``) where the params do not. A cut prompt generates
what the same ids given uncut generate."""
from __future__ import annotations

import pytest

from encdec import SamplingParams, TokensPrompt
from encdec.sampling_params import BeamSearchParams

IDS = [0] + list(range(10, 60)) + [2]  # <s> ... </s>: 52 tokens of the tiny BART (256 positions)
GREEDY = dict(temperature=0, max_tokens=6)


@pytest.mark.parametrize("cls", [SamplingParams, lambda **kw: BeamSearchParams(2, 4, **kw)])
@pytest.mark.parametrize("kwargs, error, match", [
    (dict(truncate_prompt_tokens=0), ValueError, "truncate_prompt_tokens must be >= 1, or -1"),
    (dict(truncate_prompt_tokens=-2), ValueError, "truncate_prompt_tokens must be >= 1, or -1"),
    (dict(truncate_prompt_tokens=1.5), TypeError, "truncate_prompt_tokens must be an int"),
    (dict(truncate_prompt_tokens=True), TypeError, "truncate_prompt_tokens must be an int"),
    (dict(truncate_prompt_tokens=4, truncation_side="middle"), ValueError, "truncation_side must be one of"),
])
def test_params_refuse_bad_truncation(cls, kwargs, error, match):
    with pytest.raises(error, match=match):
        cls(**kwargs)


def _run(llm, prompt, params, **kwargs):
    return llm.generate(prompt, params, use_tqdm=False, **kwargs)[0]


@pytest.mark.parametrize("side, k, expect", [
    ("left", 10, IDS[-10:]),  # vLLM's: the last k
    ("right", 10, IDS[:9] + [2]),  # HF's: the first k, the final eos kept
    ("left", 60, IDS),  # shorter than k: unchanged
])
def test_truncate_prompt_tokens_cuts_the_encoder_prompt(bart_llm, side, k, expect):
    sampled = _run(bart_llm, TokensPrompt(prompt_token_ids=IDS),
                   SamplingParams(**GREEDY, truncate_prompt_tokens=k, truncation_side=side))
    beams = _run(bart_llm, TokensPrompt(prompt_token_ids=IDS),
                 BeamSearchParams(2, 6, truncate_prompt_tokens=k, truncation_side=side))
    assert sampled.encoder_prompt_token_ids == expect == beams.encoder_prompt_token_ids
    same = _run(bart_llm, TokensPrompt(prompt_token_ids=expect), SamplingParams(**GREEDY))
    assert sampled.outputs[0].token_ids == same.outputs[0].token_ids
    same = _run(bart_llm, TokensPrompt(prompt_token_ids=expect), BeamSearchParams(2, 6))
    assert beams.outputs[0].token_ids == same.outputs[0].token_ids


def test_minus_one_is_the_models_limit_and_more_is_refused(bart_llm):
    long = [0] + [10 + i % 200 for i in range(400)] + [2]
    out = _run(bart_llm, TokensPrompt(prompt_token_ids=long), SamplingParams(**GREEDY, truncate_prompt_tokens=-1))
    assert out.encoder_prompt_token_ids == long[-256:]
    with pytest.raises(ValueError, match="truncate_prompt_tokens=257 is more than the model's 256 encoder"):
        _run(bart_llm, TokensPrompt(prompt_token_ids=IDS), SamplingParams(**GREEDY, truncate_prompt_tokens=257))
    with pytest.raises(ValueError, match="longer than the model's 256 encoder positions; to cut it, set "
                                         "truncate_prompt_tokens"):
        _run(bart_llm, TokensPrompt(prompt_token_ids=long), SamplingParams(**GREEDY))
    assert not bart_llm.llm_engine.has_unfinished_requests()


def test_generate_truncation_sets_the_params_it_leaves_theirs(bart_llm):
    """``truncation=True``: HF's cut where the params set none (a user's params
    object untouched, default params too); an explicit ``truncate_prompt_tokens`` wins."""
    long = [0] + [10 + i % 200 for i in range(400)] + [2]
    params = SamplingParams(**GREEDY)
    outs = bart_llm.generate([TokensPrompt(prompt_token_ids=long)] * 2, params, use_tqdm=False, truncation=True)
    assert params.truncate_prompt_tokens is None
    assert [o.encoder_prompt_token_ids for o in outs] == [long[:255] + [2]] * 2
    out = _run(bart_llm, TokensPrompt(prompt_token_ids=long), None, truncation=True)
    assert out.encoder_prompt_token_ids == long[:255] + [2]
    own = SamplingParams(**GREEDY, truncate_prompt_tokens=5)
    assert _run(bart_llm, TokensPrompt(prompt_token_ids=long), own, truncation=True).encoder_prompt_token_ids \
        == long[-5:]
    with pytest.raises(TypeError, match="truncation must be a bool"):
        _run(bart_llm, TokensPrompt(prompt_token_ids=IDS), params, truncation=1)


def test_priority_is_checked_per_prompt_before_anything_is_queued(bart_llm):
    with pytest.raises(ValueError, match=r"^prompt 1: got priority 3 but priority scheduling is not enabled"):
        bart_llm.generate(["a", "b"], SamplingParams(**GREEDY), use_tqdm=False, priority=[0, 3])
    with pytest.raises(TypeError, match="^priority must be a list of ints, one per prompt, got int"):
        bart_llm.generate(["a"], SamplingParams(**GREEDY), use_tqdm=False, priority=0)
    with pytest.raises(ValueError, match="^got 1 priorities for 2 prompts"):
        bart_llm.generate(["a", "b"], SamplingParams(**GREEDY), use_tqdm=False, priority=[0])
    assert not bart_llm.llm_engine.has_unfinished_requests()
    assert [len(o.outputs[0].token_ids) > 0 for o in bart_llm.generate(
        ["a", "b"], SamplingParams(**GREEDY), use_tqdm=False, priority=[0, 0])] == [True, True]


def test_cli_generate_truncation_flags(tiny_bart, capsys):
    """``encdec generate``: a prompt past the model's positions is one error line
    naming the flags that exist; ``--truncation`` / ``--truncate-prompt-tokens`` cut it."""
    from encdec.entrypoints.cli import main

    head = ["generate", "--model", tiny_bart, "--kv-cache-memory", str(16 << 20), "--swap-space", "0.01",
            "--max-tokens", "3", "--quiet", "--json"]
    long = " ".join(["rain in spain"] * 200)
    assert main([*head, long]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--truncate-prompt-tokens" in err and "--truncation" in err
    for flags in (["--truncation"], ["--truncate-prompt-tokens", "-1"], ["--truncate-prompt-tokens", "40"]):
        assert main([*head, *flags, long]) == 0, flags
        assert len(capsys.readouterr().out.strip().splitlines()) == 1
    assert main([*head, "--truncate-prompt-tokens", "0", long]) == 2
    assert "truncate_prompt_tokens must be >= 1, or -1" in capsys.readouterr().err
