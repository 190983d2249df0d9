"""The encoder cache end to end (tiny random BART; real Whisper where its
weights are installed): requests with the same encoder input share one
encoder pass and one cross table, and every output is token-identical to a
run with the cache off, in one call and across calls, under swap and
recompute preemption, aborts and n > 1; no block leaks."""
from __future__ import annotations

import random

import pytest

from encdec import LLM, SamplingParams, TokensPrompt
from encdec.inputs import ExplicitEncoderDecoderPrompt

BLOCK_BYTES = 2 * 2 * 16 * 64 * 4  # tiny BART: 2 decoder layers, d_model 64, float32
DOCS = ["the quick brown fox jumps over the lazy dog", "rain in spain falls mainly on the plain",
        "paged attention keeps blocks of keys and values", "one two three four five six seven"]


def doc_prompts(docs: list, decoder_prompts: list[str]) -> list:
    """Several explicit decoder prompts per document, documents interleaved, plus each
    document alone (the default decoder prompt)."""
    out: list = [ExplicitEncoderDecoderPrompt(encoder_prompt=d, decoder_prompt=p)
                 for p in decoder_prompts for d in docs]
    return out + list(docs)


def make_llm(path: str, num_blocks: int = 4096, **kwargs) -> LLM:
    if num_blocks < 32:
        kwargs.setdefault("max_model_len", 128)
    return LLM(path, kv_cache_memory=num_blocks * BLOCK_BYTES, swap_space=0.01, num_threads=1, **kwargs)


def tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def assert_all_free(llm: LLM) -> None:
    engine = llm.llm_engine
    assert engine.num_free_blocks() == (engine.cache_config.num_gpu_blocks, engine.cache_config.num_cpu_blocks)
    assert not engine.scheduler.block_manager.cross_block_tables and not engine.has_unfinished_requests()


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("backend", ["torch_sdpa", "xformers"])  # xformers: its CPU reference path
def test_bart_shared_documents_match_cache_off_in_one_call_and_across_calls(tiny_bart, backend):
    if backend == "xformers":
        pytest.importorskip("xformers")
    prompts = doc_prompts(DOCS, ["Summary:", "Title", "Who is it about?"])
    off = make_llm(tiny_bart, enable_encoder_cache=False, attention_backend=backend)
    ref = [tokens(off.generate(prompts, GREEDY, use_tqdm=False)) for _ in range(2)]
    assert off.llm_engine.stats.num_encoder_passes == 2 * len(prompts)
    assert off.llm_engine.stats.encoder_cache_queries == 0
    on = make_llm(tiny_bart, attention_backend=backend)
    first = on.generate(prompts, GREEDY, use_tqdm=False)
    stats = on.llm_engine.stats
    assert stats.num_encoder_passes == len(DOCS)  # one per distinct document
    assert [o.metrics.encoder_cache_hit for o in first] == [False] * len(DOCS) + [True] * (len(prompts) - len(DOCS))
    second = on.generate(prompts, GREEDY, use_tqdm=False)  # cached-free tables revived
    assert stats.num_encoder_passes == len(DOCS)
    assert all(o.metrics.encoder_cache_hit for o in second)
    assert stats.encoder_cache_queries == 2 * len(prompts)
    assert stats.encoder_cache_hits == 2 * len(prompts) - len(DOCS)
    assert tokens(first) == ref[0] and tokens(second) == ref[1] == ref[0]
    assert_all_free(on)
    # Token prompts with the same ids as the text's share too; different ids never do.
    ids = on.get_tokenizer()(DOCS[0])["input_ids"]
    out = on.generate([TokensPrompt(prompt_token_ids=ids), TokensPrompt(prompt_token_ids=ids[:-2] + ids[-1:])],
                      GREEDY, use_tqdm=False)
    assert [o.metrics.encoder_cache_hit for o in out] == [True, False]


def _pressure_workload(seed: int = 0) -> tuple[list, list[SamplingParams]]:
    """24 requests over 6 documents (4-100 tokens), greedy, seeded n=2 and long outputs."""
    rng = random.Random(seed)
    docs = [TokensPrompt(prompt_token_ids=[rng.randrange(4, 990) for _ in range(rng.randint(4, 100))])
            for _ in range(6)]
    prompts, params = [], []
    for i in range(24):
        doc = docs[rng.randrange(len(docs))]
        prompts.append(ExplicitEncoderDecoderPrompt(encoder_prompt=doc, decoder_prompt=TokensPrompt(prompt_token_ids=[2, 0, 4 + i % 3]))
                       if i % 2 else doc)
        if i % 5 == 0:
            params.append(SamplingParams(n=2, temperature=0.9, seed=100 + i, max_tokens=rng.randint(8, 40),
                                         ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=rng.randint(4, 60), ignore_eos=True))
    return prompts, params


