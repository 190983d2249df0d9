"""The int8 linear method (vLLM's quant-method shape) and how its matmul runs here.

A ``Linear`` with ``quant_method`` set delegates to it: the method quantizes the
layer's loaded float32 weight (``process_weights_after_loading``: int8 per output
channel, symmetric, float32 scales; checkpoints hold float weights, so the method
creates no parameters of its own before loading) and runs every call (``apply``).
Rules that must hold:

- Activations are quantized per row on each call (symmetric, dynamic, as
  CTranslate2's int8), so a row's output never depends on the other rows of its batch.
- One quantization, three ways to multiply (``INT8_PATHS``, chosen by ``int8_path``):
  oneDNN's s8 x s8 ``torch._int_mm`` only where its int32 sums are exact (VNNI),
  fbgemm's dynamic linear elsewhere, in 7 bits where the CPU lacks VNNI (its
  pairwise u8 x s8 products would saturate 16 bits).
- A call of a few rows (a decode step) takes the panel kernel
  (``small_linear_int8_cpu``) on the oneDNN path: its values are oneDNN's, bit for bit.
"""
from __future__ import annotations

import functools
import warnings
from typing import TYPE_CHECKING

import torch
from torch import nn

from encdec.kernels.cpu import int8_rows_cpu, small_linear_cpu, small_linear_int8_cpu
from encdec.kernels.cpu.build import cpu_flags, cpu_isa
from encdec.models.activation import apply_act_

if TYPE_CHECKING:
    from encdec.models.layers import Linear

INT8_PATHS = ("onednn", "fbgemm", "fbgemm-7bit")  # Int8LinearMethod's paths; int8_path picks one


def reduce_range() -> bool:
    """fbgemm's 7-bit activations, where the CPU lacks VNNI (AVX512-VNNI, or AVX-VNNI
    under ``ENCDEC_CPU_ISA=avx2``/``none``: an emulated AVX2 host)."""
    vnni = {"avx512_vnni", "avx_vnni"} if cpu_isa() == "avx512" else {"avx_vnni"}
    return not (vnni & cpu_flags())


def int8_path() -> str:
    """How int8 linears multiply here: "onednn" where oneDNN's s8 x s8 matmul is
    exact (it runs VNNI), else fbgemm ("fbgemm-7bit" where the CPU lacks VNNI)."""
    if reduce_range():
        return "fbgemm-7bit"
    return "onednn" if _onednn_int8_exact() else "fbgemm"


@functools.cache
def _onednn_int8_exact() -> bool:
    """Whether ``torch._int_mm`` gives exact int32 sums of int8 products here.
    Without VNNI (no such CPU flag, or oneDNN capped below it by
    ``ONEDNN_MAX_CPU_ISA``) oneDNN sums pairs of u8 x s8 products in 16 bits with
    saturation: the largest products (127 x 127, 2 x 64 000 > 32 767 per pair) show it."""
    a = torch.full((1, 64), 127, dtype=torch.int8)
    try:
        got = torch._int_mm(a, a.t().contiguous())
    except (AttributeError, RuntimeError, NotImplementedError):  # a torch without a CPU _int_mm
        return False
    return int(got[0, 0]) == 127 * 127 * 64


