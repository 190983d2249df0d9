"""The greedy + log-prob kernel against argmax, log_softmax and the sampler's rank."""
from __future__ import annotations

import pytest
import torch

from encdec.kernels.cpu import build, greedy_cpu

VECTOR_ISAS = [isa for isa in build.host_isas() if isa != "none"]


@pytest.mark.skipif(not VECTOR_ISAS or not greedy_cpu.available(), reason="no C compiler or no vector ISA here")
@pytest.mark.parametrize("isa", VECTOR_ISAS)
@pytest.mark.parametrize("vocab", [51865, 1001, 7])  # Whisper's, and tails off the lanes
def test_matches_torch(isa, vocab):
    assert greedy_cpu.path(isa) == isa  # the build runs its ISA's lanes
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=g) * 4
    x[:, : vocab // 3] = float("-inf")  # suppressed tokens, as Whisper's rules leave them
    x[2, -1] = x[2].max() + 2  # the maximum in the tail
    x[4, vocab // 2] = x[4, vocab - 2] = x[4].max() + 1  # a tie: the first index, rank 2
    tok, lp, rank = greedy_cpu.greedy_logprobs(x, isa=isa)
    want = x.argmax(-1)
    logprobs = x.log_softmax(-1)
    chosen = logprobs.gather(1, want[:, None])
    assert tok.tolist() == want.tolist()
    exact = x.double().log_softmax(-1).gather(1, want[:, None])[:, 0]  # torch's float sum drifts more
    torch.testing.assert_close(lp.double(), exact, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lp, chosen[:, 0], atol=1e-5, rtol=1e-5)
    assert rank.tolist() == (logprobs >= chosen).sum(-1).tolist()
    assert rank[4] == 2
    # A view whose rows are apart by more than the vocabulary (stride) reads the same.
    wide = torch.zeros(9, vocab + 5)
    wide[:, :vocab] = x
    assert greedy_cpu.greedy_logprobs(wide[:, :vocab], isa=isa)[0].tolist() == want.tolist()


@pytest.mark.skipif(not greedy_cpu.available(), reason="no C compiler or no vector ISA here")
def test_declines_what_it_cannot_do():
    assert greedy_cpu.greedy_logprobs(torch.full((2, 40), float("-inf"))) is None  # no finite maximum
    for where in (3, 39):  # one NaN in a lane block, one in the tail: torch's argmax would pick it
        bad = torch.randn(2, 40)
        bad[1, where] = float("nan")
        assert greedy_cpu.greedy_logprobs(bad) is None
    assert greedy_cpu.greedy_logprobs(torch.full((1, 40), float("nan"))) is None
    assert greedy_cpu.greedy_logprobs(torch.randn(2, 40, dtype=torch.float64)) is None
    assert greedy_cpu.greedy_logprobs(torch.randn(40, 2).t()) is None  # columns not contiguous
    assert greedy_cpu.greedy_logprobs(torch.randn(2, 40), isa="none") is None  # torch is faster there
