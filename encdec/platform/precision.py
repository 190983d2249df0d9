"""Whether a reduced precision (``dtype="bfloat16"`` or ``"float16"``) pays on
this CPU, decided by measuring it, not by CPU flags.

The rule, the same for both dtypes: on CPU a reduced dtype is refused (a
ValueError giving the measured factor) where the engine's ``Linear`` runs it
slower than float32, and accepted where it runs faster. A reduced precision
that is not faster only costs accuracy. Flags do not decide it: oneDNN's bf16
matmul is faster than float32 on some AVX512-BF16 CPUs without AMX and slower
on others, and float16 has no fast CPU path in torch.

The measurement (``time_ratio``): the engine's own ``Linear`` (prepacked for
oneDNN where it packs that dtype) over one Whisper-encoder-window shape,
float32 and the reduced dtype alternating, medians of a few calls; well under
a second. It runs at the first use of a reduced dtype on CPU and is kept in
``<kernel cache>/precision.json`` (``$ENCDEC_CACHE_DIR``), keyed by the CPU's
model name, torch's version, the thread count and oneDNN's ISA cap, so each
host measures once per setting. ``$ENCDEC_PRECISION_RATIOS``
(``"bfloat16=0.4,float16=6"``: each dtype's time over float32's) gives the
result instead of measuring (tests; a host that wants a fixed answer).
"""
from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import tempfile
import threading
import time

import torch

from encdec.kernels.cpu.build import cache_dir

logger = logging.getLogger(__name__)

RATIOS_ENV = "ENCDEC_PRECISION_RATIOS"
REDUCED = (torch.bfloat16, torch.float16)
# rows x in -> out: one encoder window of Whisper tiny's fc1 (the encoder's
# linears dominate a reduced dtype's gain or loss).
PROBE_SHAPE = (1500, 384, 1536)
# Timed calls per dtype, after one warm-up each: at least the first, more while the
# ratio is near 1 (a 5x slower float16 needs no third call to say so).
PROBE_REPEATS = (2, 5)
DECISIVE = (2 / 3, 1.5)
_lock = threading.Lock()
_measured: dict[tuple[str, str], float] = {}  # (host key, dtype) -> time ratio, this process


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
    """What a measurement holds for: CPU model, torch version, threads, oneDNN's ISA cap."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "-"
    onednn = os.environ.get("ENCDEC_ONEDNN", "1")
    return f"{cpu_model()} | torch {torch.__version__} | {torch.get_num_threads()} threads | isa cap {cap} | " \
           f"onednn {onednn}"


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
    """``dtype``'s time over float32's for the engine's ``Linear`` at ``PROBE_SHAPE``,
    on torch's current thread count (medians, the two alternating)."""
    from encdec.models.layers import Linear

    rows, n_in, n_out = PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, n_in, generator=gen)
    layers, inputs = {}, {}
    for dt in (torch.float32, dtype):
        layer = Linear(n_in, n_out).to(dt).requires_grad_(False)
        layer.pack()  # as the loader does: oneDNN-prepacked where it packs dt
        layers[dt], inputs[dt] = layer, x.to(dt)
    times: dict[torch.dtype, list[float]] = {torch.float32: [], dtype: []}
    ratio = 1.0
    with torch.inference_mode():
        for i in range(PROBE_REPEATS[1] + 1):
            for dt in (torch.float32, dtype):
                t0 = time.perf_counter()
                layers[dt](inputs[dt])
                if i:  # the first round warms up (oneDNN's primitive cache, pages)
                    times[dt].append(time.perf_counter() - t0)
            if i:
                ratio = statistics.median(times[dtype]) / statistics.median(times[torch.float32])
            if i >= PROBE_REPEATS[0] and not DECISIVE[0] < ratio < DECISIVE[1]:
                break
    return ratio


def time_ratio(dtype: torch.dtype) -> tuple[float, str]:
    """``dtype``'s time over float32's on this CPU (< 1: faster) and where the figure
    came from ("given", "cached", "measured")."""
    name = _name(dtype)
    given = _given(name)
    if given is not None:
        return given, "given"
    key = host_key()
    with _lock:  # one probe per process and setting, however many engines start at once
        if (key, name) in _measured:
            return _measured[key, name], "measured"
        cached = _read_cache().get(key, {}).get(name)
        if isinstance(cached, (int, float)) and cached > 0:
            _measured[key, name] = float(cached)
            return float(cached), "cached"
        t0 = time.perf_counter()
        ratio = probe(dtype)
        logger.info("dtype=%r on this CPU: %.2fx float32's time (probe %.2f s, kept in %s)", name, ratio,
                    time.perf_counter() - t0, cache_file())
        _measured[key, name] = ratio
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
            f"{torch.get_num_threads()} threads; a {PROBE_SHAPE[0]}x{PROBE_SHAPE[1]}->{PROBE_SHAPE[2]} linear, "
            f"{how}): use dtype='float32' (exact) or quantization='int8'")
