"""Compiles the C kernels in this folder once per machine and ISA, loads them
with ctypes, and gives each wrapper its contract (``Kernel``: ``available``,
``path``; see this package's docstring).

Hosts of one kind differ (some have AVX-512, some only AVX2+FMA), so each
kernel is built once per instruction set with explicit flags, never
``-march=native``: ``cpu_isa()`` picks the best one this CPU runs, or the one
``ENCDEC_CPU_ISA=avx512|avx2|none`` asks for (tests, benchmarks). Builds go to
``$ENCDEC_CACHE_DIR`` (default ``~/.cache/encdec``) under a name keyed by the
source's hash, the flags and the ISA, so a changed kernel rebuilds, a cache
shared between hosts never hands one a binary it cannot run, and concurrent
builders never see half a file. No torch headers: a kernel builds in about a
second (the fused decode step in a few).

``build_all`` compiles every kernel of one ISA that is not cached yet, in
parallel on the cores the process can get: ``encdec build-kernels`` runs it at
set-up, and the first ``load`` that finds its kernel unbuilt runs it too, so a
process compiles at most once per ISA and says so once (a WARNING, which an
unconfigured logger still prints: the first request is seconds slower).

Nothing here raises: a missing source, no compiler, a failed build or
``ENCDEC_DISABLE_C_KERNELS=1`` makes ``load`` return None (with a warning, once
per kernel and ISA) and callers run their torch path.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import Any

logger = logging.getLogger(__name__)

_DIR = os.path.dirname(__file__)
# No OpenMP: each kernel library shares its work through its own small pool of
# threads (team.h), whose waits spin briefly and then sleep, and whose caller
# never waits for a thread that has not started.
_FLAGS = ["-O3", "-shared", "-fPIC", "-std=gnu99", "-pthread", "-lm"]
# Best first. "none" builds for the compiler's baseline target (any CPU of this
# architecture); kernels without a portable vector path decline there.
ISA_FLAGS: dict[str, list[str]] = {
    "avx512": ["-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "none": [],
}
# /proc/cpuinfo flags an ISA needs (the kernel lists only what the OS enables).
_CPU_FLAGS = {
    "avx512": {"avx512f", "avx512dq", "avx512bw", "avx512vl", "avx2", "fma", "f16c"},
    "avx2": {"avx2", "fma", "f16c"},
    "none": set(),
}
ISA_ENV = "ENCDEC_CPU_ISA"
# A kernel's vector path -> the CPU flag its int8 dot products (vpdpbusd) need.
_VNNI_FLAGS = {"avx512": "avx512_vnni", "avx2": "avx_vnni"}


CACHE_ENV = "ENCDEC_CACHE_DIR"
# Seconds one kernel takes to build on one core, about (the notice's estimate;
# the fused decode step, which includes two other kernels, takes the most).
_BUILD_SECONDS = {"decoder_step_cpu.c": 3.5}
_DEFAULT_BUILD_SECONDS = 0.8
_build_lock = threading.Lock()  # one builder per process; processes race safely (os.replace)
_announced = False  # the one-time compile notice was given in this process


def cache_dir() -> str:
    """Where built kernels (and other per-host measurements) are kept:
    ``$ENCDEC_CACHE_DIR``, default ``~/.cache/encdec``."""
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "encdec")


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@cache
def host_isas() -> tuple[str, ...]:
    """The ISAs this CPU runs, best first; always ends with "none"."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ("none",)
    flags = cpu_flags()
    if not flags:  # no /proc/cpuinfo: ask torch, which reads CPUID itself
        import torch

        cap = torch.backends.cpu.get_cpu_capability().lower()
        flags = frozenset(_CPU_FLAGS["avx512"] if cap.startswith("avx512") else
                          _CPU_FLAGS["avx2"] if cap == "avx2" else ())
    return tuple(isa for isa, need in _CPU_FLAGS.items() if need <= flags)


@cache
def _resolve(requested: str | None) -> str:
    isas = host_isas()
    if requested is None or requested == "":
        return isas[0]
    if requested not in ISA_FLAGS:
        logger.warning("%s=%s is not one of %s: using %s", ISA_ENV, requested, "|".join(ISA_FLAGS), isas[0])
        return isas[0]
    if requested not in isas:
        logger.warning("%s=%s but this CPU lacks it (it runs %s): using %s", ISA_ENV, requested,
                       "|".join(isas), isas[0])
        return isas[0]
    return requested


