"""Builds and calls ``greedy_cpu.c``: each row's greedy token with its
log-probability and rank in one pass, without a vocab-wide log-softmax; or
the greedy token alone (``greedy_argmax``, torch's argmax in an eighth of its
time on a large vocabulary).

The sampler takes it for all-greedy batches that ask for the chosen token's
log-probability only (``logprobs=0``, processed), as a Whisper transcription
does every step (see the C file for the measurement). Built by
``build.load`` for ``build.cpu_isa()``; ``path(isa)`` says which vector path a
build runs. Where no compiler works, on the portable build (scalar expf over
the vocabulary: 0.83 ms at 7 rows, torch's path 0.43, so ``path("none")`` is
"torch"), or where a row holds a NaN or no finite value, ``greedy_logprobs``
returns None and the sampler's general path runs.
"""
from __future__ import annotations

import ctypes

import torch

from encdec.kernels.cpu import build
from encdec.platform.cpu_threads import kernel_threads

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_KERNEL = build.Kernel("greedy_cpu.c", "greedy_logprob_f32", [_P, _I64, _I64, _I64, _P, _P, _P, ctypes.c_int],
                       ctypes.c_int, "greedy steps take the sampler's general path (slower)",
                       path_symbol="greedy_path", portable=False)
_ARGMAX = build.Kernel("greedy_cpu.c", "greedy_argmax_f32", [_P, _I64, _I64, _I64, _P, ctypes.c_int],
                       ctypes.c_int, "greedy tokens take torch's argmax (slower)",
                       path_symbol="greedy_path", portable=False)
available, path = _KERNEL.available, _KERNEL.path


def _applies(logits: torch.Tensor) -> bool:
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(1) == 1 and logits.shape[1] > 0)


def greedy_argmax(logits: torch.Tensor, *, isa: str | None = None) -> torch.Tensor | None:
    """(rows, vocab) float32 CPU logits -> each row's first maximum (rows,)
    int64, as ``logits.argmax(-1)``; None where the kernel does not apply (a
    row with a NaN, which torch's argmax picks, or with no finite value)."""
    kernel = _ARGMAX.function(isa) if _applies(logits) else None
    if kernel is None:
        return None
    rows = logits.shape[0]
    tok = torch.empty(rows, dtype=torch.int64)
    if kernel(logits.data_ptr(), rows, logits.shape[1], logits.stride(0), tok.data_ptr(),
              min(rows, kernel_threads())):
        return None
    return tok


def greedy_logprobs(logits: torch.Tensor, *, isa: str | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(rows, vocab) float32 CPU logits -> (token ids (rows,) int64, their
    log-softmax values (rows,) float32, ranks (rows,) int64: the entries equal to
    the maximum), as ``argmax``, ``log_softmax`` + gather and the sampler's rank
    give them; None where the kernel does not apply."""
    kernel = _KERNEL.function(isa) if _applies(logits) else None
    if kernel is None:
        return None
    rows = logits.shape[0]
    tok = torch.empty(rows, dtype=torch.int64)
    lp = torch.empty(rows, dtype=torch.float32)
    rank = torch.empty(rows, dtype=torch.int64)
    if kernel(logits.data_ptr(), rows, logits.shape[1], logits.stride(0), tok.data_ptr(), lp.data_ptr(),
              rank.data_ptr(), min(rows, kernel_threads())):  # a row per thread at most: no idle wake-up
        return None
    return tok, lp, rank
