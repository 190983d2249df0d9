"""Every wrapper in encdec/kernels/cpu keeps the package's contract: ``available``
and ``path`` for each ISA this CPU runs (and a ValueError for one it lacks), and
a main call that returns None, having done nothing, where it cannot run."""
from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch

import encdec.kernels.cpu as cpu_pkg
from encdec.kernels.cpu import build

WRAPPERS = sorted(m.name for m in pkgutil.iter_modules(cpu_pkg.__path__) if m.name.endswith("_cpu"))


def test_every_c_file_has_a_wrapper_of_its_name():
    import os

    sources = sorted(f[:-2] for f in os.listdir(os.path.dirname(build.__file__)) if f.endswith("_cpu.c"))
    assert sources == WRAPPERS and len(WRAPPERS) == 8


@pytest.mark.parametrize("name", WRAPPERS)
@pytest.mark.parametrize("isa", build.host_isas())
def test_available_and_path(name, isa):
    mod = importlib.import_module(f"encdec.kernels.cpu.{name}")
    path = mod.path(isa)
    assert path in (isa, "torch"), path  # a build runs its own ISA's code, or the kernel declines
    assert mod.available(isa) == (path != "torch")
    assert mod.path() == mod.path(build.cpu_isa())
    if isa != "none":  # every kernel has a vector path for each vector ISA
        assert mod.available(isa) == (build.load(f"{name}.c", "", isa) is not None)
    with pytest.raises(ValueError, match="this CPU runs only"):
        mod.path("avx1024")
    with pytest.raises(ValueError, match="this CPU runs only"):
        mod.available("avx1024")


def _main_calls(isa: str) -> dict:
    """Each wrapper's main call on inputs it must take, by wrapper name."""
    from encdec.kernels.cpu import (dense_attention_cpu, greedy_cpu, int8_rows_cpu, paged_attention_cpu,
                                    small_linear_cpu, small_linear_int8_cpu, whisper_rules_cpu)

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 2, 64, generator=g)
    cache = torch.randn(2, 4, 16, 2, 64, generator=g)
    tables, lens = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    return {
        "dense_attention_cpu": lambda: dense_attention_cpu.dense_attention(q, q, q, 0.125, isa=isa),
        "paged_attention_cpu": lambda: paged_attention_cpu.paged_decode_attention(
            q[0, :1], cache[0], cache[1], tables, lens, 0.125, isa=isa),
        "small_linear_cpu": lambda: small_linear_cpu.small_linear(
            q[0, :, 0], small_linear_cpu.pack(torch.ones(3, 64)), 3, None, isa=isa),
        "greedy_cpu": lambda: greedy_cpu.greedy_logprobs(q[0, :, 0], isa=isa),
        "int8_rows_cpu": lambda: int8_rows_cpu.quantize_rows(q[0, :, 0], isa=isa),
        "small_linear_int8_cpu": lambda: small_linear_int8_cpu.small_linear_int8(
            q[0, :, 0], small_linear_int8_cpu.pack(torch.ones(3, 64, dtype=torch.int8), torch.ones(3)), None,
            isa=isa),
        "whisper_rules_cpu": lambda: whisper_rules_cpu.whisper_rules(
            q[0, :, 0].clone(), [0] * 4, [0] * 4, None, None, no_timestamps=1, eos=2, timestamp_begin=40,
            max_initial=None, isa=isa),
    }


@pytest.mark.parametrize("isa", build.host_isas())
def test_main_call_runs_where_available_and_declines_with_none_elsewhere(isa, monkeypatch):
    """Where a wrapper is available its main call answers; with no build (as with
    no compiler) it returns None. decode_step takes a model: test_whisper_model
    runs it, and its declining is checked here."""
    from encdec.kernels.cpu import decoder_step_cpu, small_linear_int8_cpu

    for name, call in _main_calls(isa).items():
        mod = importlib.import_module(f"encdec.kernels.cpu.{name}")
        runs = mod.available(isa)
        if mod is small_linear_int8_cpu and isa != "none" and not small_linear_int8_cpu.vnni_available(isa):
            runs = False  # built, but this CPU lacks its VNNI: it declines instead of faulting
        assert (call() is not None) == runs, (name, isa)
    with monkeypatch.context() as m:
        for name in WRAPPERS:  # as if no compiler: no kernel builds
            m.setattr(importlib.import_module(f"encdec.kernels.cpu.{name}")._KERNEL, "_functions",
                      dict.fromkeys(build.host_isas()))
            m.setattr(importlib.import_module(f"encdec.kernels.cpu.{name}")._KERNEL, "_paths", {})
        for name, call in _main_calls(isa).items():
            mod = importlib.import_module(f"encdec.kernels.cpu.{name}")
            assert not mod.available(isa) and mod.path(isa) == "torch"
            assert call() is None, name
        assert decoder_step_cpu.decoder_weights([object()]) is None
        weights = decoder_step_cpu.DecoderWeights(64, 1, 64, 1e-5, 0.125, "gelu", [], [[0] * 18])
        h = torch.zeros(1, 64)
        idx = torch.zeros(1, 1, dtype=torch.int32)
        slots = torch.zeros(1, dtype=torch.long)
        assert decoder_step_cpu.decode_step(h, weights, [torch.zeros(2, 1, 16, 1, 64)], slots, idx, idx[0], idx,
                                            idx[0], isa=isa) is None
