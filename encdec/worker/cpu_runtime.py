"""Process-wide CPU settings, applied only when a program asks for them.

The engine never changes process state by itself: a library that sets torch's
thread count or glibc's allocator from a constructor surprises every other
user of the process (HF models, a server's other engines, tests). Programs
that want full CPU speed call this once, before building an ``LLM``::

    import encdec
    encdec.configure_cpu_runtime()              # glibc keeps freed memory
    encdec.configure_cpu_runtime(num_threads=2)  # and torch uses 2 threads

The CLI and the benchmarks do.
"""
from __future__ import annotations

import os

from encdec.worker.host_allocator import retain_freed_memory as _retain_freed_memory


def configure_cpu_runtime(num_threads: int | None = None, *, retain_freed_memory: bool = True) -> int:
    """Set torch's intra-op threads and (glibc) keep large freed buffers.

    ``num_threads``: None reads ``ENCDEC_NUM_THREADS`` and otherwise leaves
    torch's default (one per core). ``retain_freed_memory``: see
    ``encdec.worker.host_allocator`` (Whisper's encoder 4.7 s -> 3.3 s on 16
    clips here); ``False`` leaves the allocator as it is. Both are
    process-wide and apply to everything in the process. Returns the thread
    count now in effect.
    """
    import torch

    if num_threads is None:
        num_threads = int(os.environ.get("ENCDEC_NUM_THREADS", "0")) or None
    if num_threads is not None:
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads must be a positive int, got {num_threads!r}")
        torch.set_num_threads(num_threads)
    if retain_freed_memory:
        _retain_freed_memory()
    return torch.get_num_threads()
