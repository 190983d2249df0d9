"""The KV cache tensors: one per decoder layer on the device, a CPU swap area,
and the block copies (swap in/out, copy-on-write) the scheduler asks for.

Self- and cross-attention blocks share each layer's tensor; the block manager
keeps their block numbers apart. Each layer's tensor, on both sides::

    (2, num_blocks, block_size, num_kv_heads, head_size)
     K/V  block b = block_size token slots, contiguous for one of K or V

A swap moves whole blocks. The block manager hands out runs of consecutive
blocks where it can (a cross table is one run on both devices, a growing self
table usually is), so pairs are merged into runs and each run of each of K/V
is one contiguous copy:

    pairs  (40,7) (41,8) (42,9) (90,3)  ->  runs  (40->7, 3 blocks) (90->3, 1)

On CUDA the CPU side is pinned and every swap copy is an async copy on the
current stream: it is ordered before the forward that reads the swapped-in
blocks and after the one that wrote the swapped-out ones, with no host sync
(nothing on the host reads the swap area). On CPU runs with many short runs
fall back to one gather/scatter per layer.
"""
from __future__ import annotations

import logging
import math

import torch

from encdec.attention.backends.abstract import AttentionBackend
from encdec.platform import huge_pages

logger = logging.getLogger(__name__)

_GiB = 1 << 30
# CPU only: above this many runs a swap is one index_select/index_copy_ per
# layer instead of a Python loop of slice copies.
_MAX_RUNS = 8


