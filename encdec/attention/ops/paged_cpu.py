"""Builds and calls ``paged_attention_cpu.c``: decode attention straight from
the paged cache, so no step copies a sequence's keys and values.

The C file is compiled once per machine with the system C compiler into
``$ENCDEC_CACHE_DIR`` (default ``~/.cache/encdec``) and loaded with ctypes (no
torch headers, a one-second build). Where no compiler works, ``available()``
is False and the torch backend gathers instead (logged once).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache

import torch

logger = logging.getLogger(__name__)

_SRC = os.path.join(os.path.dirname(__file__), "paged_attention_cpu.c")
# -fopenmp links libgomp.so.1; in a process where torch already loaded its own
# libgomp.so.1 the loader reuses that one, so both share one thread pool.
_FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=gnu99", "-fopenmp", "-lm"]


def _cache_dir() -> str:
    return os.environ.get("ENCDEC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "encdec")


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if os.environ.get("ENCDEC_DISABLE_C_KERNELS") == "1":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        logger.warning("no C compiler found: CPU decode attention gathers KV (slower)")
        return None
    src = open(_SRC, "rb").read()
    key = hashlib.sha256(src + " ".join(_FLAGS).encode() + platform.machine().encode()).hexdigest()[:16]
    path = os.path.join(_cache_dir(), f"paged_attention_cpu_{key}.so")
    if not os.path.exists(path):
        tmp = ""
        try:
            os.makedirs(_cache_dir(), exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=_cache_dir())
            os.close(fd)
            subprocess.run([cc, _SRC, "-o", tmp, *_FLAGS], check=True, capture_output=True, timeout=120)
            os.replace(tmp, path)  # atomic: concurrent builders each install a whole file
        except (subprocess.SubprocessError, OSError) as e:
            detail = getattr(e, "stderr", b"") or b""
            logger.warning("building the CPU attention kernel failed (%s %s): decode attention "
                           "gathers KV (slower)", e, detail.decode(errors="replace")[:500])
            if tmp and os.path.exists(tmp):
                os.unlink(tmp)
            return None
    lib = ctypes.CDLL(path)
    fn = lib.paged_attention_decode_f32
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, p, p, p, p, i64, p, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    fn.restype = None
    return lib


def available() -> bool:
    return _library() is not None


def paged_decode_attention(
    q: torch.Tensor,  # (num_seqs, num_heads, head_size) float32, contiguous
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_size) float32, contiguous
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int32, contiguous
    seq_lens: torch.Tensor,  # (num_seqs,) int32
    scale: float,
) -> torch.Tensor:  # (num_seqs, num_heads, head_size)
    lib = _library()
    assert lib is not None and q.dtype == torch.float32 and q.device.type == "cpu"
    q = q.contiguous()
    out = torch.empty_like(q)
    num_seqs, num_heads, head_size = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    lib.paged_attention_decode_f32(
        out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
        num_seqs, num_heads, num_kv_heads, head_size, block_size, scale, torch.get_num_threads())
    return out