class Int8LinearMethod:
    """int8 weights per output channel, activations per row, for one ``path``
    (one of ``INT8_PATHS``). State lives on the layer, as vLLM keeps a quantized
    layer's tensors: ``weight`` (int8, (out, in)), ``weight_scale`` ((out,)
    float32), ``int8`` (the weight as ``path`` runs it), ``int8_small_rows`` and
    ``int8_panels`` (the decode step's panels, made at the first call of a few rows)."""

    def __init__(self, path: str):
        if path not in INT8_PATHS:
            raise ValueError(f"Linear.quantize_int8: path must be one of {INT8_PATHS}, got {path!r}")
        self.path = path

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Quantize ``layer``'s loaded weight (symmetric, scale = max |w| / 127 per
        output channel); the float weight is dropped (an LM head tied to its
        embedding unties: the embedding keeps its own)."""
        w = layer.weight.detach().float()
        scale = w.abs().amax(1).clamp(min=1e-12) / 127  # (out_features,) float32
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.register_buffer("weight_scale", scale)
        layer.int8_small_rows = self.path == "onednn" and small_linear_int8_cpu.vnni_available()
        if self.path == "onednn":
            layer.int8 = q.t()  # (in, out): _int_mm's right operand, the weight's own memory
        else:
            with warnings.catch_warnings():  # quantized tensors are deprecated; fbgemm's prepack still takes one
                warnings.simplefilter("ignore", UserWarning)
                zero = torch.zeros_like(scale, dtype=torch.long)
                qw = torch._make_per_channel_quantized_tensor(q, scale.double(), zero, 0)
            layer.int8 = torch.ops.quantized.linear_prepack(qw, None)

    def apply(self, layer: Linear, x: torch.Tensor, act: str) -> torch.Tensor:
        """``act(layer(x))``: a few rows (a decode step's LM head, an op-by-op
        decoder's linears) on the panel kernel, bit for bit the oneDNN path's values
        (the same per-row quantization, exact int32 sums, the bias in one FMA);
        more rows on the path's matmul."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] == 0:
            return x.new_empty(*lead, layer.out_features)
        if layer.int8_small_rows and x2.shape[0] <= small_linear_cpu.MAX_ROWS:
            out = small_linear_int8_cpu.small_linear_int8(x2, self.panel_weight(layer), layer.bias, post=act)
            if out is not None:
                return out.view(*lead, layer.out_features)
        run = int8_onednn if self.path == "onednn" else int8_fbgemm
        return run(layer, x2, act).view(*lead, layer.out_features)

    def panel_weight(self, layer: Linear) -> small_linear_int8_cpu.PackedInt8:
        """``layer``'s int8 weight in the decode step's panels (``small_linear_int8_cpu.pack``; made once, then kept)."""
        if layer.int8_panels is None:
            layer.int8_panels = small_linear_int8_cpu.pack(layer.weight, layer.weight_scale)
        return layer.int8_panels


def int8_onednn(lin: Linear, x2: torch.Tensor, act: str) -> torch.Tensor:
    """Each row quantized on its own scale (max |x| / 127, symmetric, as
    CTranslate2's), oneDNN's s8 x s8 -> s32 matmul, then the scales, bias and
    ``act`` in one pass over the int32 result (``int8_rows_cpu``)."""
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
    row is quantized on its own scale (max |x| / 127.5), whatever else is in the batch."""
    rows, k = x2.shape
    lo, hi = torch.aminmax(x2, dim=1, keepdim=True)  # max |x| per row, with no |x| tensor made
    r = torch.maximum(hi, lo.neg_()).float().clamp_(min=1e-30)  # (rows, 1)
    # The scaled rows written straight into the buffer that holds the pin rows
    # (no concatenated copy): the same values.
    if torch.is_grad_enabled() and x2.requires_grad:  # out= refuses what autograd records
        xn = torch.cat([x2 / r, _pin_rows(k)])
    else:
        xn = torch.empty(rows + 2, k, dtype=r.dtype)
        torch.div(x2, r, out=xn[:rows])
        xn[rows:] = _pin_rows(k)
    out = torch.ops.quantized.linear_dynamic(xn, lin.int8, lin.quant_method.path == "fbgemm-7bit")[:rows]
    out = out.mul_(r) if lin.bias is None else torch.addcmul(lin.bias, out, r)
    return apply_act_(out, act)


@functools.cache
def _pin_rows(k: int) -> torch.Tensor:
    """Two rows of width ``k`` holding 1 and -1 (``int8_fbgemm``)."""
    pin = torch.zeros(2, k)
    pin[0, 0], pin[1, 0] = 1.0, -1.0
    return pin
