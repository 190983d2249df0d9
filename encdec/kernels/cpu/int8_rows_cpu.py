"""Builds and calls ``int8_rows_cpu.c``: the float passes around an int8
matmul, per-row quantization of its input and dequantization (with bias and
activation) of its int32 result, one pass each (see the C file for why).

``Linear`` runs them around ``torch._int_mm`` where oneDNN multiplies int8 with
VNNI (``encdec.quantization.int8_path``). Built by ``build.load`` for
``build.cpu_isa()``: AVX-512, AVX2, or plain C for "none"; ``path(isa)`` says
which code a build runs. Where no compiler works, the functions return None and
``Linear`` takes the same steps in torch ops (slower, the same values up to
float32 rounding of the scale products).
"""
from __future__ import annotations

import ctypes

import torch

from encdec.kernels.cpu import build, small_linear_cpu
from encdec.platform.cpu_threads import kernel_threads

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_FALLBACK = "int8 linears quantize and dequantize in torch ops (slower)"
_KERNEL = build.Kernel("int8_rows_cpu.c", "quantize_rows_s8", [_P, _I64, _I64, _I64, _P, _P, _INT], None,
                         _FALLBACK, path_symbol="int8_rows_path")
_DEQUANTIZE = build.Kernel("int8_rows_cpu.c", "dequantize_rows", [_P, _I64, _I64, _P, _P, _P, _INT, _INT], None,
                           _FALLBACK, path_symbol="int8_rows_path")
available, path = _KERNEL.available, _KERNEL.path
ACTS = {act: small_linear_cpu.POST[act] for act in ("none", "gelu", "relu")}  # the activations dequantize_rows runs


def quantize_rows(x: torch.Tensor, *, threads: int | None = None, isa: str | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(R, K) float32 -> (int8 (R, K), float32 scales (R,)): each row on its own
    symmetric scale, ``max |row| / 127``; None where the kernel is not built."""
    kernel = _KERNEL.function(isa)
    if kernel is None:
        return None
    assert x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=torch.int8)
    scale = torch.empty(rows, dtype=torch.float32)
    kernel(x.data_ptr(), rows, k, x.stride(0), q.data_ptr(), scale.data_ptr(), kernel_threads(threads))
    return q, scale


def dequantize_rows(acc: torch.Tensor, row_scale: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None, act: str = "none", *, threads: int | None = None,
                    isa: str | None = None) -> torch.Tensor | None:
    """int32 (R, N) -> float32 ``act(acc * row_scale[:, None] * weight_scale + bias)``,
    written over ``acc``'s memory (returned as its float32 view); None where the
    kernel is not built."""
    kernel = _DEQUANTIZE.function(isa)
    if kernel is None:
        return None
    assert acc.dtype == torch.int32 and acc.is_contiguous() and acc.dim() == 2
    assert row_scale.is_contiguous() and weight_scale.is_contiguous() and (bias is None or bias.is_contiguous())
    rows, n = acc.shape
    assert row_scale.shape == (rows,) and weight_scale.shape == (n,) and (bias is None or bias.shape == (n,))
    kernel(acc.data_ptr(), rows, n, row_scale.data_ptr(), weight_scale.data_ptr(),
           None if bias is None else bias.data_ptr(), ACTS[act], kernel_threads(threads))
    return acc.view(torch.float32)