def vnni_in_cpu(kernel_path: str) -> bool:
    """Whether this CPU runs the VNNI instructions a kernel's ``kernel_path``
    ("avx512", "avx2", "none", "torch") compiles them for: AVX512-VNNI for the
    AVX-512 build, AVX-VNNI for the AVX2 one; never for the others."""
    return _VNNI_FLAGS.get(kernel_path, "-") in cpu_flags()


def cpu_isa() -> str:
    """The instruction set the C kernels run with here: "avx512", "avx2" or "none"
    (the best this CPU runs unless ``ENCDEC_CPU_ISA`` asks for a lower one)."""
    return _resolve(os.environ.get(ISA_ENV))


def _local_includes(src: bytes, seen: frozenset[bytes] = frozenset()) -> list[bytes]:
    """The text of the files of this folder that ``src`` includes (``#include "x.c"``),
    and of what they include, so that a change to one rebuilds its includers too."""
    out = []
    for name in re.findall(rb'^\s*#\s*include\s+"([^"]+)"', src, flags=re.MULTILINE):
        if name in seen:
            continue
        seen = seen | {name}
        with open(os.path.join(_DIR, name.decode()), "rb") as f:
            text = f.read()
        out += [text, *_local_includes(text, seen)]
    return out


def sources() -> list[str]:
    """Every kernel source of this folder (``<name>_cpu.c``), sorted."""
    return sorted(f for f in os.listdir(_DIR) if f.endswith("_cpu.c"))


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def built_path(source: str, isa: str) -> str:
    """The cache file ``source`` built for ``isa`` is (or would be) kept in."""
    with open(os.path.join(_DIR, source), "rb") as f:
        src = f.read()
    flags = [*_FLAGS, *ISA_FLAGS[isa]]
    key = hashlib.sha256(b"\0".join([src, *_local_includes(src), " ".join(flags).encode(), isa.encode(),
                                     platform.machine().encode()])).hexdigest()[:16]
    return os.path.join(cache_dir(), f"{os.path.splitext(source)[0]}_{isa}_{key}.so")


def _compile(cc: str, source: str, isa: str) -> str | None:
    """Build ``source`` for ``isa`` into the cache; None, or why it failed."""
    tmp = ""
    try:
        path = built_path(source, isa)
        os.makedirs(cache_dir(), exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir())
        os.close(fd)
        subprocess.run([cc, os.path.join(_DIR, source), "-o", tmp, *_FLAGS, *ISA_FLAGS[isa]],
                       check=True, capture_output=True, timeout=120)
        os.replace(tmp, path)  # atomic: concurrent builders each install a whole file
        return None
    except (subprocess.SubprocessError, OSError) as e:
        detail = getattr(e, "stderr", b"") or b""
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)
        return f"{e} {detail.decode(errors='replace')[:500]}".strip()


def build_all(isa: str | None = None, *, notice: bool = True) -> dict[str, str | None]:
    """Compile every kernel not yet built for ``isa`` (default ``cpu_isa()``),
    in parallel; the kernels it compiled, each with None or why its build failed
    (empty: all were cached). Gives the one-time notice (``notice``) when it compiles.
    ValueError for an ISA this CPU does not run; RuntimeError without a compiler
    (or with ``ENCDEC_DISABLE_C_KERNELS=1``) where a kernel is missing."""
    global _announced
    isa = checked_isa(isa)
    with _build_lock:
        missing = [s for s in sources() if not os.path.exists(built_path(s, isa))]
        if not missing:
            return {}
        cc = _compiler()
        if os.environ.get("ENCDEC_DISABLE_C_KERNELS") == "1":
            raise RuntimeError("ENCDEC_DISABLE_C_KERNELS=1 turns the C kernels off")
        if cc is None:
            raise RuntimeError("no C compiler found (cc, gcc or $CC)")
        workers = max(1, min(len(missing), len(os.sched_getaffinity(0))))
        if notice and not _announced:
            _announced = True
            seconds = [_BUILD_SECONDS.get(s, _DEFAULT_BUILD_SECONDS) for s in missing]
            logger.warning("compiling CPU kernels (%s), one time, ~%.0f s; `encdec build-kernels` does it at set-up",
                           isa, max(max(seconds), sum(seconds) / workers))
        with ThreadPoolExecutor(workers) as pool:
            return dict(zip(missing, pool.map(lambda s: _compile(cc, s, isa), missing)))


