"""Calls ``dense_attention_cpu.c``: non-causal attention over equal-length
sequences (Whisper's encoder), read straight from a fused qkv projection.

The kernel has an AVX-512 and an AVX2+FMA path, built per ISA and picked by
``build.cpu_isa()``; it has no portable path (``path("none")`` is "torch").
``dense_attention`` returns None when it cannot take the call (no compiler,
neither ISA, head size other than 64, not float32 on CPU, or
``ENCDEC_DISABLE_C_KERNELS=1``) and the caller runs torch SDPA instead: same
math, 20-30% slower on this kind of machine. ``int8=True`` (quantization="int8")
runs both products in int8 where ``int8_available``.
"""
from __future__ import annotations

import ctypes

import torch

from encdec.kernels.cpu import build
from encdec.platform.cpu_threads import kernel_threads

HEAD_SIZE = 64
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_KERNEL = build.Kernel("dense_attention_cpu.c", "dense_attention_f32",
                       [_P] * 4 + [_I64] * 10 + [ctypes.c_float, _P, _I64] + [ctypes.c_int] * 2, ctypes.c_int,
                       "dense attention runs torch SDPA", path_symbol="dense_attention_path", portable=False)
available, path = _KERNEL.available, _KERNEL.path


def int8_available(isa: str | None = None) -> bool:
    """Whether ``int8=True`` runs the attention's two products in int8 here: the
    C file's VNNI paths (AVX512-VNNI on the AVX-512 build, AVX-VNNI on the AVX2
    one). Without VNNI, int8 dot products are no faster than float32 FMAs (AVX2's
    vpmaddubsw saturates its 16-bit pairs), so the attention stays float32."""
    return available(isa) and build.vnni_in_cpu(path(isa))


def _fits(x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 4
            and x.shape[-1] == HEAD_SIZE and x.stride(-1) == 1 and x.stride(-2) == HEAD_SIZE)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
                    offset_bias: torch.Tensor | None = None, int8: bool = False,
                    isa: str | None = None) -> torch.Tensor | None:
    """softmax(scale * q k^T + bias) v per batch row and head, or None if the kernel cannot run it.

    q: (B, T_q, H, 64), k and v: (B, T_k, H, 64), float32 on CPU; heads adjacent
    in memory (any batch and time strides, so views of a fused qkv work).
    ``offset_bias``: (H, T_q + T_k - 1) float32, or None: the score of query i
    over key t gains ``offset_bias[h, t - i + T_q - 1]`` (a bias that depends on
    ``t - i`` alone, as T5's). ``int8``: q k^T and P v in int8 where
    ``int8_available`` (quantization="int8"; the C file says how), else
    float32. Returns (B, T_q, H, 64) contiguous. ``isa`` picks the path (tests;
    default ``build.cpu_isa()``).
    """
    if not (_fits(q) and _fits(k) and _fits(v) and k.shape == v.shape
            and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2] and k.shape[1] > 0):
        return None
    if offset_bias is not None and not (
            offset_bias.device.type == "cpu" and offset_bias.dtype == torch.float32 and offset_bias.is_contiguous()
            and offset_bias.shape == (q.shape[2], q.shape[1] + k.shape[1] - 1)):
        return None
    if q.requires_grad or k.requires_grad or v.requires_grad or not available(isa):
        return None
    B, tq, H, D = q.shape
    out = torch.empty(B, tq, H, D, dtype=q.dtype)
    rc = _KERNEL.function(isa)(
        out.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), B, H, tq, k.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        scale, None if offset_bias is None else offset_bias.data_ptr(),
        0 if offset_bias is None else offset_bias.shape[1], int(int8 and int8_available(isa)),
        kernel_threads())
    if rc == -2:
        raise MemoryError("dense CPU attention kernel could not allocate its scratch buffers")
    return out if rc == 0 else None
