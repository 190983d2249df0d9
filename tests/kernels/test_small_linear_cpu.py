"""The C small-row linear (decode steps, weights in column panels) against
F.linear, for each ISA build this CPU runs, and ``Linear``'s choice between it
and oneDNN."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from encdec.kernels.cpu import build, small_linear_cpu

pytestmark = pytest.mark.skipif(not small_linear_cpu.available(), reason="no C compiler here")


def test_pack_lays_columns_in_zero_padded_panels():
    w = torch.arange(70 * 3, dtype=torch.float32).view(70, 3)  # 70 outputs: 3 panels, the last 6 wide
    p = small_linear_cpu.pack(w)
    assert p.shape == (3, 3, small_linear_cpu.PANEL) and p.is_contiguous()
    assert torch.equal(p[1, 2, 5], w[32 + 5, 2]) and torch.equal(p[2, :, 5], w[69])
    assert not p[2, :, 6:].any()


@pytest.mark.parametrize("isa", build.host_isas())  # each build this CPU runs, "none" = portable
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_f_linear(isa, threads):
    # The build says which code it runs: the vector path of its ISA, or plain C.
    assert small_linear_cpu.path(isa) == isa
    g = torch.Generator().manual_seed(0)
    # N a multiple of the panel and not (a padded last panel); K any size; every
    # row count up to two register tiles and then some.
    for k, n in [(384, 1152), (1536, 384), (64, 51), (100, 7), (24, 5)]:
        w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        panels = small_linear_cpu.pack(w)
        for m in [*range(1, 18), 40, small_linear_cpu.MAX_ROWS]:
            x = torch.randn(m, k, generator=g)
            ref = F.linear(x, w, b)
            got = small_linear_cpu.small_linear(x, panels, n, b, threads=threads, isa=isa)
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)
            got = small_linear_cpu.small_linear(x, panels, n, b, post="gelu", threads=threads, isa=isa)
            torch.testing.assert_close(got, F.gelu(ref), atol=1e-4, rtol=1e-5)
            got = small_linear_cpu.small_linear(x, panels, n, b, post="relu", threads=threads, isa=isa)
            torch.testing.assert_close(got, F.relu(ref), atol=1e-4, rtol=1e-5)
            got = small_linear_cpu.small_linear(x, panels, n, None, threads=threads, isa=isa)
            torch.testing.assert_close(got, F.linear(x, w), atol=1e-4, rtol=1e-5)
    x = torch.randn(8, 2 * 384, generator=g)[:, ::2]  # a strided input is made contiguous first
    w = torch.randn(7, 384, generator=g)
    torch.testing.assert_close(small_linear_cpu.small_linear(x, small_linear_cpu.pack(w), 7, None,
                                                             threads=threads, isa=isa),
                               F.linear(x, w), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("isa", build.host_isas())
def test_relu_post_op_keeps_nan_and_zeroes_negatives(isa):
    x = torch.tensor([[-3.0], [-0.0], [0.0], [2.5], [float("nan")], [float("-inf")], [float("inf")]])
    got = small_linear_cpu.small_linear(x, small_linear_cpu.pack(torch.ones(1, 1)), 1, None, post="relu", isa=isa)
    torch.testing.assert_close(got, torch.relu(x), equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("isa", build.host_isas())
def test_gelu_post_op_is_as_accurate_as_torch(isa):
    """The vector GELU (erf by Abramowitz-Stegun 7.1.26) against float64 over
    [-12, 12], negatives included (where 1 + erf cancels): within 4e-7, about
    torch's own float32 error there (6e-7)."""
    x = torch.linspace(-12, 12, 4801).view(-1, 1)
    got = small_linear_cpu.small_linear(x, small_linear_cpu.pack(torch.ones(1, 1)), 1, None, post="gelu",
                                        isa=isa)[:, 0].double()
    xd = x[:, 0].double()
    exact = 0.5 * xd * (1 + torch.erf(xd / 2 ** 0.5))
    ours = (got - exact).abs().max().item()
    theirs = (F.gelu(x[:, 0]).double() - exact).abs().max().item()
    assert ours <= max(4e-7, theirs), (ours, theirs)


def test_linear_takes_the_kernel_for_few_rows_only(monkeypatch):
    """A packed ``Linear`` runs up to MAX_ROWS rows on the kernel (GELU fused)
    and more rows on oneDNN; both equal F.linear to float32 rounding. Its panels
    are made at the first call of a few rows, then kept."""
    from encdec.models import layers

    lin = layers.Linear(384, 1536)
    if not lin.pack():
        pytest.skip("oneDNN is not available here")
    assert lin.small_rows and lin.panels is None
    calls = []
    real = small_linear_cpu.small_linear
    monkeypatch.setattr(small_linear_cpu, "small_linear", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    g = torch.Generator().manual_seed(1)
    top = small_linear_cpu.MAX_ROWS
    for m in (1, 5, top, top + 1, 100):
        x = torch.randn(2, m, 384, generator=g)[0]
        ref = F.linear(x, lin.weight, lin.bias)
        torch.testing.assert_close(lin(x), ref, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(lin.forward_gelu(x), F.gelu(ref), atol=1e-4, rtol=1e-5)
    assert calls == [1, 1, 5, 5, top, top]
    assert lin.panels is lin.panel_weight()
    lin.unpack()
    assert not lin.small_rows and lin.panels is None
