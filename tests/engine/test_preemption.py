"""KV memory under pressure, end to end on the tiny BART: with a cache that holds
about three requests, 48 requests (greedy and seeded n=3, short and long)
finish with exactly the outputs of an unconstrained run, by swapping or by
recomputing; aborts anywhere and requests that can never fit leak no block."""
from __future__ import annotations

import random

import pytest
import torch

from encdec import LLM, SamplingParams, TokensPrompt
from encdec.attention.backends.torch_sdpa import TorchSDPABackend
from encdec.worker.cache_engine import CacheEngine, block_runs

# Tiny BART: 2 decoder layers, d_model 64, float32 on CPU.
BLOCK_BYTES = 2 * 2 * 16 * 64 * 4
# Largest request of the workload: encoder 100 tokens (7 cross blocks) and
# n=3 x 42 decoder tokens (3 x 3 self blocks) = 16 blocks; a typical one is 4-8.
TIGHT_BLOCKS = 24
# LLM() refuses a cache that cannot hold one longest request: with max_model_len
# 128 (it bounds BART's encoder prompt too) that is 8 self + 8 cross blocks.
TIGHT_MAX_LEN = 128
WORDS = "rain spain falls mainly plain quick brown fox jumps lazy dog blocks pages batch".split()


def workload(n: int = 48, seed: int = 0) -> tuple[list, list[SamplingParams]]:
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(n):
        if i % 3 == 0:
            prompts.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40))))
        else:
            prompts.append(TokensPrompt(prompt_token_ids=[rng.randrange(4, 990)
                                                          for _ in range(rng.randint(1, 100))]))
        if i % 6 == 0:
            params.append(SamplingParams(n=3, temperature=0.9, seed=1000 + i,
                                         max_tokens=rng.randint(8, 40), ignore_eos=True))
        elif i % 6 == 3:
            params.append(SamplingParams(temperature=0.8, top_k=50, seed=i, max_tokens=rng.randint(4, 30)))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=rng.randint(4, 60),
                                         ignore_eos=i % 2 == 0))
    return prompts, params


def make_llm(path: str, num_blocks: int, **kwargs) -> LLM:
    kwargs.setdefault("max_model_len", TIGHT_MAX_LEN if num_blocks < 32 else None)
    return LLM(path, kv_cache_memory=num_blocks * BLOCK_BYTES, swap_space=0.01, num_threads=1, **kwargs)


def summary(out) -> list[tuple]:
    return [(o.index, o.token_ids, o.text, o.finish_reason) for o in out.outputs]


def assert_all_free(llm: LLM) -> None:
    engine = llm.llm_engine
    assert engine.num_free_blocks() == (engine.cache_config.num_gpu_blocks,
                                        engine.cache_config.num_cpu_blocks)
    bm = engine.scheduler.block_manager
    assert not bm.block_tables and not bm.cross_block_tables
    assert not engine.scheduler.get_seq_groups() and not engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def reference(tiny_bart):
    """The workload's outputs with room for everything at once."""
    prompts, params = workload()
    llm = make_llm(tiny_bart, 4096)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.scheduler.stats.num_preempted == 0
    return prompts, params, outs


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_outputs_under_pressure_match_unconstrained_run(tiny_bart, reference, mode):
    prompts, params, ref = reference
    llm = make_llm(tiny_bart, TIGHT_BLOCKS, preemption_mode=mode)
    assert llm.llm_engine.cache_config.num_gpu_blocks == TIGHT_BLOCKS
    sched = llm.llm_engine.scheduler
    running = []
    orig = sched.schedule

    def spy():
        out = orig()
        running.append(len(sched.running))
        return out

    sched.schedule = spy
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert max(running) <= 8 and sum(running) / len(running) < 5  # about three at once (mean 3.8)
    for r, o in zip(ref, outs):
        assert o.error is None
        assert summary(o) == summary(r), f"request {o.request_id}"
    assert sum(len(o.outputs) == 3 for o in outs) == 8
    stats = sched.stats
    cache = llm.llm_engine.worker.cache_engine
    if mode == "swap":
        assert stats.num_preempted_swap > 0 and stats.num_preempted_recompute == 0
    else:  # single-sequence groups are recomputed; forked (n=3) ones are still swapped
        assert stats.num_preempted_recompute > 0 and stats.num_preempted_swap > 0
    # Every swapped group came back, and the cache engine moved what was asked.
    assert stats.num_swapped_in == stats.num_preempted_swap
    assert cache.num_swapped_out_blocks == stats.num_blocks_swapped_out
    assert cache.num_swapped_in_blocks == stats.num_blocks_swapped_in == stats.num_blocks_swapped_out
    assert stats.num_ignored == 0
    assert_all_free(llm)


