"""Thread counts: never more than the cores the process can get (``available_cores``),
and one for small decode steps, where OpenMP's wake-up costs more than the work.

Under ``OMP_WAIT_POLICY=PASSIVE`` (the benchmarks' policy, on both sides) the
workers sleep between parallel regions, and waking them is costly. A decode step
of a few rows is dozens of small matmuls and vocab-wide elementwise ops, each a
parallel region: those run on one thread (``single_thread``, up to
``SMALL_STEP_ROWS``). Kernels that stream memory one core does not saturate (the
LM head, paged attention over many rows' cross K/V: ``bandwidth_threads``) keep
the full count.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import itertools
import math
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from functools import cache
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

# Decode steps of at most this many rows run their decoder layers and logits
# rules on one thread. Under OMP_WAIT_POLICY=PASSIVE every parallel region
# wakes the sleeping workers (~100 us here), which costs more than the work of
# a 1-16 row matmul: packed 384x1536 at 1 row, 169 us on 2 threads vs 83 us on
# one; 512x2048 at 8 rows, 278 vs 197 us; at 32 rows 2 threads win (packed
# Linear timed alone, AMD EPYC, AVX-512). Whisper tiny.en, one long file: a
# batch-1 decode step 16.2 -> 12.1 ms; batch 8, 23.9 -> 20.0 ms.
SMALL_STEP_ROWS = 16
# Paged decode attention over at least this many rows keeps the full count.
BANDWIDTH_MIN_SEQS = 2


_outer = threading.local()  # the thread count single_thread() set aside, per Python thread
_CGROUP_ROOT = "/sys/fs/cgroup"


def cgroup_cpu_limit(proc_cgroup: str, root: str = _CGROUP_ROOT) -> float | None:
    """The CPU quota, in cores, of the cgroup that ``proc_cgroup`` (the text of
    /proc/self/cgroup) names and of its ancestors, whichever is lowest: cgroup
    v2 ``cpu.max`` ("QUOTA PERIOD" or "max PERIOD") under ``root``, or v1
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1: none) under
    ``root/cpu`` or ``root/cpu,cpuacct``. None where no quota is set or none
    can be read."""
    limits = []
    for line in proc_cgroup.splitlines():
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":
            dirs, read = [root, os.path.join(root, "unified")], _v2_limit
        elif "cpu" in controllers.split(","):
            dirs, read = [os.path.join(root, controllers), os.path.join(root, "cpu")], _v1_limit
        else:
            continue
        parts = [p for p in path.strip().split("/") if p]
        for base in dirs:
            for depth in range(len(parts), -1, -1):  # the cgroup, then each ancestor
                limit = read(os.path.join(base, *parts[:depth]))
                if limit is not None:
                    limits.append(limit)
    return min(limits, default=None)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _v2_limit(folder: str) -> float | None:
    fields = (_read(os.path.join(folder, "cpu.max")) or "max").split()
    return None if fields[0] == "max" or len(fields) < 2 else int(fields[0]) / int(fields[1])


def _v1_limit(folder: str) -> float | None:
    quota, period = _read(os.path.join(folder, "cpu.cfs_quota_us")), _read(os.path.join(folder, "cpu.cfs_period_us"))
    if quota is None or period is None or int(quota) <= 0:
        return None
    return int(quota) / int(period)


@cache
def available_cores() -> int:
    """How many threads of this process can run at once: the CPUs its affinity
    allows (taskset, a container's cpuset), capped by its cgroup's CPU quota
    rounded up (``cgroup_cpu_limit``; a container given 1.5 CPUs runs 2). Read
    once per process. Threads past this only wait for each other: a kernel
    whose threads meet each phase runs at the pace of one that is off its core."""
    cores = len(_affinity()) or os.cpu_count() or 1
    quota = cgroup_cpu_limit(_read("/proc/self/cgroup") or "")
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)


def kernel_threads(requested: int | None = None) -> int:
    """Threads for one C kernel call: ``requested`` (default torch's count), at
    most ``available_cores()``."""
    if requested is None:
        import torch

        requested = torch.get_num_threads()
    return max(1, min(requested, available_cores()))


@contextlib.contextmanager
def single_thread(enabled: bool = True) -> Iterator[None]:
    """Run the block on one intra-op thread, then restore the count. A no-op
    when ``enabled`` is False or torch already runs one thread. torch's count
    is process-wide: torch work on other Python threads meanwhile (a server's
    word alignment) runs on one thread too, for the few ms of a step. Kernels bound
    by memory bandwidth, not by the wake-up, may still ask for the count set
    aside (``bandwidth_threads``)."""
    import torch

    n = torch.get_num_threads()
    if not enabled or n == 1:
        yield
        return
    torch.set_num_threads(1)
    _outer.threads = n
    try:
        yield
    finally:
        _outer.threads = None
        torch.set_num_threads(n)


def bandwidth_threads() -> int:
    """Threads for a kernel that streams much memory per call (paged decode
    attention over many rows' cross K/V: 4.6 MB per row and layer for Whisper
    tiny): torch's count, or inside ``single_thread`` the count it set aside.
    One core does not saturate memory bandwidth; two do. At most ``available_cores()``."""
    return kernel_threads(getattr(_outer, "threads", None))


# --- items on threads of one intra-op thread each ----------------------------

_pools: dict[tuple[int, int], concurrent.futures.ThreadPoolExecutor | None] = {}
_pools_lock = threading.Lock()


def map_one_thread_each(fn: Callable[[T], R], items: Sequence[T], workers: int) -> list[R] | None:
    """``[fn(item) for item in items]``, computed on ``workers`` threads that run
    torch (and our C kernels) on one intra-op thread each, every item taken by
    whichever thread is free next; the results in ``items``' order. None, with
    nothing run, where that cannot be had: fewer items than workers, one worker,
    a call from a pool thread itself (it would wait for its own pool), or a torch
    whose intra-op count cannot be set per thread (``omp_set_num_threads``).

    Why: an op split over all threads (oneDNN's GEMMs split each matmul in fixed
    parts) runs at the pace of its slowest thread, so a core taken by another
    process slows every op to about half speed. Whole items taken by free
    threads leave the busy core fewer of them. Measured (AMD EPYC, AVX-512, 2
    threads, tiny.en's encoder over 20 windows, medians of 4 alternating): idle
    4.46 s batched on 2 threads, 4.69 s one window per thread; beside one
    `while True: pass` process 6.63 s (1.49x idle) against 5.85 s (1.25x).
    End to end, whisper_bench's 32 clips (the engine's, one process alternating,
    medians of 3): idle 8.74 -> 8.73 s and, another run, 9.87 -> 9.54 s (the
    frontend's constant tail is now cut per window); with one busy process
    14.85 -> 12.46 s.

    Where the workers are as many as the caller's CPUs, each pool thread is kept
    on a CPU of its own (``_place``): three busy threads on two cores otherwise
    share them evenly as the kernel moves them about (ours get 4/3 of a core's
    time), where kept apart the busy process shares one core with one of ours
    (ours get 3/2). Unpinned, the same run took 1.47x its idle time. With CPUs
    to spare they go where the kernel puts them (two processes pinning to the
    same few CPUs of many would share those and leave the rest idle)."""
    if workers <= 1 or len(items) < workers or hasattr(_worker, "index"):
        return None
    pool = _pool(workers)
    if pool is None:
        return None
    import torch

    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()
    cpus = _affinity()
    futures = [pool.submit(_on_one_thread, fn, item, inference, grad, cpus, len(cpus) == workers) for item in items]
    try:
        return [f.result() for f in futures]
    except BaseException:
        for f in futures:  # none left running behind the caller's back
            f.cancel()
        concurrent.futures.wait(futures)
        raise


_worker = threading.local()  # a pool thread's index in its pool, and the CPUs it may run on


def _on_one_thread(fn: Callable[[T], R], item: T, inference: bool, grad: bool, cpus: list[int], pin: bool) -> R:
    import torch

    if cpus:
        _place({cpus[_worker.index % len(cpus)]} if pin else set(cpus))
    with torch.inference_mode() if inference else torch.set_grad_enabled(grad):
        return fn(item)


def _pool(workers: int) -> concurrent.futures.ThreadPoolExecutor | None:
    """The ``workers``-thread pool of this process, started on first use (a
    forked child starts its own: the parent's threads are not in it), or None
    where a thread's intra-op count cannot be made one."""
    key = (os.getpid(), workers)
    with _pools_lock:
        if key not in _pools:
            pool = None
            if omp_set_num_threads() is not None:
                pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="encdec-item",
                                                             initializer=_start_worker, initargs=(itertools.count(),))
                if not pool.submit(_intra_op_threads).result():
                    pool.shutdown()
                    pool = None
            _pools[key] = pool
        return _pools[key]


def _start_worker(indices: Iterator[int]) -> None:
    """A pool thread's set-up: its index, and one intra-op thread for its life
    (OpenMP's count is per thread; nothing on this thread sets it again)."""
    import torch

    _worker.index, _worker.cpus = next(indices), None
    torch.get_num_threads()  # torch's own per-thread set-up first: it sets the process's count
    omp_set_num_threads()(1)


def _affinity() -> list[int]:
    """The CPUs this thread may run on, sorted; [] where the platform has no affinity call."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return []


def _place(cpus: set[int]) -> None:
    """This thread on ``cpus`` (from the caller's mask, which may have changed
    since the last item). A refused call leaves the thread where it is."""
    if _worker.cpus != cpus:
        try:
            os.sched_setaffinity(0, cpus)  # 0: this thread (Linux sets each thread's own mask)
        except OSError:
            pass
        _worker.cpus = cpus


def _intra_op_threads() -> bool:
    import torch

    return torch.get_num_threads() == 1


@cache
def omp_set_num_threads() -> Callable[[int], None] | None:
    """``omp_set_num_threads`` of the OpenMP runtime torch's intra-op work runs
    on (the libgomp its Linux wheels ship), or None where torch's backend is not
    OpenMP or no runtime is loaded. OpenMP keeps the count per thread, so it sets
    this thread's torch, oneDNN and C-kernel count (``kernel_threads``) alone;
    ``torch.set_num_threads`` would also set process-wide ones (MKL's, and the
    count torch gives each new thread)."""
    import torch

    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        with open("/proc/self/maps") as f:
            paths = {fields[5] for fields in map(str.split, f) if len(fields) > 5 and fields[5].startswith("/")}
    except OSError:
        return None
    runtimes = [p for p in paths if os.path.basename(p).startswith(("libgomp", "libiomp5", "libomp"))]
    torch_dir = os.path.dirname(torch.__file__)
    runtimes.sort(key=lambda p: (not p.startswith(torch_dir), p))  # torch's own first
    for path in runtimes:
        try:
            fn = ctypes.CDLL(path).omp_set_num_threads
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], None
        return fn
    return None
