"""Calls ``whisper_rules_cpu.c``: Whisper's logits rules (begin-suppress,
suppress, timestamps) for a decode step's rows, in place, in one C call.

``encdec.models.whisper_processors`` states the rules and computes each row's
flags from its output; this runs them: 0.019 ms at one row and 0.084 ms at 7,
against 0.12 and 0.41 ms as torch ops (tiny.en, AMD EPYC, AVX-512). Built by
``build.load`` for ``build.cpu_isa()`` (AVX-512, AVX2+FMA or portable C;
``path(isa)`` says which); where no compiler works ``available()`` is False,
``whisper_rules`` returns None and the processor runs its torch ops.
"""
from __future__ import annotations

import ctypes

import torch

from encdec.kernels.cpu import build

# Row flags (whisper_rules_cpu.c)
SUPPRESS, BEGIN, TIMESTAMPS, LAST_TS, PENULT_TS, FIRST = 1, 2, 4, 8, 16, 32
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_KERNEL = build.Kernel("whisper_rules_cpu.c", "whisper_rules_f32",
                       [_P, _I64, _I64, _I64, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64], None,
                       "Whisper's logits rules run as torch ops (slower)", path_symbol="whisper_rules_path")
available, path = _KERNEL.available, _KERNEL.path


def _ids(ids: torch.Tensor | None) -> tuple[int | None, int]:
    return (None, 0) if ids is None else (ids.data_ptr(), ids.numel())


def whisper_rules(logits: torch.Tensor, flags: list[int], lows: list[int], suppress_ids: torch.Tensor | None,
                  begin_ids: torch.Tensor | None, *, no_timestamps: int, eos: int, timestamp_begin: int,
                  max_initial: int | None, isa: str | None = None) -> torch.Tensor | None:
    """Apply the rules to ``logits`` (rows, vocab) float32 on CPU, in place, and
    return it; None, having done nothing, where the kernel does not run (no
    build, logits of another dtype, device or layout). ``flags[r]``: row r's
    rules (the flags above); ``lows[r]``: its lowest timestamp token allowed;
    ``suppress_ids``, ``begin_ids``: sorted int64 CPU ids or None;
    ``max_initial``: the cap on the first timestamp, None for none."""
    kernel = _KERNEL.function(isa)
    if (kernel is None or logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2
            or logits.stride(1) != 1):
        return None
    n = logits.shape[0]
    assert len(flags) == len(lows) == n, (len(flags), len(lows), n)
    flags_t, lows_t = torch.tensor(flags, dtype=torch.int32), torch.tensor(lows, dtype=torch.int64)
    kernel(logits.data_ptr(), n, logits.shape[1], logits.stride(0), flags_t.data_ptr(), lows_t.data_ptr(),
           *_ids(suppress_ids), *_ids(begin_ids), no_timestamps, eos, timestamp_begin,
           -1 if max_initial is None else max_initial)
    return logits
