"""The sampler's side of structured outputs: a step's grammar masks
(``SchedulerOutputs.token_masks``, rows by seq_id) in the persistent batch's
row order, and their application to the logits. Torch (and numpy) only; no
xgrammar.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import torch

from encdec.core.scheduler_outputs import TokenMasks


@dataclass
class BatchBitmask:
    rows: torch.Tensor | None  # (k,) int64: the constrained rows of the logits, ascending; None: every row
    bitmask: torch.Tensor  # (k, words) int32, row i for logits row rows[i]; bit set = allowed


def batch_bitmask(masks: TokenMasks | None, req_ids: list[str], device: torch.device) -> BatchBitmask | None:
    """``masks`` for the batch whose row r holds sequence ``req_ids[r]``; None
    when no row is constrained."""
    if masks is None:
        return None
    rows, src = [], []
    for r, key in enumerate(req_ids):
        i = masks.rows.get(int(key))
        if i is not None:
            rows.append(r)
            src.append(i)
    if not rows:
        return None
    bitmask = masks.bitmask[src] if src != list(range(len(masks.rows))) else masks.bitmask
    every = rows == list(range(len(req_ids)))
    return BatchBitmask(None if every else torch.tensor(rows, dtype=torch.long).to(device), bitmask.to(device))


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack_bits(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """(k, words) int32 -> (k, vocab) bool, bit by bit. On CPU numpy unpacks the
    bits (a little-endian word's bytes are its bits in order); on a device, 32
    shifts per word."""
    if bitmask.device.type == "cpu" and sys.byteorder == "little":
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")  # (k, words * 32)
        return torch.from_numpy(bits[:, :vocab]).view(torch.bool)
    shifts = _SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _SHIFTS[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()  # (k, vocab)


def apply_bitmask(logits: torch.Tensor, mask: BatchBitmask) -> None:
    """Every token a row's grammar does not allow to -inf, in place. ``logits``:
    (num_rows, vocab) float32. Where the other processors left none of the
    grammar's tokens (Whisper's timestamp rules forcing a timestamp when the
    grammar allows only end-of-text), the grammar wins: its tokens get 0 (equally
    likely), so a row is never all -inf."""
    vocab = logits.shape[1]
    refused = unpack_bits(~mask.bitmask, vocab)  # (k, vocab), True = not allowed
    rows = logits if mask.rows is None else logits.index_select(0, mask.rows)
    rows.masked_fill_(refused, float("-inf"))
    empty = rows.amax(dim=-1) == float("-inf")  # (k,)
    if empty.any():
        rows[empty] = torch.zeros_like(rows[empty]).masked_fill_(refused[empty], float("-inf"))
    if mask.rows is not None:
        logits.index_copy_(0, mask.rows, rows)
