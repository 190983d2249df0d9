"""The C dense attention kernel (Whisper's encoder) against a float64 reference,
once per ISA path this CPU runs (the path is in the test id)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from encdec.kernels.cpu import build, dense_attention_cpu

VECTOR_ISAS = [isa for isa in build.host_isas() if isa != "none"]


@pytest.fixture(params=VECTOR_ISAS or [pytest.param("none", marks=pytest.mark.skip(
    reason=f"this CPU has neither AVX-512 nor AVX2+FMA ({build.host_isas()})"))])
def isa(request) -> str:
    if not dense_attention_cpu.available(request.param):
        pytest.skip(f"the {request.param} kernel did not build here (no C compiler?)")
    assert dense_attention_cpu.path(request.param) == request.param  # the build runs its ISA's tiles
    return request.param


def reference(q, k, v, scale):
    q, k, v = (x.double().transpose(1, 2) for x in (q, k, v))  # (B, H, T, D)
    return F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(1, 2).float()


@pytest.mark.parametrize("B, tq, tk, H, mag", [
    (1, 1, 1, 1, 1.0), (2, 7, 7, 2, 1.0), (3, 100, 37, 6, 1.0), (2, 5, 300, 3, 1.0),
    (1, 301, 1500, 6, 1.0), (2, 64, 65, 4, 8.0),  # 8.0: scores in the hundreds (softmax near one-hot)
    (1, 13, 9, 2, 40.0),  # scores spread past exp's float range: tiny terms flush to 0
])
def test_matches_reference_on_fused_qkv(isa, B, tq, tk, H, mag):
    g = torch.Generator().manual_seed(tq * 1000 + tk)
    q = torch.randn(B, tq, H, 64, generator=g) * mag
    kv = torch.randn(B, tk, 2, H, 64, generator=g) * mag  # k, v as strided views of one tensor
    k, v = kv[:, :, 0], kv[:, :, 1]
    out = dense_attention_cpu.dense_attention(q, k, v, 0.125, isa=isa)
    assert out is not None and out.shape == (B, tq, H, 64) and out.is_contiguous()
    ref = reference(q, k, v, 0.125)
    # As close to the float64 answer as torch's own float32 SDPA is (large
    # scores lose digits in float32 whatever computes them).
    torch_f32 = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), scale=0.125)
    torch_err = (torch_f32.transpose(1, 2) - ref).abs().max().item()
    assert (out - ref).abs().max().item() <= 2 * torch_err + 2e-6


def test_long_sums_are_as_accurate_as_torch(isa):
    """1500 keys and values with a mean (sums that do not cancel): the P V sums
    run in blocks (KC), as a GEMM's do; one running sum over every key was 2.4x
    torch's float32 error and moved Whisper's encoder output past HF's."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 60, 2, 64, generator=g) * 1.5
    k = torch.randn(1, 1500, 2, 64, generator=g) * 1.5
    v = torch.randn(1, 1500, 2, 64, generator=g) * 1.5 + 0.5
    ref = reference(q, k, v, 0.125)
    torch_f32 = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), scale=0.125)
    torch_err = (torch_f32.transpose(1, 2) - ref).abs().max().item()
    err = (dense_attention_cpu.dense_attention(q, k, v, 0.125, isa=isa) - ref).abs().max().item()
    assert err <= 1.25 * torch_err, (err, torch_err)


