"""Speculative decoding inside the engine's step (``speculative_config``, the
``ngram`` method): greedy requests give exactly the tokens they give without
it, beside requests that do not speculate (beams, a logits processor) or
speculate otherwise (sampled, log-probs) in the same batches; rejected
drafts' blocks go back; preemption and aborts while speculating leave every
block free; bad configs are refused before anything loads."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from encdec import LLM, SamplingParams, TokensPrompt
from encdec.sampling_params import BeamSearchParams
from encdec.testing import make_random_bart, make_random_m2m100, make_random_marian, make_random_mbart, make_random_t5

# make_random_bart's defaults: 2 decoder layers, d_model 64, float32; 16 slots a block, K and V
BLOCK_BYTES = 2 * 2 * 16 * 64 * 4
FAMILIES = {"bart": make_random_bart, "marian": make_random_marian, "m2m100": make_random_m2m100,
            "mbart": make_random_mbart,
            "t5": lambda path, seed: make_random_t5(path, seed=seed, d_kv=16, init_factor=1.5)}


def _spec(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def _prompts(n: int, seed: int = 0) -> list[TokensPrompt]:
    """Encoder inputs that repeat phrases (drafts copied from them get tried)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(10, 900) for _ in range(rng.randint(2, 5))]
        ids = []
        while len(ids) < rng.randint(8, 40):
            ids += phrase if rng.random() < 0.5 else [rng.randrange(10, 900)]
        out.append(TokensPrompt(prompt_token_ids=ids))
    return out


def _mixed_params(n: int) -> list:
    """Mostly plain greedy requests, and beside them a sampled one and one of
    each kind that does not speculate (or only past min_tokens)."""
    params = [SamplingParams(temperature=0, max_tokens=30 + i % 7) for i in range(n)]
    params[1] = SamplingParams(temperature=0, max_tokens=25, min_tokens=10)  # speculates after 10 tokens
    params[2] = SamplingParams(temperature=0, max_tokens=25, logit_bias={50: 2.0})  # a processor acts on it
    params[3] = SamplingParams(temperature=0.9, seed=3, max_tokens=25)  # sampled: rejection sampling
    params[4] = SamplingParams(temperature=0, max_tokens=25, logprobs=1)
    params[5] = BeamSearchParams(beam_width=2, max_tokens=12)
    params[6] = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[77, 78])
    return params


def _tokens(outs, params=None) -> list:
    """Each request's outputs, but a request that samples randomly: its draws
    differ with speculation (its distribution does not: the chi-square test)."""
    return [[(list(c.token_ids), c.finish_reason) for c in o.outputs]
            if params is None or getattr(params[i], "temperature", 0) == 0 else "sampled"
            for i, o in enumerate(outs)]


def _all_free(llm: LLM) -> bool:
    free, _ = llm.llm_engine.num_free_blocks()
    return free == llm.llm_engine.cache_config.num_gpu_blocks


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    path = FAMILIES[request.param](str(tmp_path_factory.mktemp(request.param)), seed=1)
    base = LLM(path, kv_cache_memory=16 << 20, enable_encoder_cache=False)
    prompts, params = _prompts(10), _mixed_params(10)
    return path, prompts, params, _tokens(base.generate(prompts, params, use_tqdm=False), params)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_ngram_is_token_identical_in_mixed_batches(family, k):
    path, prompts, params, want = family
    llm = LLM(path, kv_cache_memory=16 << 20, enable_encoder_cache=False, speculative_config=_spec(k))
    got = _tokens(llm.generate(prompts, params, use_tqdm=False), params)
    assert got == want
    stats = llm.llm_engine.get_stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert 0 <= stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    assert _all_free(llm)


@pytest.fixture(scope="module")
def bart_dir(tmp_path_factory):
    return make_random_bart(str(tmp_path_factory.mktemp("bart")), seed=1)


