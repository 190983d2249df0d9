"""The encoder cache under random scheduler-like traffic: requests over a few
documents share cross tables, while others append, fork, finish, swap out and
in (one sharer or all), are recomputed (their table dropped and re-acquired),
abort, and cached-free tables are revived or evicted. After every step: free +
used = total on each device, every block's reference count equals the tables
(live or cached-free) holding it, a table's users are exactly the requests
pointing at it, a CPU table has only swapped users, a running request's table
is on the device, and no block is both cached-free and in use. At the end all
blocks are free."""
from __future__ import annotations

from collections import Counter

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from encdec.block_manager import AllocStatus, BlockSpaceManager
from encdec.block_manager.allocator import Device
from encdec.sequence import Sequence, SequenceGroup, SequenceStatus

BS = 4
NUM_GPU, NUM_CPU = 28, 24
WATERMARK = 0.05  # 1 block
DOC_LENS = [5, 9, 14, 30, 40]  # encoder tokens of the shared documents (2, 3, 4, 8, 10 blocks)


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BS)


class SharingMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockSpaceManager(BS, NUM_GPU, NUM_CPU, watermark=WATERMARK)
        self.groups: dict[str, SequenceGroup] = {}
        self.where: dict[str, Device] = {}  # request -> device of its self tables
        self.next_id = 0

    def _new_group(self, doc: int | None, dec_len: int, n: int) -> SequenceGroup:
        enc_len = DOC_LENS[doc] if doc is not None else 7
        inputs = {"prompt_token_ids": list(range(dec_len)), "encoder_prompt_token_ids": [doc or 0] * enc_len,
                  "prompt": None, "encoder_prompt": None}
        request_id = f"r{self.next_id}"
        seqs = [Sequence(self.next_id + i, inputs, BS) for i in range(n)]
        encoder_seq = Sequence(self.next_id, inputs, BS, from_decoder_prompt=False)
        self.next_id += n
        key = f"doc{doc}" if doc is not None else None
        return SequenceGroup(request_id, seqs, arrival_time=0.0, encoder_seq=encoder_seq, encoder_cache_key=key)

    def live(self, device: Device) -> list[str]:
        return sorted(r for r, d in self.where.items() if d is device)

    def _release(self, request_id: str) -> None:
        group = self.groups.pop(request_id)
        del self.where[request_id]
        for seq in group.get_seqs():
            self.bm.free(seq)
        self.bm.free_cross(group)

    # -- rules ---------------------------------------------------------------
    @rule(doc=st.one_of(st.none(), *[st.integers(0, len(DOC_LENS) - 1)] * 3), dec_len=st.integers(1, 3 * BS),
          n=st.integers(1, 2))
    def add(self, doc: int | None, dec_len: int, n: int) -> None:
        group = self._new_group(doc, dec_len, n)
        key = group.encoder_cache_key
        table = self.bm.cross._by_key.get(key) if key else None
        num_cross = blocks_for(group.get_encoder_seq().get_len())
        live = table is not None and table.device is Device.GPU and table.users
        cached = table is not None and table.device is Device.GPU and not table.users
        required = blocks_for(dec_len) + (0 if live else len(table.blocks) if cached else num_cross)
        free = self.bm.get_num_free_gpu_blocks()
        status = self.bm.can_allocate(group)
        if free - required < int(WATERMARK * NUM_GPU):
            assert status is AllocStatus.LATER
            return
        assert status is AllocStatus.OK
        evictions = self.bm.cross.num_evictions
        self.bm.allocate(group)
        if self.bm.cross.num_evictions > evictions:
            event("cached-free table evicted")
        assert self.bm.get_num_free_gpu_blocks() == free - required
        if live or cached:
            assert self.bm.get_cross_block_table(group) is table.blocks
        hit = not self.bm.claim_cross_write(group)  # the prefill
        assert hit == bool(live or cached)
        if hit:
            event("revived cached-free table" if cached else "shared live table")
        for seq in group.get_seqs():
            seq.status = SequenceStatus.RUNNING
            seq.data.update_num_computed_tokens(dec_len)
        self.groups[group.request_id] = group
        self.where[group.request_id] = Device.GPU

    @precondition(lambda self: self.live(Device.GPU))
    @rule(data=st.data(), k=st.integers(1, BS + 1))
    def append(self, data, k: int) -> None:
        request_id = data.draw(st.sampled_from(self.live(Device.GPU)))
        group = self.groups[request_id]
        seq = data.draw(st.sampled_from(group.get_seqs(status=SequenceStatus.RUNNING)))
        for _ in range(k):
            seq.append_token_id(5)
        if not self.bm.can_append_slots(group):
            self.recompute_or_swap(request_id)
            return
        self.bm.append_slots(seq)
        seq.data.update_num_computed_tokens(seq.get_len() - seq.data.get_num_computed_tokens())

    def recompute_or_swap(self, request_id: str) -> None:
        if self.bm.can_swap_out(self.groups[request_id]):
            self._swap(request_id, Device.CPU)
        else:
            self._release(request_id)

    @precondition(lambda self: self.live(Device.GPU))
    @rule(data=st.data())
    def fork(self, data) -> None:
        group = self.groups[data.draw(st.sampled_from(self.live(Device.GPU)))]
        if len(group.get_seqs()) >= 3:
            return
        parent = group.get_seqs(status=SequenceStatus.RUNNING)[0]
        child = parent.fork(self.next_id)
        self.next_id += 1
        group.add(child)
        self.bm.fork(parent, child)

    @precondition(lambda self: self.live(Device.GPU))
    @rule(data=st.data())
    def finish(self, data) -> None:
        self._release(data.draw(st.sampled_from(self.live(Device.GPU))))

    @precondition(lambda self: self.live(Device.GPU))
    @rule(data=st.data())
    def recompute(self, data) -> None:
        """Recompute preemption: the KV is dropped and the request admitted again
        later (here: at once, as a new group with the same input if it fits)."""
        request_id = data.draw(st.sampled_from(self.live(Device.GPU)))
        group = self.groups[request_id]
        key, dec_len = group.encoder_cache_key, group.seqs[0].get_prompt_len()
        self._release(request_id)
        doc = int(key[3:]) if key else None
        self.add(doc, dec_len, 1)

    def _swap(self, request_id: str, dst: Device) -> None:
        group = self.groups[request_id]
        table = self.bm.cross.table_of(request_id)
        src_free = (self.bm.get_num_free_gpu_blocks if dst is Device.CPU else self.bm.get_num_free_cpu_blocks)
        dst_free = (self.bm.get_num_free_cpu_blocks if dst is Device.CPU else self.bm.get_num_free_gpu_blocks)
        status = SequenceStatus.RUNNING if dst is Device.CPU else SequenceStatus.SWAPPED
        seqs = group.get_seqs(status=status)
        self_blocks = {b for s in seqs for b in self.bm.block_tables[s.seq_id]}
        others_on_device = table.on_device_users() - (1 if dst is Device.CPU else 0)
        table_moves = table.device is not dst and (dst is Device.GPU or others_on_device == 0)
        moved = len(self_blocks) + (len(table.blocks) if table_moves else 0)
        s0, d0 = src_free(), dst_free()
        pairs = self.bm.swap_out(group) if dst is Device.CPU else self.bm.swap_in(group)
        assert len(pairs) == moved
        if len(table.users) > 1:
            event(f"shared table {'moved' if table_moves else 'stayed'} when a sharer swapped to {dst.name}")
        assert src_free() == s0 + moved and dst_free() == d0 - moved
        for seq in seqs:
            seq.status = SequenceStatus.SWAPPED if dst is Device.CPU else SequenceStatus.RUNNING
        self.where[request_id] = dst

    @precondition(lambda self: self.live(Device.GPU))
    @rule(data=st.data())
    def swap_out(self, data) -> None:
        request_id = data.draw(st.sampled_from(self.live(Device.GPU)))
        if self.bm.can_swap_out(self.groups[request_id]):
            self._swap(request_id, Device.CPU)

    @precondition(lambda self: self.live(Device.CPU))
    @rule(data=st.data())
    def swap_in(self, data) -> None:
        request_id = data.draw(st.sampled_from(self.live(Device.CPU)))
        if self.bm.can_swap_in(self.groups[request_id]) is AllocStatus.OK:
            self._swap(request_id, Device.GPU)

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def abort(self, data) -> None:
        self._release(data.draw(st.sampled_from(sorted(self.groups))))

    @rule()
    def schedule_start(self) -> None:
        """What ``schedule()`` does first: idle shared tables follow their users to CPU."""
        cpu0 = self.bm.get_num_free_cpu_blocks()
        pairs = self.bm.swap_out_idle_cross()
        assert self.bm.get_num_free_cpu_blocks() == cpu0 - len(pairs)
        if pairs:
            event("idle shared table swapped out after its running users ended")

    # -- invariants ----------------------------------------------------------
    @invariant()
    def books_balance(self) -> None:
        bm, cross = self.bm, self.bm.cross
        assert set(bm.cross_block_tables) == set(self.groups)
        tables = {id(cross.table_of(r)): cross.table_of(r) for r in self.groups}
        for table in tables.values():
            users = {r for r in self.groups if cross.table_of(r) is table}
            assert table.users == users  # reference counts = table references
            assert table.swapped == {r for r in users if self.where[r] is Device.CPU}
            if table.device is Device.CPU:
                assert not table.on_device_users()  # a running user always finds it on the device
            assert len(table.blocks) == len(set(table.blocks))
        refs = {Device.GPU: Counter(), Device.CPU: Counter()}
        for table in tables.values():
            refs[table.device].update(table.blocks)
        cached_blocks = set()
        for table in cross.cached_free():
            assert table.device is Device.GPU and not table.users and id(table) not in tables
            cached_blocks.update(table.blocks)
            refs[Device.GPU].update(table.blocks)
        assert len(cached_blocks) == cross.num_evictable
        for request_id, group in self.groups.items():
            for seq in group.get_unfinished_seqs():
                refs[self.where[request_id]].update(bm.block_tables[seq.seq_id])
        in_use = {b for t in tables.values() if t.device is Device.GPU for b in t.blocks} | {
            b for r, g in self.groups.items() if self.where[r] is Device.GPU
            for s in g.get_unfinished_seqs() for b in bm.block_tables[s.seq_id]}
        assert not cached_blocks & in_use  # no block both cached-free and in use
        for device, counter in refs.items():
            alloc = bm.gpu_allocator if device is Device.GPU else bm.cpu_allocator
            assert [alloc.get_ref_count(b) for b in range(alloc.num_blocks)] == [
                counter[b] for b in range(alloc.num_blocks)]
            assert alloc.get_num_free_blocks() + len(counter) == alloc.num_blocks  # free + used = total
        assert bm.get_num_free_gpu_blocks() == bm.gpu_allocator.get_num_free_blocks() + cross.num_evictable

    def teardown(self) -> None:
        for request_id in sorted(self.groups):
            self._release(request_id)
        self.bm.swap_out_idle_cross()
        assert self.bm.get_num_free_gpu_blocks() == NUM_GPU
        assert self.bm.get_num_free_cpu_blocks() == NUM_CPU
        self.bm.cross.make_room(NUM_GPU)  # evict every cached-free table
        assert self.bm.gpu_allocator.get_num_free_blocks() == NUM_GPU and not self.bm.cross.cached_free()


SharingMachine.TestCase.settings = settings(max_examples=400, stateful_step_count=60, deadline=None)
test_cross_sharing_state_machine = SharingMachine.TestCase
