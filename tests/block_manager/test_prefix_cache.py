"""The decoder prefix cache in the block manager: full prompt blocks found again
by (encoder input, tokens), shared by reference count, kept cached-free and
evicted least recently used first, never matched across encoder inputs, and
every block accounted for after any mix of allocations, forks, swaps and frees."""
from __future__ import annotations

import random

from encdec.block_manager import BlockSpaceManager
from encdec.block_manager.prefix_cache import block_hashes
from encdec.sampling_params import SamplingParams
from encdec.sequence import Sequence, SequenceGroup, SequenceStatus

BS = 4
_ids = iter(range(10**7))


def make_group(request_id: str, dec: list[int], key: str | None, enc_len: int = 6, n: int = 1,
               params: SamplingParams | None = None) -> SequenceGroup:
    inputs = {"prompt_token_ids": list(dec), "encoder_prompt_token_ids": list(range(enc_len)),
              "prompt": None, "encoder_prompt": None}
    seqs = [Sequence(next(_ids), inputs, BS) for _ in range(n)]
    encoder_seq = Sequence(seqs[0].seq_id, inputs, BS, from_decoder_prompt=False)
    return SequenceGroup(request_id, seqs, 0.0, params, encoder_seq=encoder_seq, encoder_cache_key=key)


def start(bm: BlockSpaceManager, group: SequenceGroup) -> int:
    """allocate + what the scheduler and the prefill step do around it."""
    cached = bm.allocate(group)
    bm.claim_cross_write(group)  # the prefill runs the encoder or reads the table
    for seq in group.get_seqs():
        seq.status = SequenceStatus.RUNNING
        seq.data.update_num_computed_tokens(seq.get_len())
    return cached


def finish(bm: BlockSpaceManager, group: SequenceGroup) -> None:
    for seq in group.get_seqs():
        bm.free(seq)
    bm.free_cross(group)


def assert_all_free(bm: BlockSpaceManager) -> None:
    assert not bm.block_tables and not bm.cross_block_tables
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
    assert bm.get_num_free_cpu_blocks() == bm.num_total_cpu_blocks
    bm.prefix.make_room(bm.num_total_gpu_blocks)  # evict every cached-free block: none is held
    bm.cross.make_room(bm.num_total_gpu_blocks)
    assert bm.gpu_allocator.get_num_free_blocks() == bm.num_total_gpu_blocks


PROMPT = list(range(100, 111))  # 11 tokens: blocks [100..103] [104..107] full, [108..110] partial


def test_same_input_and_prefix_hits_the_full_blocks():
    bm = BlockSpaceManager(BS, 64, 16, enable_caching=True)
    a, b = make_group("a", PROMPT, "doc"), make_group("b", PROMPT[:9] + [7, 7], "doc")
    assert start(bm, a) == 0
    assert start(bm, b) == 8  # two full blocks shared, the rest computed
    ta, tb = bm.get_block_table(a.seqs[0]), bm.get_block_table(b.seqs[0])
    assert ta[:2] == tb[:2] and ta[2] != tb[2]
    assert [bm.gpu_allocator.get_ref_count(x) for x in ta[:2]] == [3, 3]  # a, b and the cache
    assert (bm.prefix.num_queries, bm.prefix.num_hits) == (22, 8)
    finish(bm, a)
    finish(bm, b)
    assert bm.prefix.num_evictable == 2
    c = make_group("c", PROMPT, "doc")
    assert start(bm, c) == 8  # found again while cached-free
    assert bm.prefix.num_evictable == 0
    finish(bm, c)
    assert_all_free(bm)


def test_never_across_encoder_inputs_nor_without_a_key():
    bm = BlockSpaceManager(BS, 64, 16, enable_caching=True)
    assert start(bm, make_group("a", PROMPT, "doc1")) == 0
    assert start(bm, make_group("b", PROMPT, "doc2")) == 0  # equal decoder prompt, other input
    assert start(bm, make_group("c", PROMPT, None)) == 0  # encoder cache off: no key
    assert start(bm, make_group("d", PROMPT, None)) == 0
    assert bm.prefix.num_hits == 0
    assert block_hashes("doc1", PROMPT, BS) != block_hashes("doc2", PROMPT, BS)


def test_the_last_token_and_asked_positions_are_always_computed():
    bm = BlockSpaceManager(BS, 64, 16, enable_caching=True)
    prompt = list(range(12))  # three full blocks
    start(bm, make_group("a", prompt, "doc"))
    assert start(bm, make_group("b", prompt, "doc")) == 8  # not the block of the last token
    for i, asked in enumerate(({5: [3]}, {-1: [3]})):  # read from a whole prefill's rows
        params = SamplingParams(prompt_token_logprobs=asked)
        assert start(bm, make_group(f"c{i}", prompt, "doc", params=params)) == 0
    assert start(bm, make_group("d", prompt, "doc", params=SamplingParams(prompt_logprobs=1))) == 0


def test_no_reuse_once_the_cross_table_left_the_device():
    # Self K/V are reused only beside the cross K/V they were computed against.
    bm = BlockSpaceManager(BS, 64, 16, enable_caching=True)
    a = make_group("a", PROMPT, "doc")
    start(bm, a)
    finish(bm, a)
    bm.cross.make_room(bm.num_total_gpu_blocks)  # the cached-free cross table is evicted
    assert start(bm, make_group("b", PROMPT, "doc")) == 0


