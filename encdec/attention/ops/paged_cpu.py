"""Builds and calls ``paged_attention_cpu.c``: decode attention straight from
the paged cache, so no step copies a sequence's keys and values.

Built by ``build.load``; where no compiler works, ``available()`` is False and
the torch backend gathers instead (logged once).
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from encdec.attention.ops import build


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    lib = build.load("paged_attention_cpu.c", "decode attention gathers KV (slower)")
    if lib is None:
        return None
    fn = lib.paged_attention_decode_f32
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, p, p, p, p, i64, p, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    fn.restype = None
    return lib


def available() -> bool:
    return _library() is not None


def paged_decode_attention(
    q: torch.Tensor,  # (num_seqs, num_heads, head_size) float32, contiguous
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_size) float32, contiguous
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int32, contiguous
    seq_lens: torch.Tensor,  # (num_seqs,) int32
    scale: float,
) -> torch.Tensor:  # (num_seqs, num_heads, head_size)
    lib = _library()
    assert lib is not None and q.dtype == torch.float32 and q.device.type == "cpu"
    q = q.contiguous()
    out = torch.empty_like(q)
    num_seqs, num_heads, head_size = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    lib.paged_attention_decode_f32(
        out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
        num_seqs, num_heads, num_kv_heads, head_size, block_size, scale, torch.get_num_threads())
    return out