@pytest.mark.parametrize("B, tq, tk, H", [(1, 1, 1, 1), (2, 7, 7, 2), (1, 130, 130, 12), (2, 45, 300, 3)])
def test_offset_bias_matches_a_float64_mask(isa, B, tq, tk, H):
    """T5's encoder bias read by offset (t - i + tq - 1) equals the same bias
    given to a float64 SDPA as an (H, tq, tk) mask; rows past 6 and keys past a
    panel of 16 each read their own slice. Scale 1, as T5's."""
    g = torch.Generator().manual_seed(tq * 7 + tk)
    q, k, v = (torch.randn(B, t, H, 64, generator=g) for t in (tq, tk, tk))
    table = torch.randn(H, tq + tk - 1, generator=g) * 4
    i, t = torch.arange(tq)[:, None], torch.arange(tk)[None, :]
    mask = table[:, t - i + tq - 1]  # (H, tq, tk)
    out = dense_attention_cpu.dense_attention(q, k, v, 1.0, offset_bias=table, isa=isa)
    ref = F.scaled_dot_product_attention(*(x.double().transpose(1, 2) for x in (q, k, v)), attn_mask=mask.double(),
                                         scale=1.0).transpose(1, 2)
    torch_f32 = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), attn_mask=mask,
                                               scale=1.0).transpose(1, 2)
    torch_err = (torch_f32.double() - ref).abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 2 * torch_err + 2e-6
    # Against no bias: the bias is applied (a kernel that ignored it fails here).
    plain = dense_attention_cpu.dense_attention(q, k, v, 1.0, isa=isa)
    assert (plain - out).abs().max().item() > 1e-2 or tk == 1
    # A table of the wrong width or dtype is declined, not read out of bounds.
    assert dense_attention_cpu.dense_attention(q, k, v, 1.0, offset_bias=table[:, 1:].contiguous(), isa=isa) is None
    assert dense_attention_cpu.dense_attention(q, k, v, 1.0, offset_bias=table.double(), isa=isa) is None


def test_declines_what_it_cannot_run(isa):
    x = torch.randn(1, 4, 2, 64)
    assert dense_attention_cpu.dense_attention(x.double(), x.double(), x.double(), 1.0, isa=isa) is None
    y = torch.randn(1, 4, 2, 32)
    assert dense_attention_cpu.dense_attention(y, y, y, 1.0, isa=isa) is None  # head size 32
    t = x.transpose(1, 2)
    assert dense_attention_cpu.dense_attention(t, t, t, 1.0, isa=isa) is None
    assert dense_attention_cpu.dense_attention(x, x[:, :0], x[:, :0], 1.0, isa=isa) is None  # no keys
    assert dense_attention_cpu.dense_attention(x.requires_grad_(), x, x, 1.0, isa=isa) is None


def test_portable_build_declines():
    """Built for no vector ISA the kernel says so and callers run torch SDPA."""
    if build.load("dense_attention_cpu.c", "torch SDPA", "none") is None:
        pytest.skip("no C compiler here")
    assert not dense_attention_cpu.available("none") and dense_attention_cpu.path("none") == "torch"
    x = torch.randn(1, 40, 2, 64)
    assert dense_attention_cpu.dense_attention(x, x, x, 0.125, isa="none") is None


def test_refuses_an_isa_this_cpu_lacks(monkeypatch):
    monkeypatch.setattr(build, "host_isas", lambda: ("avx2", "none"))
    with pytest.raises(ValueError, match="avx512"):
        dense_attention_cpu.available("avx512")


def test_missing_source_warns_and_falls_back(caplog):
    """A wheel without the .c files (or a read-only, unbuildable one) runs torch, never crashes."""
    with caplog.at_level("WARNING", logger=build.__name__):
        assert build.load("no_such_kernel.c", "torch runs instead", "none") is None
    assert "no_such_kernel.c" in caplog.text and "torch runs instead" in caplog.text


def test_builds_are_keyed_by_isa(tmp_path, monkeypatch):
    """One cache dir shared by hosts of different ISAs holds one file per ISA."""
    monkeypatch.setenv("ENCDEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "sources", lambda: ["dense_attention_cpu.c"])  # a miss builds every source: this one only
    built = [isa for isa in build.host_isas()
             if build.load.__wrapped__("dense_attention_cpu.c", "torch", isa) is not None]
    if not built:
        pytest.skip("no C compiler here")
    names = sorted(p.name for p in tmp_path.glob("*.so"))
    assert [n.split("_")[3] for n in names] == sorted(built), names