def test_forked_sequences_share_cross_and_prompt_blocks(tiny_bart):
    llm = make_llm(tiny_bart, 64)
    engine = llm.llm_engine
    bm = engine.scheduler.block_manager
    engine.add_request("r", TokensPrompt(prompt_token_ids=list(range(5, 45))),  # 3 cross blocks
                       SamplingParams(n=3, temperature=5.0, seed=7, max_tokens=20, ignore_eos=True))
    engine.step()  # prefill: the prompt [2, 0] computed once, three tokens sampled
    group = engine.scheduler.get_seq_group("r")
    seqs = group.get_seqs()
    tables = [bm.get_block_table(s) for s in seqs]
    assert len(seqs) == 3 and tables[0] == tables[1] == tables[2] and len(tables[0]) == 1
    assert bm.gpu_allocator.get_ref_count(tables[0][0]) == 3
    assert list(bm.cross_block_tables) == ["r"]  # one cross table per request, not per sequence
    cross = bm.get_cross_block_table(group)
    assert len(cross) == 3 and all(bm.gpu_allocator.get_ref_count(b) == 1 for b in cross)
    assert engine.num_free_blocks()[0] == 64 - 4
    engine.step()  # each writes its own token into the shared block: two copies, one keeps it
    assert engine.worker.cache_engine.num_copied_blocks == 2
    tables = [bm.get_block_table(s) for s in seqs]
    assert len({t[0] for t in tables}) == 3
    assert all(bm.gpu_allocator.get_ref_count(t[0]) == 1 for t in tables)
    assert bm.get_cross_block_table(group) == cross
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert [len(o.token_ids) for o in outs[0].outputs] == [20, 20, 20]
    assert len({tuple(o.token_ids) for o in outs[0].outputs}) == 3  # each wrote its own KV
    assert_all_free(llm)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_aborts_in_every_queue_leak_nothing_and_disturb_nobody(tiny_bart, reference, mode):
    prompts, params, ref = reference
    llm = make_llm(tiny_bart, TIGHT_BLOCKS, preemption_mode=mode)
    engine = llm.llm_engine
    sched = engine.scheduler
    n = 24
    for i in range(n):
        engine.add_request(str(i), prompts[i], params[i])
    rng = random.Random(1)
    aborted: dict[str, str] = {}  # request id -> queue it was aborted in
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
        queues = {"waiting": sched.waiting, "running": sched.running, "swapped": sched.swapped}
        for name, queue in queues.items():
            hit = sum(q == name for q in aborted.values())
            if queue and hit < 2 and rng.random() < 0.2:
                victim = rng.choice(list(queue)).request_id
                engine.abort_request(victim)
                aborted[victim] = name
                assert engine.scheduler.get_seq_group(victim) is None
    assert set(aborted.values()) == {"waiting", "running", "swapped"}, aborted
    assert set(outs) == {str(i) for i in range(n)} - set(aborted)
    for rid, o in outs.items():
        assert summary(o) == summary(ref[int(rid)]), f"request {rid}"
    assert sched.stats.num_aborted == len(aborted)
    engine.abort_request(["no-such-request"])  # unknown ids are ignored
    assert_all_free(llm)


