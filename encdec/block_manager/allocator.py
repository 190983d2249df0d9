"""Per-device block allocator: which KV-cache blocks are free, and how many
block-table entries point at each used one.

A block is ``block_size`` token slots of one device's KV cache. The allocator
only hands out block numbers; the cache engine owns the memory. A block is free
exactly when its reference count is zero.

The free blocks are kept twice, each view making one query cheap:

    block      0  1  2  3  4  5  6  7  ...
    free_map  01 01 00 00 01 01 01 00  ...   one byte per block, 01 = free
              -> first-fit contiguous run of n: free_map.find(b"\\x01" * n), in C
              -> lowest free block: free_map.find(1, low), in C
    free set  {0, 1, 4, 5, 6, ...}
              -> "is block b free?" and the free count in O(1)
    low       every block below it is in use (a search's start, not exact)
    mark      blocks from it up have never been handed out (nor prefaulted)

Both matter for a CPU cache, which is mapped lazily: the first write to a
never-used block faults its pages in (on huge pages, 2 MiB zeroed and perhaps
compacted), and that first write costs ~10x a repeated one. So a block is the
lowest free one, and a run comes from below the mark while one is free there
(``CrossTables.make_room`` evicts cached tables to keep it so). Measured
(Whisper tiny.en, 8 files of 6 minutes, 2 cores): before, prefill steps' cache
writes took 6.5 ms a layer for self-attention and 2.1 ms for cross-attention,
against 0.3 and 0.8 ms for the same writes repeated. On CUDA the whole cache
is written at start (``warm_blocks`` = all of it), so only the order is left.

Contiguous runs matter for cross-attention: the backend reads a request's
cross KV as a zero-copy slice of the cache when its blocks form one run.
"""
from __future__ import annotations

import enum


class Device(enum.Enum):
    GPU = enum.auto()  # the device the model runs on (the CPU itself on CPU-only runs)
    CPU = enum.auto()  # host swap space


class BlockAllocator:
    """Free list and reference counts of one device's blocks."""

    def __init__(self, device: Device, num_blocks: int, warm_blocks: int | None = None) -> None:
        self.device = device
        self.num_blocks = num_blocks
        # Written before any allocation; None: all of them (a cache allocated whole).
        self.warm_blocks = num_blocks if warm_blocks is None else min(warm_blocks, num_blocks)
        self.reset()

    def reset(self) -> None:
        """Every block free, no references."""
        self._ref_counts = [0] * self.num_blocks
        self._free = set(range(self.num_blocks))
        self._free_map = bytearray(b"\x01") * self.num_blocks
        self._low = 0
        self._mark = self.warm_blocks

    def get_num_free_blocks(self) -> int:
        return len(self._free)

    def get_num_free_warm_blocks(self) -> int:
        """Free blocks below the mark: taking them writes no never-used memory."""
        return len(self._free) - (self.num_blocks - self._mark)

    def get_ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def allocate(self, *, prefer: int | None = None) -> int:
        """One free block with reference count 1.

        ``prefer`` is taken when free: a growing table asks for ``last + 1`` so
        its blocks stay in a run. Otherwise the lowest free block (module
        docstring): a byte search in C from ``low``.
        """
        if prefer is not None and prefer in self._free:
            block = prefer
        else:
            assert self._free, f"out of {self.device.name} blocks"
            block = self._free_map.find(1, self._low)
            self._low = block + 1
        self._mark = max(self._mark, block + 1)
        self._free.remove(block)
        self._free_map[block] = 0
        self._ref_counts[block] = 1
        return block

    def allocate_contiguous(self, n: int) -> list[int]:
        """``n`` blocks with reference count 1: the lowest free contiguous
        ascending run below the mark; else, when ``n`` free blocks are below it,
        the lowest ``n`` (a run is worth less than a page fault per page);
        else the lowest run anywhere, or the lowest ``n`` free blocks.
        O(num_blocks) byte scans in C, then O(n)."""
        assert n <= len(self._free), f"out of {self.device.name} blocks"
        if n == 0:
            return []
        run = b"\x01" * n
        start = self._free_map.find(run, self._low, self._mark)
        if start < 0 and self.get_num_free_warm_blocks() < n:
            start = self._free_map.find(run, self._low)
        if start >= 0:
            blocks = list(range(start, start + n))
        else:
            blocks = []
            for _ in range(n):
                blocks.append(self._free_map.find(1, blocks[-1] + 1 if blocks else self._low))
        self._free.difference_update(blocks)
        for block in blocks:
            self._free_map[block] = 0
            self._ref_counts[block] = 1
        self._mark = max(self._mark, blocks[-1] + 1)
        return blocks

    def incr_ref(self, block: int) -> None:
        """One more table entry shares ``block`` (fork, shared prompt, swap)."""
        assert self._ref_counts[block] > 0, f"{self.device.name} block {block} is free"
        self._ref_counts[block] += 1

    def free(self, block: int) -> None:
        """Drop one reference; the block is free again when none is left."""
        count = self._ref_counts[block] - 1
        assert count >= 0, f"double free of {self.device.name} block {block}"
        self._ref_counts[block] = count
        if count == 0:
            self._free.add(block)
            self._free_map[block] = 1
            self._low = min(self._low, block)
