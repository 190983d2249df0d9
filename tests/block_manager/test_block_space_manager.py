"""BlockSpaceManager: the seed's free-block arithmetic, admission statuses,
copy-on-write, and the contiguous cross tables the backend slices zero-copy."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from encdec.block_manager import AllocStatus, BlockSpaceManager
from encdec.sequence import Sequence, SequenceGroup, SequenceStatus

BS = 4


def make_group(request_id: str, dec_len: int, enc_len: int, n: int = 1, seq_id: int = 0) -> SequenceGroup:
    inputs = {
        "prompt_token_ids": list(range(dec_len)),
        "encoder_prompt_token_ids": list(range(enc_len)),
        "prompt": None,
        "encoder_prompt": None,
    }
    seqs = [Sequence(seq_id + i, inputs, BS) for i in range(n)]
    encoder_seq = Sequence(seq_id, inputs, BS, from_decoder_prompt=False)
    return SequenceGroup(request_id, seqs, arrival_time=0.0, encoder_seq=encoder_seq)


def start(bm: BlockSpaceManager, group: SequenceGroup) -> None:
    """allocate + what the scheduler and the prefill step do around it."""
    bm.allocate(group)
    for seq in group.get_seqs():
        seq.status = SequenceStatus.RUNNING
        seq.data.update_num_computed_tokens(seq.get_len())


def decode_step(bm: BlockSpaceManager, seq: Sequence, token: int = 7) -> list[tuple[int, int]]:
    seq.append_token_id(token)
    copies = bm.append_slots(seq)
    seq.data.update_num_computed_tokens(1)
    return copies


def diverged_group(bm: BlockSpaceManager) -> SequenceGroup:
    """BART-like: decoder prompt [2, 0] in one block, encoder 10 tokens (3
    blocks), n=3 forked after prefill; each child's first token copies the
    shared block, so the three self tables end up unshared."""
    group = make_group("r", dec_len=2, enc_len=10)
    start(bm, group)
    parent = group.seqs[0]
    for child_id in (1, 2):
        child = parent.fork(child_id)
        group.add(child)
        bm.fork(parent, child)
    for seq in group.get_seqs():
        decode_step(bm, seq)
    tables = [bm.get_block_table(s) for s in group.get_seqs()]
    assert len({b for t in tables for b in t}) == sum(len(t) for t in tables) == 3
    return group


def test_seed_allocate_shares_one_prompt_table():
    bm = BlockSpaceManager(BS, 64, 64, watermark=0)
    group = make_group("r", dec_len=6, enc_len=10, n=3)
    before = bm.get_num_free_gpu_blocks()
    bm.allocate(group)
    tables = [bm.get_block_table(s) for s in group.get_seqs()]
    cross = bm.get_cross_block_table(group)
    assert tables[0] == tables[1] == tables[2] and len(tables[0]) == 2 and len(cross) == 3
    # seq group blocks = |cross| + the one shared decoder prompt table
    assert bm.get_num_free_gpu_blocks() == before - (len(cross) + len(tables[0]))
    assert all(bm.gpu_allocator.get_ref_count(b) == 3 for b in tables[0])
    assert bm.cross_block_tables == {"r": cross}


def test_seed_allocate_until_full():
    bm = BlockSpaceManager(BS, 4, 4, watermark=0)
    for i in range(2):  # 2 blocks per group: one decoder, one cross
        group = make_group(str(i), dec_len=BS, enc_len=BS, seq_id=i)
        assert bm.can_allocate(group) == AllocStatus.OK
        bm.allocate(group)
        assert bm.get_num_free_gpu_blocks() == 4 - 2 * (i + 1)
    assert bm.can_allocate(make_group("x", BS, BS, seq_id=9)) == AllocStatus.LATER


def test_seed_swap_out_swap_in():
    bm = BlockSpaceManager(BS, 64, 64, watermark=0)
    group = diverged_group(bm)
    seqs = group.get_seqs()
    gpu_blocks = [b for s in seqs for b in bm.get_block_table(s)] + bm.get_cross_block_table(group)
    group_blocks = len(gpu_blocks)  # = |cross| + sum_i |seq_i table|
    assert bm.can_swap_out(group)
    gpu0, cpu0 = bm.get_num_free_gpu_blocks(), bm.get_num_free_cpu_blocks()
    mapping = bm.swap_out(group)
    assert [g for g, _ in mapping] == gpu_blocks
    assert bm.get_num_free_gpu_blocks() == gpu0 + group_blocks
    assert bm.get_num_free_cpu_blocks() == cpu0 - group_blocks
    cpu_blocks = [b for s in seqs for b in bm.get_block_table(s)] + bm.get_cross_block_table(group)
    assert [c for _, c in mapping] == cpu_blocks
    for seq in seqs:
        seq.status = SequenceStatus.SWAPPED

    assert bm.can_swap_in(group) == AllocStatus.OK
    gpu1, cpu1 = bm.get_num_free_gpu_blocks(), bm.get_num_free_cpu_blocks()
    mapping = bm.swap_in(group)
    assert [c for c, _ in mapping] == cpu_blocks
    assert bm.get_num_free_gpu_blocks() == gpu1 - group_blocks
    assert bm.get_num_free_cpu_blocks() == cpu1 + group_blocks
    assert [g for _, g in mapping] == [b for s in seqs for b in bm.get_block_table(s)] + bm.get_cross_block_table(group)


def test_swap_moves_shared_blocks_once_and_keeps_ref_counts():
    bm = BlockSpaceManager(BS, 64, 64, watermark=0)
    group = make_group("r", dec_len=6, enc_len=5, n=3)
    start(bm, group)
    cpu0 = bm.get_num_free_cpu_blocks()
    mapping = bm.swap_out(group)
    assert len(mapping) == 2 + 2  # distinct blocks: shared prompt table + cross
    assert bm.get_num_free_cpu_blocks() == cpu0 - 4
    assert bm.get_num_free_gpu_blocks() == 64
    assert all(bm.cpu_allocator.get_ref_count(b) == 3 for b in bm.get_block_table(group.seqs[0]))


@pytest.mark.parametrize("where", ["gpu", "cpu"])
def test_seed_free_free_cross_reset(where: str):
    bm = BlockSpaceManager(BS, 64, 64, watermark=0)
    group = diverged_group(bm)
    free_blocks = bm.get_num_free_gpu_blocks
    if where == "cpu":
        bm.swap_out(group)
        for seq in group.get_seqs():
            seq.status = SequenceStatus.SWAPPED
        free_blocks = bm.get_num_free_cpu_blocks
    for seq in group.get_seqs():
        before, size = free_blocks(), len(bm.get_block_table(seq))
        bm.free(seq)
        assert free_blocks() == before + size
        assert seq.seq_id not in bm.block_tables
        bm.free(seq)  # no table: no-op
        assert free_blocks() == before + size
    before, size = free_blocks(), len(bm.get_cross_block_table(group))
    bm.free_cross(group)
    assert free_blocks() == before + size and bm.cross_block_tables == {}
    bm.free_cross(group)
    assert free_blocks() == before + size

    start(bm, make_group("a", 9, 30, n=2, seq_id=10))
    bm.reset()
    assert bm.get_num_free_gpu_blocks() == 64 and bm.get_num_free_cpu_blocks() == 64
    assert bm.block_tables == {} and bm.cross_block_tables == {}


def test_alloc_status_never_later_watermark():
    bm = BlockSpaceManager(BS, 100, 10, watermark=0.1)  # 10 watermark blocks
    assert bm.watermark_blocks == 10
    # 1 decoder block + cross blocks; 90 fit an empty cache, 91 never do.
    assert bm.can_allocate(make_group("a", 1, 89 * BS)) == AllocStatus.OK
    assert bm.can_allocate(make_group("a", 1, 90 * BS)) == AllocStatus.NEVER
    assert bm.can_allocate(make_group("a", 1, 89 * BS), num_lookahead_slots=BS) == AllocStatus.NEVER
    start(bm, make_group("big", 1, 84 * BS, seq_id=1))
    assert bm.get_num_free_gpu_blocks() == 15
    assert bm.can_allocate(make_group("a", BS, 4 * BS, seq_id=2)) == AllocStatus.OK  # 15 - 5 >= 10
    assert bm.can_allocate(make_group("a", BS, 5 * BS, seq_id=2)) == AllocStatus.LATER  # 15 - 6 < 10


def test_can_swap_in_never_later():
    bm = BlockSpaceManager(BS, 20, 20, watermark=0)
    whole = make_group("whole", BS, 19 * BS)  # 20 blocks: fits, but not with room to append
    assert bm.can_allocate(whole) == AllocStatus.OK
    start(bm, whole)
    bm.swap_out(whole)
    whole.seqs[0].status = SequenceStatus.SWAPPED
    assert bm.can_swap_in(whole) == AllocStatus.NEVER
    bm.free(whole.seqs[0])
    bm.free_cross(whole)

    big = make_group("big", BS, 14 * BS, seq_id=1)  # 15 blocks
    start(bm, big)
    bm.swap_out(big)
    big.seqs[0].status = SequenceStatus.SWAPPED
    other = make_group("o", BS, 4 * BS, seq_id=5)  # 5 blocks
    start(bm, other)
    assert bm.can_swap_in(big) == AllocStatus.LATER  # 15 + 1 > 15 free
    assert bm.can_swap_out(other)  # 5 CPU blocks free: fits exactly
    bm.free(other.seqs[0])
    bm.free_cross(other)
    assert bm.can_swap_in(big) == AllocStatus.OK
    assert bm.can_swap_in(big, num_lookahead_slots=5 * BS) == AllocStatus.NEVER  # 15 + 6 > 20


def test_can_swap_out_false_when_cpu_full():
    bm = BlockSpaceManager(BS, 20, 4, watermark=0)
    group = make_group("r", BS, 4 * BS)  # 5 blocks > 4 CPU blocks
    start(bm, group)
    assert not bm.can_swap_out(group)


def test_fork_then_append_copies_on_write():
    bm = BlockSpaceManager(BS, 16, 0, watermark=0)
    group = make_group("r", dec_len=6, enc_len=3)  # blocks: [x, y], y half full
    start(bm, group)
    parent = group.seqs[0]
    child = parent.fork(1)
    group.add(child)
    bm.fork(parent, child)
    shared = list(bm.get_block_table(parent))
    assert bm.get_block_table(child) == shared
    assert [bm.gpu_allocator.get_ref_count(b) for b in shared] == [2, 2]
    assert bm.can_append_slots(group)
    copies = decode_step(bm, child)
    (src, dst), = copies
    assert src == shared[1] and bm.get_block_table(child) == [shared[0], dst]
    assert bm.gpu_allocator.get_ref_count(src) == 1 and bm.gpu_allocator.get_ref_count(dst) == 1
    assert decode_step(bm, parent) == []  # the parent is now the only holder
    assert bm.get_block_table(parent) == shared


def test_append_grows_after_last_block_and_covers_lookahead():
    bm = BlockSpaceManager(BS, 64, 0, watermark=0)
    group = make_group("r", dec_len=BS, enc_len=BS)
    start(bm, group)
    seq = group.seqs[0]
    assert decode_step(bm, seq) == []
    table = bm.get_block_table(seq)
    assert len(table) == 2 and table[1] == table[0] + 1
    seq.append_token_id(1)
    assert bm.can_append_slots(group, num_lookahead_slots=2 * BS)
    assert bm.append_slots(seq, num_lookahead_slots=2 * BS) == []
    assert len(table) == -(-(seq.get_len() + 2 * BS) // BS)
    assert table == list(range(table[0], table[0] + len(table)))


def test_can_append_slots_counts_growth_and_copies():
    bm = BlockSpaceManager(BS, 3, 0, watermark=0)
    group = make_group("r", dec_len=BS - 1, enc_len=BS)  # 2 blocks, 1 free
    start(bm, group)
    parent = group.seqs[0]
    child = parent.fork(1)
    group.add(child)
    bm.fork(parent, child)
    parent.append_token_id(1)
    child.append_token_id(1)
    assert not bm.can_append_slots(group)  # each of the two would copy the shared block
    group.remove(1)
    bm.free(child)
    assert bm.can_append_slots(group)


def test_cross_tables_are_contiguous_runs():
    bm = BlockSpaceManager(BS, 256, 256, watermark=0)
    groups = [make_group(str(i), dec_len=1 + 3 * i, enc_len=1 + 7 * i, seq_id=i) for i in range(8)]
    for group in groups:
        start(bm, group)
    for group in groups:
        cross = bm.get_cross_block_table(group)
        assert cross == list(range(cross[0], cross[0] + len(cross)))
    # Free every other group: later cross tables take the lowest hole that fits.
    for group in groups[::2]:
        bm.free(group.seqs[0])
        bm.free_cross(group)
    late = make_group("late", dec_len=1, enc_len=10 * BS, seq_id=99)
    start(bm, late)
    cross = bm.get_cross_block_table(late)
    assert cross == list(range(cross[0], cross[0] + 10))
    # Swapping keeps the run on both devices.
    bm.swap_out(late)
    late.seqs[0].status = SequenceStatus.SWAPPED
    cross = bm.get_cross_block_table(late)
    assert cross == list(range(cross[0], cross[0] + 10))
    bm.swap_in(late)
    cross = bm.get_cross_block_table(late)
    assert cross == list(range(cross[0], cross[0] + 10))


def test_sliding_window_not_implemented():
    with pytest.raises(NotImplementedError, match="Sliding window"):
        BlockSpaceManager(BS, 8, 8, sliding_window=16)


def test_import_does_not_pull_torch():
    code = "import sys, encdec.block_manager; assert 'torch' not in sys.modules, 'torch imported'"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
