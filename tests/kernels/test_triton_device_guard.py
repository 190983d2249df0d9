"""The GPU path never reaches a CPU-only C kernel: every encdec/kernels/cpu entry
point that a model, the sampler or an attention backend calls with a step's
tensors declines (returns None, having done nothing) for a tensor that is not on
the CPU, and the Triton kernel is the one that takes them. The "meta" device
stands in for CUDA here: not the CPU, no data, so a kernel that read it would fail."""
from __future__ import annotations

import pytest
import torch

from encdec.kernels.cpu import dense_attention_cpu, greedy_cpu, paged_attention_cpu, whisper_rules_cpu

META = torch.device("meta")


def test_dense_attention_declines_device_tensors():
    q = torch.empty(1, 40, 2, 64, device=META)
    assert dense_attention_cpu.dense_attention(q, q, q, 0.125) is None


def test_paged_attention_declines_device_tensors():
    q = torch.empty(3, 2, 64, device=META)
    cache = torch.empty(8, 16, 2, 64, device=META)
    tables = torch.empty(3, 2, dtype=torch.int32, device=META)
    lens = torch.empty(3, dtype=torch.int32, device=META)
    assert paged_attention_cpu.paged_decode_attention(q, cache, cache, tables, lens, 0.125) is None


def test_greedy_declines_device_tensors():
    assert greedy_cpu.greedy_logprobs(torch.empty(4, 100, device=META)) is None


def test_whisper_rules_declines_device_tensors():
    logits = torch.empty(2, 51864, device=META)
    assert whisper_rules_cpu.whisper_rules(logits, [0, 0], [0, 0], None, None, no_timestamps=50362,
                                           eos=50256, timestamp_begin=50363, max_initial=None) is None


def test_paged_path_on_device_tensors_is_the_triton_kernel():
    pa = pytest.importorskip("encdec.kernels.triton.paged_attention")
    if pa.triton is None:
        pytest.skip("triton not installed")
    assert pa.path("cuda") in ("cuda", "torch")  # "torch" only under the CPU interpreter
    assert pa.path(META) == "torch"  # neither CUDA nor an interpreted CPU tensor: declines
