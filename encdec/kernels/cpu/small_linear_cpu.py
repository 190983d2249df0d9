"""Builds and calls ``small_linear_cpu.c``: ``x W^T + b`` for the few rows of a
decode step, from the weight packed once in column panels (``pack``).

A decode step reads every decoder weight once; the kernel streams each panel
once for all the step's rows, shared by the threads (see the C file for
the layout and the measurements). Built by ``build.load`` for
``build.cpu_isa()``: AVX-512, AVX2+FMA, or plain C for "none"; ``path(isa)``
says which code a build runs. Where no compiler works, ``available()`` is
False, ``small_linear`` returns None and ``Linear`` keeps oneDNN (logged once).
"""
from __future__ import annotations

import ctypes

import torch

from encdec.kernels.cpu import build
from encdec.platform.cpu_threads import kernel_threads

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
PANEL = 32  # output columns per panel (PW in the C file)
# At most this many rows take the kernel: its tiles run near the FMA peak at any
# row count, and a decode batch past this is a GEMM oneDNN blocks better.
MAX_ROWS = 64
POST = {"none": 0, "gelu": 1, "add": 2, "relu": 3}  # what the kernel does with x W^T + b
_KERNEL = build.Kernel("small_linear_cpu.c", "small_linear_f32",
                       [_P, _P, _P, _P, _I64, _I64, _I64, ctypes.c_int, ctypes.c_int], None,
                       "decode-step linears run on oneDNN (slower)", path_symbol="small_linear_path")
available, path = _KERNEL.available, _KERNEL.path


def pack(weight: torch.Tensor) -> torch.Tensor:
    """nn.Linear's (N, K) weight -> panels (ceil(N / 32), K, 32), columns past N zero."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // PANEL) * PANEL, k, dtype=weight.dtype)
    padded[:n] = weight.detach()
    return padded.view(-1, PANEL, k).transpose(1, 2).contiguous()


def small_linear(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None, *,
                 post: str = "none", threads: int | None = None, isa: str | None = None) -> torch.Tensor | None:
    """x (M, K) float32 -> post(x W^T + b) (M, n) from ``pack(W)``, on ``threads``
    threads (default torch's count; at most ``available_cores()``); ``post`` is "none", "gelu" or "relu".
    None where the kernel is not built."""
    kernel = _KERNEL.function(isa)
    if kernel is None:
        return None
    assert x.dtype == panels.dtype == torch.float32 and x.device.type == "cpu"
    assert panels.is_contiguous() and (bias is None or bias.is_contiguous()) and post in ("none", "gelu", "relu")
    x = x.contiguous()
    m, k = x.shape
    assert panels.shape == (-(-n // PANEL), k, PANEL), (tuple(panels.shape), n, k)
    out = torch.empty(m, n, dtype=torch.float32)
    kernel(out.data_ptr(), x.data_ptr(), panels.data_ptr(), None if bias is None else bias.data_ptr(),
           m, k, n, POST[post], kernel_threads(threads))
    return out
