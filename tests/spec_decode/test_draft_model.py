"""The ``draft_model`` method (``worker/draft_model.py``): a second model
proposes the drafts. Greedy requests keep exactly the tokens they give without
speculation, whatever the draft (an int8 self-draft sharing the target's
cache, a copy of the target or another model in a pool of their own), beside
requests that do not speculate; preemption and aborts leave every block free."""
from __future__ import annotations

import shutil

import pytest

from encdec import LLM, SamplingParams
from tests.spec_decode.test_engine_spec import (FAMILIES, _all_free, _mixed_params, _prompts, _tokens, aborted_run,
                                               preempted_run)


def _draft(model: str, k: int, **options) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k, **options}


def _acceptance(llm: LLM) -> float:
    stats = llm.llm_engine.get_stats()
    assert stats.spec_decode_num_draft_tokens > 0
    return stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_draft_tokens


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """The target, a copy of it in another directory (a draft with a pool of
    its own that agrees with the target), and the target's outputs."""
    path = FAMILIES[request.param](str(tmp_path_factory.mktemp(request.param)), seed=1)
    copy = str(tmp_path_factory.mktemp(request.param + "_copy") / "model")
    shutil.copytree(path, copy)
    prompts, params = _prompts(10), _mixed_params(10)
    base = LLM(path, kv_cache_memory=16 << 20, enable_encoder_cache=False)
    return path, copy, prompts, params, _tokens(base.generate(prompts, params, use_tqdm=False), params)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("draft", ["int8 self-draft", "own pool"])
def test_greedy_draft_model_is_token_identical_in_mixed_batches(family, draft, k):
    path, copy, prompts, params, want = family
    spec = _draft(path, k, quantization="int8") if draft == "int8 self-draft" else _draft(copy, k)
    llm = LLM(path, kv_cache_memory=16 << 20, enable_encoder_cache=False, speculative_config=spec)
    assert _tokens(llm.generate(prompts, params, use_tqdm=False), params) == want
    assert 0.0 < _acceptance(llm) <= 1.0
    assert _all_free(llm)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_a_copy_in_its_own_pool_agrees_with_the_target(bart_pair, target_copy, k):
    """A copy of the target's weights, in a pool of its own: its K/V is kept
    in step with the target's tokens (the prefills run by the draft too, the
    catch-up after a round whose drafts were all kept), so its greedy drafts
    are the target's tokens."""
    target, copy = bart_pair[0], target_copy
    prompts, params = _prompts(8, seed=4), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    want = _tokens(LLM(target, kv_cache_memory=16 << 20).generate(prompts, params, use_tqdm=False))
    llm = LLM(target, kv_cache_memory=16 << 20, speculative_config=_draft(copy, k))
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == want
    assert _acceptance(llm) > 0.98


@pytest.fixture(scope="module")
def bart_pair(tmp_path_factory):
    from encdec.testing import make_random_bart

    target = make_random_bart(str(tmp_path_factory.mktemp("target")), seed=1)
    other = make_random_bart(str(tmp_path_factory.mktemp("other")), seed=2, layers=1, d_model=32, heads=2, ffn=64)
    return target, other


@pytest.mark.parametrize("k", [1, 3, 5])
def test_another_model_drafts_exactly(bart_pair, k):
    """A smaller model of another seed: its drafts are mostly rejected, and
    the tokens are still the target's."""
    target, other = bart_pair
    prompts, params = _prompts(8, seed=3), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = _tokens(LLM(target, kv_cache_memory=16 << 20).generate(prompts, params, use_tqdm=False))
    llm = LLM(target, kv_cache_memory=16 << 20, speculative_config=_draft(other, k))
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == want
    assert 0.0 <= _acceptance(llm) <= 1.0
    assert _all_free(llm)


@pytest.fixture(scope="module")
def target_copy(bart_pair, tmp_path_factory):
    """A copy of the target in another directory: a draft with a pool of its own."""
    copy = str(tmp_path_factory.mktemp("copy") / "model")
    shutil.copytree(bart_pair[0], copy)
    return copy


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("draft", ["int8 self-draft", "own pool"])
def test_preemption_while_drafting(bart_pair, target_copy, mode, draft):
    target = bart_pair[0]
    if draft == "int8 self-draft":
        # the budget holds the blocks and their bfloat16 copy (a third of it): 1.5 times the blocks' bytes
        got, want, preempted, free = preempted_run(target, _draft(target, 3, quantization="int8"), mode, pools=1.5)
    else:  # the budget holds both pools: twice the blocks' bytes for the same blocks
        got, want, preempted, free = preempted_run(target, _draft(target_copy, 3), mode, pools=2)
    assert got == want and preempted > 0 and free


