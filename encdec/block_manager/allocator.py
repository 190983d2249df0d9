"""Per-device block allocator: which KV-cache blocks are free, and how many
block-table entries point at each used one.

A block is ``block_size`` token slots of one device's KV cache. The allocator
only hands out block numbers; the cache engine owns the memory. A block is free
exactly when its reference count is zero.

The free blocks are kept twice, each view making one query cheap:

    block      0  1  2  3  4  5  6  7  ...
    free_map  01 01 00 00 01 01 01 00  ...   one byte per block, 01 = free
              -> first-fit contiguous run of n: free_map.find(b"\\x01" * n), in C
    free set  {0, 1, 4, 5, 6, ...}
              -> "is block b free?" and "any free block" in O(1)

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

    def __init__(self, device: Device, num_blocks: int) -> None:
        self.device = device
        self.num_blocks = num_blocks
        self.reset()

    def reset(self) -> None:
        """Every block free, no references."""
        self._ref_counts = [0] * self.num_blocks
        self._free = set(range(self.num_blocks))
        self._free_map = bytearray(b"\x01") * self.num_blocks

    def get_num_free_blocks(self) -> int:
        return len(self._free)

    def get_ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def allocate(self, *, prefer: int | None = None) -> int:
        """One free block with reference count 1.

        ``prefer`` is taken when free: a growing table asks for ``last + 1`` so
        its blocks stay in a run. Otherwise any free block, O(1).
        """
        if prefer is not None and prefer in self._free:
            block = prefer
            self._free.remove(block)
        else:
            assert self._free, f"out of {self.device.name} blocks"
            block = self._free.pop()
        self._free_map[block] = 0
        self._ref_counts[block] = 1
        return block

    def allocate_contiguous(self, n: int) -> list[int]:
        """``n`` blocks with reference count 1, as the lowest contiguous ascending
        run that is free; when no run of ``n`` is free, any ``n`` free blocks
        (ascending). O(num_blocks) byte scan in C, then O(n)."""
        assert n <= len(self._free), f"out of {self.device.name} blocks"
        if n == 0:
            return []
        start = self._free_map.find(b"\x01" * n)
        if start >= 0:
            blocks = list(range(start, start + n))
            self._free.difference_update(blocks)
            self._free_map[start : start + n] = bytes(n)
        else:
            blocks = sorted(self._free.pop() for _ in range(n))
            for block in blocks:
                self._free_map[block] = 0
        for block in blocks:
            self._ref_counts[block] = 1
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
