"""Builds and calls ``paged_attention_cpu.c``: decode attention straight from
the paged cache, so no step copies a sequence's keys and values.

Built by ``build.load`` for ``build.cpu_isa()``: AVX-512 or AVX2+FMA lanes, or
portable C where that is "none" (``path()`` says which); where no compiler
works, ``available()`` is False, ``paged_decode_attention`` returns None and
the torch backend gathers instead (logged once).
"""
from __future__ import annotations

import ctypes

import torch

from encdec.kernels.cpu import build
from encdec.platform.cpu_threads import BANDWIDTH_MIN_SEQS, bandwidth_threads, kernel_threads

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_KERNEL = build.Kernel(
    "paged_attention_cpu.c", "paged_attention_decode_f32",
    [_P, _P, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, ctypes.c_float, _P, _I64, ctypes.c_int,
     ctypes.c_int],
    None, "decode attention gathers KV (slower)", path_symbol="paged_attention_path")
available, path = _KERNEL.available, _KERNEL.path
_WRITE = build.Kernel("paged_attention_cpu.c", "kv_write_bf16", [_P, _I64, _I64, _I64, _P, _P, _P, ctypes.c_int],
                      None, "a bfloat16 cache is written by torch (three passes)",
                      path_symbol="paged_attention_path")
# What a cache may hold: float32, or bfloat16 (kv_cache_dtype="bfloat16" with float32 weights), widened as read.
CACHE_DTYPES = (torch.float32, torch.bfloat16)


def paged_decode_attention(
    q: torch.Tensor,  # (num_seqs, num_heads, head_size) float32
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_size) float32 or bfloat16, contiguous
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int32, contiguous
    seq_lens: torch.Tensor,  # (num_seqs,) int32
    scale: float,
    *,
    position_bias: torch.Tensor | None = None,  # (num_heads, >= max(seq_lens)) float32
    isa: str | None = None,
) -> torch.Tensor | None:  # (num_seqs, num_heads, head_size)
    """Each row's query over its cached keys and values; None where the kernel
    does not run (no build, a query not float32 on CPU, a cache of another dtype
    than ``CACHE_DTYPES`` or not contiguous).

    ``position_bias`` (causal self-attention only, T5): ``[h, d]`` is added to
    head h's score of a key d positions before the query, the query sitting at
    position ``seq_len - 1`` and slot t at position t (the attention backend
    builds it from T5's bucketed bias once per step). Cross-attention passes none."""
    kernel = _KERNEL.function(isa)
    if kernel is None or q.dtype != torch.float32 or q.device.type != "cpu" or not cache_ok(k_cache, v_cache):
        return None
    bias_ptr, bias_stride = None, 0
    if position_bias is not None:
        if position_bias.dtype != torch.float32 or position_bias.device.type != "cpu":
            return None
        # The kernel reads [h, len - 1 - t] unchecked: the table must cover every row.
        if position_bias.shape[0] != q.shape[1] or position_bias.shape[1] < int(seq_lens.max()):
            raise ValueError(f"position_bias {tuple(position_bias.shape)} does not cover {q.shape[1]} heads "
                             f"and {int(seq_lens.max())} keys")
        position_bias = position_bias.contiguous()
        bias_ptr, bias_stride = position_bias.data_ptr(), position_bias.shape[1]
    q = q.contiguous()
    out = torch.empty_like(q)
    num_seqs, num_heads, head_size = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    kernel(
        out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
        num_seqs, num_heads, num_kv_heads, head_size, block_size, scale, bias_ptr, bias_stride,
        bandwidth_threads() if num_seqs >= BANDWIDTH_MIN_SEQS else kernel_threads(),
        int(k_cache.dtype == torch.bfloat16))
    return out


def cache_ok(*caches: torch.Tensor) -> bool:
    """Caches the C kernels read: contiguous on CPU, one dtype of ``CACHE_DTYPES`` for all."""
    return (len({c.dtype for c in caches}) == 1 and caches[0].dtype in CACHE_DTYPES
            and all(c.device.type == "cpu" and c.is_contiguous() for c in caches))


def write_bf16(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor | None:
    """Rows of ``x`` (n, H, D) float32 rounded into slots ``slots`` (int64) of the
    bfloat16 ``cache`` (blocks, block_size, H, D) as torch rounds them, and
    returned widened, (n, H, D) float32; None (nothing written) where the kernel
    cannot take it: no build, other dtypes or layouts."""
    kernel = _WRITE.function()
    n = x.shape[0]
    if (kernel is None or x.dtype != torch.float32 or cache.dtype != torch.bfloat16 or x.device.type != "cpu"
            or not cache.is_contiguous() or x.dim() != 3 or x.shape[1:] != cache.shape[2:]
            or x.stride(2) != 1 or x.stride(1) != x.shape[2] or slots.dtype != torch.int64
            or not slots.is_contiguous() or slots.shape[0] != n):
        return None
    out = torch.empty(x.shape, dtype=torch.float32)
    kernel(x.data_ptr(), n, x.shape[1] * x.shape[2], x.stride(0), slots.data_ptr(), cache.data_ptr(),
           out.data_ptr(), kernel_threads())
    return out


_ROUND = build.Kernel("paged_attention_cpu.c", "kv_round_bf16", [_P, _P, _P, _P, _I64, _I64, ctypes.c_int],
                      None, "a draft's bfloat16 copy of K/V is made by torch (three passes)",
                      path_symbol="paged_attention_path")


def round_units_bf16(src: torch.Tensor, dst: torch.Tensor, src_units: torch.Tensor, dst_units: torch.Tensor,
                     unit: int, *, isa: str | None = None) -> torch.Tensor | None:
    """Units ``src_units`` (int64) of ``src`` (float32, contiguous, ``unit``
    values each) rounded to bfloat16 as torch rounds into units ``dst_units``
    of ``dst`` (bfloat16, contiguous); returns ``dst``, or None, nothing
    written, where the kernel cannot take them (no build, other dtypes or
    layouts). Indices are not checked here: the caller's must lie within both."""
    kernel = _ROUND.function(isa)
    if (kernel is None or src.dtype != torch.float32 or dst.dtype != torch.bfloat16
            or not (src.is_contiguous() and dst.is_contiguous()) or src.device.type != "cpu"
            or dst.device.type != "cpu" or src_units.dtype != torch.int64 or dst_units.dtype != torch.int64
            or not (src_units.is_contiguous() and dst_units.is_contiguous())
            or src_units.shape != dst_units.shape or src.numel() % unit or dst.numel() % unit):
        return None
    kernel(src.data_ptr(), dst.data_ptr(), src_units.data_ptr(), dst_units.data_ptr(), src_units.shape[0], unit,
           kernel_threads())
    return dst
