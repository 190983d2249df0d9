"""Thread counts: never more than the cores the process can get (``available_cores``),
and one for small decode steps, where OpenMP's wake-up costs more than the work.

Under ``OMP_WAIT_POLICY=PASSIVE`` (the benchmarks' policy, on both sides) the
workers sleep between parallel regions, and waking them costs about 100 us
here. A decode step of a few rows is dozens of small matmuls and vocab-wide
elementwise ops, each a parallel region: on one thread they are faster. The
LM head (an 80 MB weight for Whisper tiny, read once a step) and the paged
attention over many rows' cross K/V stream memory, which one core does not
saturate: those keep the full count.
"""
from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Iterator
from functools import cache

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
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity call on this platform
        cores = os.cpu_count() or 1
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
