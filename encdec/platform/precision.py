"""Whether a reduced precision (``dtype="bfloat16"`` or ``"float16"``) pays on
this CPU, decided by measuring it, not by CPU flags.

The rule, the same for both dtypes: on CPU a reduced dtype is refused (a
ValueError giving the measured factor) where the engine runs it slower than
float32 end to end, and accepted where it runs faster. A reduced precision
that is not faster only costs accuracy. Flags do not decide it: oneDNN's bf16
matmul is faster than float32 on some AVX512-BF16 CPUs without AMX and slower
on others, float16 has no fast CPU path in torch, and a faster matmul does
not make a faster engine (the float32 C kernels decline the other dtypes).

The measurement (``precision_probe``, in a child process): the engine itself,
float32 and the reduced dtype alternating, greedy decoding on a small random
model of Whisper tiny's widths; seconds. It runs at ``encdec build-kernels`` (set-up,
bfloat16) or at the first use of a reduced dtype on CPU, saying so once, and
is kept in ``<kernel cache>/precision.json`` (``$ENCDEC_CACHE_DIR``), keyed by
the CPU's model name, torch's version, the thread count, oneDNN's ISA cap and
the kernels' ISA, so each host measures once per setting.
``$ENCDEC_PRECISION_RATIOS`` (``"bfloat16=0.4,float16=6"``: each dtype's time
over float32's) gives the result instead of measuring (tests; a host that
wants a fixed answer).
"""
from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time

import torch

from encdec.kernels.cpu.build import cache_dir, cpu_isa

logger = logging.getLogger(__name__)

RATIOS_ENV = "ENCDEC_PRECISION_RATIOS"
REDUCED = (torch.bfloat16, torch.float16)
# Part of the cache key: a new measurement method does not read an older one's figures.
PROBE_VERSION = "engine-1"
# The probe's wall time on 2 idle cores of an AMD EPYC, for the one-time notice.
PROBE_SECONDS = {torch.bfloat16: 8, torch.float16: 10}
PROBE_TIMEOUT_S = 600
# What the factor in a refusal was measured on (``precision_probe`` says it in full).
PROBE_WORKLOAD = "greedy decoding by the engine, a small random BART of Whisper tiny's widths"
_lock = threading.Lock()
# (host key, dtype) -> (time ratio, "cached" or "measured"), known in this process
_measured: dict[tuple[str, str], tuple[float, str]] = {}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_key() -> str:
    """What a measurement holds for: CPU model, torch version, threads, oneDNN's ISA cap,
    the C kernels' ISA and the probe's method."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "-"
    onednn = os.environ.get("ENCDEC_ONEDNN", "1")
    kernels = "off" if os.environ.get("ENCDEC_DISABLE_C_KERNELS") == "1" else cpu_isa()
    return f"{cpu_model()} | torch {torch.__version__} | {torch.get_num_threads()} threads | isa cap {cap} | " \
           f"onednn {onednn} | kernels {kernels} | probe {PROBE_VERSION}"


def cache_file() -> str:
    return os.path.join(cache_dir(), "precision.json")


def _given(name: str) -> float | None:
    """The ratio ``$ENCDEC_PRECISION_RATIOS`` gives for ``name``; ValueError if malformed."""
    text = os.environ.get(RATIOS_ENV, "").strip()
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        try:
            ratio = float(value) if sep else -1.0
        except ValueError:
            ratio = -1.0
        if ratio <= 0:
            raise ValueError(f"{RATIOS_ENV} must read like 'bfloat16=0.4,float16=6' (positive time ratios), "
                             f"got {text!r}")
        if key.strip() == name:
            return ratio
    return None


def _read_cache() -> dict:
    try:
        with open(cache_file()) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(key: str, name: str, ratio: float) -> None:
    """Add one measurement to the cache file (whole-file replace: readers never see half)."""
    data = _read_cache()
    data.setdefault(key, {})[name] = ratio
    folder = os.path.dirname(cache_file())
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=folder)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, cache_file())
    except OSError as e:  # a read-only cache: measure again next process
        logger.debug("cannot keep the precision measurement in %s: %s", cache_file(), e)


def probe(dtype: torch.dtype) -> float:
    """``dtype``'s time over float32's, the engine end to end on torch's current
    thread count, measured by ``precision_probe`` in a child process (it builds
    engines, and the engine imports this module: no import cycle, and none of
    its memory stays in the caller's process)."""
    cmd = [sys.executable, "-m", "encdec.platform.precision_probe", _name(dtype),
           "--threads", str(torch.get_num_threads())]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    words = done.stdout.split()
    if done.returncode != 0 or not words:
        raise RuntimeError(f"measuring {_name(dtype)} on this CPU failed ({' '.join(cmd)}: exit "
                           f"{done.returncode}): {done.stderr.strip()[-2000:]}")
    return float(words[-1])


def time_ratio(dtype: torch.dtype, *, notice: bool = True) -> tuple[float, str]:
    """``dtype``'s time over float32's on this CPU (< 1: faster) and where the figure
    came from ("given", "cached", "measured"); ``notice``: say so (a warning) before
    a measurement, which takes seconds."""
    name = _name(dtype)
    given = _given(name)
    if given is not None:
        return given, "given"
    key = host_key()
    with _lock:  # one probe per process and setting, however many engines start at once
        if (key, name) in _measured:
            return _measured[key, name]
        cached = _read_cache().get(key, {}).get(name)
        if isinstance(cached, (int, float)) and cached > 0:
            _measured[key, name] = float(cached), "cached"
            return float(cached), "cached"
        if notice:
            logger.warning("measuring whether %s pays on this CPU, one time, ~%d s; `encdec build-kernels` does "
                           "it at set-up", name, PROBE_SECONDS[dtype])
        t0 = time.perf_counter()
        ratio = probe(dtype)
        logger.info("dtype=%r on this CPU: %.2fx float32's time (probe %.2f s, kept in %s)", name, ratio,
                    time.perf_counter() - t0, cache_file())
        _measured[key, name] = ratio, "measured"
        _write_cache(key, name, ratio)
        return ratio, "measured"


def check_cpu_dtype(device: torch.device, dtype: torch.dtype) -> None:
    """ValueError for a reduced ``dtype`` on a CPU where it runs slower than float32
    (``time_ratio`` > 1), the factor in the message; nothing for float32, other
    devices, or a reduced dtype that runs faster."""
    if device.type != "cpu" or dtype not in REDUCED:
        return
    ratio, source = time_ratio(dtype)
    if ratio > 1.0:
        how = {"given": f"as {RATIOS_ENV} gives it", "cached": f"as measured here before, {cache_file()}",
               "measured": "measured now"}[source]
        raise ValueError(
            f"dtype={_name(dtype)!r} runs {ratio:.1f}x slower than float32 on this CPU ({cpu_model()}, "
            f"{torch.get_num_threads()} threads; {PROBE_WORKLOAD}, {how}): "
            f"use dtype='float32' (exact) or quantization='int8'")
