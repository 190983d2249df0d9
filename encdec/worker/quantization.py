"""Reduced precision on CPU, opt-in: ``quantization="int8"`` and ``dtype="bfloat16"``.

int8 (vLLM's ``quantization`` name; faster-whisper's ``compute_type="int8"``):
the ``Linear``s of the encoder, decoder and LM head get int8 weights per output
channel with float32 scales, quantized at load from the float32 weights
(``Linear.quantize_int8``; on a CPU without VNNI a pre-norm decoder's layers stay
float32 in its fused decode step: ``quantize`` says why); activations are
quantized on the fly per row (dynamic, as CTranslate2's int8), the products
summed in int32 and dequantized to float32 (``int8_path``: oneDNN's s8 x s8
matmul between our C row passes where oneDNN runs VNNI, fbgemm's
``quantized::linear_dynamic`` elsewhere; the fused decode step's own VNNI
matmul for decode steps, ``small_linear_int8_cpu``). An encoder's
unmasked self-attention (Whisper's, over 1500 frames a window) computes q k^T
and P v in int8 where the CPU has VNNI (``dense_attention_cpu``; its softmax's exp
stays float32): tiny.en's encoder attention 54-55 -> 28 ms a 4-window batch,
and ``whisper_bench --compute-type int8`` 2.0 -> 2.6x HF float32, WER on the
shipped clips unchanged within 0.01; so does a cross-attention's prefill in the
same kernel (``AttentionImpl.int8_dense``: Whisper's ~225-token sequential
prompts). Everything else (embeddings, convolutions, layer norms, the decoder's
other attention, the KV cache unless ``kv_cache_dtype`` says otherwise) stays float32.

Why fbgemm's op (where oneDNN's int8 is not exact), not ``torch._weight_int8pack_mm``:
measured on this project's 2-core AVX-512 (VNNI) host, 2 threads, per call,
oneDNN float32 prepacked -> fbgemm int8 dynamic:
384x1536 at 1 row 0.113 -> 0.032 ms, 16 rows 0.212 -> 0.065, 1500 rows (an
encoder window) 11.6 -> 3.8; 512x2048 at 1500 rows 20.4 -> 6.3; the tiny.en LM
head (384x51865) at 1 row 2.95 -> 0.86 ms, 16 rows 10.6 -> 1.8.
``_weight_int8pack_mm`` (int8 weights, float activations) took 0.46 / 9.9 / 903 ms
on the same shapes: it is a weight-only kernel for a few rows, not a GEMM.

fbgemm's ``reduce_range``: on a CPU without VNNI its u8 x s8 pairwise products
can saturate 16 bits, so activations use 7 bits there (``reduce_range()``).

bfloat16 (``dtype="bfloat16"``): bf16 weights and activations, oneDNN's bf16
matmuls (float32 accumulation), torch's bf16 CPU softmax and layer norms (both
compute in float32 internally); the float32 C kernels decline bf16 tensors and
their callers take torch's path. The LM head's logits stay float32
(``float32_logits``). Refused (``check_bfloat16``) on a CPU without
AMX-BF16, where it measured slower than float32.
"""
from __future__ import annotations

import dataclasses
import functools
import logging

import torch
from torch import nn

from encdec.attention import AttentionType
from encdec.kernels.cpu.build import cpu_flags, cpu_isa
from encdec.platform import huge_pages
from encdec.models.layers import Linear, MultiHeadAttention

logger = logging.getLogger("encdec")

QUANTIZATIONS = ("int8",)


def reduce_range() -> bool:
    """fbgemm's 7-bit activations, where the CPU lacks VNNI (AVX512-VNNI, or AVX-VNNI
    under ``ENCDEC_CPU_ISA=avx2``/``none``: an emulated AVX2 host)."""
    vnni = {"avx512_vnni", "avx_vnni"} if cpu_isa() == "avx512" else {"avx_vnni"}
    return not (vnni & cpu_flags())


def int8_path() -> str:
    """How int8 linears multiply here (``Linear.quantize_int8``): "onednn" where
    oneDNN's s8 x s8 matmul is exact (it runs VNNI), else fbgemm ("fbgemm-7bit"
    where the CPU lacks VNNI)."""
    if reduce_range():
        return "fbgemm-7bit"
    return "onednn" if _onednn_int8_exact() else "fbgemm"