def test_copying_model_accepts_drafts_and_rolls_back_across_blocks(bart_dir, monkeypatch):
    """Random weights rarely agree with a draft; a request whose output repeats
    itself does (its own tokens are drafts). Every rollback that crosses a
    block boundary frees the block (``BlockSpaceManager.trim``): counted here."""
    llm = LLM(bart_dir, kv_cache_memory=16 << 20, speculative_config=_spec(5))
    base = LLM(bart_dir, kv_cache_memory=16 << 20)
    prompts, params = _prompts(16, seed=5), SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    bm = llm.llm_engine.scheduler.block_manager
    real, freed = bm.trim, []

    def trim(seq):
        before = len(bm.get_block_table(seq))
        real(seq)
        freed.append(before - len(bm.get_block_table(seq)))

    monkeypatch.setattr(bm, "trim", trim)
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == _tokens(
        base.generate(prompts, params, use_tqdm=False))
    assert llm.llm_engine.get_stats().spec_decode_num_accepted_tokens > 0
    assert sum(freed) > 0  # rejected drafts past a block boundary gave their block back
    assert _all_free(llm)


def preempted_run(path: str, spec: dict, mode: str, pools: float = 1) -> tuple[list, list, int, bool]:
    """A cache that holds a few requests at a time, so rows are swapped or
    recomputed mid-speculation: (tokens, tokens without speculation,
    preemptions, every block free after). ``pools``: caches the budget is split
    over (a draft with a pool of its own: 2)."""
    prompts = _prompts(12, seed=7)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    want = _tokens(LLM(path, kv_cache_memory=16 << 20).generate(prompts, params, use_tqdm=False))
    llm = LLM(path, kv_cache_memory=int(24 * BLOCK_BYTES * pools), swap_space=0.01 * pools, max_model_len=128,
              preemption_mode=mode, speculative_config=spec, max_num_seqs=12)
    got = _tokens(llm.generate(prompts, params, use_tqdm=False))
    return got, want, llm.llm_engine.stats.num_preempted, _all_free(llm)


def aborted_run(path: str, spec: dict) -> tuple[int, bool, bool]:
    """Requests aborted mid-speculation, half after a few steps, the rest
    later: (drafts verified before the first aborts, any request left, every
    block free after)."""
    llm = LLM(path, kv_cache_memory=16 << 20, speculative_config=spec)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for i, p in enumerate(_prompts(6, seed=9)):
        engine.add_request(f"r{i}", p, params)
    for _ in range(15):
        engine.step()
    drafts = engine.get_stats().spec_decode_num_draft_tokens
    engine.abort_request([f"r{i}" for i in range(0, 6, 2)])
    for _ in range(5):
        engine.step()
    engine.abort_request([f"r{i}" for i in range(1, 6, 2)])
    return drafts, engine.has_unfinished_requests(), _all_free(llm)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_while_speculating(bart_dir, mode):
    got, want, preempted, free = preempted_run(bart_dir, _spec(3), mode)
    assert got == want and preempted > 0 and free


def test_aborts_while_speculating_free_every_block(bart_dir):
    drafts, unfinished, free = aborted_run(bart_dir, _spec(4))
    assert drafts > 0 and not unfinished and free


@pytest.mark.parametrize("spec, match", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup"),
    ({"method": "draft_model", "model": "/nonexistent", "num_speculative_tokens": 2}, "speculative_config.model"),
])
def test_bad_configs_refused_before_loading(spec, match):
    with pytest.raises(ValueError, match=match):
        LLM("/nonexistent/model/dir", speculative_config=spec)


def test_async_scheduling_with_speculation_refused():
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM("/nonexistent/model/dir", speculative_config=_spec(2), async_scheduling=True)


