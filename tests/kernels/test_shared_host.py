"""The kernels on a host whose cores are not all ours: with more threads than
the process can run at once and a busy sibling process taking a core, a whole
decoder step and an LM-head-sized matmul give the one-thread result, bit for
bit, in a time bounded by a generous multiple of their idle time (a thread
that waits spins briefly, then sleeps, and work goes to whichever thread is
free: see encdec/kernels/cpu/team.h)."""
from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from encdec.testing import jitter_layer_norms
from encdec.kernels.cpu import decoder_step_cpu, small_linear_cpu
from encdec.platform.cpu_threads import available_cores

OVERSUBSCRIBED = 4 * available_cores()
# Bound on a loaded run against the idle one-thread run: generous, as the host
# may be shared with other work; the old spinning barrier ran ~100x slower.
SLOWDOWN, SLACK_S = 30, 1.0


@contextlib.contextmanager
def busy_sibling():
    """A process spinning on one core until the block ends (killed by its pid)."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def timed(fn, repeats: int) -> tuple[list, float]:
    outs, t = [], time.perf_counter()
    for _ in range(repeats):
        outs.append(fn())
    return outs, time.perf_counter() - t


def whisper_tiny_layers(num_layers: int = 2):
    from encdec.attention.backends.torch_sdpa import TorchSDPABackend
    from encdec.models.whisper import WhisperDecoderLayer

    torch.manual_seed(0)
    cfg = SimpleNamespace(d_model=384, decoder_attention_heads=6, decoder_ffn_dim=1536)
    layers = [WhisperDecoderLayer(cfg, TorchSDPABackend) for _ in range(num_layers)]
    jitter_layer_norms(layers)
    return layers


@pytest.mark.skipif(not decoder_step_cpu.available(), reason="no C compiler here")
@torch.inference_mode()
def test_decoder_step_oversubscribed_under_load_matches_one_thread(monkeypatch):
    layers = whisper_tiny_layers()
    weights = decoder_step_cpu.decoder_weights(layers)
    assert weights is not None
    g = torch.Generator().manual_seed(1)
    rows, block, cross_len = 5, 16, 1500
    n_cross, n_self = -(-cross_len // block), 4
    caches = [torch.randn(2, 2 * n_cross + rows * n_self, block, 6, 64, generator=g) for _ in layers]
    cross = torch.tensor([[i % 2 * n_cross + j for j in range(n_cross)] for i in range(rows)], dtype=torch.int32)
    self_t = torch.tensor([[2 * n_cross + i * n_self + j for j in range(n_self)] for i in range(rows)],
                          dtype=torch.int32)
    self_lens = torch.tensor([1, 17, 40, 64, 33], dtype=torch.int32)
    cross_lens = torch.full((rows,), cross_len, dtype=torch.int32)
    slots = (self_t[torch.arange(rows), (self_lens.long() - 1) // block].long() * block
             + (self_lens.long() - 1) % block)
    h0 = torch.randn(rows, 384, generator=g)

    def step(threads: int):
        monkeypatch.setattr(decoder_step_cpu, "bandwidth_threads", lambda: threads)
        h, kv = h0.clone(), [c.clone() for c in caches]
        assert decoder_step_cpu.decode_step(h, weights, kv, slots, self_t, self_lens, cross, cross_lens) is h
        return h, kv

    def many(threads: int, n: int = 10):  # n steps on the same caches, timed
        monkeypatch.setattr(decoder_step_cpu, "bandwidth_threads", lambda: threads)
        h = h0.clone()
        return timed(lambda: decoder_step_cpu.decode_step(h, weights, caches, slots, self_t, self_lens, cross,
                                                          cross_lens), n)[1]

    ref_h, ref_kv = step(1)
    idle = min(many(1) for _ in range(2))
    with busy_sibling():
        h, kv = step(OVERSUBSCRIBED)
        loaded = many(OVERSUBSCRIBED)
    assert torch.equal(h, ref_h) and all(torch.equal(a, b) for a, b in zip(kv, ref_kv))
    assert torch.equal(step(2)[0], ref_h)
    assert loaded < SLOWDOWN * idle + SLACK_S, (loaded, idle)


@pytest.mark.skipif(not small_linear_cpu.available(), reason="no C compiler here")
def test_lm_head_matmul_oversubscribed_under_load_matches_one_thread(monkeypatch):
    g = torch.Generator().manual_seed(2)
    n, k = 51865, 384  # Whisper tiny's LM head
    panels = small_linear_cpu.pack(torch.randn(n, k, generator=g))
    x = torch.randn(8, k, generator=g)

    def run(threads: int, repeats: int = 5):
        monkeypatch.setattr(small_linear_cpu, "kernel_threads", lambda requested: threads)
        outs, seconds = timed(lambda: small_linear_cpu.small_linear(x, panels, n, None), repeats)
        return outs[0], seconds

    ref, _ = run(1, 1)
    idle = min(run(1)[1] for _ in range(2))
    with busy_sibling():
        out, loaded = run(OVERSUBSCRIBED)
    assert torch.equal(out, ref)
    assert loaded < SLOWDOWN * idle + SLACK_S, (loaded, idle)


@pytest.mark.skipif(not small_linear_cpu.available(), reason="no C compiler here")
def test_a_forked_child_runs_kernels_on_its_own_pool():
    """A kernel library's pool threads are not copied by fork(): a child (Ray's or
    multiprocessing's workers) starts its own and gets the same values."""
    import os

    g = torch.Generator().manual_seed(3)
    panels = small_linear_cpu.pack(torch.randn(300, 64, generator=g))
    x = torch.randn(8, 64, generator=g)
    ref = small_linear_cpu.small_linear(x, panels, 300, None, threads=1).numpy().tobytes()
    assert small_linear_cpu.small_linear(x, panels, 300, None, threads=2).numpy().tobytes() == ref  # pool up
    pid = os.fork()
    if pid == 0:  # the child: no torch op that could start an OpenMP pool, only the kernel
        threads_before = len(os.listdir("/proc/self/task"))
        same = small_linear_cpu.small_linear(x, panels, 300, None, threads=2).numpy().tobytes() == ref
        started = len(os.listdir("/proc/self/task")) > threads_before or available_cores() < 2
        os._exit(0 if same and started else 1 if not same else 2)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's kernel call did not return within 60 s")
    assert os.waitstatus_to_exitcode(done[1]) == 0, "1: other values, 2: no pool thread started in the child"


