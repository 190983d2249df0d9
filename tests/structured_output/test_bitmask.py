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


def test_every_row_in_place_and_both_unpackings_agree():
    from encdec.structured_output import bitmask as bm

    g = torch.Generator().manual_seed(1)
    vocab = 100
    bits = torch.randint(-2**31, 2**31 - 1, (3, 4), generator=g, dtype=torch.int64).to(torch.int32)
    mask = batch_bitmask(TokenMasks({4: 2, 5: 0, 6: 1}, bits), ["5", "6", "4"], torch.device("cpu"))
    assert mask.rows is None and torch.equal(mask.bitmask, bits)  # every row, in batch order
    want = _allowed(bits, vocab)
    assert torch.equal(bm.unpack_bits(bits, vocab), want)
    shifted = ((bits.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten(1)[:, :vocab].bool()
    assert torch.equal(shifted, want)  # the device path's unpacking, run on CPU tensors
    logits = torch.randn(3, vocab, generator=g)
    ref = logits.masked_fill(~want, float("-inf"))
    apply_bitmask(logits, mask)
    assert torch.equal(logits, ref)


def test_a_row_left_empty_keeps_the_grammars_tokens():
    logits = torch.full((1, 40), float("-inf"))
    logits[0, 3] = 1.0  # the other processors allow token 3 alone; the grammar allows 5 and 33
    bits = torch.tensor([[1 << 5, 1 << 1]], dtype=torch.int32)
    apply_bitmask(logits, batch_bitmask(TokenMasks({0: 0}, bits), ["0"], torch.device("cpu")))
    assert logits[0].isfinite().nonzero().flatten().tolist() == [5, 33] and logits[0, 5] == 0
