"""The int8 records of a self-draft's cross K/V copy (paged_attention_i8.h
reads them in the draft's fused step; ``draft_kv.DraftKV`` writes them).

Why: one draft row's cross attention streams its window's cross K/V every
draft step (Whisper base: 18 MB a step in bfloat16, ~1.45 ms of a ~3.3 ms
step); int8 halves those bytes. Only drafts read the copy and the target
verifies every draft, so the rounding costs acceptance at most.

The layout: the copy's cache tensors keep their shape and dtype (its self
blocks stay bfloat16, and blocks move between self and cross use), and a
cross block holds, from its first byte, ``block_size`` records of
``H * D + 4 * H`` bytes, one a slot: the slot's values as int8 (head-major),
then each head's float32 scale (``max |x| / 127``), value = int8 * scale. K's blocks in a layer's ``cache[0]``, V's in ``cache[1]``.
"""
from __future__ import annotations

import ctypes

import torch

from encdec.kernels.cpu import build
from encdec.platform.cpu_threads import kernel_threads

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_QUANTIZE = build.Kernel("paged_attention_cpu.c", "kv_quantize_i8", [_P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64,
                                                                      ctypes.c_int],
                         None, "a draft's int8 cross copy is made by torch (eight passes)",
                         path_symbol="paged_attention_path")


def record_bytes(num_heads: int, head_size: int) -> int:
    return num_heads * head_size + 4 * num_heads


def holds(num_heads: int, head_size: int, value_bytes: int) -> bool:
    """Whether a cache block of ``value_bytes`` a value holds its slots' records
    (bfloat16 and float32 do, from head size 4)."""
    return record_bytes(num_heads, head_size) <= num_heads * head_size * value_bytes


def fits(cache: torch.Tensor) -> bool:
    """``holds`` for ``cache`` ((2, blocks, block_size, H, D))."""
    return cache.dim() == 5 and holds(cache.shape[3], cache.shape[4], cache.element_size())


def quantize(blocks: torch.Tensor) -> torch.Tensor:
    """(..., block_size, H, D) float values -> (..., block_size * record) uint8 records."""
    *lead, bs, h, d = blocks.shape
    x = blocks.float()
    amax = x.abs().amax(-1, keepdim=True)
    scale = amax / 127
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))  # as int8_rows_cpu.c's quantize_row
    q = torch.round(x * inv).clamp_(-127, 127).to(torch.int8)
    rec = torch.cat([q.reshape(*lead, bs, h * d).view(torch.uint8),
                     scale.reshape(*lead, bs, h).contiguous().view(torch.uint8)], dim=-1)
    return rec.reshape(*lead, bs * record_bytes(h, d))


def dequantize(records: torch.Tensor, block_size: int, num_heads: int, head_size: int) -> torch.Tensor:
    """``quantize``'s inverse up to its rounding: (..., block_size * record) uint8 -> (..., block_size, H, D) float32."""
    *lead, _ = records.shape
    hd = num_heads * head_size
    rec = records.reshape(*lead, block_size, hd + 4 * num_heads)
    q = rec[..., :hd].contiguous().view(torch.int8).float().reshape(*lead, block_size, num_heads, head_size)
    scale = rec[..., hd:].contiguous().view(torch.float32).reshape(*lead, block_size, num_heads, 1)
    return q * scale


def write_blocks(src: torch.Tensor, src_blocks: torch.Tensor, dst: torch.Tensor, dst_blocks: torch.Tensor, *,
                 isa: str | None = None) -> None:
    """Blocks ``src_blocks`` (int64) of cache ``src`` (K and V) as records into
    blocks ``dst_blocks`` of cache ``dst`` (both (2, blocks, block_size, H, D),
    contiguous; ``fits(dst)``): one C pass (``kv_quantize_i8``) where it runs,
    else torch's. Indices are not checked here: the caller's lie within both."""
    kernel = _QUANTIZE.function(isa)
    if kernel is not None and src.dtype == torch.float32 and src.device.type == "cpu":
        _, n_src, bs, h, d = src.shape
        s = torch.cat([src_blocks, src_blocks + n_src]).contiguous()
        t = torch.cat([dst_blocks, dst_blocks + dst.shape[1]]).contiguous()
        kernel(src.data_ptr(), dst.data_ptr(), s.data_ptr(), t.data_ptr(), s.shape[0], bs, h, d,
               dst[0, 0].numel() * dst.element_size(), kernel_threads())
        return
    records = quantize(src.index_select(1, src_blocks))  # (2, n, block_size * record)
    raw = dst.view(2, dst.shape[1], -1).view(torch.uint8)  # each block's bytes
    raw[:, :, :records.shape[-1]].index_copy_(1, dst_blocks, records)


def read_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Blocks of ``cache`` written by ``write_blocks``, dequantized (2, n, block_size, H, D) float32 (tests)."""
    _, _, bs, h, d = cache.shape
    raw = cache.view(2, cache.shape[1], -1).view(torch.uint8)
    return dequantize(raw.index_select(1, blocks)[:, :, :bs * record_bytes(h, d)], bs, h, d)
