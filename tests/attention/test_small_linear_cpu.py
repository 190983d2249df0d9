"""The C small-row linear (decode steps) against F.linear, for each ISA build
this CPU runs, and ``Linear``'s choice between it and oneDNN."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from encdec.attention.ops import build, small_linear_cpu

pytestmark = pytest.mark.skipif(not small_linear_cpu.available(), reason="no C compiler here")


@pytest.mark.parametrize("isa", build.host_isas())  # each build this CPU runs, "none" = portable
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_f_linear(isa, threads):
    # The build says which code it runs: the vector path of its ISA, or plain C.
    assert small_linear_cpu.path(isa) == isa
    g = torch.Generator().manual_seed(0)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # K a multiple of the vector width (the fast path) and not (the generic
        # path); N not a multiple of anything; 1..8 rows (every tail of 4).
        for k, n in [(384, 1152), (1536, 384), (64, 51), (100, 7), (24, 5)]:
            w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
            for m in range(1, small_linear_cpu.MAX_ROWS + 1):
                x = torch.randn(m, k, generator=g)
                got = small_linear_cpu.small_linear(x, w, b, isa=isa)
                torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-4, rtol=1e-5)
                torch.testing.assert_close(small_linear_cpu.small_linear(x, w, None, isa=isa), F.linear(x, w),
                                           atol=1e-4, rtol=1e-5)
        x = torch.randn(8, 2 * 384, generator=g)[:, ::2]  # a strided input is made contiguous first
        w = torch.randn(7, 384, generator=g)
        torch.testing.assert_close(small_linear_cpu.small_linear(x, w, None, isa=isa), F.linear(x, w),
                                   atol=1e-4, rtol=1e-5)
    finally:
        torch.set_num_threads(old)


def test_linear_takes_the_kernel_for_few_rows_only(monkeypatch):
    """A packed ``Linear`` runs up to MAX_ROWS rows on the kernel (GELU applied
    after it) and more rows on oneDNN; both equal F.linear to float32 rounding."""
    from encdec.models import layers

    lin = layers.Linear(384, 1536)
    if not lin.pack():
        pytest.skip("oneDNN is not available here")
    assert lin.small_rows
    calls = []
    real = layers.small_linear
    monkeypatch.setattr(layers, "small_linear", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    g = torch.Generator().manual_seed(1)
    for m in (1, 5, small_linear_cpu.MAX_ROWS, small_linear_cpu.MAX_ROWS + 1, 40):
        x = torch.randn(2, m, 384, generator=g)[0]
        ref = F.linear(x, lin.weight, lin.bias)
        torch.testing.assert_close(lin(x), ref, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(lin.forward_gelu(x), F.gelu(ref), atol=1e-4, rtol=1e-5)
    assert calls == [1, 1, 5, 5, small_linear_cpu.MAX_ROWS, small_linear_cpu.MAX_ROWS]
    lin.unpack()
    assert not lin.small_rows
