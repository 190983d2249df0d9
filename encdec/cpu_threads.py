"""Thread counts for small decode steps, where OpenMP's wake-up costs more than the work.

Under ``OMP_WAIT_POLICY=PASSIVE`` (the benchmarks' policy, on both sides) the
workers sleep between parallel regions, and waking them costs about 100 us
here. A decode step of a few rows is dozens of small matmuls and vocab-wide
elementwise ops, each a parallel region: on one thread they are faster. The
LM head (an 80 MB weight for Whisper tiny, read once a step) and the paged
attention over many rows' cross K/V stream memory, which one core does not
saturate: those keep the full count.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

# Decode steps of at most this many rows run their decoder layers and logits
# rules on one thread. Under OMP_WAIT_POLICY=PASSIVE every parallel region
# wakes the sleeping workers (~100 us here), which costs more than the work of
# a 1-16 row matmul: packed 384x1536 at 1 row, 169 us on 2 threads vs 83 us on
# one; 512x2048 at 8 rows, 278 vs 197 us; at 32 rows 2 threads win (packed
# Linear timed alone, AMD EPYC, AVX-512). Whisper tiny.en, one long file: a
# batch-1 decode step 16.2 -> 12.1 ms; batch 8, 23.9 -> 20.0 ms.
SMALL_STEP_ROWS = 16
# Paged decode attention over at least this many rows keeps the full count.
BANDWIDTH_MIN_SEQS = 2


_outer = threading.local()  # the thread count single_thread() set aside, per Python thread


@contextlib.contextmanager
def single_thread(enabled: bool = True) -> Iterator[None]:
    """Run the block on one intra-op thread, then restore the count. A no-op
    when ``enabled`` is False or torch already runs one thread. torch's count
    is process-wide: torch work on other Python threads meanwhile (a server's
    word alignment) runs on one thread too, for the few ms of a step. Kernels bound
    by memory bandwidth, not by the wake-up, may still ask for the count set
    aside (``bandwidth_threads``)."""
    import torch

    n = torch.get_num_threads()
    if not enabled or n == 1:
        yield
        return
    torch.set_num_threads(1)
    _outer.threads = n
    try:
        yield
    finally:
        _outer.threads = None
        torch.set_num_threads(n)


def bandwidth_threads() -> int:
    """Threads for a kernel that streams much memory per call (paged decode
    attention over many rows' cross K/V: 4.6 MB per row and layer for Whisper
    tiny): torch's count, or inside ``single_thread`` the count it set aside.
    One core does not saturate memory bandwidth; two do."""
    import torch

    return getattr(_outer, "threads", None) or torch.get_num_threads()
