"""The C small-row linear (decode steps, weights in column panels) against
F.linear, for each ISA build this CPU runs, and ``Linear``'s choice between it
and oneDNN."""
from __future__ import annotations

import sys

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


@pytest.mark.parametrize("every", [False, True])
@pytest.mark.parametrize("isa", build.host_isas())
def test_linear_rows_by_choice_and_path(monkeypatch, isa, every):
    """A packed float32 ``Linear`` runs up to MAX_ROWS rows on the kernel and more
    on oneDNN (panels made at the first call of a few rows); packed for every row
    count on a vector path, every call on the kernel (panels made at pack time).
    GELU is fused; every path equals F.linear to float32 rounding."""
    from encdec.models import layers

    monkeypatch.setenv(build.ISA_ENV, isa)
    lin = layers.Linear(384, 1536)
    panels_only = every and small_linear_cpu.every_row_count(isa)
    assert small_linear_cpu.every_row_count(isa) == (isa != "none")
    if not lin.pack(every):
        assert not panels_only and not layers.onednn_available()
        pytest.skip("oneDNN is not available here")
    assert lin.panel_rows == (sys.maxsize if panels_only else small_linear_cpu.MAX_ROWS)
    assert (lin.panels is not None) == panels_only and (lin.packed is None) == panels_only
    calls = []
    real = small_linear_cpu.small_linear
    monkeypatch.setattr(small_linear_cpu, "small_linear", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    g = torch.Generator().manual_seed(1)
    top = small_linear_cpu.MAX_ROWS
    sizes = (1, 5, top, top + 1, 100, 700)
    for m in sizes:
        x = torch.randn(2, m, 384, generator=g)[0]
        ref = F.linear(x, lin.weight, lin.bias)
        torch.testing.assert_close(lin(x), ref, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(lin.forward_gelu(x), F.gelu(ref), atol=1e-4, rtol=1e-5)
    assert calls == [m for m in sizes for _ in range(2) if panels_only or m <= top]
    assert lin.panels is lin.panel_weight()
    lin.unpack()
    assert lin.panel_rows == 0 and lin.panels is None and lin.packed is None


def test_whisper_asks_for_panels_at_every_row_count_and_the_text_families_do_not():
    from encdec.models.bart import BartForConditionalGeneration
    from encdec.models.whisper import WhisperForConditionalGeneration

    assert WhisperForConditionalGeneration.cpu_panels_every_row_count is True
    assert not getattr(BartForConditionalGeneration, "cpu_panels_every_row_count", False)


@pytest.mark.parametrize("isa", build.host_isas())
@pytest.mark.parametrize("rows", [239, 240, 241, 481, 1000])
def test_row_blocks_cover_every_row_once(isa, rows):
    """Past 240 rows a call's items are blocks of rows x panels: each output is
    written once, the same whether one thread or two take the items."""
    g = torch.Generator().manual_seed(rows)
    w, b, x = torch.randn(100, 72, generator=g), torch.randn(100, generator=g), torch.randn(rows, 72, generator=g)
    panels = small_linear_cpu.pack(w)
    one = small_linear_cpu.small_linear(x, panels, 100, b, threads=1, isa=isa)
    if one is None:
        pytest.skip(f"no {isa} build here")
    two = small_linear_cpu.small_linear(x, panels, 100, b, threads=2, isa=isa)
    assert torch.equal(one, two)
    torch.testing.assert_close(one, F.linear(x, w, b), atol=1e-4, rtol=1e-5)
