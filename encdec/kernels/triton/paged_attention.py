"""Paged attention in one launch: every query group of a step over its keys and
values in the paged cache, read in place through its block table.

A *group* is a run of consecutive query rows that read the same block table
(``q_start_loc[g]:q_start_loc[g + 1]``):

    decode, self       one row per sequence, its own table (causal is a no-op: q_len 1)
    decode, cross      the rows that share a cross table (beams, n > 1, the encoder
                       cache), so the group's keys are read once for all of them
    prefill, self      a prompt's tokens over its own cached keys, causal
    prefill, cross     a prompt's tokens over its request's cached encoder keys

Grid: (groups, heads, query tiles of BLOCK_M rows). Each program walks the
group's table one cache block (``block_size`` keys) at a time with an online
softmax in float32::

    kv_cache[0 or 1]: (num_blocks, block_size, num_kv_heads, head_size)
    block b of group g = tables[g, b];  key j lives at (tables[g, j // bs], j % bs)

Causal: query i of a group of q_len rows over kv_len keys sits at position
kv_len - q_len + i and sees keys 0..that position (prefill with no cached
context: the block-diagonal causal mask; decode: every key).
"""
from __future__ import annotations

import functools
import logging
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # available() says so; import encdec never needs triton
    triton = None

logger = logging.getLogger(__name__)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def path(device: torch.device | str = "cuda") -> str:
    """What a call on ``device`` runs: "cuda", "interpreter" (CPU tensors under
    ``TRITON_INTERPRET=1``) or "torch" (declines: no triton, or a CPU tensor
    without the interpreter)."""
    if triton is None:
        return "torch"
    kind = torch.device(device).type
    if kind == "cuda" and not _interpreting():
        return "cuda"
    if kind == "cpu" and _interpreting():
        return "interpreter"
    return "torch"


def available(device: torch.device | str = "cuda") -> bool:
    return path(device) != "torch"


def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, q_start_ptr, kv_lens_ptr, bias_ptr,
    scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot, stride_oh, stride_tg,
    stride_bt, stride_bh,
    HEADS_PER_KV: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    g = tl.program_id(0)
    h = tl.program_id(1)
    tile = tl.program_id(2)
    q0 = tl.load(q_start_ptr + g)
    q_len = tl.load(q_start_ptr + g + 1) - q0
    if tile * BLOCK_M >= q_len:
        return
    kv_len = tl.load(kv_lens_ptr + g)
    kvh = h // HEADS_PER_KV

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows of this tile, in the group
    offs_d = tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, BLOCK_SIZE)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_SIZE
    q = tl.load(q_ptr + (q0 + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = kv_len - q_len + offs_m  # causal: the last key each row sees

    kv_end = kv_len
    if CAUSAL:
        kv_end = tl.minimum(kv_len, kv_len - q_len + (tile + 1) * BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for b in range(0, tl.cdiv(kv_end, BLOCK_SIZE)):
        block = tl.load(tables_ptr + g * stride_tg + b).to(tl.int64)
        offs_n = b * BLOCK_SIZE + offs_s  # key positions of this block
        n_mask = offs_n < kv_len
        kv_off = block * stride_kb + offs_s[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)  # (BLOCK_SIZE, BLOCK_D)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale  # (BLOCK_M, BLOCK_SIZE) float32
        if HAS_BIAS:  # T5's position bias: bias[query row, head, key position]
            s = s + tl.load(bias_ptr + (q0 + offs_m)[:, None] * stride_bt + h * stride_bh + offs_n[None, :],
                         mask=m_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
        keep = n_mask[None, :]
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a padded row has seen no key
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + (q0 + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@functools.cache
def _jit(interpreting: bool):
    """The jitted kernel; built on first use so ``TRITON_INTERPRET`` is read
    then, not at import (a kernel jitted without it cannot take CPU tensors)."""
    return triton.jit(_paged_attention_kernel)


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def runs_block_size(block_size: int) -> bool:
    """Cache blocks of a power of two, 16+ keys (one block is one tl.dot tile)."""
    return block_size >= 16 and block_size & (block_size - 1) == 0


def tile_rows(max_q_len: int) -> int:
    """Query rows per program: 16 (tl.dot's smallest tile) up to 64 for prefills."""
    return min(64, max(16, triton.next_power_of_2(max_q_len)))


def paged_attention(
    q: torch.Tensor,  # (num_q, num_heads, head_size)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_size)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (num_groups, max_blocks) int32, the group's table
    q_start_loc: torch.Tensor,  # (num_groups + 1,) int32, prefix sum of group query rows
    kv_lens: torch.Tensor,  # (num_groups,) int32, keys each group sees
    *,
    scale: float,
    causal: bool,
    max_q_len: int,  # longest group (host int: sets the grid without a device sync)
    out: torch.Tensor | None = None,  # (num_q, num_heads, head_size), may be a view
    bias: torch.Tensor | None = None,  # (num_q, num_heads, >= longest kv_lens), added to the scaled scores
) -> torch.Tensor | None:
    """Attention of each group's queries over its paged keys; None (nothing
    done) where it cannot run: see ``path``, or a dtype other than fp16, bf16, fp32."""
    if (_failure or not available(q.device) or q.dtype not in _DTYPES or k_cache.dtype != q.dtype
            or not runs_block_size(k_cache.shape[1])):
        return None
    if out is None:
        out = torch.empty_like(q)
    if q.shape[0] == 0 or kv_lens.shape[0] == 0:
        return out
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and out.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride() and block_tables.stride(-1) == 1
    bm = tile_rows(max_q_len)
    grid = (kv_lens.shape[0], q.shape[1], triton.cdiv(max_q_len, bm))
    try:
        _launch(grid, q, k_cache, v_cache, out, block_tables, q_start_loc, kv_lens, bias, scale, causal, bm)
    except Exception as e:  # a compile failure on a new GPU/triton: decline from now on, once logged
        if q.device.type != "cuda":
            raise  # under the interpreter a failure is a bug in the kernel: let the tests see it
        _failure.append(f"{type(e).__name__}: {str(e)[:300]}")
        logger.error("the Triton paged-attention kernel failed (%s); decode attention gathers "
                     "the cache instead (slower)", _failure[0])
        return None
    return out


_failure: list[str] = []  # why the kernel failed on CUDA, once it has


def _launch(grid, q, k_cache, v_cache, out, block_tables, q_start_loc, kv_lens, bias, scale, causal, bm) -> None:
    num_heads, head_size = q.shape[1], q.shape[2]
    if bias is not None:
        assert bias.shape[:2] == q.shape[:2], (bias.shape, q.shape)
        bias = bias if bias.stride(-1) == 1 else bias.contiguous()
    _jit(_interpreting())[grid](
        q, k_cache, v_cache, out, block_tables, q_start_loc, kv_lens, q if bias is None else bias, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0),
        0 if bias is None else bias.stride(0), 0 if bias is None else bias.stride(1),
        HEADS_PER_KV=num_heads // k_cache.shape[2], HEAD_SIZE=head_size,
        BLOCK_D=triton.next_power_of_2(head_size), BLOCK_SIZE=k_cache.shape[1], BLOCK_M=bm,
        CAUSAL=causal, IEEE=q.dtype == torch.float32,
        # bf16 runs its dots on fp32 copies (tf32 holds bf16 values exactly; the
        # interpreter's bf16 dot reads raw bits); fp16 stays fp16 with fp32 sums.
        UPCAST=q.dtype == torch.bfloat16, HAS_BIAS=bias is not None,
    )