@pytest.mark.skipif(not small_linear_cpu.available(), reason="no C compiler here")
def test_pool_threads_are_kept_off_the_callers_cpu():
    """A kernel's pool threads may run on any CPU the caller may, except the
    one the caller is on (team.h's team_place_pool says why). Checked on a
    call the caller did not change CPU during."""
    import ctypes
    import os

    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("the caller may use one CPU only: nothing to keep the pool off")
    getcpu = ctypes.CDLL(None).sched_getcpu
    g = torch.Generator().manual_seed(4)
    panels = small_linear_cpu.pack(torch.randn(4096, 256, generator=g))
    x = torch.randn(16, 256, generator=g)
    ref = small_linear_cpu.small_linear(x, panels, 4096, None, threads=1)
    small_linear_cpu.small_linear(x, panels, 4096, None, threads=2)  # the pool starts (placed from its next job)
    time.sleep(0.05)
    for _ in range(50):
        before = getcpu()
        out = small_linear_cpu.small_linear(x, panels, 4096, None, threads=2)
        if getcpu() == before:
            break
    else:
        pytest.skip("the caller changed CPU during each of 50 calls")
    assert torch.equal(out, ref)
    masks = {}
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that has ended meanwhile
            masks[int(tid)] = os.sched_getaffinity(int(tid))
    kept_off = [tid for tid, mask in masks.items() if mask == allowed - {before}]
    assert kept_off, f"no thread kept off CPU {before}: {masks}"
    assert threading.get_native_id() not in kept_off  # the caller itself keeps its own mask
