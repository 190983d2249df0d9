"""BlockSpaceManager: which KV-cache blocks each request owns, on which device.

An encoder/decoder request owns two kinds of block tables (vLLM V0 layout):

    block_tables        decoder seq_id -> self-attention blocks; grows by one
                        block every block_size tokens; forks share blocks by
                        reference count and copy the one they write (CoW)
        7 -> [12, 13, 40]            12, 13: ref count 2 (seqs 7 and 8)
        8 -> [12, 13, 41]

    cross_block_tables  request_id -> cross-attention blocks; written once at
                        prefill from the encoder output, read every decode
                        step, never grown; one per request, whatever n is,
                        shared by requests with the same encoder input
                        (``SequenceGroup.encoder_cache_key``; cross_tables.py)
        "req-3" -> [20, 21, 22, 23]  one contiguous run when one is free: the
                                     backend then reads it as a zero-copy slice

With ``enable_caching`` full prompt blocks are found again by content (prefix_cache.py).

swap_out / swap_in move a group's live self tables and its cross table between
devices together (a shared cross table moves only with the last sharer to
leave the device, or the first to come back). The free-block arithmetic of
the design seed holds, with "group blocks" counting distinct physical blocks
that move or are freed, and cached-free cross blocks counted as free:

    allocate   free_gpu -= group blocks
    swap_out   free_gpu += group blocks    free_cpu -= group blocks
    swap_in    free_gpu -= group blocks    free_cpu += group blocks
    free       free_dev += |seq table|     (blocks no other table shares)
    free_cross free_dev += |cross table|
    reset      everything free
"""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from encdec.block_manager.allocator import BlockAllocator, Device
from encdec.block_manager.capacity import WATERMARK, watermark_blocks  # noqa: F401 (re-exported)
from encdec.block_manager.cross_tables import CrossTables
from encdec.block_manager.prefix_cache import PrefixCache, cacheable_tokens
from encdec.sequence import SequenceStatus

if TYPE_CHECKING:
    from encdec.sequence import Sequence, SequenceGroup


class AllocStatus(enum.Enum):
    """Whether a group fits on the GPU: now, once others leave, or never."""

    OK = enum.auto()
    LATER = enum.auto()
    NEVER = enum.auto()


