"""Random scheduler-like traffic against BlockSpaceManager, checking after every
step that the books balance: free + used = total on each device, every block's
reference count equals the table entries pointing at it, tables hold blocks of
the device their group is on, and a cross table lives exactly as long as its
group."""
from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from encdec.block_manager import AllocStatus, BlockSpaceManager
from encdec.block_manager.allocator import Device
from encdec.sequence import Sequence, SequenceGroup, SequenceStatus

BS = 4
NUM_GPU, NUM_CPU = 32, 24
WATERMARK = 0.05  # 1 block


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BS)


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockSpaceManager(BS, NUM_GPU, NUM_CPU, watermark=WATERMARK)
        self.groups: dict[str, SequenceGroup] = {}
        self.where: dict[str, Device] = {}  # request_id -> device of its tables
        self.next_seq_id = 0
        self.next_request = 0

    # -- helpers -------------------------------------------------------------

    def live(self, device: Device) -> list[str]:
        return sorted(r for r, d in self.where.items() if d is device)

    def allocator(self, device: Device):
        return self.bm.gpu_allocator if device is Device.GPU else self.bm.cpu_allocator

    def tables(self, request_id: str) -> list[list[int]]:
        group = self.groups[request_id]
        return [self.bm.block_tables[s.seq_id] for s in group.get_unfinished_seqs()]

    def group_blocks(self, request_id: str) -> set[int]:
        blocks = {b for t in self.tables(request_id) for b in t}
        return blocks | set(self.bm.cross_block_tables[request_id])

    def drop(self, request_id: str) -> None:
        free = self.allocator(self.where.pop(request_id)).get_num_free_blocks
        before, blocks = free(), len(self.group_blocks(request_id))
        group = self.groups.pop(request_id)
        for seq in group.get_seqs():
            self.bm.free(seq)
        self.bm.free_cross(group)
        assert free() == before + blocks

    def preempt(self, request_id: str) -> None:
        if self.bm.can_swap_out(self.groups[request_id]):
            self.swap_out_group(request_id)
        else:
            self.drop(request_id)

    def swap_out_group(self, request_id: str) -> None:
        self.move(request_id, SequenceStatus.RUNNING, SequenceStatus.SWAPPED, Device.GPU, Device.CPU)

    def move(self, request_id, status, new_status, src_dev, dst_dev) -> None:
        group = self.groups[request_id]
        src, dst = self.allocator(src_dev), self.allocator(dst_dev)
        seqs = group.get_seqs(status=status)
        old_tables = [list(self.bm.block_tables[s.seq_id]) for s in seqs]
        old_cross = list(self.bm.cross_block_tables[request_id])
        order = list(dict.fromkeys(b for t in old_tables for b in t)) + old_cross
        old_refs = {b: src.get_ref_count(b) for b in order}
        src0, dst0 = src.get_num_free_blocks(), dst.get_num_free_blocks()
        before = set(range(dst.num_blocks)) - dst._free

        mapping = self.bm.swap_out(group) if dst_dev is Device.CPU else self.bm.swap_in(group)

        assert [s for s, _ in mapping] == order
        moved = dict(mapping)
        assert len(set(moved.values())) == len(moved) and not before & set(moved.values())
        assert src.get_num_free_blocks() == src0 + len(order)
        assert dst.get_num_free_blocks() == dst0 - len(order)
        for seq, old in zip(seqs, old_tables):
            assert self.bm.block_tables[seq.seq_id] == [moved[b] for b in old]
            seq.status = new_status
        assert self.bm.cross_block_tables[request_id] == [moved[b] for b in old_cross]
        assert all(dst.get_ref_count(moved[b]) == old_refs[b] for b in order)
        self.where[request_id] = dst_dev

    # -- rules ---------------------------------------------------------------

    # Mostly small requests; now and then one near or past the whole cache (NEVER).
    @rule(
        dec_len=st.integers(1, 3 * BS),
        enc_len=st.one_of(*[st.integers(1, 6 * BS)] * 3, st.integers((NUM_GPU - 6) * BS, NUM_GPU * BS)),
        n=st.integers(1, 3),
    )
    def add(self, dec_len: int, enc_len: int, n: int) -> None:
        request_id = f"r{self.next_request}"
        self.next_request += 1
        inputs = {
            "prompt_token_ids": list(range(dec_len)),
            "encoder_prompt_token_ids": list(range(enc_len)),
            "prompt": None,
            "encoder_prompt": None,
        }
        seqs = [Sequence(self.next_seq_id + i, inputs, BS) for i in range(n)]
        encoder_seq = Sequence(self.next_seq_id, inputs, BS, from_decoder_prompt=False)
        self.next_seq_id += n
        group = SequenceGroup(request_id, seqs, arrival_time=0.0, encoder_seq=encoder_seq)

        required = blocks_for(dec_len) + blocks_for(enc_len)
        watermark = int(WATERMARK * NUM_GPU)
        free = self.bm.get_num_free_gpu_blocks()
        status = self.bm.can_allocate(group)
        if NUM_GPU - required < watermark:
            assert status == AllocStatus.NEVER
        elif free - required < watermark:
            assert status == AllocStatus.LATER
        else:
            assert status == AllocStatus.OK
            self.bm.allocate(group)
            assert self.bm.get_num_free_gpu_blocks() == free - required
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
                seq.data.update_num_computed_tokens(dec_len)
            self.groups[request_id] = group
            self.where[request_id] = Device.GPU

    @precondition(lambda self: self.live(Device.GPU))
    @rule(data=st.data(), k=st.integers(1, BS + 1), lookahead=st.integers(0, 2))
    def append(self, data, k: int, lookahead: int) -> None:
        request_id = data.draw(st.sampled_from(self.live(Device.GPU)))
        group = self.groups[request_id]
        seq = data.draw(st.sampled_from(group.get_seqs(status=SequenceStatus.RUNNING)))
        for _ in range(k):
            seq.append_token_id(5)
        if not self.bm.can_append_slots(group, lookahead):
            self.preempt(request_id)
            return
        gpu = self.bm.gpu_allocator
        old = list(self.bm.block_tables[seq.seq_id])
        old_refs = [gpu.get_ref_count(b) for b in old]
        used_before = set(range(NUM_GPU)) - gpu._free
        first = seq.data.get_num_computed_tokens() // BS
        end = blocks_for(seq.get_len() + lookahead)

        copies = self.bm.append_slots(seq, lookahead)

        table = self.bm.block_tables[seq.seq_id]
        assert len(table) == max(len(old), end)
        expected = [(old[i], table[i]) for i in range(first, min(end, len(old))) if old_refs[i] > 1]
        assert copies == expected
        for i, b in enumerate(table):
            if first <= i < end:
                assert gpu.get_ref_count(b) == 1  # written this step: exclusive
                if i >= len(old) or old_refs[i] > 1:
                    assert b not in used_before  # fresh
            else:
                assert b == old[i]
        # The step computes every token without KV.
        seq.data.update_num_computed_tokens(seq.get_len() - seq.data.get_num_computed_tokens())

    @precondition(lambda self: self.live(Device.GPU))
    @rule(data=st.data())
    def fork(self, data) -> None:
        request_id = data.draw(st.sampled_from(self.live(Device.GPU)))
        group = self.groups[request_id]
        if len(group.get_seqs()) >= 4:
            return
        parent = data.draw(st.sampled_from(group.get_seqs(status=SequenceStatus.RUNNING)))
        child = parent.fork(self.next_seq_id)
        self.next_seq_id += 1
        group.add(child)
        refs = [self.bm.gpu_allocator.get_ref_count(b) for b in self.bm.block_tables[parent.seq_id]]
        self.bm.fork(parent, child)
        table = self.bm.block_tables[parent.seq_id]
        assert self.bm.block_tables[child.seq_id] == table
        assert [self.bm.gpu_allocator.get_ref_count(b) for b in table] == [r + 1 for r in refs]

    @precondition(lambda self: self.live(Device.GPU))
    @rule(data=st.data())
    def finish(self, data) -> None:
        request_id = data.draw(st.sampled_from(self.live(Device.GPU)))
        group = self.groups[request_id]
        seq = data.draw(st.sampled_from(group.get_seqs(status=SequenceStatus.RUNNING)))
        gpu = self.bm.gpu_allocator
        before = gpu.get_num_free_blocks()
        unshared = sum(gpu.get_ref_count(b) == 1 for b in self.bm.block_tables[seq.seq_id])
        seq.status = SequenceStatus.FINISHED_STOPPED
        self.bm.free(seq)
        assert gpu.get_num_free_blocks() == before + unshared
        if group.is_finished():
            before = gpu.get_num_free_blocks()
            cross = len(self.bm.cross_block_tables[request_id])
            self.bm.free_cross(group)
            assert gpu.get_num_free_blocks() == before + cross
            del self.groups[request_id], self.where[request_id]

    @precondition(lambda self: self.live(Device.GPU))
    @rule(data=st.data())
    def swap_out(self, data) -> None:
        request_id = data.draw(st.sampled_from(self.live(Device.GPU)))
        if self.bm.can_swap_out(self.groups[request_id]):
            self.swap_out_group(request_id)
        else:
            assert len(self.group_blocks(request_id)) > self.bm.get_num_free_cpu_blocks()

    @precondition(lambda self: self.live(Device.CPU))
    @rule(data=st.data())
    def swap_in(self, data) -> None:
        request_id = data.draw(st.sampled_from(self.live(Device.CPU)))
        group = self.groups[request_id]
        required = len(self.group_blocks(request_id)) + group.num_seqs(status=SequenceStatus.SWAPPED)
        status = self.bm.can_swap_in(group)
        if required > NUM_GPU:
            assert status == AllocStatus.NEVER
        elif self.bm.get_num_free_gpu_blocks() - required < int(WATERMARK * NUM_GPU):
            assert status == AllocStatus.LATER
        else:
            assert status == AllocStatus.OK
            self.move(request_id, SequenceStatus.SWAPPED, SequenceStatus.RUNNING, Device.CPU, Device.GPU)

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def abort(self, data) -> None:
        self.drop(data.draw(st.sampled_from(sorted(self.groups))))

    # -- invariants ----------------------------------------------------------

    @invariant()
    def books_balance(self) -> None:
        assert set(self.bm.cross_block_tables) == set(self.groups)
        live_seqs = {s.seq_id for g in self.groups.values() for s in g.get_unfinished_seqs()}
        assert set(self.bm.block_tables) == live_seqs
        refs = {Device.GPU: Counter(), Device.CPU: Counter()}
        for request_id, group in self.groups.items():
            counter = refs[self.where[request_id]]
            cross = self.bm.cross_block_tables[request_id]
            assert len(cross) == blocks_for(group.get_encoder_seq().get_len())
            counter.update(cross)
            for seq in group.get_unfinished_seqs():
                table = self.bm.block_tables[seq.seq_id]
                assert len(set(table)) == len(table)
                assert len(table) >= blocks_for(seq.data.get_num_computed_tokens())
                counter.update(table)
        for device, counter in refs.items():
            alloc = self.allocator(device)
            assert all(0 <= b < alloc.num_blocks for b in counter)
            # A block sits in several tables exactly when its ref count says so,
            # and only on the device its group is on.
            assert [alloc.get_ref_count(b) for b in range(alloc.num_blocks)] == [
                counter[b] for b in range(alloc.num_blocks)
            ]
            assert alloc.get_num_free_blocks() + len(counter) == alloc.num_blocks
            assert alloc._free == set(range(alloc.num_blocks)) - set(counter)


BlockManagerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_block_manager_state_machine = BlockManagerMachine.TestCase