def test_cache_too_small_for_one_longest_request_is_refused(tiny_bart):
    with pytest.raises(ValueError, match=r"holds 24 blocks .* needs 32 blocks .*16 for a "
                                         r"max_model_len=256 decoder sequence, 16 for its .* and 0 kept free"):
        make_llm(tiny_bart, TIGHT_BLOCKS, max_model_len=None)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_requests_that_can_never_fit_are_refused_or_fail_and_the_rest_complete(tiny_bart, reference, mode):
    prompts, params, ref = reference
    llm = make_llm(tiny_bart, 12, preemption_mode=mode, max_model_len=96)  # 6 self + 6 cross blocks
    engine = llm.llm_engine
    picked = [1, 2, 4, 5, 7]
    # Longer than max_model_len (which bounds the encoder prompt): refused before anything runs.
    too_long = TokensPrompt(prompt_token_ids=[7] * 250)
    with pytest.raises(ValueError, match="encoder prompt is 250 tokens"):
        llm.generate([prompts[i] for i in picked[:2]] + [too_long], use_tqdm=False)
    assert_all_free(llm)
    # Fits at admission (6 cross blocks), but its three forked sequences need 3 x 6 self
    # blocks: refused at entry, naming the sizes; nothing of the call is queued.
    outgrows = TokensPrompt(prompt_token_ids=[9] * 90)
    grow = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=90, ignore_eos=True)
    batch = [prompts[i] for i in picked] + [outgrows]
    with pytest.raises(ValueError, match=r"^(prompt 5: )?the request can never fit the KV cache: it needs "
                                         r"up to \d+ blocks .* but the cache has 12 blocks"):
        llm.generate(batch, [params[i] for i in picked] + [grow], use_tqdm=False)
    with pytest.raises(ValueError, match=r"^prompt 1: .*but the cache has 12 blocks"):
        engine.process_requests([prompts[1], outgrows], [params[1], grow])
    assert_all_free(llm)
    assert not engine.has_unfinished_requests()
    outs = llm.generate([prompts[i] for i in picked], [params[i] for i in picked], use_tqdm=False)
    for i, o in zip(picked, outs):
        assert o.error is None and summary(o) == summary(ref[i])
    assert_all_free(llm)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_priority_policy_preempts_for_urgent_arrivals(tiny_bart, reference, mode):
    prompts, params, ref = reference
    llm = make_llm(tiny_bart, TIGHT_BLOCKS, preemption_mode=mode, scheduling_policy="priority")
    engine = llm.llm_engine
    low, high = [2, 4, 8, 10, 14, 16], [20, 22]  # greedy, ignore_eos: they run their full length
    for i in low:
        engine.add_request(str(i), prompts[i], params[i], priority=5)
    outs = {}
    for _ in range(3):
        for o in engine.step():
            outs[o.request_id] = o
    step_added = engine.scheduler.num_steps
    for i in high:
        engine.add_request(str(i), prompts[i], params[i], priority=0)
    sched = engine.scheduler
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
        # Once admitted, the urgent ones run every step until they finish.
        urgent = {r for r in ("20", "22") if r in sched.stats.admitted_at_step} - set(outs)
        assert urgent <= {g.request_id for g in sched.running}
    stats = sched.stats
    assert stats.num_preempted_for_priority > 0
    # Room is made for the most urgent waiting group each step (as in vLLM V0).
    assert stats.admitted_at_step["20"] == step_added
    assert stats.admitted_at_step["22"] <= step_added + 1
    for rid, o in outs.items():
        assert summary(o) == summary(ref[int(rid)]), f"request {rid}"
    assert_all_free(llm)


# -- cache engine ----------------------------------------------------------------

def test_block_runs_merge_pairs_that_continue_on_both_sides():
    assert block_runs([(40, 7), (41, 8), (42, 9), (90, 3), (91, 5), (92, 6)]) == \
        [(40, 7, 3), (90, 3, 1), (91, 5, 2)]
    assert block_runs([]) == []


@pytest.mark.parametrize("scattered", [False, True])
def test_cache_engine_swap_round_trip_moves_exactly_the_blocks(scattered):
    torch.manual_seed(0)
    cache = CacheEngine(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, num_gpu_blocks=40,
                        num_cpu_blocks=40, dtype=torch.float32, device=torch.device("cpu"),
                        backend=TorchSDPABackend)
    for layer in cache.gpu_cache:
        layer.normal_()
    original = [layer.clone() for layer in cache.gpu_cache]
    if scattered:  # more runs than the slice-copy loop takes: one gather per layer
        out_pairs = [(2 * i, 39 - 3 * i) for i in range(12)]
    else:  # a cross table and a self table: two runs
        out_pairs = [(10 + i, 5 + i) for i in range(6)] + [(30, 0), (31, 1)]
    cache.swap_out(out_pairs)
    for layer in cache.gpu_cache:
        layer.zero_()
    back = [(cpu, 20 + i) for i, (_, cpu) in enumerate(out_pairs)]
    cache.swap_in(back)
    for layer, orig in zip(cache.gpu_cache, original):
        for (gpu, _), (_, new) in zip(out_pairs, back):
            torch.testing.assert_close(layer[:, new], orig[:, gpu], rtol=0, atol=0)
        untouched = sorted(set(range(40)) - {new for _, new in back})
        assert layer[:, untouched].abs().sum() == 0
    assert cache.num_swapped_out_blocks == cache.num_swapped_in_blocks == len(out_pairs)
    assert cache.bytes_moved(len(out_pairs)) == len(out_pairs) * 2 * 2 * 4 * 2 * 8 * 4


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_swap_area_is_pinned_and_round_trips():
    cache = CacheEngine(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, num_gpu_blocks=16,
                        num_cpu_blocks=16, dtype=torch.float16, device=torch.device("cuda"),
                        backend=TorchSDPABackend)
    assert all(t.is_pinned() for t in cache.cpu_cache)
    for layer in cache.gpu_cache:
        layer.normal_()
    original = [layer.clone() for layer in cache.gpu_cache]
    cache.swap_out([(3, 0), (4, 1), (9, 5)])
    for layer in cache.gpu_cache:
        layer.zero_()
    cache.swap_in([(0, 10), (1, 11), (5, 2)])
    torch.cuda.synchronize()
    for layer, orig in zip(cache.gpu_cache, original):
        torch.testing.assert_close(layer[:, [10, 11, 2]], orig[:, [3, 4, 9]], rtol=0, atol=0)
