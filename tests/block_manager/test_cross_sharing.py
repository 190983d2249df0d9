"""Shared cross tables, case by case: one table per encoder input, swapped once
whatever the number of sharers, kept cached-free after its last request and
evicted least recently used (the state machine in test_cross_sharing_stateful.py
covers random traffic)."""
from __future__ import annotations

from encdec.block_manager import AllocStatus, BlockSpaceManager
from encdec.sequence import Sequence, SequenceGroup, SequenceStatus

BS = 4


def make_group(request_id: str, key: str | None, enc_len: int = 10, seq_id: int = 0) -> SequenceGroup:
    inputs = {"prompt_token_ids": [2, 0], "encoder_prompt_token_ids": [7] * enc_len,
              "prompt": None, "encoder_prompt": None}
    seq = Sequence(seq_id, inputs, BS)
    encoder_seq = Sequence(seq_id, inputs, BS, from_decoder_prompt=False)
    return SequenceGroup(request_id, [seq], arrival_time=0.0, encoder_seq=encoder_seq, encoder_cache_key=key)


def start(bm: BlockSpaceManager, group: SequenceGroup) -> bool:
    """allocate + the prefill; returns whether the prefill reused the cross KV."""
    bm.allocate(group)
    for seq in group.get_seqs():
        seq.status = SequenceStatus.RUNNING
        seq.data.update_num_computed_tokens(seq.get_len())
    return not bm.claim_cross_write(group)


def end(bm: BlockSpaceManager, group: SequenceGroup) -> None:
    for seq in group.get_seqs():
        bm.free(seq)
    bm.free_cross(group)


def swap(bm: BlockSpaceManager, group: SequenceGroup, out: bool) -> list[tuple[int, int]]:
    pairs = bm.swap_out(group) if out else bm.swap_in(group)
    for seq in group.get_seqs():
        seq.status = SequenceStatus.SWAPPED if out else SequenceStatus.RUNNING
    return pairs


def test_same_input_shares_one_table_and_one_encoder_pass():
    bm = BlockSpaceManager(BS, 32, 16, watermark=0)
    a, b, c = make_group("a", "doc"), make_group("b", "doc", seq_id=1), make_group("c", "other", seq_id=2)
    assert start(bm, a) is False  # the first runs the encoder
    free = bm.get_num_free_gpu_blocks()
    assert start(bm, b) is True
    assert bm.get_num_free_gpu_blocks() == free - 1  # its self block only
    assert bm.get_cross_block_table(b) is bm.get_cross_block_table(a)
    assert start(bm, c) is False and bm.get_cross_block_table(c) != bm.get_cross_block_table(a)
    # Both admitted in one step: the second reads what the first writes in that step.
    d, e = make_group("d", "new", seq_id=3), make_group("e", "new", seq_id=4)
    bm.allocate(d), bm.allocate(e)
    assert [bm.claim_cross_write(d), bm.claim_cross_write(e)] == [True, False]


def test_a_shared_table_is_swapped_once_and_stays_while_a_sharer_runs():
    bm = BlockSpaceManager(BS, 32, 16, watermark=0)
    a, b = make_group("a", "doc"), make_group("b", "doc", seq_id=1)
    start(bm, a), start(bm, b)
    cross = list(bm.get_cross_block_table(a))
    assert len(swap(bm, a, out=True)) == 1  # a's self block; b still reads the table on the device
    assert bm.get_cross_block_table(a) == cross
    assert len(swap(bm, b, out=True)) == 1 + 3  # the last sharer takes the table along
    assert bm.get_num_free_gpu_blocks() == 32 and bm.get_num_free_cpu_blocks() == 16 - 5
    assert len(swap(bm, b, out=False)) == 1 + 3  # the first back brings it
    assert len(swap(bm, a, out=False)) == 1
    assert bm.get_cross_block_table(a) is bm.get_cross_block_table(b)
    end(bm, a), end(bm, b)
    assert bm.get_num_free_gpu_blocks() == 32 and bm.get_num_free_cpu_blocks() == 16


def test_table_follows_swapped_sharers_when_the_running_one_ends():
    bm = BlockSpaceManager(BS, 32, 16, watermark=0)
    a, b = make_group("a", "doc"), make_group("b", "doc", seq_id=1)
    start(bm, a), start(bm, b)
    swap(bm, a, out=True)
    end(bm, b)  # a is swapped: the table must not hold device blocks for it
    pairs = bm.swap_out_idle_cross()  # what the next schedule() runs first
    assert len(pairs) == 3 and bm.swap_out_idle_cross() == []
    assert bm.get_num_free_gpu_blocks() == 32
    assert len(swap(bm, a, out=False)) == 1 + 3
    end(bm, a)
    assert bm.get_num_free_cpu_blocks() == 16


def test_cached_free_tables_count_as_free_are_revived_and_evicted_lru():
    bm = BlockSpaceManager(BS, 10, 4, watermark=0)
    old, new = make_group("old", "doc1"), make_group("new", "doc2", seq_id=1)
    start(bm, old), start(bm, new)
    end(bm, old), end(bm, new)
    assert bm.get_num_free_gpu_blocks() == 10  # cached-free blocks are free to every caller
    assert bm.gpu_allocator.get_num_free_blocks() == 10 - 6
    again = make_group("again", "doc1", seq_id=2)
    assert start(bm, again) is True  # revived: no encoder pass
    end(bm, again)  # doc1 is now the most recently used
    big = make_group("big", None, enc_len=24, seq_id=3)  # 6 cross + 1 self: evicts one table
    assert bm.can_allocate(big) is AllocStatus.OK
    start(bm, big)
    assert [t.key for t in bm.cross.cached_free()] == ["doc1"]  # doc2, least recently used, went
    end(bm, big)  # a keyless table is never kept
    assert [t.key for t in bm.cross.cached_free()] == ["doc1"]
    assert start(bm, make_group("x", "doc2", seq_id=4)) is False  # evicted: the encoder runs again


def test_a_lazily_mapped_cache_evicts_cached_tables_before_writing_new_memory():
    """Blocks 0-7 written at start (a CPU cache's prefault): finished tables are
    evicted, least recently used first, rather than new tables taking blocks
    8 and up; a cache written whole keeps them (the test above)."""
    bm = BlockSpaceManager(BS, 40, 4, watermark=0, warm_gpu_blocks=8)
    assert bm.gpu_allocator.get_num_free_warm_blocks() == 8
    used: set[int] = set()
    for i in range(6):  # 3 cross + 1 self blocks each
        g = make_group(f"r{i}", f"doc{i}", seq_id=i)
        assert start(bm, g) is False
        used.update(bm.get_cross_block_table(g))
        used.update(bm.get_block_table(g.get_seqs()[0]))
        end(bm, g)
    assert max(used) < 8  # never past the written blocks
    assert [t.key for t in bm.cross.cached_free()] == ["doc4", "doc5"]  # as many as the 8 blocks hold
    assert bm.cross.num_evictions == 4
    again = make_group("again", "doc5", seq_id=9)
    assert start(bm, again) is True  # still revived: no encoder pass
    end(bm, again)
    # When live tables need more than the written blocks, new ones are taken and then kept written.
    live = [make_group(f"l{i}", f"live{i}", seq_id=10 + i) for i in range(3)]
    for g in live:
        start(bm, g)
    assert bm.gpu_allocator.get_num_free_warm_blocks() == 0
    for g in live:
        end(bm, g)
    assert len(bm.cross.cached_free()) == 3  # the cached ones now fit in what was written
