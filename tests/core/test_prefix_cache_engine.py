"""enable_prefix_caching end to end: requests with the same encoder input and
the same leading decoder tokens skip those tokens' prefill (run as decode rows
over the cached K/V) and give token for token what the engine without the
cache gives: BART, T5, n > 1, beams; hits where expected, none across encoder
inputs; every block back at the end, under a small cache and preemption too."""
from __future__ import annotations

import random

import pytest

from encdec import LLM, SamplingParams, TokensPrompt
from encdec.engine.arg_utils import EngineArgs
from encdec.inputs import ExplicitEncoderDecoderPrompt
from encdec.sampling_params import BeamSearchParams


def _prompt(enc: list[int], dec: list[int]) -> ExplicitEncoderDecoderPrompt:
    return ExplicitEncoderDecoderPrompt(encoder_prompt=TokensPrompt(prompt_token_ids=enc),
                                        decoder_prompt=TokensPrompt(prompt_token_ids=dec))


def documents_x_prompts(num_docs: int, num_prompts: int, prefix_len: int, seed: int = 0,
                        bos: int = 2) -> list[ExplicitEncoderDecoderPrompt]:
    """``num_docs`` encoder inputs, each with ``num_prompts`` decoder prompts sharing
    a ``prefix_len``-token prefix (then 1-6 tokens of their own)."""
    rng = random.Random(seed)
    docs = [[0] + [rng.randrange(4, 900) for _ in range(rng.randint(20, 60))] + [2] for _ in range(num_docs)]
    prefix = [bos] + [rng.randrange(4, 900) for _ in range(prefix_len - 1)]
    return [_prompt(doc, prefix + [rng.randrange(4, 900) for _ in range(rng.randint(1, 6))])
            for doc in docs for _ in range(num_prompts)]


def run(model: str, prompts, params, *, on: bool, waves: int = 1, **options):
    """Tokens of every request (``waves`` calls, prompts split evenly), the
    prefix cache's (queries, hits), and whether every block is back."""
    llm = LLM(model, device="cpu", kv_cache_memory=options.pop("kv_cache_memory", 64 << 20), swap_space=0.05,
              enable_prefix_caching=on, **options)
    size = -(-len(prompts) // waves)
    outs = []
    for i in range(0, len(prompts), size):
        p = params[i:i + size] if isinstance(params, list) else params
        outs += llm.generate(prompts[i:i + size], p, use_tqdm=False)
    engine = llm.llm_engine
    bm = engine.scheduler.block_manager
    stats = (bm.prefix.num_queries, bm.prefix.num_hits) if bm.prefix is not None else (0, 0)
    all_free = engine.num_free_blocks()[0] == engine.cache_config.num_gpu_blocks
    run.num_preempted = engine.scheduler.stats.num_preempted
    return [[list(c.token_ids) for c in o.outputs] for o in outs], stats, all_free


def test_prefix_caching_needs_the_encoder_cache():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineArgs(model="m", enable_prefix_caching=True, enable_encoder_cache=False)
    assert EngineArgs(model="m", enable_prefix_caching=True).cache_config().enable_prefix_caching


@pytest.mark.parametrize("waves", [1, 4])
def test_bart_documents_times_prompts_on_equals_off(tiny_bart, waves):
    prompts = documents_x_prompts(4, 4, 20)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    off, _, free_off = run(tiny_bart, prompts, params, on=False, waves=waves)
    on, (queries, hits), free_on = run(tiny_bart, prompts, params, on=True, waves=waves)
    assert on == off
    assert hits >= 16 * 12  # each later prompt of a document: at least its first 16 tokens
    assert free_on and free_off


def test_no_hit_across_encoder_inputs_with_equal_decoder_prompts(tiny_bart):
    rng = random.Random(3)
    dec = [2] + [rng.randrange(4, 900) for _ in range(40)]
    prompts = [_prompt([0, 10 + i, 11, 12, 2], dec) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    off, _, _ = run(tiny_bart, prompts, params, on=False)
    on, (queries, hits), free = run(tiny_bart, prompts, params, on=True, waves=6)
    assert on == off and hits == 0 and queries > 0 and free


def test_repeated_requests_n_and_beams(tiny_bart):
    prompts = documents_x_prompts(2, 3, 24, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True),
              BeamSearchParams(3, 8, num_return_sequences=2)] * 2
    off, _, _ = run(tiny_bart, prompts, params, on=False, waves=3)
    on, (_, hits), free = run(tiny_bart, prompts, params, on=True, waves=3)
    assert on == off and hits > 0 and free


def test_t5_on_equals_off(tmp_path):
    from encdec.testing import make_random_t5

    model = make_random_t5(str(tmp_path / "t5"), seed=0)
    prompts = documents_x_prompts(3, 3, 18, seed=2, bos=0)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    off, _, _ = run(model, prompts, params, on=False, waves=3)
    on, (_, hits), free = run(model, prompts, params, on=True, waves=3)
    assert on == off and hits > 0 and free


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_small_cache_eviction_and_preemption(tiny_bart, mode):
    prompts = documents_x_prompts(6, 4, 20, seed=9)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    small = dict(kv_cache_memory=1 << 19, max_num_seqs=12, preemption_mode=mode)
    off, _, _ = run(tiny_bart, prompts, params, on=False, waves=2, **small)
    on, (_, hits), free = run(tiny_bart, prompts, params, on=True, waves=2, **small)
    assert on == off and hits > 0 and free
    assert run.num_preempted > 0


def test_asked_prompt_log_probs_come_from_a_whole_prefill(tiny_bart):
    prompts = documents_x_prompts(2, 3, 20, seed=4)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_token_logprobs={2: [5], -1: [7]})
    got = {}
    for on in (False, True):
        llm = LLM(tiny_bart, device="cpu", kv_cache_memory=64 << 20, enable_prefix_caching=on)
        outs = [o for i in range(0, 6, 2) for o in llm.generate(prompts[i:i + 2], params, use_tqdm=False)]
        got[on] = [(list(o.outputs[0].token_ids), o.prompt_token_logprobs) for o in outs]
        assert llm.llm_engine.scheduler.block_manager.prefix is None or \
            llm.llm_engine.scheduler.block_manager.prefix.num_hits == 0
    for (tok_off, lp_off), (tok_on, lp_on) in zip(got[False], got[True]):
        assert tok_on == tok_off and lp_on.keys() == lp_off.keys()
        for p in lp_off:
            assert lp_on[p] == pytest.approx(lp_off[p], abs=1e-5)


