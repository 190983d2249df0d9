"""The sampler's side: masks put in batch-row order and applied as -inf,
checked against a per-token reference."""
from __future__ import annotations

import torch

from encdec.core.scheduler_outputs import TokenMasks
from encdec.structured_output.bitmask import apply_bitmask, batch_bitmask


def _allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.tensor([[bool(int(bitmask[r, t // 32]) >> (t % 32) & 1) for t in range(vocab)]
                         for r in range(bitmask.shape[0])])


def test_apply_matches_reference_in_batch_order():
    g = torch.Generator().manual_seed(0)
    vocab, words = 70, 3  # vocab not a multiple of 32; bit 31 (the sign) used
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, words), generator=g, dtype=torch.int64).to(torch.int32)
    masks = TokenMasks({11: 0, 7: 1}, bitmask)
    req_ids = ["5", "7", "9", "11"]  # rows 1 and 3 constrained, by seq_id
    mask = batch_bitmask(masks, req_ids, torch.device("cpu"))
    assert mask.rows.tolist() == [1, 3]
    logits = torch.randn(4, vocab, generator=g)
    want = logits.clone()
    want[1][~_allowed(bitmask[1:2], vocab)[0]] = float("-inf")
    want[3][~_allowed(bitmask[0:1], vocab)[0]] = float("-inf")
    apply_bitmask(logits, mask)
    assert torch.equal(logits, want)


def test_no_constrained_row_is_none():
    masks = TokenMasks({3: 0}, torch.zeros(1, 1, dtype=torch.int32))
    assert batch_bitmask(None, ["1"], torch.device("cpu")) is None
    assert batch_bitmask(masks, ["1", "2"], torch.device("cpu")) is None
