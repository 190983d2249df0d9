"""The C dense attention kernel (Whisper's encoder) against a float64 reference."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from encdec.attention.ops import dense_cpu

pytestmark = pytest.mark.skipif(not dense_cpu.available(), reason="no C compiler or no AVX-512 here")


def reference(q, k, v, scale):
    q, k, v = (x.double().transpose(1, 2) for x in (q, k, v))  # (B, H, T, D)
    return F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(1, 2).float()


@pytest.mark.parametrize("B, tq, tk, H, mag", [
    (1, 1, 1, 1, 1.0), (2, 7, 7, 2, 1.0), (3, 100, 37, 6, 1.0), (2, 5, 300, 3, 1.0),
    (1, 301, 1500, 6, 1.0), (2, 64, 65, 4, 8.0),  # 8.0: scores in the hundreds (softmax near one-hot)
])
def test_matches_reference_on_fused_qkv(B, tq, tk, H, mag):
    g = torch.Generator().manual_seed(tq * 1000 + tk)
    q = torch.randn(B, tq, H, 64, generator=g) * mag
    kv = torch.randn(B, tk, 2, H, 64, generator=g) * mag  # k, v as strided views of one tensor
    k, v = kv[:, :, 0], kv[:, :, 1]
    out = dense_cpu.dense_attention(q, k, v, 0.125)
    assert out is not None and out.shape == (B, tq, H, 64) and out.is_contiguous()
    ref = reference(q, k, v, 0.125)
    # As close to the float64 answer as torch's own float32 SDPA is (large
    # scores lose digits in float32 whatever computes them).
    torch_f32 = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), scale=0.125)
    torch_err = (torch_f32.transpose(1, 2) - ref).abs().max().item()
    assert (out - ref).abs().max().item() <= 2 * torch_err + 2e-6


def test_declines_what_it_cannot_run():
    x = torch.randn(1, 4, 2, 64)
    assert dense_cpu.dense_attention(x.double(), x.double(), x.double(), 1.0) is None
    y = torch.randn(1, 4, 2, 32)
    assert dense_cpu.dense_attention(y, y, y, 1.0) is None  # head size 32
    assert dense_cpu.dense_attention(x.transpose(1, 2), x.transpose(1, 2), x.transpose(1, 2), 1.0) is None
    assert dense_cpu.dense_attention(x, x[:, :0], x[:, :0], 1.0) is None  # no keys
    assert dense_cpu.dense_attention(x.requires_grad_(), x, x, 1.0) is None
