"""The oneDNN-packed Linear against nn.Linear."""
from __future__ import annotations

import pytest
import torch

from encdec.models.layers import Linear, onednn_available, pack_linears
from encdec import quantization


@pytest.mark.skipif(not onednn_available(), reason="no oneDNN in this torch")
@pytest.mark.parametrize("rows", [0, 1, 7, 64])
def test_packed_matches_plain(rows):
    torch.manual_seed(0)
    lin = Linear(48, 96)
    x = torch.randn(2, rows, 48) if rows else torch.randn(0, 48)
    ref = torch.nn.functional.linear(x, lin.weight, lin.bias)
    assert pack_linears(torch.nn.Sequential(lin)) == 1
    out = lin(x)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_no_packing_off_cpu_float32():
    lin = Linear(8, 8).to(torch.float64)
    assert not lin.pack() and lin.packed is None


@pytest.mark.skipif(not onednn_available(), reason="no oneDNN in this torch")
@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_forward_gelu_paths_match(isa, monkeypatch):
    """Both GELU paths give gelu(linear(x)); which one ran is the ISA's."""
    from encdec.kernels.cpu import build
    from encdec.models import layers

    if isa not in build.host_isas():
        pytest.skip(f"this CPU does not run {isa}")
    monkeypatch.setenv(build.ISA_ENV, isa)
    path = layers.gelu_path()
    assert path == {"avx512": "fused", "avx2": "separate"}[isa]
    print(f"isa {isa}: gelu path {path}")
    torch.manual_seed(0)
    lin = Linear(48, 192)
    x = torch.randn(70, 48)
    ref = torch.nn.functional.gelu(torch.nn.functional.linear(x, lin.weight, lin.bias))
    assert lin.pack()
    with torch.inference_mode():
        torch.testing.assert_close(lin.forward_gelu(x), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [3, 70, 600])  # the small-row kernel; oneDNN (row buckets past 256)
def test_forward_act_relu_and_none_match_torch(rows):
    """ReLU fused into the matmul (the small-row kernel's post-op, oneDNN's where
    packed), unpacked, and int8: each equals relu(linear(x)) of its own path."""
    torch.manual_seed(1)
    lin = Linear(48, 192)
    x = torch.randn(rows, 48)
    ref = torch.nn.functional.linear(x, lin.weight, lin.bias)
    with torch.inference_mode():
        torch.testing.assert_close(lin.forward_act(x, "relu"), ref.relu(), atol=0, rtol=0)  # unpacked
        if lin.pack():
            torch.testing.assert_close(lin.forward_act(x, "relu"), ref.relu(), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lin.forward_act(x, "none"), ref, atol=1e-5, rtol=1e-5)
        plain = lin(x)
        lin.quantize_int8(quantization.int8_path())
        torch.testing.assert_close(lin.forward_act(x, "relu"), lin(x).relu(), atol=0, rtol=0)
        assert (lin(x) - plain).abs().max() < 0.05 * plain.abs().max()
    with pytest.raises(ValueError, match="act must be"):
        lin.forward_act(x, "tanh")


@pytest.mark.parametrize("rows", [3, 70, 300])  # the small-row kernel; oneDNN
def test_forward_bias_adds_the_bias_in_the_matmul(rows):
    """A bias-free layer's ``forward_bias(x, b)`` (BART's LM head and final_logits_bias)
    is ``self(x) + b`` to the bit on each path: unpacked, packed, int8."""
    torch.manual_seed(2)
    lin = Linear(48, 1000, bias=False)
    x, b = torch.randn(rows, 48), torch.randn(1, 1000)
    with torch.inference_mode():
        torch.testing.assert_close(lin.forward_bias(x, b[0]), lin(x) + b, atol=0, rtol=0)
        if lin.pack():
            torch.testing.assert_close(lin.forward_bias(x, b[0]), lin(x) + b, atol=0, rtol=0)
        lin.quantize_int8(quantization.int8_path())
        torch.testing.assert_close(lin.forward_bias(x, b[0]), lin(x) + b, atol=0, rtol=0)