def cache_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_size: int,
                      dtype: torch.dtype) -> int:
    """Bytes of one block across all layers (keys and values)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_size * elem


def profiled_kv_cache_bytes(*, total: int, gpu_memory_utilization: float, weights: int,
                            peak_activations: int, non_torch: int = 0, profiled: str = "",
                            free: int | None = None) -> int:
    """vLLM's rule: this engine's share of the device (``gpu_memory_utilization``
    x ``total``) less its weights, the peak activations of a profiled forward at
    the step budget, and memory outside torch's allocator (CUDA context, NCCL).
    Not "free memory at start": a second engine in the process gets its own
    share, not what the first left. A ValueError when nothing is left, and (as
    vLLM checks at start) when ``free`` (the device's free memory now, this
    engine's weights loaded) cannot hold the cache: an OOM halfway through
    allocating it says much less."""
    share = int(total * gpu_memory_utilization)
    left = share - weights - peak_activations - non_torch
    gib = lambda n: f"{n / _GiB:.2f} GiB"  # noqa: E731
    if left > 0 and free is not None and left > free:
        raise ValueError(
            f"the KV cache of gpu_memory_utilization={gpu_memory_utilization} ({gib(share)} of {gib(total)}, "
            f"{gib(left)} of it for the cache) does not fit in the {gib(free)} of the device that is free: "
            f"another engine or process holds {gib(max(0, total - free - weights - non_torch))}; lower "
            f"gpu_memory_utilization so that the engines' shares add up to at most 1, set kv_cache_memory, "
            f"or release the other engine first")
    if left <= 0:
        raise ValueError(
            f"no memory left for the KV cache: gpu_memory_utilization={gpu_memory_utilization} of "
            f"{gib(total)} is {gib(share)}, of which the weights take {gib(weights)}, the peak "
            f"activations of a profiled forward{' (' + profiled + ')' if profiled else ''} "
            f"{gib(peak_activations)} and memory outside torch {gib(non_torch)}; raise "
            f"gpu_memory_utilization, lower max_num_batched_tokens or max_num_seqs, or set kv_cache_memory")
    return left


def profile_batch(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                  max_encoder_len: int) -> tuple[list[int], list[int]]:
    """(decoder lengths, encoder lengths) of the largest prefill step the scheduler
    admits: as many longest encoder inputs as the step budget (decoder + encoder
    tokens) holds, within ``max_num_seqs``, the rest of the budget as decoder
    tokens (at most ``max_model_len`` each)."""
    n = max(1, min(max_num_seqs, max_num_batched_tokens // (max_encoder_len + 1)))
    dec_total = max(n, min(max_num_batched_tokens - n * max_encoder_len, n * max_model_len))
    dec = [dec_total // n + (i < dec_total % n) for i in range(n)]
    return dec, [max_encoder_len] * n


def typical_decoder_len(max_model_len: int) -> int:
    """Decoder tokens a default CPU cache plans for per sequence: a quarter of
    ``max_model_len`` (BART summaries and Whisper windows stay well under it;
    a longer mix is preempted, not refused)."""
    return max(1, max_model_len // 4)


def default_cpu_kv_cache_bytes(wanted: int, *, minimum: int) -> int:
    """A default CPU cache: ``wanted`` (the engine's ``max_num_seqs`` typical
    requests with their cross tables), capped at a fifth of available memory
    (the model, activations and swap area need the rest), never below
    ``minimum`` (one longest request). Mapped lazily: it costs RSS only as
    blocks are written."""
    return max(minimum, min(wanted, _available_memory() // 5))


def _available_memory() -> int:
    try:
        import psutil

        return psutil.virtual_memory().available
    except ImportError:
        return 8 * _GiB


def explicit_prefault_bytes(kv_bytes: int) -> int:
    """How much of a CPU cache the user sized (``kv_cache_memory``) to commit
    at start: all of it, up to half of available memory. Why all: the first
    large batch otherwise faults in the rest one small page at a time inside
    its cache writes (torch's index_copy_, one thread) and reads its cross K/V
    from small pages every step after. Measured (Xeon family 6 model 207,
    AVX-512, 2 threads; 64 requests at m2m100_418M dims, 3 GiB cache, ~1.9 GB
    written; runs alternating): the run 50.9 and 47.6 s with 1 GiB committed,
    46.7 and 44.0 s with all 3; committing 3 GiB took 0.3-3.5 s at start
    (1 GiB: 0.1-0.3 s), as fast as Linux hands out huge pages. Capped, so a
    cache sized past the host's memory still starts and maps the rest lazily."""
    return min(kv_bytes, _available_memory() // 2)


def block_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``[(src, dst)]`` -> ``[(src_start, dst_start, length)]``, merging pairs
    whose source and destination both continue the previous run."""
    runs: list[list[int]] = []
    for src, dst in pairs:
        if runs and src == runs[-1][0] + runs[-1][2] and dst == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([src, dst, 1])
    return [(s, d, n) for s, d, n in runs]


MAX_PREFAULT_BYTES = 1 << 30  # a default CPU cache's most committed at start; see CacheEngine._prefault


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, huge_blocks: int | None = None
           ) -> torch.Tensor:
    """Zeroed cache, (2, num_blocks, ...). On CPU an anonymous mmap maps zero
    pages lazily, so a cache of many GiB costs nothing until blocks are written
    (torch.zeros would touch every page up front: seconds, and all of it
    resident). mmap rather than calloc: with ``retain_freed_memory`` glibc would
    take it from its heap. On huge pages where Linux grants them (``huge_pages``),
    since decode attention streams a request's cross K/V every step: the first
    ``huge_blocks`` blocks of K and of V (None: all), the ones written at start
    (``CacheEngine._prefault``); blocks first written mid-run stay on small
    pages, which fault in 4x faster here (Whisper tiny.en, 8 files at once in
    independent mode: 1.4 GB of cross K/V written in the first prefills)."""
    numel = math.prod(shape)
    if device.type == "cpu" and numel:
        nbytes = numel * dtype.itemsize
        ranges = None
        if huge_blocks is not None:
            half, block = nbytes // 2, nbytes // 2 // shape[1]  # K, then V
            ranges = [(0, huge_blocks * block), (half, half + huge_blocks * block)]
        return huge_pages.anonymous_buffer(nbytes, ranges).view(dtype).view(shape)
    return torch.zeros(shape, dtype=dtype, device=device)


class CacheEngine:
    """Owns the KV memory; the block manager only hands out block numbers."""

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_size: int, block_size: int,
                 num_gpu_blocks: int, num_cpu_blocks: int, dtype: torch.dtype,
                 device: torch.device, backend: type[AttentionBackend],
                 prefault_bytes: int = MAX_PREFAULT_BYTES):
        self.backend = backend
        self.block_size = block_size
        self.device = torch.device(device)
        shape = backend.get_kv_cache_shape(num_gpu_blocks, block_size, num_kv_heads, head_size)
        assert shape[:2] == (2, num_gpu_blocks), f"swaps assume (2, num_blocks, ...) caches, got {shape}"
        self.bytes_per_block = cache_block_bytes(num_layers, block_size, num_kv_heads, head_size, dtype)
        # Blocks written now: the block manager hands these out first (BlockAllocator).
        self.num_warm_blocks = num_gpu_blocks
        if self.device.type == "cpu":
            self.num_warm_blocks = min(num_gpu_blocks, prefault_bytes // self.bytes_per_block)
        self.gpu_cache = [_zeros(shape, dtype, self.device, self.num_warm_blocks) for _ in range(num_layers)]
        if self.device.type == "cpu":
            self._prefault(self.num_warm_blocks)
        cpu_shape = backend.get_kv_cache_shape(num_cpu_blocks, block_size, num_kv_heads, head_size)
        # Pinned on CUDA: device <-> host copies are then true async DMA.
        self.pin_memory = self.device.type == "cuda"
        if self.pin_memory:
            self.cpu_cache = [torch.zeros(cpu_shape, dtype=dtype, pin_memory=True) for _ in range(num_layers)]
        else:
            self.cpu_cache = [_zeros(cpu_shape, dtype, torch.device("cpu")) for _ in range(num_layers)]
        self.num_swapped_in_blocks = 0
        self.num_swapped_out_blocks = 0
        self.num_copied_blocks = 0

    def _prefault(self, n: int) -> None:
        """Write the first ``n`` blocks now. The allocator hands out low block
        numbers first, so these are the blocks the first requests get. Measured
        here (140 MiB, 2 threads): zeroing fresh pages took 0.19 s, while the
        same pages faulted in by the first prefill's cache writes took 0.7-1.0 s.
        The rest of the cache stays lazily mapped."""
        for cache in self.gpu_cache:
            cache[:, :n].zero_()

    @staticmethod
    def _mapping(pairs: list[tuple[int, int]]) -> torch.Tensor:
        return torch.tensor(pairs, dtype=torch.long).view(-1, 2)

    def _transfer(self, src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor],
                  pairs: list[tuple[int, int]]) -> None:
        """Copy block ``s`` of every source layer to block ``d`` of the same
        destination layer, for each ``(s, d)``."""
        runs = block_runs(pairs)
        if self.device.type == "cpu" and len(runs) > _MAX_RUNS:
            m = self._mapping(pairs)
            for src, dst in zip(src_caches, dst_caches):
                dst.index_copy_(1, m[:, 1], src.index_select(1, m[:, 0]))
            return
        # Async only where the host side is pinned: a copy into pageable memory
        # must not be left in flight.
        async_ok = self.device.type == "cuda" and self.cpu_cache[0].is_pinned()
        for src, dst in zip(src_caches, dst_caches):
            for kv in range(2):  # one contiguous region per run for each of K and V
                s_kv, d_kv = src[kv], dst[kv]
                for s, d, n in runs:
                    d_kv[d: d + n].copy_(s_kv[s: s + n], non_blocking=async_ok)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """CPU block -> device block, every layer."""
        if pairs:
            self._transfer(self.cpu_cache, self.gpu_cache, pairs)
            self.num_swapped_in_blocks += len(pairs)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Device block -> CPU block, every layer."""
        if pairs:
            self._transfer(self.gpu_cache, self.cpu_cache, pairs)
            self.num_swapped_out_blocks += len(pairs)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: device block -> device block, every layer."""
        if pairs:
            self.backend.copy_blocks(self.gpu_cache, self._mapping(pairs))
            self.num_copied_blocks += len(pairs)

    def bytes_moved(self, num_blocks: int) -> int:
        """Bytes one direction of a swap of ``num_blocks`` blocks copies."""
        return num_blocks * self.bytes_per_block