def test_hits_reach_get_stats_and_metrics(tiny_bart):
    from encdec.engine.async_llm_engine import StepStats
    from encdec.entrypoints.openai.metrics import ServerMetrics

    llm = LLM(tiny_bart, device="cpu", kv_cache_memory=64 << 20, enable_prefix_caching=True)
    prompts = documents_x_prompts(1, 3, 20, seed=6)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    es = llm.llm_engine.get_stats()
    assert es.prefix_cache_queries == sum(len(p["decoder_prompt"]["prompt_token_ids"]) for p in prompts)
    assert es.prefix_cache_hits == 2 * 16  # two later prompts, one full 16-token block each
    metrics = ServerMetrics("m")
    for _ in range(2):  # counters take what is new since the last step
        metrics.record_step(StepStats(0.0, 0, 0, 0, 0.0, 0, 0, 0, prefix_cache_queries=es.prefix_cache_queries,
                                      prefix_cache_hits=es.prefix_cache_hits))
    text = metrics.render().decode()
    assert f'vllm:prefix_cache_hits_total{{model_name="m"}} {float(es.prefix_cache_hits)}' in text
    assert f'vllm:prefix_cache_queries_total{{model_name="m"}} {float(es.prefix_cache_queries)}' in text


def test_whisper_retry_of_a_window_with_previous_text_matches_off(ct2_dir, speech_clips):
    """What a temperature fallback does: the same window and prompt (previous
    text, then the start tokens) decoded again, at a temperature, best of n."""
    from encdec import TextPrompt

    wav, prev = speech_clips[2][3], " ".join(speech_clips[1][4:8])  # ~50 tokens of previous text
    prompt = TextPrompt(prompt=f"<|startofprev|> {prev}<|startoftranscript|><|notimestamps|>",
                        multi_modal_data={"audio": (wav, 16000)})
    attempts = [SamplingParams(temperature=0.0, max_tokens=24),
                SamplingParams(temperature=0.6, n=3, seed=1, max_tokens=24),
                SamplingParams(temperature=1.0, n=3, seed=2, max_tokens=24)]
    got = {}
    for on in (False, True):
        llm = LLM(ct2_dir, kv_cache_memory=256 << 20, swap_space=0.05, num_threads=2, enable_prefix_caching=on)
        got[on] = [[list(c.token_ids) for c in llm.generate([prompt], p, use_tqdm=False)[0].outputs]
                   for p in attempts]
        queries, hits = llm.llm_engine.scheduler.block_manager.prefix_cache_stats()
        if on:
            assert hits >= 2 * 16, (queries, hits)  # each retry skips at least a block of the prompt
        engine = llm.llm_engine
        assert engine.num_free_blocks()[0] == engine.cache_config.num_gpu_blocks
    assert got[True] == got[False]


def churn(engine, prompts: list, rng: random.Random, step_chance: float, count: int = 300) -> None:
    """``count`` requests of ``prompts`` (n = 1 greedy or n = 2 sampled, 1-12
    tokens), a step after some of them, a random live one aborted after
    others, then every step until all have finished."""
    live: list[str] = []
    for i in range(count):
        n = rng.choice([1, 1, 2])
        engine.add_request(f"r{i}", prompts[rng.randrange(len(prompts))],
                           SamplingParams(n=n, temperature=0.8 if n > 1 else 0.0, seed=i,
                                          max_tokens=rng.randint(1, 12), ignore_eos=True))
        live.append(f"r{i}")
        if rng.random() < step_chance:
            done = {o.request_id for o in engine.step()}
            live = [r for r in live if r not in done]
        if live and rng.random() < 0.25:
            engine.abort_request(live.pop(rng.randrange(len(live))))
    while engine.has_unfinished_requests():
        engine.step()


def test_many_mixed_requests_with_aborts_leak_no_block(tiny_bart):
    from encdec.engine.llm_engine import LLMEngine

    rng = random.Random(11)
    engine = LLMEngine(EngineArgs(model=tiny_bart, device="cpu", kv_cache_memory=2 << 20, swap_space=0.05,
                                  max_num_seqs=16, enable_prefix_caching=True))
    churn(engine, documents_x_prompts(5, 6, 18, seed=12), rng, step_chance=0.5)
    bm = engine.scheduler.block_manager
    assert bm.prefix_cache_stats()[1] > 0
    assert engine.num_free_blocks() == (bm.num_total_gpu_blocks, bm.num_total_cpu_blocks)
    assert not bm.block_tables and not bm.cross_block_tables


def test_bart_with_async_scheduling_on_equals_off(tiny_bart):
    # The next step is planned while one runs: a prefill may reuse blocks the running step writes.
    prompts = documents_x_prompts(4, 4, 20)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    off, _, _ = run(tiny_bart, prompts, params, on=False, waves=4, async_scheduling=True)
    on, (_, hits), free = run(tiny_bart, prompts, params, on=True, waves=4, async_scheduling=True)
    assert on == off and hits > 0 and free
