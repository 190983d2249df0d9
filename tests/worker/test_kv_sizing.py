"""KV sizing on CUDA as vLLM does it, with fake numbers (the rule), the batch the
profile runs (the largest prefill step the scheduler admits), and the profile
forward itself on CPU (it is device-agnostic: one prefill over a one-block cache)."""
from __future__ import annotations

import pytest
import torch

from encdec.worker.cache_engine import profile_batch, profiled_kv_cache_bytes

GiB = 1 << 30


def test_share_less_weights_activations_and_outside_torch():
    kv = profiled_kv_cache_bytes(total=80 * GiB, gpu_memory_utilization=0.9, weights=1 * GiB,
                                 peak_activations=3 * GiB, non_torch=GiB // 2)
    assert kv == int(80 * GiB * 0.9) - 1 * GiB - 3 * GiB - GiB // 2


def test_a_second_engine_gets_its_own_share():
    """Free memory does not enter: two engines at 0.45 each get the same cache,
    where sizing from free memory left the second 0 bytes."""
    one = profiled_kv_cache_bytes(total=80 * GiB, gpu_memory_utilization=0.45, weights=GiB, peak_activations=GiB)
    two = profiled_kv_cache_bytes(total=80 * GiB, gpu_memory_utilization=0.45, weights=GiB, peak_activations=GiB)
    assert one == two == int(80 * GiB * 0.45) - 2 * GiB


def test_too_little_left_is_a_clear_error():
    with pytest.raises(ValueError) as e:
        profiled_kv_cache_bytes(total=16 * GiB, gpu_memory_utilization=0.5, weights=6 * GiB,
                                peak_activations=3 * GiB, profiled="21 prefills, 1247 decoder and 31500 encoder tokens")
    msg = str(e.value)
    for part in ("no memory left for the KV cache", "gpu_memory_utilization=0.5", "16.00 GiB", "8.00 GiB",
                 "weights take 6.00 GiB", "21 prefills", "3.00 GiB", "raise gpu_memory_utilization",
                 "max_num_batched_tokens", "kv_cache_memory"):
        assert part in msg, (part, msg)


def test_a_share_that_is_not_free_is_a_clear_error():
    """Seen on an H100: a first engine at 0.7 still held its cache, and the second
    engine's 0.7 ran out of memory halfway through allocating its cache."""
    fits = profiled_kv_cache_bytes(total=80 * GiB, gpu_memory_utilization=0.5, weights=GiB,
                                   peak_activations=GiB, free=39 * GiB)
    assert fits == 38 * GiB
    with pytest.raises(ValueError) as e:
        profiled_kv_cache_bytes(total=80 * GiB, gpu_memory_utilization=0.7, weights=GiB, peak_activations=GiB,
                                free=23 * GiB)
    msg = str(e.value)
    for part in ("gpu_memory_utilization=0.7", "54.00 GiB of it for the cache", "23.00 GiB of the device that is free",
                 "another engine or process holds 56.00 GiB", "kv_cache_memory"):
        assert part in msg, (part, msg)


@pytest.mark.parametrize("budget,seqs,dec_max,enc_max,n", [
    (32768, 256, 1024, 1024, 31),  # BART: 31 longest inputs, the rest as decoder tokens
    (32768, 256, 448, 1500, 21),  # Whisper: 21 windows of 1500 frames
    (32768, 8, 1024, 1024, 8),  # max_num_seqs caps it
    (1000, 256, 1024, 1024, 1),  # a budget under one request: one request
])
def test_profile_batch_is_the_largest_admitted_prefill_step(budget, seqs, dec_max, enc_max, n):
    dec, enc = profile_batch(budget, seqs, dec_max, enc_max)
    assert len(dec) == len(enc) == n
    assert enc == [enc_max] * n
    assert all(1 <= d <= dec_max for d in dec) and max(dec) - min(dec) <= 1
    if n > 1 and n < seqs:
        assert sum(dec) + sum(enc) <= budget
        assert sum(dec) == min(budget - n * enc_max, n * dec_max)


@pytest.mark.parametrize("backend", ["torch_sdpa", "torch_native"])
def test_profile_forward_runs_the_step_on_cpu(tiny_bart, backend, monkeypatch):
    from encdec import LLM

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # prefill only: no paged launch anyway
    llm = LLM(tiny_bart, device="cpu", attention_backend=backend, kv_cache_memory=16 << 20)
    worker = llm.llm_engine.worker
    mc = worker.model_config
    dec, enc = profile_batch(600, 4, mc.max_model_len, mc.max_encoder_len)
    logits = worker.profile_forward(dec, enc, 16)
    assert logits.shape == (len(dec), worker.vocab_size) and torch.isfinite(logits).all()


def test_cuda_sizing_wiring_with_fake_device_numbers(tiny_bart, monkeypatch):
    """The worker's CUDA branch end to end on CPU: torch.cuda's memory figures
    replaced by fake ones, the profile forward run for real."""
    from encdec import LLM

    llm = LLM(tiny_bart, device="cpu", kv_cache_memory=16 << 20)
    worker = llm.llm_engine.worker
    fake = {"allocated": 3 * GiB, "peak": 5 * GiB, "reserved": 6 * GiB}
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: fake["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: fake["peak"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: fake["reserved"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (70 * GiB, 80 * GiB))  # 10 GiB in use
    profiled = []
    real = worker.profile_forward
    monkeypatch.setattr(worker, "profile_forward", lambda d, e, bs: profiled.append((d, e)) or real(d, e, bs))
    cfg = llm.llm_engine.cache_config
    weights = sum(t.numel() * t.element_size() for t in (*worker.model.parameters(), *worker.model.buffers()))
    mc = worker.model_config
    kv = worker._profiled_cuda_kv_bytes(cfg, 4, 2000)
    assert profiled == [profile_batch(2000, 4, mc.max_model_len, mc.max_encoder_len)]
    # 0.9 x 80 GiB - weights - (5 - 3) GiB peak - (10 - 6) GiB outside torch
    assert kv == int(80 * GiB * cfg.gpu_memory_utilization) - weights - 2 * GiB - 4 * GiB
