"""small_linear_int8_cpu: the fused decode step's int8 panel matmul, per ISA path
(VNNI on the vector builds, plain C on the portable one), against the exact
int8 product sums in float64."""
from __future__ import annotations

import pytest
import torch

from encdec.kernels.cpu import build, small_linear_int8_cpu
from encdec.models.layers import Linear


@pytest.mark.parametrize("isa", build.host_isas())
@pytest.mark.parametrize("rows", [1, 7, 19])
def test_int8_panel_matmul_matches_the_int8_linear(monkeypatch, isa, rows):
    """The fused decode step's int8 matmul (small_linear_int8_cpu: VNNI on the
    AVX-512 build, plain C on the others) gives the op-by-op int8 linear's values:
    the same int8 products, the scales' float32 rounding aside; widths that leave
    partial panels and quads."""
    monkeypatch.setenv(build.ISA_ENV, isa)
    assert small_linear_int8_cpu.path(isa) == isa
    if not (small_linear_int8_cpu.vnni_available(isa) or isa == "none"):
        pytest.skip(f"this CPU lacks the VNNI of the {isa} path")
    lin = Linear(70, 45)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(45, 70, generator=torch.Generator().manual_seed(rows)) * 0.05)
        lin.weight[0] *= 20  # an outlier output channel
    lin.quantize_int8("onednn")  # the int8 weight and scales; the op-by-op path is not run here
    packed = small_linear_int8_cpu.pack(lin.weight, lin.weight_scale)
    x = torch.randn(rows, 70, generator=torch.Generator().manual_seed(2)) * 3
    scale = x.abs().amax(1, keepdim=True) / 127
    exact = torch.round(x / scale).double() @ lin.weight.double().T * scale.double() * lin.weight_scale.double()
    for post, f in (("none", lambda t: t), ("relu", torch.relu), ("gelu", torch.nn.functional.gelu)):
        got = small_linear_int8_cpu.small_linear_int8(x, packed, lin.bias, post=post, isa=isa)
        assert got is not None and got.shape == (rows, 45)
        torch.testing.assert_close(got.double(), f(exact + lin.bias.double()), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 3])
def test_one_row_panel_matmul_is_the_op_by_op_linear_bit_for_bit(rows):
    """The one-row tile (4 accumulator pairs, summed at the end) and the vectorized
    epilogue give the op-by-op int8 linear's floats exactly (int32 sums in any
    order are the same sums): K of 98 quads (the 4-quad loop and a tail), N with a
    partial last panel, with and without a bias."""
    if not small_linear_int8_cpu.vnni_available():
        pytest.skip("this CPU lacks the VNNI of its vector path")
    from encdec.quantization.int8 import int8_onednn

    g = torch.Generator().manual_seed(rows)
    for bias in (True, False):
        lin = Linear(390, 1000, bias=bias)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(1000, 390, generator=g) * 0.05)
            if bias:
                lin.bias.copy_(torch.randn(1000, generator=g))
        lin.quantize_int8("onednn")
        packed = small_linear_int8_cpu.pack(lin.weight, lin.weight_scale)
        x = torch.randn(rows, 390, generator=g) * 3
        for post in ("none", "gelu"):
            got = small_linear_int8_cpu.small_linear_int8(x, packed, lin.bias, post=post)
            want = int8_onednn(lin, x, post)
            assert got is not None and torch.equal(got, want), (bias, post, (got - want).abs().max())
