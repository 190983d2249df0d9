"""Keeps large freed host buffers in the process (glibc only).

glibc serves every allocation above its mmap threshold (at most 32 MiB) with
fresh ``mmap`` pages and unmaps them on free, so each large activation is
page-faulted and zeroed again every time it is made: Whisper's encoder makes
tensors of 37-150 MB per layer at batch 16, and the faults cost more than the
ops that fill them.

``retain_freed_memory`` makes glibc serve them from its heap and keep the
freed heap (``M_MMAP_MAX=0``, a 1 GiB ``M_TRIM_THRESHOLD``), the effect of a
caching allocator. It is process-wide, so everything else in the process
(HF models included) gets it too, and only programs apply it, through
``encdec.configure_cpu_runtime()`` (an ``LLM`` never does by itself); the cost
is that peak activation memory stays resident. ``ENCDEC_RETAIN_FREED_MEMORY=0`` turns it off; other processes
get the same with ``GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1073741824``.
Buffers that must stay lazily mapped (the KV cache) use ``mmap`` directly.
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_applied = False


def retain_freed_memory() -> bool:
    """Apply the setting once per process; True if it is in effect."""
    global _applied
    if _applied:
        return True
    if os.environ.get("ENCDEC_RETAIN_FREED_MEMORY", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # absent on musl and other libcs
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(_M_MMAP_MAX, 0) != 1 or mallopt(_M_TRIM_THRESHOLD, 1 << 30) != 1:
        return False
    _applied = True
    logger.info("glibc keeps freed host memory (ENCDEC_RETAIN_FREED_MEMORY=0 to turn off)")
    return True
