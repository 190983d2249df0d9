"""Beam groups under KV memory pressure: preempted (swapped; single-beam groups
also recomputed), resumed and aborted as units, with exactly the outputs of an
unconstrained run and no leaked block; one cross table per request."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from encdec import LLM, SamplingParams, TokensPrompt
from encdec.sampling_params import BeamSearchParams
from tests.beam_search.conftest import mixed_prompts
from tests.engine.test_preemption import assert_all_free

BLOCK_BYTES = 2 * 2 * 16 * 64 * 4  # tiny BART: 2 layers x (K, V) x 16 tokens x d_model 64, float32
# Largest request: 120 encoder tokens (8 cross blocks) + 5 beams x 2 self blocks,
# plus the copy-on-write copies of a step: about 20 blocks.
TIGHT_BLOCKS = 26


def workload(n: int = 16):
    """Beam widths 5, 1, 2, 4 and greedy requests, mixed lengths."""
    encs = mixed_prompts(n, seed=3)
    widths = (5, 1, 2, None, 4, 1, 2, None)
    params = []
    for i in range(n):
        k = widths[i % len(widths)]
        if k is None:
            params.append(SamplingParams(temperature=0.0, max_tokens=20 + i))
        else:
            params.append(BeamSearchParams(k, 24, early_stopping=i % 3 == 0,
                                           no_repeat_ngram_size=3 * (i % 2)))
    return [TokensPrompt(prompt_token_ids=e) for e in encs], params


def summary(out) -> list[tuple]:
    return [(o.token_ids, o.finish_reason, round(getattr(o, "score", 0.0), 4)) for o in out.outputs]


def make_llm(path: str, num_blocks: int, **kwargs) -> LLM:
    # max_model_len=128 (8 + 8 blocks for the longest request) lets LLM() accept 26 blocks.
    return LLM(path, kv_cache_memory=num_blocks * BLOCK_BYTES, swap_space=0.02, num_threads=1,
               max_model_len=128, **kwargs)


def count_cross_allocations(llm: LLM) -> Counter:
    bm = llm.llm_engine.scheduler.block_manager
    counts: Counter = Counter()
    orig = bm.allocate

    def allocate(group):
        counts[group.request_id] += 1
        return orig(group)

    bm.allocate = allocate
    return counts


@pytest.fixture(scope="module")
def reference(beam_barts):
    prompts, params = workload()
    llm = make_llm(beam_barts["eosy"], 4096)
    counts = count_cross_allocations(llm)
    engine = llm.llm_engine
    bm = engine.scheduler.block_manager
    orig_step = engine.step
    cross_tables_seen = []

    def step():
        outs = orig_step()
        # one cross table per admitted request, however many beams it runs (the
        # encoder budget may keep some waiting: they have none yet)
        sched = engine.scheduler
        cross_tables_seen.append((len(bm.cross_block_tables), len(sched.running) + len(sched.swapped)))
        return outs

    engine.step = step
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert engine.scheduler.stats.num_preempted == 0
    assert all(c == 1 for c in counts.values()) and len(counts) == len(prompts)
    assert all(tables == groups for tables, groups in cross_tables_seen)
    assert not bm.block_tables
    return prompts, params, outs


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_beam_groups_under_pressure_match_unconstrained_run(beam_barts, reference, mode):
    prompts, params, ref = reference
    llm = make_llm(beam_barts["eosy"], TIGHT_BLOCKS, preemption_mode=mode)
    counts = count_cross_allocations(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for r, o in zip(ref, outs):
        assert o.error is None and summary(o) == summary(r), o.request_id
    stats = llm.llm_engine.scheduler.stats
    assert stats.num_preempted_swap > 0 and stats.num_swapped_in == stats.num_preempted_swap
    if mode == "recompute":  # single-beam groups are recomputed, wider ones swapped
        assert stats.num_preempted_recompute > 0
    multi = {str(i) for i, p in enumerate(params) if isinstance(p, BeamSearchParams) and p.beam_width > 1}
    rid = {o.request_id: str(i) for i, o in enumerate(outs)}
    # a swapped beam group keeps its one cross table: allocated once
    assert all(counts[r] == 1 for r, i in rid.items() if i in multi)
    assert_all_free(llm)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_aborted_beam_groups_leak_nothing_and_disturb_nobody(beam_barts, reference, mode):
    prompts, params, ref = reference
    llm = make_llm(beam_barts["eosy"], TIGHT_BLOCKS, preemption_mode=mode)
    engine = llm.llm_engine
    sched = engine.scheduler
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    rng = random.Random(2)
    aborted: dict[str, str] = {}
    outs = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            outs[o.request_id] = o
        for name, queue in {"waiting": sched.waiting, "running": sched.running,
                            "swapped": sched.swapped}.items():
            if queue and sum(q == name for q in aborted.values()) < 2 and rng.random() < 0.25:
                victim = rng.choice(list(queue)).request_id
                engine.abort_request(victim)
                aborted[victim] = name
    assert not engine.has_unfinished_requests()
    assert {"running", "swapped"} <= set(aborted.values()), aborted
    assert set(outs) == {str(i) for i in range(len(prompts))} - set(aborted)
    for rid, o in outs.items():
        assert summary(o) == summary(ref[int(rid)]), rid
    assert not engine.get_num_unfinished_requests()
    assert_all_free(llm)