@functools.cache
def _onednn_int8_exact() -> bool:
    """Whether ``torch._int_mm`` gives exact int32 sums of int8 products here.
    Without VNNI (no such CPU flag, or oneDNN capped below it by
    ``ONEDNN_MAX_CPU_ISA``) oneDNN sums pairs of u8 x s8 products in 16 bits
    with saturation: measured under ``ONEDNN_MAX_CPU_ISA=AVX2`` on the AVX-512
    host, 1500 x 384 -> 1536 was inexact and took 6.0 ms (fbgemm 2.3-3.1); with
    AVX2_VNNI exact, 3.0-3.4 ms; with AVX-512 VNNI exact, 1.4-1.9 ms. The
    largest products (127 x 127, 2 x 64 000 > 32 767 per pair) show it."""
    a = torch.full((1, 64), 127, dtype=torch.int8)
    try:
        got = torch._int_mm(a, a.t().contiguous())
    except (AttributeError, RuntimeError, NotImplementedError):  # a torch without a CPU _int_mm
        return False
    return int(got[0, 0]) == 127 * 127 * 64


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


def check_bfloat16(device: torch.device, dtype: torch.dtype) -> None:
    """ValueError for bfloat16 on a CPU where it runs slower than float32: every
    CPU without AMX-BF16, or with kernels capped below AVX-512. Measured on an
    AVX-512 host with AVX512-BF16 but no AMX (2 threads, tiny.en, other load on
    the host, runs interleaved, best of 3): oneDNN's bf16 linear of an encoder
    window 21.1 ms against 11.6 in float32; a 52 s file 4.20 s sequential and
    2.79 s independent against 3.80 and 2.77 in float32 (bf16 also leaves the
    float32 C kernels: fused decode step, attention)."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return
    if cpu_isa() != "avx512" or "amx_bf16" not in cpu_flags():
        raise ValueError(f"dtype='bfloat16' on this CPU (kernels' ISA {cpu_isa()}, no AMX-BF16) runs slower "
                         "than float32 (measured up to 1.1x slower with AVX512-BF16, never faster): "
                         "use dtype='float32' (exact) or quantization='int8'")


def fused_step_linears(model: nn.Module) -> set[int]:
    """ids of the Linears a float32 fused decode step runs (``decoder_step_cpu``:
    the pre-norm decoder layers on CPU, where the kernel is built and the CPU
    lacks the VNNI its int8 matmuls need), else empty."""
    from encdec.kernels.cpu import decoder_step_cpu, small_linear_int8_cpu

    if (not getattr(model, "fused_decode", False) or not decoder_step_cpu.available()
            or small_linear_int8_cpu.vnni_available()):
        return set()
    per_layer = [decoder_step_cpu.decoder_linears(layer) for layer in model.decoder.layers]
    if any(linears is None for linears in per_layer):  # a gated FFN (T5 v1.1): the step declines the layers
        return set()
    return {id(m) for linears in per_layer for m in linears}


def quantize(model: nn.Module, quantization: str | None) -> int:
    """Quantize the ``Linear``s of ``model`` (weights loaded, on CPU, float32);
    returns how many. Without VNNI, the ones a fused float32 decode step runs
    stay float32 (``fused_step_linears``): measured on tiny.en, a 52 s file
    sequentially (2 threads, AVX-512, shared host, best of 4): every linear int8,
    decode steps op by op 3.20 s; decoder layers float32 in the fused C step,
    encoder, cross K/V and LM head int8 1.81 s; all float32 5.09 s. With VNNI
    the fused step runs them int8 (``decoder_step_cpu``)."""
    if quantization is None:
        return 0
    path = int8_path()
    keep = fused_step_linears(model)
    linears = [m for m in model.modules() if isinstance(m, Linear) and id(m) not in keep]
    for m in linears:
        m.quantize_int8(path)
    for m in model.modules():
        if isinstance(m, MultiHeadAttention):
            m.int8_attention = True
            if m.attn is not None and m.attn_type == AttentionType.ENCODER_DECODER:
                m.attn.impl.int8_dense = True
    logger.info("quantized %d linear layers to int8 (%s, per-channel weights, dynamic activations); "
                "%d stay float32 in the fused decode step", len(linears), path, len(keep))
    return len(linears)


def decode_panel_linears(model: nn.Module) -> list[Linear]:
    """The int8 ``Linear``s a CPU decode step streams as panels
    (``Linear.int8_panel_weight``, ``small_linear_int8_cpu``): each decoder
    layer's six matmuls (``decoder_step_cpu.decoder_linears``; none for a gated
    FFN's layers) and the LM head. Empty without VNNI, where no step reads panels."""
    from encdec.kernels.cpu import decoder_step_cpu, small_linear_int8_cpu

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
    returns their bytes there, 0 where none move. Why: each decode step streams
    them all (tiny.en: 28 MB), and on 4 KiB pages every 4 KiB of that stream is a
    TLB miss. Measured on the 2-core AVX512-VNNI host, tiny.en's 368 s file
    sequentially, int8, the panels on ordinary pages and copied onto huge pages
    alternating in one process, 6 runs each: 4.88 -> 4.62 s (medians; 5 of 6
    pairs faster), the same text."""
    linears = decode_panel_linears(model)
    packed = [m.int8_panel_weight() for m in linears]
    moved = huge_pages.move_tensors([p.wq for p in packed])
    if moved is None:
        return 0
    for m, p, wq in zip(linears, packed, moved):
        m.int8_panels = dataclasses.replace(p, wq=wq)
    return sum(t.numel() for t in moved)


def float32_logits(model: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """bfloat16 on CPU: the LM head (the ``Linear`` with ``model.vocab_size``
    outputs) widened to float32 (``Linear.widen_to_float32``: the same bf16
    values), so the logits are its float32 sums, not those rounded to bfloat16;
    returns how many heads. Why: a bf16 logit near 20 is a multiple of 0.125,
    and Whisper's two best tokens are often closer than that, so rounding made
    ties that greedy and beam search broke by token id. tiny.en on the shipped
    clips (AMD EPYC, AVX512-BF16, no AMX; float32 WER 0.1655): bf16 WER 0.1757
    -> 0.1689. Costs the head's float32 weight (the embedding keeps its bf16
    one) and twice the bytes read per step: tiny.en's head at 8 rows 2.28 ms in
    oneDNN's prepacked bf16, 3.76 ms widened (same host, alternating), the
    float32 mode's own head. torch's CPU matmuls have no bf16 x bf16 -> float32
    output (``torch.mm(out_dtype=)`` is CUDA-only)."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return 0
    heads = [m for m in model.modules() if isinstance(m, Linear) and m.out_features == model.vocab_size]
    for m in heads:
        m.widen_to_float32()
    return len(heads)


def kv_cache_dtype(cache_dtype: str, dtype: torch.dtype, device: torch.device, backend: str) -> torch.dtype:
    """The dtype the KV cache holds: the model's ("auto" or its name), or
    bfloat16 under float32 weights on CPU with the torch_sdpa backend, whose C
    decode kernels read it widened to float32 (half the bytes a decode step
    streams: Whisper's cross K/V is most of them). ValueError for anything else:
    the other backends attend in the dtype they are given."""
    name = str(dtype).removeprefix("torch.")
    if cache_dtype in ("auto", name):
        return dtype
    if cache_dtype == "bfloat16" and dtype == torch.float32:
        if device.type != "cpu" or backend != "torch_sdpa":
            raise ValueError(f"kv_cache_dtype='bfloat16' with dtype='float32' runs on CPU with the torch_sdpa "
                             f"attention backend only (here: {device.type}, {backend}); on CUDA use "
                             "dtype='bfloat16'")
        return torch.bfloat16
    raise ValueError(f"kv_cache_dtype={cache_dtype!r} with dtype={name!r} is not supported: the KV cache "
                     f"holds the model's dtype (kv_cache_dtype='auto' or {name!r}), or bfloat16 under "
                     "float32 weights on CPU")