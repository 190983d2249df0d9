"""int8_rows_cpu: the row passes around an int8 matmul, per ISA path, against torch."""
from __future__ import annotations

import pytest
import torch

from encdec.kernels.cpu import build, int8_rows_cpu


@pytest.mark.parametrize("isa", build.host_isas())
def test_int8_row_passes_match_torch(monkeypatch, isa):
    """int8_rows_cpu's quantization gives torch's bytes (round half to even) and
    its dequantization torch's floats, on this ISA's path; rows of zeros and a
    width that leaves a tail past the lanes included."""
    monkeypatch.setenv(build.ISA_ENV, isa)
    if not int8_rows_cpu.available(isa):
        pytest.skip(f"int8_rows_cpu not built for {isa} here (no C compiler)")
    assert int8_rows_cpu.path(isa) == isa
    g = torch.Generator().manual_seed(5)
    x = torch.randn(21, 75, generator=g) * 3
    x[4] = 0
    q, scale = int8_rows_cpu.quantize_rows(x, isa=isa)
    ref_scale = x.abs().amax(1) / 127
    assert torch.equal(scale, ref_scale)
    inv = torch.where(x.abs().amax(1) > 0, 127 / x.abs().amax(1), torch.zeros(()))
    assert torch.equal(q, torch.round(x * inv[:, None]).to(torch.int8))
    strided = torch.randn(9, 150, generator=g)[:, :75]  # rows 150 apart: the row stride is honoured
    assert strided.stride() == (150, 1)
    q2, s2 = int8_rows_cpu.quantize_rows(strided, isa=isa)
    assert torch.equal(s2, strided.abs().amax(1) / 127)
    assert torch.equal(q2, torch.round(strided / s2[:, None]).to(torch.int8))
    w_scale = torch.rand(37, generator=g) + 0.5
    bias = torch.randn(37, generator=g)
    acc = torch.randint(-50000, 50000, (21, 37), generator=g, dtype=torch.int32)
    ref = acc.double() * (scale.double()[:, None] * w_scale.double()) + bias.double()
    for act, f in (("none", lambda t: t), ("relu", torch.relu), ("gelu", torch.nn.functional.gelu)):
        got = int8_rows_cpu.dequantize_rows(acc.clone(), scale, w_scale, bias, act, isa=isa)
        assert got.dtype == torch.float32 and got.shape == (21, 37)
        assert torch.allclose(got.double(), f(ref), rtol=1e-6, atol=1e-6), act
    got = int8_rows_cpu.dequantize_rows(acc.clone(), scale, w_scale, None, isa=isa)
    assert torch.allclose(got.double(), acc.double() * (scale.double()[:, None] * w_scale.double()), rtol=1e-6)