class BlockSpaceManager:
    """Maps decoder sequences and requests to blocks of the GPU cache and the
    CPU swap space. Pure bookkeeping: ints and lists, no tensors."""

    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        watermark: float = WATERMARK,
        sliding_window: int | None = None,
        enable_caching: bool = False,
        warm_gpu_blocks: int | None = None,
    ) -> None:
        if sliding_window is not None:
            raise NotImplementedError(
                "Sliding window attention for encoder/decoder models is not currently supported."
            )
        assert watermark >= 0.0
        self.block_size = block_size
        self.num_total_gpu_blocks = num_gpu_blocks
        self.num_total_cpu_blocks = num_cpu_blocks
        # Blocks kept free at admission so running groups can still grow.
        self.watermark_blocks = watermark_blocks(num_gpu_blocks, watermark)
        # Blocks the cache engine wrote at start (None: all): allocations stay on
        # them while they can (BlockAllocator).
        self.gpu_allocator = BlockAllocator(Device.GPU, num_gpu_blocks, warm_gpu_blocks)
        self.cpu_allocator = BlockAllocator(Device.CPU, num_cpu_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self.cross = CrossTables(self.gpu_allocator, self.cpu_allocator)
        # Full decoder prompt blocks found again by (encoder input, tokens); None: off.
        self.prefix = PrefixCache(self.gpu_allocator, block_size) if enable_caching else None
        # Which device each self table's block numbers refer to.
        self._seq_device: dict[int, Device] = {}

    @property
    def cross_block_tables(self) -> dict[str, list[int]]:
        """request_id -> its cross table's blocks (a new dict of live lists)."""
        return self.cross.tables()

    def can_allocate(self, seq_group: SequenceGroup, num_lookahead_slots: int = 0) -> AllocStatus:
        """Counts one decoder prompt (the group's WAITING seqs share it), with
        room for the lookahead slots, plus the cross table: NEVER as if it
        were not shared, LATER/OK by what taking it costs now (nothing when
        another request's table of the same input is live)."""
        seq = seq_group.get_seqs(status=SequenceStatus.WAITING)[0]
        required = self._num_blocks(seq.get_len() + num_lookahead_slots)
        alone = required
        encoder_seq = seq_group.get_encoder_seq()
        if encoder_seq is not None:
            num_cross = self._num_blocks(encoder_seq.get_len())
            alone += num_cross
            required += self.cross.device_blocks_needed(seq_group.encoder_cache_key, num_cross)
        if self.num_total_gpu_blocks - alone < self.watermark_blocks:
            return AllocStatus.NEVER
        if self.get_num_free_gpu_blocks() - required >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(self, seq_group: SequenceGroup, num_new_tokens: int | None = None) -> int:
        """One self table for the WAITING decoder seqs, shared by reference count
        (they hold the same prompt), and the request's cross table, on the GPU:
        the live or cached-free one of its encoder input when there is one.
        Returns the prompt tokens whose K/V the prefix cache holds (skipped; 0
        with the cache off). ``num_new_tokens``: the prompt tokens past those this
        step computes (a first chunk): blocks after them are not registered."""
        gpu = self.gpu_allocator
        encoder_seq = seq_group.get_encoder_seq()
        key = seq_group.encoder_cache_key if self.prefix is not None else None
        # Self blocks are reused only beside their cross table, still on the device:
        # the prefill then reads its cross K/V there too (no encoder pass).
        reuse = key is not None and self.cross.has_device_table(key)
        if encoder_seq is not None:  # cross first: on an idle cache it takes the lowest run
            num_cross = self._num_blocks(encoder_seq.get_len())
            if not self.cross.has_device_table(seq_group.encoder_cache_key):
                self._make_room(num_cross)
            self.cross.acquire(seq_group.request_id, seq_group.encoder_cache_key, num_cross)

        waiting = seq_group.get_seqs(status=SequenceStatus.WAITING)
        assert waiting, "allocate needs WAITING sequences"
        table: list[int] = []
        if key is not None:
            hashes, table = self.prefix.lookup(key, waiting[0].get_token_ids(),
                                               cacheable_tokens(seq_group, waiting[0]) if reuse else 0)
        cached = len(table)
        self._grow(table, self._num_blocks(waiting[0].get_len()))
        if key is not None:
            end = None if num_new_tokens is None else cached + num_new_tokens // self.block_size
            self.prefix.register_all(table, hashes[:end], cached)  # the prompt's other full blocks
        for seq in waiting:
            assert seq.seq_id not in self.block_tables
            self.block_tables[seq.seq_id] = table.copy()
            self._seq_device[seq.seq_id] = Device.GPU
        for _ in waiting[1:]:
            for block in table:
                gpu.incr_ref(block)
        return cached * self.block_size

    def can_append_slots(self, seq_group: SequenceGroup, num_lookahead_slots: int = 0) -> bool:
        """Whether every RUNNING seq can take its append_slots now. Conservative:
        siblings sharing one block each count a copy, though the last keeps it."""
        gpu = self.gpu_allocator
        needed = 0
        for seq in seq_group.get_seqs(status=SequenceStatus.RUNNING):
            table = self.block_tables[seq.seq_id]
            first, end = self._write_range(seq, num_lookahead_slots)
            needed += max(0, end - len(table))
            for i in range(first, min(end, len(table))):
                needed += gpu.get_ref_count(table[i]) > 1
        return needed <= self.get_num_free_gpu_blocks()

    def slot_is_ready(self, seq: Sequence, num_lookahead_slots: int = 0) -> bool:
        """Whether a decode step's one write (position ``get_len() - 1``, plus the
        lookahead) lands in a block ``seq`` alone holds, so ``append_slots`` would
        change nothing: checked per row per step, before the general path."""
        table = self.block_tables[seq.seq_id]
        data = seq.data
        n = data.get_len()
        end = n + num_lookahead_slots
        if end > len(table) * self.block_size or data.get_num_computed_tokens() < n - 1:
            return False
        bs, ref = self.block_size, self.gpu_allocator.get_ref_count
        first, last = (n - 1) // bs, (end - 1) // bs
        if first == last:  # a decode step without lookahead: one block
            return ref(table[first]) == 1
        return all(ref(table[i]) == 1 for i in range(first, last + 1))

    def append_slots(self, seq: Sequence, num_lookahead_slots: int = 0) -> list[tuple[int, int]]:
        """Make the slots this step writes exist and belong to ``seq`` alone.

        The table grows to cover ``get_len() + num_lookahead_slots`` tokens, and
        each shared block the step writes into is copied (CoW). The step writes
        from the first token without KV; ``get_len() - 1`` at the latest, so a
        decode step is safe even if computed tokens were already counted. In a
        decode step that is one block: O(1). Returns ``[(src, dst)]`` GPU copies.
        """
        assert self._seq_device[seq.seq_id] is Device.GPU
        gpu = self.gpu_allocator
        table = self.block_tables[seq.seq_id]
        first, end = self._write_range(seq, num_lookahead_slots)
        copies: list[tuple[int, int]] = []
        for i in range(first, min(end, len(table))):
            src = table[i]
            if gpu.get_ref_count(src) > 1:
                self._make_room(1)
                dst = gpu.allocate(prefer=table[i - 1] + 1 if i else None)
                self._free_block(gpu, src)
                table[i] = dst
                copies.append((src, dst))
        self._grow(table, end)
        return copies

    def fork(self, parent_seq: Sequence, child_seq: Sequence) -> None:
        """The child shares all the parent's blocks; CoW splits them on write.
        The cross table is per request, so it is shared without any work."""
        table = self.block_tables.get(parent_seq.seq_id)
        if table is None:  # parent already freed: nothing to share
            return
        device = self._seq_device[parent_seq.seq_id]
        allocator = self._allocator(device)
        for block in table:
            allocator.incr_ref(block)
        assert child_seq.seq_id not in self.block_tables
        self.block_tables[child_seq.seq_id] = table.copy()
        self._seq_device[child_seq.seq_id] = device

    def can_swap_out(self, seq_group: SequenceGroup) -> bool:
        blocks = self._group_blocks(seq_group, SequenceStatus.RUNNING)
        return len(blocks) <= self.cpu_allocator.get_num_free_blocks()

    def can_swap_in(self, seq_group: SequenceGroup, num_lookahead_slots: int = 0) -> AllocStatus:
        """As vLLM V0: the group's distinct blocks plus, per SWAPPED seq, room to
        append right after (one token and the lookahead). The watermark holds."""
        num_seqs = seq_group.num_seqs(status=SequenceStatus.SWAPPED)
        required = len(self._group_blocks(seq_group, SequenceStatus.SWAPPED))
        required += num_seqs * self._num_blocks(num_lookahead_slots + 1)
        if required > self.num_total_gpu_blocks:
            return AllocStatus.NEVER
        if self.get_num_free_gpu_blocks() - required >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def swap_out(self, seq_group: SequenceGroup) -> list[tuple[int, int]]:
        """RUNNING seqs' tables and the cross table to the CPU: ``[(gpu, cpu)]``."""
        return self._swap(seq_group, SequenceStatus.RUNNING, self.gpu_allocator, self.cpu_allocator)

    def swap_in(self, seq_group: SequenceGroup) -> list[tuple[int, int]]:
        """SWAPPED seqs' tables and the cross table to the GPU: ``[(cpu, gpu)]``."""
        return self._swap(seq_group, SequenceStatus.SWAPPED, self.cpu_allocator, self.gpu_allocator)

    def _swap(
        self, seq_group: SequenceGroup, status: SequenceStatus, src: BlockAllocator, dst: BlockAllocator
    ) -> list[tuple[int, int]]:
        """Move tables from ``src`` to ``dst``. A block shared by several seqs is
        copied once (``mapping``) and keeps its reference count. Pairs list the
        decoder tables' blocks first (first-seen order), then the cross table's
        when it moves (see ``CrossTables.moves_with``)."""
        if dst.device is Device.GPU:
            self._make_room(len(self._group_blocks(seq_group, status)))
        mapping: dict[int, int] = {}
        for seq in seq_group.get_seqs(status=status):
            assert self._seq_device[seq.seq_id] is src.device
            new_table: list[int] = []
            for block in self.block_tables[seq.seq_id]:
                moved = mapping.get(block)
                if moved is None:
                    prefer = new_table[-1] + 1 if new_table else None
                    moved = mapping[block] = dst.allocate(prefer=prefer)
                else:
                    dst.incr_ref(moved)
                self._free_block(src, block)
                new_table.append(moved)
            self.block_tables[seq.seq_id] = new_table
            self._seq_device[seq.seq_id] = dst.device
        return list(mapping.items()) + self.cross.swap_user(seq_group.request_id, dst.device)

    def free(self, seq: Sequence) -> None:
        """Drop the seq's self table on whichever device holds it; blocks that no
        other table shares become free. No-op for a seq without a table."""
        table = self.block_tables.pop(seq.seq_id, None)
        if table is None:
            return
        allocator = self._allocator(self._seq_device.pop(seq.seq_id))
        if self.prefix is not None and allocator is self.gpu_allocator:
            # Registered blocks whose K/V no step computed (a planned step dropped
            # unrun) must not be found again.
            computed = seq.data.get_num_computed_tokens() // self.block_size
            for block in table[computed:]:
                self.prefix.unregister(block)
        for block in reversed(table):  # a cached prefix's tail blocks are evicted first
            self._free_block(allocator, block)

    def trim(self, seq: Sequence) -> None:
        """Free the device blocks past ``seq``'s tokens: draft tokens a step
        verified and rejected had slots there (speculative decoding)."""
        table = self.block_tables[seq.seq_id]
        keep = self._num_blocks(seq.get_len())
        while len(table) > keep:
            self._free_block(self.gpu_allocator, table.pop())

    def free_cross(self, seq_group: SequenceGroup) -> None:
        """Drop the request's use of its cross table: the table is freed with its
        last user, or kept cached-free (see cross_tables.py). No-op without one."""
        self.cross.release(seq_group.request_id)

    def encoder_tokens_to_run(self, seq_group: SequenceGroup) -> int:
        """Encoder input tokens admitting the group now would run through the
        encoder: 0 when a device cross table of its input is there to read (the
        encoder cache) or it has no encoder input; what the encoder budget counts."""
        encoder_seq = seq_group.get_encoder_seq()
        if encoder_seq is None or self.cross.has_device_table(seq_group.encoder_cache_key):
            return 0
        return encoder_seq.get_len()

    def claim_cross_write(self, seq_group: SequenceGroup) -> bool:
        """Whether this prefill must run the encoder and write the cross table
        (True once per table); False: its KV is there or written this step."""
        return self.cross.claim_write(seq_group.request_id)

    def swap_out_idle_cross(self) -> list[tuple[int, int]]:
        """``[(gpu, cpu)]`` for shared cross tables whose running users all
        ended while others are swapped; the scheduler runs these first."""
        return self.cross.swap_out_idle()

    def reset(self) -> None:
        """Every table dropped, every block on both devices free."""
        self.block_tables.clear()
        self.cross.reset()
        if self.prefix is not None:
            self.prefix.reset()
        self._seq_device.clear()
        self.gpu_allocator.reset()
        self.cpu_allocator.reset()

    def get_block_table(self, seq: Sequence) -> list[int]:
        """The live table (no copy: read every step); callers must not mutate it."""
        return self.block_tables[seq.seq_id]

    def get_cross_block_table(self, seq_group: SequenceGroup) -> list[int]:
        """The live cross table (no copy); callers must not mutate it."""
        table = self.cross.table_of(seq_group.request_id)
        if table is None:
            raise KeyError(seq_group.request_id)
        return table.blocks

    def get_num_free_gpu_blocks(self) -> int:
        """Free device blocks, cached-free cross blocks included: allocation
        evicts those as needed, so they are free to every caller."""
        evictable = self.cross.num_evictable + (self.prefix.num_evictable if self.prefix is not None else 0)
        return self.gpu_allocator.get_num_free_blocks() + evictable

    def prefix_cache_stats(self) -> tuple[int, int]:
        """(prompt tokens looked up, of those found cached) since the start; (0, 0) off."""
        return (self.prefix.num_queries, self.prefix.num_hits) if self.prefix is not None else (0, 0)

    def get_num_free_cpu_blocks(self) -> int:
        return self.cpu_allocator.get_num_free_blocks()

    def _num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _make_room(self, num_blocks: int) -> None:
        """Evict cached-free blocks until ``num_blocks`` can be allocated: the
        prefix cache's first (their K/V are worth one prefill's share), then
        whole cross tables (each an encoder pass)."""
        if self.prefix is not None:
            self.prefix.make_room(num_blocks)
        self.cross.make_room(num_blocks)

    def _free_block(self, allocator: BlockAllocator, block: int) -> None:
        """Drop one table entry's reference; a registered device block left to
        the prefix cache alone stays cached-free."""
        if self.prefix is not None and allocator is self.gpu_allocator:
            self.prefix.release(block)
        else:
            allocator.free(block)

    def _allocator(self, device: Device) -> BlockAllocator:
        return self.gpu_allocator if device is Device.GPU else self.cpu_allocator

    def _grow(self, table: list[int], num_blocks: int) -> None:
        """Append GPU blocks up to ``num_blocks``, each after its predecessor when free."""
        if len(table) >= num_blocks:  # most decode steps: the last block has room
            return
        gpu = self.gpu_allocator
        self._make_room(num_blocks - len(table))
        while len(table) < num_blocks:
            table.append(gpu.allocate(prefer=table[-1] + 1 if table else None))

    def _write_range(self, seq: Sequence, num_lookahead_slots: int) -> tuple[int, int]:
        """Block indices ``[first, end)`` an append step writes into."""
        num_tokens = seq.get_len()
        first = max(min(seq.data.get_num_computed_tokens(), num_tokens - 1), 0) // self.block_size
        return first, self._num_blocks(num_tokens + num_lookahead_slots)

    def _group_blocks(self, seq_group: SequenceGroup, status: SequenceStatus) -> set[int]:
        """Distinct physical blocks of the seqs in ``status`` plus the cross
        table's when it would move with them."""
        blocks: set[int] = set()
        for seq in seq_group.get_seqs(status=status):
            blocks.update(self.block_tables[seq.seq_id])
        dst = Device.CPU if status is SequenceStatus.RUNNING else Device.GPU
        blocks.update(self.cross.moves_with(seq_group.request_id, dst))
        return blocks
