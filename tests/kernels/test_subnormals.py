"""Subnormal floats inside the C kernels (team.h): a job runs with flush-to-zero
and denormals-are-zero set on its threads, so a softmax over sharply peaked
scores takes no microcode assists; the caller's own floating-point mode is put
back when the call returns, so torch on that thread still keeps subnormals.
Once per ISA path this CPU runs (the path is in the test id)."""
from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from encdec.kernels.cpu import build, dense_attention_cpu, small_linear_cpu

VECTOR_ISAS = [isa for isa in build.host_isas() if isa != "none"]
TINY = 1e-39  # below float32's smallest normal, 2**-126 ~ 1.18e-38

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64", "i686"),
                                reason="the kernels set the mode on x86 only (MXCSR)")


def keeps_subnormals() -> bool:
    """Whether this thread's float mode keeps a subnormal product (torch runs a
    one-element multiply on the calling thread)."""
    return (torch.tensor([TINY]) * 1.0).item() != 0.0


@pytest.fixture(params=VECTOR_ISAS or [pytest.param("none", marks=pytest.mark.skip(
    reason=f"this CPU has neither AVX-512 nor AVX2+FMA ({build.host_isas()})"))])
def isa(request) -> str:
    if not (dense_attention_cpu.available(request.param) and small_linear_cpu.available(request.param)):
        pytest.skip(f"the {request.param} kernels did not build here (no C compiler?)")
    return request.param


@pytest.mark.parametrize("threads", [1, 2])
def test_caller_mode_is_restored(isa, threads):
    assert keeps_subnormals(), "the test process starts with subnormals kept"
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=g)
    x = torch.randn(3, 32, generator=g)
    y = small_linear_cpu.small_linear(x, small_linear_cpu.pack(w), 64, None, threads=threads, isa=isa)
    torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-5)
    assert keeps_subnormals(), "a matmul call left flush-to-zero set on the caller's thread"
    q = torch.randn(1, 40, 2, 64, generator=g)
    assert dense_attention_cpu.dense_attention(q, q, q, 0.125, isa=isa) is not None
    assert keeps_subnormals(), "an attention call left flush-to-zero set on the caller's thread"


def test_peaked_softmax_matches_float64(isa):
    """Scores hundreds apart: most of exp(score - max) would be subnormal; flushed
    to zero, the output is as close to the float64 answer as torch's float32
    SDPA (which keeps them): scores that large lose digits in float32 alone."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 200, 4, 64, generator=g) * 30
    kv = torch.randn(1, 200, 2, 4, 64, generator=g)
    k, v = kv[:, :, 0], kv[:, :, 1]
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * 0.125
    below = (scores - scores.amax(-1, keepdim=True) < -87.3).double().mean().item()
    assert below > 0.3, f"only {below:.0%} of the weights fall in the subnormal range: not the case tested"
    out = dense_attention_cpu.dense_attention(q, k, v, 0.125, isa=isa)
    ref = F.scaled_dot_product_attention(*(t.double().transpose(1, 2) for t in (q, k, v)),
                                         scale=0.125).transpose(1, 2)
    torch_f32 = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), scale=0.125)
    torch_err = (torch_f32.transpose(1, 2).double() - ref).abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 2 * torch_err + 2e-6
    assert keeps_subnormals()


@pytest.mark.parametrize("threads", [1, 2])
def test_kernels_run_with_subnormals_as_zero(isa, threads):
    """Inside a call the mode is on, on the caller's thread and the pool's: a
    subnormal input reads as zero (torch on this thread keeps it)."""
    n = 256  # 8 panels: with 2 threads the pool takes some of them
    x = torch.full((2, 4), TINY)
    w = torch.full((n, 4), 1e10)
    assert (x @ w.T).min().item() > 0  # torch: 4e-29 per output
    y = small_linear_cpu.small_linear(x, small_linear_cpu.pack(w), n, None, threads=threads, isa=isa)
    assert y.abs().max().item() == 0.0
    assert keeps_subnormals()
