"""The KV cache tensors: one per decoder layer on the device, a CPU swap area,
and the block copies (swap in/out, copy-on-write) the scheduler asks for.

Self- and cross-attention blocks share each layer's tensor; the block manager
keeps their block numbers apart.
"""
from __future__ import annotations

import logging

import torch

from encdec.attention.backends.abstract import AttentionBackend

logger = logging.getLogger(__name__)

_GiB = 1 << 30


def cache_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_size: int,
                      dtype: torch.dtype) -> int:
    """Bytes of one block across all layers (keys and values)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_size * elem


def default_kv_cache_bytes(device: torch.device, gpu_memory_utilization: float) -> int:
    """On CUDA, the configured fraction of what the device has left; on CPU a
    fifth of available memory (the model, activations and swap area need the rest)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return max(0, int(free - total * (1 - gpu_memory_utilization)))
    try:
        import psutil

        available = psutil.virtual_memory().available
    except ImportError:
        available = 8 * _GiB
    return available // 5


class CacheEngine:
    def __init__(self, *, num_layers: int, num_kv_heads: int, head_size: int, block_size: int,
                 num_gpu_blocks: int, num_cpu_blocks: int, dtype: torch.dtype,
                 device: torch.device, backend: type[AttentionBackend]):
        self.backend = backend
        self.block_size = block_size
        shape = backend.get_kv_cache_shape(num_gpu_blocks, block_size, num_kv_heads, head_size)
        # zeros: untouched pages of a CPU cache cost no resident memory.
        self.gpu_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        cpu_shape = backend.get_kv_cache_shape(num_cpu_blocks, block_size, num_kv_heads, head_size)
        pin = device.type == "cuda"
        self.cpu_cache = [torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin) for _ in range(num_layers)]
        self.num_swapped_in_blocks = 0
        self.num_swapped_out_blocks = 0
        self.num_copied_blocks = 0
        self.bytes_per_block = cache_block_bytes(num_layers, block_size, num_kv_heads, head_size, dtype)

    @staticmethod
    def _mapping(pairs: list[tuple[int, int]]) -> torch.Tensor:
        return torch.tensor(pairs, dtype=torch.long).view(-1, 2)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """CPU block -> device block, every layer."""
        if pairs:
            m = self._mapping(pairs)
            for src, dst in zip(self.cpu_cache, self.gpu_cache):
                self.backend.swap_blocks(src, dst, m)
            self.num_swapped_in_blocks += len(pairs)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Device block -> CPU block, every layer."""
        if pairs:
            m = self._mapping(pairs)
            for src, dst in zip(self.gpu_cache, self.cpu_cache):
                self.backend.swap_blocks(src, dst, m)
            self.num_swapped_out_blocks += len(pairs)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            self.backend.copy_blocks(self.gpu_cache, self._mapping(pairs))
            self.num_copied_blocks += len(pairs)