@cache
def load(source: str, fallback: str, isa: str) -> ctypes.CDLL | None:
    """``source`` (a file name in this folder) compiled for ``isa``, or None;
    ``fallback`` says in the warning what runs instead. A kernel not built yet
    builds with every other missing one (``build_all``)."""
    if os.environ.get("ENCDEC_DISABLE_C_KERNELS") == "1":
        return None
    if _compiler() is None:
        logger.warning("no C compiler found for %s: %s", source, fallback)
        return None
    try:
        path = built_path(source, isa)
        error = None if os.path.exists(path) else build_all(isa).get(source)
        if error is None and not os.path.exists(path):  # built by another builder but since removed: once more
            error = _compile(_compiler() or "cc", source, isa)
        if error is not None:
            logger.warning("building %s for %s failed (%s): %s", source, isa, error, fallback)
            return None
        return ctypes.CDLL(path)
    except OSError as e:
        logger.warning("loading %s for %s failed (%s): %s", source, isa, e, fallback)
        return None


def load_function(source: str, name: str, argtypes: Sequence[Any], restype: Any,
                  fallback: str, *, isa: str | None = None) -> Any | None:
    """Function ``name`` of ``source`` built for ``isa`` (default ``cpu_isa()``)
    with its ctypes signature, or None."""
    lib = load(source, fallback, isa or cpu_isa())
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = list(argtypes), restype
    return fn


def vector_path(source: str, symbol: str, isa: str | None = None) -> str | None:
    """What the build of ``source`` for ``isa`` (default ``cpu_isa()``) says it runs,
    from its ``const char *symbol(void)``: "avx512", "avx2" or "none"; None if unbuilt."""
    lib = load(source, "", isa or cpu_isa())
    if lib is None:
        return None
    fn = getattr(lib, symbol)
    fn.restype = ctypes.c_char_p
    return fn().decode()


def checked_isa(isa: str | None) -> str:
    """``isa``, or ``cpu_isa()`` for None; a ValueError for one this CPU does not run."""
    if isa is None:
        return cpu_isa()
    if isa not in host_isas():
        raise ValueError(f"isa={isa!r}: this CPU runs only {host_isas()}")
    return isa


class Kernel:
    """One C entry point of this folder, built per ISA: the half of a wrapper's
    contract that is the same for every kernel. ``path(isa)`` is what the
    build for ``isa`` runs, as the build itself says (``path_symbol``):
    "avx512", "avx2", "none" (portable C), or "torch" where the kernel declines
    every call there (no build; ``portable=False`` and ``isa`` "none": the
    kernel has no portable path, or one slower than torch's)."""

    def __init__(self, source: str, symbol: str, argtypes: Sequence[Any], restype: Any, fallback: str, *,
                 path_symbol: str, portable: bool = True):
        self.source, self.symbol, self.argtypes, self.restype = source, symbol, argtypes, restype
        self.fallback, self.path_symbol, self.portable = fallback, path_symbol, portable
        self._functions: dict[str, Any] = {}
        self._paths: dict[str, str] = {}

    def function(self, isa: str | None = None) -> Any | None:
        """The ctypes function built for ``isa`` (default ``cpu_isa()``), or None where it declines."""
        isa = checked_isa(isa)
        if isa not in self._functions:
            self._functions[isa] = (load_function(self.source, self.symbol, self.argtypes, self.restype,
                                                  self.fallback, isa=isa)
                                    if self.portable or isa != "none" else None)
        return self._functions[isa]

    def path(self, isa: str | None = None) -> str:
        isa = checked_isa(isa)
        if isa not in self._paths:
            built = self.function(isa) is not None
            self._paths[isa] = (vector_path(self.source, self.path_symbol, isa) if built else None) or "torch"
        return self._paths[isa]

    def available(self, isa: str | None = None) -> bool:
        return self.path(isa) != "torch"