def test_counts_reach_outputs_stats_and_metrics(bart_dir):
    from encdec.engine.async_llm_engine import StepStats
    from encdec.entrypoints.openai.metrics import ServerMetrics

    llm = LLM(bart_dir, kv_cache_memory=16 << 20, speculative_config=_spec(3))
    prompts = _prompts(6, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True) for _ in prompts]
    params[0] = SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.2)
    outs = llm.generate(prompts, params, use_tqdm=False)
    es = llm.llm_engine.get_stats()
    assert outs[0].metrics.spec_decode_off == "penalties" and outs[0].metrics.spec_decode_accepted_tokens == 0
    assert all(o.metrics.spec_decode_off is None for o in outs[1:])
    assert sum(o.metrics.spec_decode_accepted_tokens for o in outs) == es.spec_decode_num_accepted_tokens > 0
    # Every step of the five speculating requests carried drafts (ngram over their own
    # repeating outputs): rows verified, rate and mean length follow from the counts.
    assert 0 < es.spec_decode_num_drafts <= es.spec_decode_num_draft_tokens
    assert es.spec_decode_acceptance_rate == es.spec_decode_num_accepted_tokens / es.spec_decode_num_draft_tokens
    gained = sum(len(o.outputs[0].token_ids) for o in outs[1:])  # tokens of the speculating requests
    assert 1.0 < es.spec_decode_mean_accepted_length <= 1 + 3
    assert es.spec_decode_num_drafts + es.spec_decode_num_accepted_tokens <= gained
    metrics = ServerMetrics("m")
    metrics.record_step(StepStats(0.0, 0, 0, 0, 0.0, 0, 0, 0,
                                  spec_decode_num_draft_tokens=es.spec_decode_num_draft_tokens,
                                  spec_decode_num_accepted_tokens=es.spec_decode_num_accepted_tokens,
                                  spec_decode_num_drafts=es.spec_decode_num_drafts))
    text = metrics.render().decode()
    assert f'vllm:spec_decode_num_drafts_total{{model_name="m"}} {float(es.spec_decode_num_drafts)}' in text
    assert f'vllm:spec_decode_num_draft_tokens_total{{model_name="m"}} {float(es.spec_decode_num_draft_tokens)}' in text
    assert (f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} '
            f'{float(es.spec_decode_num_accepted_tokens)}') in text


def test_sampled_requests_keep_the_target_distribution(tmp_path):
    """2000 draws of a random model whose samples at a low temperature repeat
    themselves (drafts copied from them are kept often), with and without
    speculation: the same distribution of the token at each position
    (chi-square on two samples; tokens drawn under 20 times pooled)."""
    from scipy.stats import chi2_contingency

    path = make_random_bart(str(tmp_path), seed=3, d_model=32, layers=1, heads=2, ffn=64, init_std=1.0)
    prompt = TokensPrompt(prompt_token_ids=[5, 6, 7, 5, 6, 7, 8, 5, 6])
    params = SamplingParams(temperature=0.3, max_tokens=10, ignore_eos=True)
    draws = {}
    for name, spec in (("off", None), ("on", _spec(3))):
        llm = LLM(path, kv_cache_memory=32 << 20, max_num_seqs=64, speculative_config=spec, seed=11)
        draws[name] = [list(o.outputs[0].token_ids) for o in llm.generate([prompt] * 2000, params, use_tqdm=False)]
        if spec:
            assert llm.llm_engine.get_stats().spec_decode_num_accepted_tokens > 500
            assert _all_free(llm)
    for pos in range(1, 10):
        counts = [Counter(d[pos] for d in draws[name]) for name in ("off", "on")]
        common = [t for t in set(counts[0]) | set(counts[1]) if counts[0][t] + counts[1][t] >= 20]
        table = [[c[t] for t in common] + [2000 - sum(c[t] for t in common)] for c in counts]
        table = [col for col in zip(*table) if sum(col)]
        assert chi2_contingency(list(zip(*table))).pvalue > 1e-3, (pos, table)


def test_disable_by_batch_size(bart_dir):
    """vLLM's ``disable_by_batch_size``: no drafts while more requests run than
    it says; once requests finish, rows speculate again. Tokens as without
    speculation throughout, the steps in between taking the steady path."""
    prompts = _prompts(8, seed=11)
    params = [SamplingParams(temperature=0, max_tokens=12 + 8 * i, ignore_eos=True) for i in range(8)]
    want = _tokens(LLM(bart_dir, kv_cache_memory=16 << 20).generate(prompts, params, use_tqdm=False))
    drafts = {}
    for limit in (None, 3):
        llm = LLM(bart_dir, kv_cache_memory=16 << 20,
                  speculative_config={**_spec(3), "disable_by_batch_size": limit})
        assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == want
        drafts[limit] = llm.llm_engine.get_stats().spec_decode_num_draft_tokens
        assert _all_free(llm)
    assert 0 < drafts[3] < drafts[None]  # only the last three requests' tail speculated


@pytest.mark.parametrize("value, error", [(0, ValueError), ("4", TypeError), (True, TypeError)])
def test_disable_by_batch_size_is_checked(value, error):
    with pytest.raises(error, match="disable_by_batch_size"):
        LLM("/nonexistent/model/dir", speculative_config={**_spec(2), "disable_by_batch_size": value})
