"""Builds and calls ``greedy_cpu.c``: each row's greedy token with its
log-probability and rank in one pass, without a vocab-wide log-softmax.

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

from encdec.cpu_threads import kernel_threads
from encdec.kernels.cpu import build

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_KERNEL = build.Kernel("greedy_cpu.c", "greedy_logprob_f32", [_P, _I64, _I64, _I64, _P, _P, _P, ctypes.c_int],
                       ctypes.c_int, "greedy steps take the sampler's general path (slower)",
                       path_symbol="greedy_path", portable=False)
available, path = _KERNEL.available, _KERNEL.path


def greedy_logprobs(logits: torch.Tensor, *, isa: str | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(rows, vocab) float32 CPU logits -> (token ids (rows,) int64, their
    log-softmax values (rows,) float32, ranks (rows,) int64: the entries equal to
    the maximum), as ``argmax``, ``log_softmax`` + gather and the sampler's rank
    give them; None where the kernel does not apply."""
    if (logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2
            or logits.stride(1) != 1 or logits.shape[1] == 0):
        return None
    kernel = _KERNEL.function(isa)
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
