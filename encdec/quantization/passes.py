"""The int8 passes a worker runs over a loaded model (``quantization="int8"``,
CPU, float32 weights), in this order: ``check_quantization`` before loading,
``quantize`` after, ``place_decode_panels`` once the weights are placed.

Rules that must hold:

- Every ``Linear`` of the encoder, decoder and LM head gets the int8 method, except,
  on a CPU without VNNI, those a fused float32 decode step runs (``fused_step_linears``):
  there the C step in float32 beats op-by-op int8.
- Every attention block runs its dense products in int8 where its kernel can
  (``MultiHeadAttention.use_int8_attention``). Embeddings, convolutions, layer norms,
  the decoder's self-attention and the KV cache (unless ``kv_cache_dtype`` says
  otherwise) stay float32.
"""
from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from encdec.config import QUANTIZATIONS
from encdec.kernels.cpu import decoder_step_cpu, small_linear_int8_cpu
from encdec.models.layers import Linear, MultiHeadAttention
from encdec.platform import huge_pages
from encdec.quantization.int8 import int8_path

logger = logging.getLogger("encdec")


def check_quantization(quantization: str | None, device: torch.device, dtype: torch.dtype) -> None:
    """ValueError for a ``quantization`` this engine cannot run."""
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {quantization!r}")
    if device.type != "cpu":
        raise ValueError(f"quantization={quantization!r} runs on CPU only (fbgemm), not on {device.type}")
    if dtype != torch.float32:
        raise ValueError(f"quantization={quantization!r} takes float32 activations; "
                         f"dtype must be 'auto' or 'float32', got {str(dtype).removeprefix('torch.')}")
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        raise ValueError(f"quantization={quantization!r} needs torch's fbgemm engine, "
                         "which this torch build lacks")


def fused_step_linears(model: nn.Module) -> set[int]:
    """ids of the Linears a float32 fused decode step runs (``decoder_step_cpu``:
    the pre-norm decoder layers on CPU, where the kernel is built and the CPU
    lacks the VNNI its int8 matmuls need), else empty."""
    if (not getattr(model, "fused_decode", False) or not decoder_step_cpu.available()
            or small_linear_int8_cpu.vnni_available()):
        return set()
    per_layer = [decoder_step_cpu.decoder_linears(layer) for layer in model.decoder.layers]
    if any(linears is None for linears in per_layer):  # a gated FFN (T5 v1.1): the step declines the layers
        return set()
    return {id(m) for linears in per_layer for m in linears}


def quantize(model: nn.Module, quantization: str | None) -> int:
    """Quantize the ``Linear``s of ``model`` (weights loaded, on CPU, float32) and
    turn on its attention blocks' int8 products; returns how many linears. Without
    VNNI, the ones a fused float32 decode step runs stay float32
    (``fused_step_linears``); with VNNI the fused step runs them int8."""
    if quantization is None:
        return 0
    path = int8_path()
    keep = fused_step_linears(model)
    linears = [m for m in model.modules() if isinstance(m, Linear) and id(m) not in keep]
    for m in linears:
        m.quantize_int8(path)
    for m in model.modules():
        if isinstance(m, MultiHeadAttention):
            m.use_int8_attention()
    logger.info("quantized %d linear layers to int8 (%s, per-channel weights, dynamic activations); "
                "%d stay float32 in the fused decode step", len(linears), path, len(keep))
    return len(linears)


def decode_panel_linears(model: nn.Module) -> list[Linear]:
    """The int8 ``Linear``s a CPU decode step streams as panels
    (``Linear.int8_panel_weight``, ``small_linear_int8_cpu``): each decoder
    layer's six matmuls (``decoder_step_cpu.decoder_linears``; none for a gated
    FFN's layers) and the LM head. Empty without VNNI, where no step reads panels."""
    if not small_linear_int8_cpu.vnni_available():
        return []
    layers = getattr(getattr(model, "decoder", None), "layers", [])
    fused = getattr(model, "fused_decode", False)  # the fused step reads its layers' panels
    linears = [m for layer in layers for m in decoder_step_cpu.decoder_linears(layer) or ()
               if m.int8 is not None and (fused or m.int8_small_rows)]
    vocab = getattr(model, "vocab_size", None)
    return linears + [m for m in model.modules()
                      if isinstance(m, Linear) and m.out_features == vocab and m.int8_small_rows]


def place_decode_panels(model: nn.Module) -> int:
    """Pack the int8 decode panels now (``decode_panel_linears``; made on a step's
    first use otherwise) into one huge-page arena (``huge_pages.move_tensors``);
    returns their bytes there, 0 where none move. Each decode step streams them
    all, and on 4 KiB pages every 4 KiB of that stream is a TLB miss."""
    linears = decode_panel_linears(model)
    packed = [m.int8_panel_weight() for m in linears]
    moved = huge_pages.move_tensors([p.wq for p in packed])
    if moved is None:
        return 0
    for m, p, wq in zip(linears, packed, moved):
        m.int8_panels = dataclasses.replace(p, wq=wq)
    return sum(t.numel() for t in moved)
