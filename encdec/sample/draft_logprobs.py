"""The log-probs a speculating row reports for the tokens it keeps.

Without speculation each token of a request that asks ``logprobs=N`` comes
with what the sampler reports for it (``Sampler`` steps 1, 6b and 12): the
token's log-prob, its rank and the top ``N``, from the raw logits or from the
logits after the processors (``logprobs_mode``), before temperature. With
speculation a step keeps several tokens of a row, each scored at its own query
row of the step (its first row, then its draft rows). So the same rows are made
here as the sampler makes them: raw, or through every processor as it would
act at that position (``LogitsProcessors.apply_at``: the row's output grown by
the drafts before it), then log-softmaxed. The kept tokens are only known once
the step's tokens reach the host (greedy rows: ``draft_rows.accept``; sampled
rows: rejection sampling), so the rows are made when the step is queued and
gathered per kept token afterwards (``kept_logprobs``).

A speculating row has no allowed-token mask, bad words, penalties or grammar
(``core.speculation.reason``), and no processor acts on it in ways
``apply_at`` does not cover (``slots_changing_argmax``), so these rows hold
exactly the sampler's; the values differ from a run without speculation only
by the float rounding of computing a position among several query rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from encdec.sample.sampler import LogprobsTensors, compute_logprobs, gather_logprobs


@dataclass
class DraftLogprobs:
    """Per speculating sequence, its first row then its draft rows, log-softmaxed."""

    logprobs: torch.Tensor  # (rows, vocab) float32, raw or processed (the row's logprobs_mode)
    start: dict[int, int]  # seq_id -> its first row in ``logprobs``
    num_logprobs: int  # top-k gathered per row: the batch's largest ``logprobs``

    def gather(self, kept: dict[int, list[int]]) -> tuple[list[int], LogprobsTensors]:
        """(seq_id per gathered row, their tensors): row ``start[sid] + i``
        scored kept token ``i`` of ``sid``; sequences not in ``kept`` are left out."""
        owners, index, tokens = [], [], []
        for sid, start in self.start.items():
            toks = kept.get(sid)
            if toks:
                owners += [sid] * len(toks)
                index += range(start, start + len(toks))
                tokens += toks
        device = self.logprobs.device
        rows = self.logprobs.index_select(0, torch.tensor(index, dtype=torch.long, device=device))
        return owners, gather_logprobs(rows, self.num_logprobs, torch.tensor(tokens, device=device))


def draft_logprobs(drafts: list[tuple[int, int, list[int]]], batch_row: dict[int, int], logits: torch.Tensor,
                   draft_logits: torch.Tensor, md: Any) -> DraftLogprobs | None:
    """The rows of every speculating sequence (``drafts``: (seq_id, index of
    its first draft row, drafts), its draft rows in that order in
    ``draft_logits``; ``batch_row``: seq_id -> its row of ``logits`` and of the
    sampling metadata ``md``) when some row of the batch asks log-probs; None
    otherwise. Call before the sampler edits ``logits`` in place. Rows whose
    request asks none are made too (their values are not read)."""
    if md.max_num_logprobs is None or not drafts:
        return None
    processed = set() if md.processed_logprobs_rows is None else set(md.processed_logprobs_rows.tolist())
    pieces, slots, ahead, modes, start, offset = [], [], [], [], {}, 0
    for sid, _, d in drafts:
        r = batch_row[sid]
        start[sid] = len(slots)
        pieces += [logits[r:r + 1], draft_logits[offset:offset + len(d)]]
        offset += len(d)
        slots += [r] * (1 + len(d))
        ahead += [d[:j] for j in range(1 + len(d))]
        modes += [r in processed] * (1 + len(d))
    rows = torch.cat(pieces)  # (R, vocab), a copy: the sampler may edit ``logits`` later
    out = compute_logprobs(rows) if not all(modes) else None
    if any(modes):
        idx = [i for i, p in enumerate(modes) if p]
        sub = rows.float() if out is None else rows.index_select(  # all processed (Whisper): no gather
            0, torch.tensor(idx, dtype=torch.long, device=rows.device)).float()
        sub = compute_logprobs(md.logitsprocs.apply_at(sub, [slots[i] for i in idx], [ahead[i] for i in idx]))
        if out is None:
            out = sub
        else:
            out[idx] = sub
    return DraftLogprobs(out, start, md.max_num_logprobs)
