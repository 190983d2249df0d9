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

import logging
import os

from encdec.platform.cpu_threads import available_cores
from encdec.platform.host_allocator import retain_freed_memory as _retain_freed_memory

logger = logging.getLogger(__name__)


def _openmp_loaded() -> bool:
    """Whether an OpenMP runtime (torch's libgomp or libiomp) is loaded in this process yet."""
    try:
        with open("/proc/self/maps") as f:
            return any("libgomp" in line or "libiomp" in line for line in f)
    except OSError:
        return True  # cannot tell: assume it read its settings already


def configure_cpu_runtime(num_threads: int | None = None, *, retain_freed_memory: bool = True) -> int:
    """Set torch's intra-op threads and (glibc) keep large freed buffers.

    ``num_threads``: None reads ``ENCDEC_NUM_THREADS`` and otherwise torch's
    default (one per CPU of the affinity mask); either way at most
    ``encdec.platform.cpu_threads.available_cores()`` (the affinity mask and a cgroup
    CPU quota): threads past the cores the process can get wait for each
    other at every parallel region. Where no OpenMP runtime is loaded yet (torch
    not imported), ``OMP_WAIT_POLICY`` defaults to PASSIVE: threads that wait
    at the end of a parallel region sleep, rather than spin on a core that a
    thread still at work, or another process, needs (the runtime reads it once,
    at load). ``retain_freed_memory``: see
    ``encdec.platform.host_allocator``; ``False`` leaves the allocator as it is. Both are
    process-wide and apply to everything in the process. Returns the thread
    count now in effect.
    """
    if not _openmp_loaded():
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    if num_threads is None:
        num_threads = int(os.environ.get("ENCDEC_NUM_THREADS", "0")) or None
    if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int)
                                    or num_threads < 1):
        raise ValueError(f"num_threads must be a positive int, got {num_threads!r}")
    cores = available_cores()
    if num_threads is not None and num_threads > cores:
        logger.info("num_threads=%d but this process can run %d at once: using %d", num_threads, cores, cores)
    want = min(num_threads or torch.get_num_threads(), cores)
    if want != torch.get_num_threads():
        torch.set_num_threads(want)
    if retain_freed_memory:
        _retain_freed_memory()
    return torch.get_num_threads()


_warned_spinning = False


def warn_if_openmp_spins() -> bool:
    """Log once (and return True) where OpenMP was loaded without
    ``OMP_WAIT_POLICY=PASSIVE`` in the environment: its threads then spin after
    every parallel region, on the cores encdec's C kernels' threads need.
    Measured (copy-task BART, 512 documents, 2 cores): 0.78 -> 1.49 s in waves of
    64, 1.36 -> 2.38 s with 64 in flight. The policy is read once, when torch
    loads its runtime, so nothing can change it now. (An environment set to
    PASSIVE after that load is not caught.)"""
    global _warned_spinning
    if _warned_spinning or os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE" or not _openmp_loaded():
        return False
    _warned_spinning = True
    logger.warning("torch's OpenMP threads spin between parallel regions (OMP_WAIT_POLICY is not PASSIVE), "
                   "taking the cores encdec's CPU kernels run on: up to 2x slower steps. Set "
                   "OMP_WAIT_POLICY=PASSIVE in the environment, or call encdec.configure_cpu_runtime() "
                   "before torch is imported.")
    return True

