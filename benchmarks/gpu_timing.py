"""What gpu_bench measures with: timed runs (the GPU synchronized around
them), each engine step's wall time, torch.profiler tables, and the engine
options a lease tries (``--engine``)."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def free_gpu() -> None:
    """Give the previous engine's or model's GPU memory back before the next one loads."""
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()


def sync() -> None:
    import torch

    torch.cuda.synchronize()


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """``fn()`` and its seconds, the GPU's queued work included at both ends."""
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


class StepClock:
    """Each engine step's wall time during one run, split into steps that
    admitted requests (their prefills run eagerly; Whisper's encoder is there)
    and decode-only ones (CUDA graph replays): on a lease the split says where
    a run's time went without a profiler's overhead. A step returns sampled
    tokens to the host, so its wall time includes its GPU work."""

    def __init__(self, llm: Any):
        self.engine = llm.llm_engine
        self.first_step = self.engine.scheduler.num_steps
        self.seconds: dict[int, float] = {}

    def run(self, fn: Callable[[], T]) -> T:
        eng, step = self.engine, self.engine.step

        def timed_step():
            n, t0 = eng.scheduler.num_steps, time.perf_counter()
            out = step()
            self.seconds[n] = time.perf_counter() - t0
            return out

        eng.step = timed_step  # an instance attribute: LLM.generate calls engine.step()
        try:
            return fn()
        finally:
            del eng.step

    def summary(self) -> str:
        admitted = {s for s in self.engine.stats.admitted_at_step.values() if s >= self.first_step}
        adm = [t for n, t in self.seconds.items() if n in admitted]
        dec = sorted(t for n, t in self.seconds.items() if n not in admitted)
        median = 1e3 * dec[len(dec) // 2] if dec else 0.0
        return (f"ours: {len(self.seconds)} steps in {sum(self.seconds.values()):.2f} s, "
                f"{len(adm)} admitting ({sum(adm):.2f} s), {len(dec)} decode-only "
                f"({sum(dec):.2f} s, median {median:.1f} ms)")


def profile_run(fn: Callable[[], Any], label: str) -> None:
    """Where a run's time goes, GPU kernels and host side: a bench line says how
    fast, this says why, in the same lease (GPU time is scarce)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        sync()
        wall = time.perf_counter() - t0
    table = prof.key_averages()
    for key in ("self_cuda_time_total", "self_cpu_time_total"):
        print(f"-- profile {label}, by {key} --")
        print(table.table(sort_by=key, row_limit=18, max_name_column_width=60))
    gpu = [e for e in table if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in gpu) / 1e6
    print(f"-- profile {label}: {sum(e.count for e in gpu)} GPU kernel launches, {busy:.2f} s of kernel time "
          f"in {wall:.2f} s (host-bound where far below; the profiler slows the host) --", flush=True)


def engine_options(pairs: list[str], error: Callable[[str], Any]) -> dict[str, Any]:
    """``KEY=VALUE`` words as LLM options; a value reads as an int, a float,
    true/false, else a string; ``error`` (argparse's) for a word without ``=``."""
    out = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            error(f"--engine takes KEY=VALUE, got {pair!r}")
        value: object = {"true": True, "false": False}.get(raw.lower(), raw)
        for kind in (int, float):
            try:
                value = kind(raw)
                break
            except ValueError:
                pass
        out[key] = value
    return out
