"""The oneDNN-packed Linear against nn.Linear."""
from __future__ import annotations

import pytest
import torch

from encdec.models.layers import Linear, onednn_available, pack_linears


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
