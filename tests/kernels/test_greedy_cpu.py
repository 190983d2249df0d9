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
    # The argmax-only entry: the same tokens, strided rows too.
    assert greedy_cpu.greedy_argmax(x, isa=isa).tolist() == want.tolist()
    assert greedy_cpu.greedy_argmax(wide[:, :vocab], isa=isa).tolist() == want.tolist()


@pytest.mark.skipif(not VECTOR_ISAS or not greedy_cpu.available(), reason="no C compiler or no vector ISA here")
@pytest.mark.parametrize("isa", VECTOR_ISAS)
def test_argmax_ties_and_ends(isa):
    """First index of the maximum wherever it lies (lane block, tail, ties
    across blocks), at M2M100's vocabulary and 64 rows: torch.argmax's answer."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 128112, generator=g)
    x[0, 0] = 9.0  # first entry
    x[1, -1] = 9.0  # last entry, past the lane blocks
    x[2, 17] = x[2, 100000] = 9.0  # a tie: the earlier one
    x[3, :] = 1.5  # all equal: index 0
    x[4, 5] = float("inf")
    x[4, 7] = float("inf")  # +inf has no finite maximum: declined below
    want = x[:4].argmax(-1)
    assert greedy_cpu.greedy_argmax(x[:4], isa=isa).tolist() == want.tolist() == [0, 128111, 17, 0]
    assert greedy_cpu.greedy_argmax(x[:4].contiguous(), isa=isa).tolist() == want.tolist()
    assert greedy_cpu.greedy_argmax(torch.cat([x[:4], x[5:]]), isa=isa).tolist() == \
        torch.cat([x[:4], x[5:]]).argmax(-1).tolist()
    assert greedy_cpu.greedy_argmax(x[4:5], isa=isa) is None


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
    for bad in (torch.full((2, 40), float("-inf")), torch.full((1, 40), float("nan")),
                torch.randn(2, 40, dtype=torch.float64), torch.randn(40, 2).t()):
        assert greedy_cpu.greedy_argmax(bad) is None
    nan = torch.randn(2, 40)
    nan[1, 39] = float("nan")
    assert greedy_cpu.greedy_argmax(nan) is None
    assert greedy_cpu.greedy_argmax(torch.randn(2, 40), isa="none") is None
