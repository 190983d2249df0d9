"""Compiles the C kernels in this folder once per machine and loads them with ctypes.

Each ``.c`` file is built with the system C compiler into ``$ENCDEC_CACHE_DIR``
(default ``~/.cache/encdec``), keyed by a hash of its source and flags, so a
changed kernel rebuilds and concurrent builders never see half a file. No
torch headers are involved: a build takes about a second. Where no compiler
works, or ``ENCDEC_DISABLE_C_KERNELS=1``, ``load`` returns None and callers use
their torch path (logged once per kernel).
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
from collections.abc import Sequence
from functools import cache
from typing import Any

logger = logging.getLogger(__name__)

_DIR = os.path.dirname(__file__)
# -fopenmp links libgomp.so.1; in a process where torch already loaded its own
# libgomp.so.1 the loader reuses that one, so both share one thread pool.
_FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=gnu99", "-fopenmp", "-lm"]


def _cache_dir() -> str:
    return os.environ.get("ENCDEC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "encdec")


@cache
def load(source: str, fallback: str) -> ctypes.CDLL | None:
    """The compiled ``source`` (a file name in this folder), or None; ``fallback``
    says in the warning what runs instead."""
    if os.environ.get("ENCDEC_DISABLE_C_KERNELS") == "1":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        logger.warning("no C compiler found for %s: %s", source, fallback)
        return None
    src_path = os.path.join(_DIR, source)
    with open(src_path, "rb") as f:
        src = f.read()
    key = hashlib.sha256(src + " ".join(_FLAGS).encode() + platform.machine().encode()).hexdigest()[:16]
    path = os.path.join(_cache_dir(), f"{os.path.splitext(source)[0]}_{key}.so")
    if not os.path.exists(path):
        tmp = ""
        try:
            os.makedirs(_cache_dir(), exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=_cache_dir())
            os.close(fd)
            subprocess.run([cc, src_path, "-o", tmp, *_FLAGS], check=True, capture_output=True, timeout=120)
            os.replace(tmp, path)  # atomic: concurrent builders each install a whole file
        except (subprocess.SubprocessError, OSError) as e:
            detail = getattr(e, "stderr", b"") or b""
            logger.warning("building %s failed (%s %s): %s", source, e,
                           detail.decode(errors="replace")[:500], fallback)
            if tmp and os.path.exists(tmp):
                os.unlink(tmp)
            return None
    return ctypes.CDLL(path)


def load_function(source: str, name: str, argtypes: Sequence[Any], restype: Any,
                  fallback: str) -> Any | None:
    """Function ``name`` of the compiled ``source`` with its ctypes signature, or None."""
    lib = load(source, fallback)
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = list(argtypes), restype
    return fn
