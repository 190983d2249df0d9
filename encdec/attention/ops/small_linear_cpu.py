"""Builds and calls ``small_linear_cpu.c``: ``x W^T + b`` for the few rows of a
decode step, streaming nn.Linear's own weight (no packed copy).

A decode step reads every decoder weight once; oneDNN's packed matmul reads
them at about a third of a plain streaming read's rate once the LM head has
flushed the cache (see the C file). Built by ``build.load`` for
``build.cpu_isa()``: AVX-512, AVX2+FMA, or plain C for "none";
``path(isa)`` says which code a build runs. Where no compiler works,
``available()`` is False and ``Linear`` keeps oneDNN (logged once).
"""
from __future__ import annotations

import ctypes
from functools import cache

import torch

from encdec.attention.ops import build

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
# At most this many rows take the kernel: at 8 it still matches or beats
# oneDNN in a decode step (Whisper tiny's decoder linears, 1 thread: 3.2-3.7 ms
# against 3.6-3.9; at 16, 7.0 against 4.8), so more rows stay on oneDNN.
MAX_ROWS = 8


@cache
def _kernel(isa: str):
    return build.load_function("small_linear_cpu.c", "small_linear_f32",
                               [_P, _P, _P, _P, _I64, _I64, _I64, ctypes.c_int], None,
                               "decode-step linears run on oneDNN (slower)", isa=isa)


def available(isa: str | None = None) -> bool:
    return _kernel(isa or build.cpu_isa()) is not None


def path(isa: str | None = None) -> str | None:
    """The vector path the build for ``isa`` runs ("avx512", "avx2", "none"), or None if unbuilt."""
    return build.vector_path("small_linear_cpu.c", "small_linear_path", isa)


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
                 isa: str | None = None) -> torch.Tensor:
    """x (M, K) float32 -> (M, N), on ``torch.get_num_threads()`` threads."""
    kernel = _kernel(isa or build.cpu_isa())
    assert kernel is not None and x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu"
    assert weight.is_contiguous() and (bias is None or bias.is_contiguous())
    x = x.contiguous()
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    kernel(out.data_ptr(), x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
           m, k, n, torch.get_num_threads())
    return out
