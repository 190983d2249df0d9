"""The sampler's side of structured outputs: a step's grammar masks
(``SchedulerOutputs.token_masks``, rows by seq_id) in the persistent batch's
row order, and their application to the logits. Torch only; no xgrammar.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from encdec.core.scheduler_outputs import TokenMasks


@dataclass
class BatchBitmask:
    rows: torch.Tensor  # (k,) int64: the constrained rows of the logits, ascending
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
    return BatchBitmask(torch.tensor(rows, dtype=torch.long).to(device), bitmask.to(device))


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_bitmask(logits: torch.Tensor, mask: BatchBitmask) -> None:
    """Every token a row's grammar does not allow to -inf, in place. ``logits``:
    (num_rows, vocab) float32. Where the other processors left none of the
    grammar's tokens (Whisper's timestamp rules forcing a timestamp when the
    grammar allows only end-of-text), the grammar wins: its tokens get 0 (equally
    likely), so a row is never all -inf."""
    shifts = _SHIFTS.get(logits.device)
    if shifts is None:
        shifts = _SHIFTS[logits.device] = torch.arange(32, dtype=torch.int32, device=logits.device)
    vocab = logits.shape[1]
    bits = (mask.bitmask.unsqueeze(-1) >> shifts) & 1  # (k, words, 32)
    allowed = bits.flatten(1)[:, :vocab].bool()  # (k, vocab)
    rows = logits.index_select(0, mask.rows).masked_fill_(~allowed, float("-inf"))
    empty = rows.isneginf().all(dim=-1)  # (k,)
    if empty.any():
        rows[empty] = torch.zeros_like(rows[empty]).masked_fill_(~allowed[empty], float("-inf"))
    logits.index_copy_(0, mask.rows, rows)
