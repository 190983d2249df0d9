"""Builds and calls ``small_linear_int8_cpu.c``: the decode step's panel matmul
with int8 weights (``quantization="int8"``), from a weight packed once
(``pack``); the fused decode step (``decoder_step_cpu``) runs it per layer.

``path(isa)``: "avx512" (with AVX512-VNNI), "avx2" (with AVX-VNNI), or "none"
(plain C). The vector builds need their VNNI (``vnni_available``): where the
CPU lacks it a vector build's call declines (None) rather than fault on its
first instruction. The engine runs none of them there, nor the portable build
(the decoder keeps float32 weights in the fused step there); the tests run
every one the CPU can.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

from encdec.kernels.cpu import build, small_linear_cpu
from encdec.platform.cpu_threads import kernel_threads

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
PANEL = small_linear_cpu.PANEL
_KERNEL = build.Kernel("small_linear_int8_cpu.c", "small_linear_int8",
                       [_P] * 6 + [_I64] * 3 + [ctypes.c_int, _P, ctypes.c_int], None,
                       "int8 decoder weights run op by op", path_symbol="small_linear_int8_path")
available, path = _KERNEL.available, _KERNEL.path


def vnni_available(isa: str | None = None) -> bool:
    """Whether the int8 panel matmul runs VNNI here: the AVX-512 build on a CPU
    with AVX512-VNNI, or the AVX2 build on one with AVX-VNNI."""
    return build.vnni_in_cpu(_KERNEL.path(isa))


@dataclass(frozen=True)
class PackedInt8:
    """An int8 Linear's weight as the kernels read it (the C file's layouts)."""
    wq: torch.Tensor  # (panels, ceil(K / 4), 32, 4) int8
    ws: torch.Tensor  # (panels * 32,) float32, zero past N
    comp: torch.Tensor  # (panels * 32,) int32: 128 x each column's sum
    n: int
    k: int

    def ptrs(self) -> list[int]:
        return [self.wq.data_ptr(), self.ws.data_ptr(), self.comp.data_ptr()]


def pack(weight: torch.Tensor, scale: torch.Tensor) -> PackedInt8:
    """(N, K) int8 weight and its (N,) float32 scales -> ``PackedInt8``."""
    n, k = weight.shape
    panels, k4 = -(-n // PANEL), -(-k // 4)
    padded = torch.zeros(panels * PANEL, k4 * 4, dtype=torch.int8)
    padded[:n, :k] = weight
    wq = padded.view(panels, PANEL, k4, 4).transpose(1, 2).contiguous()
    ws = torch.zeros(panels * PANEL, dtype=torch.float32)
    ws[:n] = scale
    comp = padded.sum(1, dtype=torch.int32).mul_(128)
    return PackedInt8(wq, ws, comp, n, k)


def small_linear_int8(x: torch.Tensor, packed: PackedInt8, bias: torch.Tensor | None, *, post: str = "none",
                      threads: int | None = None, isa: str | None = None) -> torch.Tensor | None:
    """post(x W^T + b), x (M, K) float32, each row quantized on its own scale;
    None where the kernel is not built, or is a vector build this CPU lacks the VNNI of."""
    return run_rows(_KERNEL, x, packed, bias, [small_linear_cpu.POST[post]], threads, isa)


def run_rows(kernel_spec: build.Kernel, x: torch.Tensor, packed: Any, bias: torch.Tensor | None,
             extra: list[int], threads: int | None, isa: str | None) -> torch.Tensor | None:
    """A test entry point of this library (int8 panels, or their int4 copy:
    ``packed`` with ``n``, ``k``, ``ptrs()``) on x (M, K) float32: the
    kernel's ``(y, x, *packed.ptrs(), bias, M, K, N, *extra, work, threads)``;
    None where it is not built, or is a vector build this CPU lacks the VNNI of."""
    kernel = kernel_spec.function(isa)
    if kernel is None or (kernel_spec.path(isa) != "none" and not vnni_available(isa)):
        return None
    assert x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and x.shape[1] == packed.k
    assert bias is None or (bias.is_contiguous() and bias.shape == (packed.n,))
    x = x.contiguous()
    m = x.shape[0]
    out = torch.empty(m, packed.n, dtype=torch.float32)
    work = torch.empty(m * 4 * (-(-packed.k // 4)) + 4 * m, dtype=torch.uint8)
    kernel(out.data_ptr(), x.data_ptr(), *packed.ptrs(), None if bias is None else bias.data_ptr(), m, packed.k,
           packed.n, *extra, work.data_ptr(), kernel_threads(threads))
    return out
