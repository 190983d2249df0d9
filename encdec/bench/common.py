"""Shared benchmark plumbing: thread and allocator settings applied to both sides, a
monitor of other processes' CPU use (this machine is shared), and busy processes
to time every side under the same competing load (``--background-load N``)."""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

# Both sides run in this process, so these apply to our engine and HF alike.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# Knobs that cap the ISA each library uses, to emulate a smaller host on this one
# (both sides: ours and HF). Each is read when its library first runs, so set
# them in the environment before starting the benchmark.
# The checkout's shipped clips (tests/data/speech); an installed package has none.
SPEECH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "data", "speech")

ISA_KNOBS = ("ENCDEC_CPU_ISA", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")


def isa_header() -> str:
    """The host's ISA, the C kernels' path and torch's vector path, plus any ISA
    knob set, as a header line: timings mean little without them."""
    import torch

    from encdec.kernels.cpu import build

    host = "avx512f" if "avx512f" in build.cpu_flags() else "avx2" if "avx2" in build.cpu_flags() else "neither"
    knobs = [f"{k}={os.environ[k]}" for k in ISA_KNOBS if os.environ.get(k)]
    line = (f"host ISA: {host} (/proc/cpuinfo); encdec C kernels: {build.cpu_isa()}; "
            f"torch CPU capability: {torch.backends.cpu.get_cpu_capability()}"
            + (f"; knobs: {' '.join(knobs)}" if knobs else ""))
    if knobs and host == "avx512f" and not os.environ.get("MKL_ENABLE_INSTRUCTIONS"):
        # HF's nn.Linear runs MKL sgemm, ours oneDNN: capping only oneDNN leaves
        # HF on AVX-512 GEMMs an AVX2-only host does not have.
        line += "\nwarning: MKL_ENABLE_INSTRUCTIONS unset, so MKL (HF's linears) still uses AVX-512"
    return line


def allocator_for_both_sides() -> str:
    """Our engine makes glibc keep freed memory process-wide when it starts
    (``encdec.platform.host_allocator``); apply it before either side runs so HF
    gets it on every repeat too. ``ENCDEC_RETAIN_FREED_MEMORY=0`` turns it off
    for both. Returns a line for the header."""
    from encdec.platform.host_allocator import retain_freed_memory

    return f"glibc keeps freed memory (both sides): {'yes' if retain_freed_memory() else 'no'}"


class OtherCPUMonitor:
    """Samples the CPU use of every process but this one and its children (the
    ``background_load`` it started) while a block runs."""

    def __init__(self, interval: float = 0.5):
        self.interval = interval
        self.samples: list[float] = []
        self._stop = threading.Event()

    def _run(self) -> None:
        import psutil

        me = os.getpid()
        procs = {}
        while not self._stop.is_set():
            total = 0.0
            ours = {me, *(c.pid for c in psutil.Process(me).children(recursive=True))}
            for p in psutil.process_iter(["pid"]):
                if p.pid in ours:
                    continue
                proc = procs.setdefault(p.pid, p)
                try:
                    total += proc.cpu_percent(None)
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    procs.pop(p.pid, None)
            self.samples.append(total)
            self._stop.wait(self.interval)

    def __enter__(self) -> OtherCPUMonitor:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def mean(self) -> float:
        s = self.samples[1:] or [0.0]  # the first sample of each process reads 0
        return sum(s) / len(s)

    def summary(self) -> str:
        s = self.samples[1:] or [0.0]
        return f"other processes' CPU: mean {sum(s) / len(s):.0f}%, max {max(s):.0f}% (100% = one core)"


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def add_background_load_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--background-load", type=int, default=0, metavar="N",
                    help="also time every side with N busy processes running (python -c 'while True: "
                         "pass', one core each), beside the idle figures")


def load_levels(busy: int) -> list[int]:
    """The background loads to time each side under: idle, then ``busy`` processes if any."""
    if busy < 0:
        raise ValueError(f"--background-load must be >= 0, got {busy}")
    return [0, busy] if busy else [0]


def load_label(busy: int) -> str:
    return "idle" if not busy else f"+{busy} busy"


@contextlib.contextmanager
def background_load(n: int) -> Iterator[list[int]]:
    """``n`` busy processes (one core's worth each) for the block's duration; they
    are killed by pid when it ends, however it ends. Yields their pids."""
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        time.sleep(0.2 if n else 0)  # running before the timed block starts
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def timed_with_load(fn, busy: int = 0):
    """``(fn(), wall seconds, other processes' mean CPU % meanwhile)``, with ``busy``
    busy processes of our own running meanwhile (not counted as others)."""
    with background_load(busy), OtherCPUMonitor() as cpu:
        t = time.perf_counter()
        result = fn()
        dt = time.perf_counter() - t
    return result, dt, cpu.mean()


def warmup_prompts(enc: list[list[int]], n: int = 2) -> list:
    """Token prompts for an untimed warm-up: the first ``n`` inputs less their
    first token. The timed run's own prompts would sit in our encoder cache
    and skip their encoder pass, which the baselines have no match for."""
    from encdec import TokensPrompt

    return [TokensPrompt(prompt_token_ids=e[1:]) for e in enc[:n]]


def bart_base_dir() -> str:
    """A random BART of bart-base's dims (the ones ``benchmarks/bart_bench.py``
    uses), written once to the temp dir and reused."""
    import tempfile

    from encdec.testing import make_random_bart

    model_dir = os.path.join(tempfile.gettempdir(), "encdec_bench_bart_base")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        make_random_bart(model_dir, vocab_size=50265, d_model=768, layers=6, heads=12, ffn=3072,
                         max_positions=1024, init_std=0.02, position_std=0.02)
    return model_dir


def stream_gaps(engine: Any, streams: list[str], stream_tokens: int, arrive: Callable[[], None]) -> dict:
    """Lets work arrive (``arrive``), then steps ``engine`` until every request
    has finished, timing each of the ``streams`` requests' waits between new
    output tokens: what a streaming client sees while other work is admitted.
    Returns every request's tokens, the seconds, the waits' median, p99 and
    max, and other processes' CPU meanwhile."""
    sched = engine.scheduler
    done: dict[str, list[int]] = {}
    last = {r: (sched.get_seq_group(r).seqs[0].get_output_len(), time.perf_counter()) for r in streams}
    gaps: list[float] = []
    with OtherCPUMonitor() as mon:
        t0 = time.perf_counter()
        arrive()
        while engine.has_unfinished_requests():
            for out in engine.step():
                done[out.request_id] = list(out.outputs[0].token_ids)
            now = time.perf_counter()
            for r in streams:
                group = sched.get_seq_group(r)
                n = group.seqs[0].get_output_len() if group is not None else stream_tokens
                if r in last and n > last[r][0]:
                    gaps.append(now - last[r][1])
                    last[r] = (n, now)
                if group is None:
                    last.pop(r, None)
        seconds = time.perf_counter() - t0
    gaps.sort()
    return dict(tokens=[done[k] for k in sorted(done)], seconds=seconds, median=statistics.median(gaps),
                mean=statistics.fmean(gaps),
                p99=gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], max=gaps[-1], other_cpu=mon.summary())
