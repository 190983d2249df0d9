"""A 4-bit copy of an int8 panel weight (``small_linear_int4.h``, built into
``small_linear_int8_cpu.c``'s library and the fused decode step's): the
screening pass of a CPU draft's two-stage LM head (``draft_step.h``), whose
candidates are then scored exactly from the int8 panels.

``from_int8`` makes the copy from ``small_linear_int8_cpu.PackedInt8`` (no
float weight needed): each column's int8 values rescaled to [-7, 7], so a
column keeps its own scale. ``small_linear_int4`` runs the pass alone (tests);
``dequantized`` gives the weight it computes with (their float64 reference).
It runs where the int8 kernel runs (``small_linear_int8_cpu.vnni_available``).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from encdec.kernels.cpu import build, small_linear_int8_cpu
from encdec.platform import huge_pages
from encdec.platform.cpu_threads import kernel_threads

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
PANEL = small_linear_int8_cpu.PANEL
_KERNEL = build.Kernel("small_linear_int8_cpu.c", "small_linear_int4", [_P] * 5 + [_I64] * 3 + [_P, ctypes.c_int],
                       None, "no int4 screening pass", path_symbol="small_linear_int8_path")
_FROM_INT8 = build.Kernel("small_linear_int8_cpu.c", "int4_from_int8", [_P] * 4 + [_I64] * 2 + [_P, ctypes.c_int],
                          None, "no int4 copy (the int8 head alone)", path_symbol="small_linear_int8_path")


@dataclass(frozen=True)
class PackedInt4:
    """An int4 copy as the kernels read it (small_linear_int4.h's layout)."""
    wq: torch.Tensor  # (panels, ceil(K / 4), 64) uint8: two nibbles (q4 + 8) a byte
    ws: torch.Tensor  # (panels * 32,) float32, zero past N
    n: int
    k: int

    def ptrs(self) -> list[int]:
        return [self.wq.data_ptr(), self.ws.data_ptr()]


# Clipping fractions tried per column: the one whose int4 copy is nearest its
# int8 column (least squares) is kept. Why: on Whisper base's head with the rows
# of an 8-minute run (1187 draft steps), the int8 winner's rank among the int4
# scores was at most 144 with max |q8| as the range (top 16: 99.75%), at most
# 11 with the best of these (top 16: 100%); group-wise scales along K did no
# better than this at 16 candidates, for more bytes.
CLIPS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)


def from_int8(packed: small_linear_int8_cpu.PackedInt8) -> PackedInt4 | None:
    """The int4 copy of an int8 panel weight: per column, q4 = clamp(round(q8 /
    step), -7, 7) (half to even) with step = c max |q8| / 7 for the first c of
    ``CLIPS`` that leaves it nearest q8 (least squares), its scale ws8 step; an
    all-zero column stays zero. None where the kernel is not built here."""
    kernel = _FROM_INT8.function()
    if kernel is None:
        return None
    panels, k4 = packed.wq.shape[:2]
    # on huge pages where the host grants them, as the int8 panels (quantization.place_decode_panels)
    wq = huge_pages.anonymous_buffer(panels * k4 * 2 * PANEL).view(panels, k4, 2 * PANEL)  # zeroed
    ws = torch.empty_like(packed.ws)
    clips = torch.tensor(CLIPS, dtype=torch.float32)
    kernel(wq.data_ptr(), ws.data_ptr(), packed.wq.data_ptr(), packed.ws.data_ptr(), panels, k4, clips.data_ptr(),
           len(CLIPS))
    return PackedInt4(wq, ws, packed.n, packed.k)


def dequantized(packed: PackedInt4) -> torch.Tensor:
    """(N, K) float64: the weight the int4 pass multiplies with."""
    lo, hi = (packed.wq & 15).to(torch.int16), (packed.wq >> 4).to(torch.int16)
    q4 = torch.cat([lo, hi], dim=-1) - 8  # (panels, K4, 128)
    panels, k4 = q4.shape[:2]
    w = q4.reshape(panels, k4, PANEL, 4).permute(0, 2, 1, 3).reshape(panels * PANEL, k4 * 4)
    return (w.double() * packed.ws.double()[:, None])[:packed.n, :packed.k]


def small_linear_int4(x: torch.Tensor, packed: PackedInt4, bias: torch.Tensor | None, *,
                      threads: int | None = None, isa: str | None = None) -> torch.Tensor | None:
    """x W4^T + b, x (M, K) float32, each row quantized as the int8 kernel
    quantizes it; None where the build or its VNNI is missing here."""
    return small_linear_int8_cpu.run_rows(_KERNEL, x, packed, bias, [], threads, isa)


# The two-stage head alone (draft_head4.h's test entry), in the fused step's library.
_TWO_STAGE = build.Kernel("decoder_step_cpu.c", "draft_head4_tokens",
                          [_P, _I64, _I64, _P, _P, _P, _P, _I64, _P, _P, _I64, _P, _P, _P, ctypes.c_int],
                          ctypes.c_int, "no two-stage head", path_symbol="decoder_step_path")
CANDIDATES = 32  # draft_head4.h's HEAD4_CAND


def two_stage_tokens(x: torch.Tensor, packed: small_linear_int8_cpu.PackedInt8, rows: torch.Tensor,
                     packed4: PackedInt4, bias: torch.Tensor | None, banned: list[int],
                     ids: torch.Tensor | None = None, *, threads: int | None = None,
                     isa: str | None = None) -> tuple[list[int], torch.Tensor] | None:
    """The two-stage head's tokens of x (M, K) float32 rows and its logits
    (int4 scores but at each row's candidates: their int8 logits); None where
    the build or its VNNI is missing here (tests)."""
    kernel = _TWO_STAGE.function(isa)
    if kernel is None or (_TWO_STAGE.path(isa) != "none" and not small_linear_int8_cpu.vnni_available(isa)):
        return None
    m, k, n = x.shape[0], packed.k, packed.n
    assert x.dtype == torch.float32 and x.is_contiguous() and x.shape[1] == k and rows.shape == (n, k)
    assert all(0 <= c < n for c in banned) and (ids is None or (ids.dtype == torch.int64 and ids.shape == (n,)))
    head = (_P * 3)(*packed.ptrs())
    head4 = (_P * 2)(*packed4.ptrs())
    logits, out = torch.empty(m, n, dtype=torch.float32), torch.zeros(m, dtype=torch.int64)
    ban = torch.tensor(banned, dtype=torch.int64)
    work = torch.empty(m * 4 * (-(-k // 4)) + 4 * m, dtype=torch.uint8)
    rc = kernel(x.data_ptr(), m, k, ctypes.addressof(head), rows.data_ptr(), ctypes.addressof(head4),
                None if bias is None else bias.data_ptr(), n, None if ids is None else ids.data_ptr(),
                ban.data_ptr() if banned else None, len(banned), logits.data_ptr(), out.data_ptr(),
                work.data_ptr(), kernel_threads(threads))
    if rc != 0:
        raise MemoryError("two-stage head kernel could not allocate its scratch")
    return out.tolist(), logits
