"""The int8 matmuls behind ``Linear.quantize_int8`` (``Linear._int8`` picks
one per call): oneDNN's exact s8 x s8 matmul between the C row passes, or
fbgemm's dynamic int8 linear where oneDNN's int8 sums are not exact. Calls of a
few rows take the decode step's panel kernel instead (``Linear._int8``).
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from encdec.kernels.cpu import int8_rows_cpu

if TYPE_CHECKING:
    from encdec.models.layers import Linear


def apply_act_(out: torch.Tensor, act: str) -> torch.Tensor:
    """``out`` with ``act`` applied in place."""
    if act == "gelu":
        return torch.ops.aten.gelu_(out)
    return out.relu_() if act == "relu" else out


INT8_PATHS = ("onednn", "fbgemm", "fbgemm-7bit")  # Linear.quantize_int8; quantization.int8_path picks one


def int8_onednn(lin: Linear, x2: torch.Tensor, act: str) -> torch.Tensor:
    """Each row quantized on its own scale (max |x| / 127, symmetric, as
    CTranslate2's), oneDNN's s8 x s8 -> s32 matmul, then the scales, bias and
    ``act`` in one pass over the int32 result (``int8_rows_cpu``). Measured on
    the 2-core AVX-512 VNNI host (2 threads), 1500 x 384 -> 1536: ``_int_mm``
    1.4-1.9 ms against fbgemm's dynamic linear 2.3-3.1 ms (which also quantizes);
    tiny.en on 32 short clips (whisper_bench): every int8 linear 2.79 -> 1.27 s
    (fbgemm with torch's passes around it -> ``_int_mm`` 0.82 s and the row
    passes 0.27 + 0.19 s), the run 5.8 -> 4.0-4.2 s."""
    qs = int8_rows_cpu.quantize_rows(x2)
    if qs is None:  # no C kernel: the same steps in torch ops
        scale = x2.abs().amax(1).div_(127)
        q = torch.round(x2 / scale.clamp(min=1e-30)[:, None]).clamp_(-127, 127).to(torch.int8)
    else:
        q, scale = qs
    acc = torch._int_mm(q, lin.int8)
    out = int8_rows_cpu.dequantize_rows(acc, scale, lin.weight_scale, lin.bias, act)
    if out is None:
        out = acc.float().mul_(scale[:, None] * lin.weight_scale)
        out = apply_act_(out if lin.bias is None else out.add_(lin.bias), act)
    return out


def int8_fbgemm(lin: Linear, x2: torch.Tensor, act: str) -> torch.Tensor:
    """fbgemm's dynamic int8 linear with per-row activation scales, as CTranslate2's:
    fbgemm picks one scale per call from the input's range, so each row is divided by
    its max |x| and two extra rows holding 1 and -1 pin that range to [-1, 1]: every
    row is quantized on its own scale (max |x| / 127.5), whatever else is in the
    batch. Measured (2 threads, AVX-512 VNNI), 384x1536 at 1500 rows: 3.9 ms per
    tensor, 5.6 per row (float32 oneDNN 11.6); relative error on rows of unequal
    scale 0.37 -> 0.03."""
    rows, k = x2.shape
    lo, hi = torch.aminmax(x2, dim=1, keepdim=True)  # max |x| per row, with no |x| tensor made
    r = torch.maximum(hi, lo.neg_()).float().clamp_(min=1e-30)  # (rows, 1)
    # The scaled rows written straight into the buffer that holds the pin rows
    # (no concatenated copy): the same values,
    # 37 -> 23 ms of the 24000 x 384 input's preparation (2 threads).
    if torch.is_grad_enabled() and x2.requires_grad:  # out= refuses what autograd records
        xn = torch.cat([x2 / r, _pin_rows(k)])
    else:
        xn = torch.empty(rows + 2, k, dtype=r.dtype)
        torch.div(x2, r, out=xn[:rows])
        xn[rows:] = _pin_rows(k)
    out = torch.ops.quantized.linear_dynamic(xn, lin.int8, lin.int8_path == "fbgemm-7bit")[:rows]
    out = out.mul_(r) if lin.bias is None else torch.addcmul(lin.bias, out, r)
    return apply_act_(out, act)


@functools.cache
def _pin_rows(k: int) -> torch.Tensor:
    """Two rows of width ``k`` holding 1 and -1 (``int8_fbgemm``)."""
    pin = torch.zeros(2, k)
    pin[0, 0], pin[1, 0] = 1.0, -1.0
    return pin
