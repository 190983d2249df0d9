"""torch_sdpa's per-sequence prefill loops: which run on one thread."""
from __future__ import annotations

import torch

from encdec.attention.backends import torch_sdpa


def test_small_prefill_loops_run_on_one_thread():
    """torch_sdpa's per-sequence prefill loops take one thread where every call
    is small (``_ONE_THREAD_MACS``), on CPU only; an empty step keeps the count."""
    from encdec.attention.backends import torch_sdpa

    cpu, width = torch.device("cpu"), 2 * 16
    short = [(0, 2, 0, 40), (2, 4, 40, 88)]  # (q_start, q_end, enc_start, enc_end): 2 queries over 40 and 48 keys
    assert torch_sdpa._one_thread(short, width, cpu)
    assert not torch_sdpa._one_thread(short + [(4, 6, 88, 88 + 40_000)], width, cpu)
    assert not torch_sdpa._one_thread([(0, 300, 0, 300)], 12 * 64, cpu)  # bart-base encoder: both threads
    assert not torch_sdpa._one_thread(short, width, torch.device("meta"))
    assert not torch_sdpa._one_thread([], width, cpu)
