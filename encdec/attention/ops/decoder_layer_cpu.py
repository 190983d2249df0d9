"""Builds and calls ``decoder_layer_cpu.c``: a pre-LayerNorm decoder layer
(Whisper's) over the few rows of a decode step, in one call.

The C file includes the decode-step matmul and paged attention kernels, so
its vector path is theirs (``path(isa)``: "avx512", "avx2" or "none"), built
by ``build.load`` for ``build.cpu_isa()``. Where no compiler works,
``available()`` is False and the model runs its layers op by op (logged once).
"""
from __future__ import annotations

import ctypes
from functools import cache

import torch

from encdec.attention.ops import build, small_linear_cpu
from encdec.cpu_threads import BANDWIDTH_MIN_SEQS, bandwidth_threads

_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
MAX_ROWS = small_linear_cpu.MAX_ROWS  # rows the matmul kernel serves (see small_linear_cpu)
_ARGS = [_P, _P, _I64, _I64, _I64, _I64, _F, _F, *[_P] * 18, _P, _P, _I64, _P, _P, _I64, _P, _P, _I64, _P,
         ctypes.c_int]


@cache
def _kernel(isa: str):
    return build.load_function("decoder_layer_cpu.c", "decoder_layer_f32", _ARGS, None,
                               "decoder layers of decode steps run op by op (slower)", isa=isa)


def available(isa: str | None = None) -> bool:
    return _kernel(isa or build.cpu_isa()) is not None


def path(isa: str | None = None) -> str | None:
    """The vector path the build for ``isa`` runs, or None if unbuilt."""
    return build.vector_path("decoder_layer_cpu.c", "decoder_layer_path", isa)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def decoder_layer(h: torch.Tensor, layer, kv_cache: torch.Tensor, slots: torch.Tensor,
                  self_tables: torch.Tensor, self_lens: torch.Tensor,
                  cross_tables: torch.Tensor, cross_lens: torch.Tensor, *, isa: str | None = None) -> None:
    """Run ``layer`` (a ``WhisperDecoderLayer``) on ``h`` (M, d), in place, for M
    decode rows: the new K/V go to ``slots`` (int64) of ``kv_cache`` (2, blocks,
    block_size, H, D); self and cross tables (int32, row-major) and lengths
    (int32) are the attention metadata's. Callers check ``supports`` first."""
    kernel = _kernel(isa or build.cpu_isa())
    sa, ca = layer.self_attn, layer.encoder_attn
    m, d = h.shape
    ffn = layer.fc1.out_features
    work = torch.empty(m * (7 * d + ffn), dtype=torch.float32)
    threads = bandwidth_threads() if m >= BANDWIDTH_MIN_SEQS else torch.get_num_threads()
    lin = [layer.self_attn_layer_norm.weight, layer.self_attn_layer_norm.bias,
           sa.qkv_proj.weight, sa.qkv_proj.bias, sa.out_proj.weight, sa.out_proj.bias,
           layer.encoder_attn_layer_norm.weight, layer.encoder_attn_layer_norm.bias,
           ca.q_proj.weight, ca.q_proj.bias, ca.out_proj.weight, ca.out_proj.bias,
           layer.final_layer_norm.weight, layer.final_layer_norm.bias,
           layer.fc1.weight, layer.fc1.bias, layer.fc2.weight, layer.fc2.bias]
    kernel(h.data_ptr(), work.data_ptr(), m, d, sa.num_heads, ffn, layer.final_layer_norm.eps, sa.scale,
           *[_ptr(t) for t in lin],
           kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), kv_cache.shape[2], slots.data_ptr(),
           self_tables.data_ptr(), self_tables.stride(0), self_lens.data_ptr(),
           cross_tables.data_ptr(), cross_tables.stride(0), cross_lens.data_ptr(), threads)


def layer_supported(layer) -> bool:
    """Whether ``decoder_layer`` can run ``layer``'s weights (check once, after loading)."""
    sa, ca = layer.self_attn, layer.encoder_attn
    norms = (layer.self_attn_layer_norm, layer.encoder_attn_layer_norm, layer.final_layer_norm)
    return (available()
            and all(p.dtype == torch.float32 and p.device.type == "cpu" and p.is_contiguous()
                    for p in layer.parameters())
            and all(m.bias is not None for m in (sa.qkv_proj, sa.out_proj, ca.q_proj, ca.out_proj,
                                                 layer.fc1, layer.fc2, *norms))
            and sa.scale == ca.scale and sa.num_heads == ca.num_heads
            and len({n.eps for n in norms}) == 1)


def step_supported(kv_cache: torch.Tensor, num_rows: int, num_heads: int, *index: torch.Tensor) -> bool:
    """Whether a decode step of ``num_rows`` rows can run with this layer cache and
    these metadata tensors (slots int64; tables and lengths int32, row-major)."""
    if not 0 < num_rows <= MAX_ROWS:
        return False
    if (kv_cache.device.type != "cpu" or kv_cache.dtype != torch.float32 or not kv_cache.is_contiguous()
            or kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3] != num_heads):
        return False
    slots, *rest = index
    return (slots.dtype == torch.int64 and slots.is_contiguous() and slots.shape[0] == num_rows
            and all(t.dtype == torch.int32 and t.device.type == "cpu" and t.is_contiguous() for t in rest))
