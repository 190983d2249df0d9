"""Model weights and the KV cache on transparent huge pages (Linux, CPU).

A decode step of a few rows streams every decoder weight and the LM head once
and is bound by how fast one core reads memory (the small steps run on one
thread: ``encdec.platform.cpu_threads``). With 4 KiB pages that stream walks a page
table entry per 4 KiB; 2 MiB pages cut the TLB misses 512-fold. The cost is at
first touch (Linux zeroes a 2 MiB page more slowly than 512 small ones), paid
when the cache is prefaulted (``CacheEngine``) and when the weights are copied.

Linux grants huge pages to private anonymous mappings that ask for them
(``madvise`` mode, this host's setting); elsewhere, or when it declines, the
weights stay where they are or land on ordinary pages: the advice changes
speed only, never a value.
"""
from __future__ import annotations

import logging
import mmap
import os
import sys

import torch
from torch import nn

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20  # bytes
MIN_BYTES = 1 << 20  # smaller tensors (norms, biases, small embeddings) stay put
_ALIGN = 64  # bytes: each tensor starts on a cache line
ENV = "ENCDEC_HUGE_PAGES"  # "0" turns the move off


def enabled() -> bool:
    return (os.environ.get(ENV, "1") != "0" and sys.platform.startswith("linux")
            and hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_ANONYMOUS"))


def anonymous_buffer(nbytes: int, huge: list[tuple[int, int]] | None = None) -> torch.Tensor:
    """``nbytes`` of zeroed uint8 memory from a fresh anonymous mapping, mapped
    lazily (a page costs nothing until written; the tensor keeps the mapping
    alive). Where ``enabled()``: private, starting on a 2 MiB boundary, and
    advised for huge pages: all of it, or the byte ranges ``[start, end)`` of
    ``huge``. Private matters: Python's default ``mmap`` is a shared mapping,
    which Linux backs with huge pages only under ``shmem_enabled`` ("never" on
    this host).

    Why ranges: under THP ``defrag=madvise`` (this host's) a first write to an
    advised page compacts memory synchronously. Faulting in fresh memory on
    huge pages ran at 0.65 GB/s here, on small pages at 2.8 GB/s (a 97 MB
    region, 2 threads), so memory written at start (the warm part of the KV
    cache) gains from huge pages and memory first written mid-run may not."""
    if not enabled():
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8, count=nbytes)
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # room to align the start
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(buf, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    page = mmap.PAGESIZE
    for lo, hi in [(0, nbytes)] if huge is None else huge:
        lo, hi = start + lo // page * page, start + -(-hi // page) * page  # whole pages around the range
        if hi > lo:
            try:
                buf.madvise(mmap.MADV_HUGEPAGE, lo, hi - lo)
            except OSError:  # advice only
                pass
    return raw[start: start + nbytes]


def move_parameters(model: nn.Module) -> int:
    """Copy the model's large CPU parameters into one huge-page arena and point
    each parameter at its copy (tied parameters stay tied: each is one
    ``Parameter``). Returns the bytes moved; 0 where ``enabled()`` is False.
    Call once the weights are loaded; tensors derived from them before (oneDNN's
    packed copies) are separate memory and unaffected."""
    params = [p for p in model.parameters()
              if p.device.type == "cpu" and p.is_contiguous() and p.numel() * p.element_size() >= MIN_BYTES]
    moved = move_tensors([p.data for p in params])
    if moved is None:
        return 0
    with torch.no_grad():
        for p, dst in zip(params, moved):
            p.data = dst
    total = sum(t.numel() * t.element_size() for t in moved)
    logger.info("moved %d parameters (%.0f MB) onto huge pages", len(params), total / 1e6)
    return total


def move_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Copies of contiguous CPU ``tensors``, side by side in one huge-page arena
    (each on a cache line), in order; None where ``enabled()`` is False or
    there are none. One arena, not one mapping each: a mapping's first write
    faults in a whole 2 MiB page, so small tensors each in their own would
    each hold one."""
    if not enabled() or not tensors:
        return None
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    arena = anonymous_buffer(total)
    out = []
    with torch.no_grad():
        for t, off in zip(tensors, offsets):
            dst = arena[off: off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            dst.copy_(t)
            out.append(dst)
    return out