def test_decode_writes_never_touch_shared_prompt_blocks():
    bm = BlockSpaceManager(BS, 64, 16, enable_caching=True)
    a, b = make_group("a", PROMPT, "doc"), make_group("b", PROMPT, "doc")
    start(bm, a)
    start(bm, b)
    for group in (a, b):
        seq = group.seqs[0]
        for _ in range(6):
            seq.append_token_id(5)
            assert bm.append_slots(seq) == []  # writes land in the seq's own blocks
            seq.data.update_num_computed_tokens(1)
    ta, tb = bm.get_block_table(a.seqs[0]), bm.get_block_table(b.seqs[0])
    assert ta[:2] == tb[:2] and not set(ta[2:]) & set(tb[2:])


def test_eviction_is_least_recently_used_tail_blocks_first_and_only_under_pressure():
    # 16 blocks: each document's request takes 2 cross + 3 self blocks (2 full).
    bm = BlockSpaceManager(BS, 16, 16, enable_caching=True, watermark=0.0)
    for i in range(3):
        g = make_group(f"r{i}", [i] * 11, f"doc{i}")
        start(bm, g)
        finish(bm, g)
    assert bm.get_num_free_gpu_blocks() == 16
    assert (bm.gpu_allocator.get_num_free_blocks(), bm.prefix.num_evictable) == (4, 6)
    assert bm.prefix.num_evictions == 0  # kept while there was room
    start(bm, make_group("new", list(range(13)), "other"))  # 2 cross + 4 self: 2 more than free
    assert bm.prefix.num_evictions == 2 and bm.cross.num_evictions == 0  # r0's two blocks, not a cross table
    assert start(bm, make_group("again1", [1] * 11, "doc1")) == 8
    # That took one more block: r2's tail block went first, its head block is still found.
    again2 = make_group("again2", [2] * 11, "doc2")
    assert start(bm, again2) == 4
    finish(bm, again2)
    assert start(bm, make_group("again0", [0] * 11, "doc0")) == 0


def test_swapping_out_a_sharer_leaves_the_other_its_blocks():
    bm = BlockSpaceManager(BS, 64, 16, enable_caching=True)
    a, b = make_group("a", PROMPT, "doc"), make_group("b", PROMPT, "doc")
    start(bm, a)
    start(bm, b)
    shared = bm.get_block_table(a.seqs[0])[:2]
    pairs = bm.swap_out(b)
    for seq in b.seqs:
        seq.status = SequenceStatus.SWAPPED
    assert {src for src, _ in pairs} >= set(shared)  # b takes its own copy to CPU
    assert bm.get_block_table(a.seqs[0])[:2] == shared  # a keeps reading them on the device
    assert all(bm.gpu_allocator.get_ref_count(x) == 2 for x in shared)  # a and the cache
    bm.swap_in(b)
    for seq in b.seqs:
        seq.status = SequenceStatus.RUNNING
    assert not set(bm.get_block_table(b.seqs[0])) & set(shared)
    finish(bm, a)
    finish(bm, b)
    assert_all_free(bm)


def test_blocks_of_a_prefill_that_never_ran_are_forgotten():
    bm = BlockSpaceManager(BS, 64, 16, enable_caching=True)
    a = make_group("a", PROMPT, "doc")
    bm.allocate(a)  # no step computed it (a planned step dropped unrun)
    for seq in a.seqs:
        bm.free(seq)
    bm.free_cross(a)
    assert bm.prefix.num_evictable == 0
    assert start(bm, make_group("b", PROMPT, "doc")) == 0


def test_many_mixed_requests_with_forks_swaps_and_aborts_leak_nothing():
    rng = random.Random(0)
    bm = BlockSpaceManager(BS, 48, 32, enable_caching=True)
    live: list[SequenceGroup] = []
    swapped: list[SequenceGroup] = []
    hits = 0
    for i in range(1000):
        op = rng.random()
        if op < 0.45:
            doc = rng.randrange(4)
            prompt = [doc] * 4 + [rng.randrange(3) for _ in range(rng.randrange(1, 10))]
            g = make_group(f"r{i}", prompt, rng.choice([f"doc{doc}", f"doc{doc}", None]), n=rng.choice([1, 2]))
            if bm.can_allocate(g).name == "OK":
                hits += start(bm, g) > 0
                live.append(g)
        elif op < 0.7 and live:
            g = rng.choice(live)
            seqs = g.get_seqs(SequenceStatus.RUNNING)
            if rng.random() < 0.3:
                child = seqs[0].fork(next(_ids))
                g.add(child)
                bm.fork(seqs[0], child)
                seqs = g.get_seqs(SequenceStatus.RUNNING)
            for seq in seqs:
                seq.append_token_id(rng.randrange(3))
            if bm.can_append_slots(g):
                for seq in seqs:
                    bm.append_slots(seq)
                    seq.data.update_num_computed_tokens(1)
            else:  # out of room: abort it
                live.remove(g)
                finish(bm, g)
        elif op < 0.8 and live:
            g = live.pop(rng.randrange(len(live)))
            if bm.can_swap_out(g):
                bm.swap_out(g)
                for seq in g.get_seqs(SequenceStatus.RUNNING):
                    seq.status = SequenceStatus.SWAPPED
                swapped.append(g)
            else:
                finish(bm, g)
        elif op < 0.85 and swapped:
            g = swapped[0]
            if bm.can_swap_in(g).name == "OK":
                bm.swap_in(swapped.pop(0))
                for seq in g.get_seqs(SequenceStatus.SWAPPED):
                    seq.status = SequenceStatus.RUNNING
                live.append(g)
        elif live or swapped:  # finish or abort, on either device
            pool = live if live and (not swapped or rng.random() < 0.7) else swapped
            finish(bm, pool.pop(rng.randrange(len(pool))))
    for g in live + swapped:
        finish(bm, g)
    assert hits > 50 and bm.prefix.num_hits > 0
    assert_all_free(bm)