@pytest.fixture(scope="module")
def pressure_reference(tiny_bart):
    prompts, params = _pressure_workload()
    llm = make_llm(tiny_bart, 4096, enable_encoder_cache=False)
    return prompts, params, tokens(llm.generate(prompts, params, use_tqdm=False))


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_bart_sharing_under_preemption_matches_unconstrained_cache_off(tiny_bart, pressure_reference, mode):
    prompts, params, ref = pressure_reference
    llm = make_llm(tiny_bart, 24, preemption_mode=mode)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.error is None for o in outs)
    assert tokens(outs) == ref
    stats = llm.llm_engine.stats
    assert stats.num_preempted > 0 and stats.encoder_cache_hits > 0
    assert stats.num_swapped_in == stats.num_preempted_swap
    cache = llm.llm_engine.worker.cache_engine
    assert cache.num_swapped_out_blocks == stats.num_blocks_swapped_out
    assert cache.num_swapped_in_blocks == stats.num_blocks_swapped_in
    assert_all_free(llm)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_aborting_sharers_disturbs_nobody_and_leaks_nothing(tiny_bart, pressure_reference, mode):
    prompts, params, ref = pressure_reference
    llm = make_llm(tiny_bart, 24, preemption_mode=mode)
    engine = llm.llm_engine
    sched = engine.scheduler
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    rng = random.Random(3)
    aborted: set[str] = set()
    outs = {}
    for _ in range(2000):  # bounded; the workload needs a few hundred steps
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            outs[o.request_id] = o
        for queue in (sched.waiting, sched.running, sched.swapped):
            if queue and len(aborted) < 8 and rng.random() < 0.15:
                victim = rng.choice(list(queue)).request_id
                engine.abort_request(victim)
                aborted.add(victim)
    assert not engine.has_unfinished_requests() and aborted
    assert set(outs) == {str(i) for i in range(len(prompts))} - aborted
    for rid, o in outs.items():
        assert [c.token_ids for c in o.outputs] == ref[int(rid)], f"request {rid}"
    assert_all_free(llm)


def test_cache_off_by_engine_args_and_cli(tiny_bart):
    from encdec.engine.arg_utils import EngineArgs
    from encdec.entrypoints.cli import _add_engine_args, engine_kwargs

    assert EngineArgs(model=tiny_bart).cache_config().enable_encoder_cache
    assert not EngineArgs(model=tiny_bart, enable_encoder_cache=False).cache_config().enable_encoder_cache
    import argparse

    p = argparse.ArgumentParser()
    _add_engine_args(p)
    assert engine_kwargs(p.parse_args(["--model", "m"]))["enable_encoder_cache"] is True
    assert engine_kwargs(p.parse_args(["--model", "m", "--no-enable-encoder-cache"]))["enable_encoder_cache"] is False


def _whisper_same_clip_twice(model_dir: str, wavs: list) -> dict[bool, list]:
    """Tokens with the cache off and on (the same clip twice in one call, once
    more in the next); checks the encoder pass counts and frees."""
    from encdec import TextPrompt

    def prompt(w):
        return TextPrompt(prompt="<|startoftranscript|><|notimestamps|>", multi_modal_data={"audio": (w, 16000)})

    prompts = [prompt(wavs[0]), prompt(wavs[1]), prompt(wavs[0])]  # the same clip sent twice
    params = SamplingParams(temperature=0.0, max_tokens=48)
    results = {}
    for on in (False, True):
        llm = LLM(model_dir, kv_cache_memory=256 << 20, swap_space=0.05, num_threads=2, enable_encoder_cache=on)
        first = llm.generate(prompts, params, use_tqdm=False)
        again = llm.generate(prompts[:1], params, use_tqdm=False)  # across calls
        results[on] = tokens(first) + tokens(again)
        stats = llm.llm_engine.stats
        assert stats.num_encoder_passes == (2 if on else 4)
        assert [o.metrics.encoder_cache_hit for o in first + again] == ([False, False, True, True] if on else
                                                                        [False] * 4)
        assert_all_free(llm)
    return results


def test_whisper_tiny_same_clip_twice_matches_cache_off(ct2_dir, speech_clips):
    results = _whisper_same_clip_twice(ct2_dir, speech_clips[2][:2])
    assert results[True] == results[False]
    assert results[True][0] == results[True][2] == results[True][3]


def test_whisper_transcribe_same_file_twice_matches_cache_off(ct2_dir, speech_clips):
    files, texts = speech_clips[0][:1], speech_clips[1][:1]
    got = {}
    for on in (False, True):
        llm = LLM(ct2_dir, kv_cache_memory=256 << 20, swap_space=0.05, num_threads=2, enable_encoder_cache=on)
        runs = [llm.transcribe(files[0], use_tqdm=False) for _ in range(2)]
        got[on] = [r[0].text for r in runs]
        # Per run, one window: one attempt, which also reports P(no speech).
        assert llm.llm_engine.stats.num_encoder_passes == (1 if on else 2)
        assert_all_free(llm)
    assert got[True] == got[False] and got[True][0] == got[True][1]
    assert texts[0].lower().split()[0] in got[True][0].lower()


def test_whisper_base_transcribe_and_translate_of_one_file_match_cache_off(whisper_base_dir, speech_clips):
    """Transcribe and translate of one recording: the decoder prompts differ, the
    encoder input is the same, so with the cache on the encoder runs once."""
    file = speech_clips[0][0]
    got = {}
    for on in (False, True):
        llm = LLM(whisper_base_dir, kv_cache_memory=256 << 20, swap_space=0.05, num_threads=2,
                  enable_encoder_cache=on)
        runs = [llm.transcribe(file, language="en", task=task, use_tqdm=False)
                for task in ("transcribe", "translate")]
        got[on] = [r[0].text for r in runs]
        assert llm.llm_engine.stats.num_encoder_passes == (1 if on else 2)  # one attempt per run
        assert_all_free(llm)
    assert got[True] == got[False]