def test_aborts_while_drafting_free_every_block(bart_pair, target_copy):
    drafts, unfinished, free = aborted_run(bart_pair[0], _draft(target_copy, 4))
    assert drafts > 0 and not unfinished and free


def test_a_draft_with_fewer_positions_is_refused(bart_pair, tmp_path):
    from encdec.testing import make_random_bart

    target, _ = bart_pair
    short = make_random_bart(str(tmp_path / "short"), seed=2, max_positions=64)
    with pytest.raises(ValueError, match="speculative_config.model"):
        LLM(target, kv_cache_memory=16 << 20, speculative_config=_draft(short, 2))


def _whisper_runs(model_dir: str, clips: list, k: int, **opts) -> tuple[list, list, LLM]:
    """``clips`` transcribed with an int8 self-draft and without: their
    segments (text, tokens, times, temperature), and the drafting engine."""
    from tests.spec_decode.test_spec_whisper import KW, _segments

    want = _segments(LLM(model_dir, **KW).transcribe(clips, use_tqdm=False, **opts))
    llm = LLM(model_dir, **KW, speculative_config=_draft(model_dir, k, quantization="int8"))
    return _segments(llm.transcribe(clips, use_tqdm=False, **opts)), want, llm


def test_whisper_int8_self_draft_transcribes_the_same(ct2_dir, speech_clips):
    """tiny.en (real weights) drafting for itself in int8, timestamps on: its
    drafts are mostly the target's tokens, and the segments are the ones
    without speculation."""
    _, _, audio = speech_clips
    got, want, llm = _whisper_runs(str(ct2_dir), [(a, 16000) for a in audio[:2]], 4, timestamps=True)
    assert got == want and _all_free(llm)
    assert _acceptance(llm) > 0.5


@pytest.mark.slow
def test_whisper_long_form_with_an_int8_self_draft(ct2_dir, speech_clips):
    from benchmarks.whisper_longform import build_file

    _, texts, audio = speech_clips
    wav, _ = build_file(audio, texts, seed=0, minutes=1.0)
    for k in (1, 5):
        got, want, llm = _whisper_runs(str(ct2_dir), [(wav, 16000)], k)
        assert got == want and _all_free(llm), k


def test_transcribe_stream_with_an_int8_self_draft(ct2_dir, speech_clips):
    """Live transcription offline (``transcribe_stream``): the same partial and
    final segments with drafts as without."""
    import numpy as np

    from tests.spec_decode.test_spec_whisper import KW

    wavs = speech_clips[2]
    audio = np.concatenate([wavs[0], np.zeros(4000, np.float32), wavs[1]])
    chunks = [audio[i:i + 1600] for i in range(0, len(audio), 1600)] + [None]
    want = [(s.text, s.final) for s in LLM(str(ct2_dir), **KW).transcribe_stream(chunks)]
    llm = LLM(str(ct2_dir), **KW, speculative_config=_draft(str(ct2_dir), 4, quantization="int8"))
    assert [(s.text, s.final) for s in llm.transcribe_stream(chunks)] == want
    assert _acceptance(llm) > 0.5
    assert _all_free(llm)


def test_the_cache_budget_holds_a_draft_s_own_pool(bart_pair, target_copy):
    """``kv_cache_memory`` is what the KV caches take in all: a draft with a
    pool of its own halves the blocks of a copy-of-the-target's size (each
    block has its twin there); a self-draft shares the target's blocks, and on
    CPU its bfloat16 copy of its rows' K/V takes a third of the budget."""
    target = bart_pair[0]
    budget = 16 << 20

    def blocks(spec):
        return LLM(target, kv_cache_memory=budget, speculative_config=spec).llm_engine.cache_config.num_gpu_blocks

    alone = blocks(None)
    assert blocks(_draft(target, 2, quantization="int8")) == (budget - budget // 3) // (budget // alone)
    assert blocks(_draft(target_copy, 2)) == alone // 2
