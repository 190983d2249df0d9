"""Candidate selection for beam search: each beam group's top-K continuations
(``SamplingType.BEAM`` rows; the scheduler's beam search turns them into beams).

HF scores every (beam, token) pair of a request by the beam's running score
plus the token's processed log-probability and keeps the best K over the
flattened ``beams x vocab`` row. The runner calls ``select_candidates`` once per
step for all beam groups; groups with the same (beams, K) share one topk, so
the cost is a few batched ops whatever the number of groups. Only ``(G, K)``
values and indices leave the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from encdec.core.outputs import BeamCandidates
from encdec.platform.device_tensors import to_device
from encdec.sampling_params import BeamRowParams, SamplingType
from encdec.sequence import SequenceGroupMetadata


@dataclass
class BeamRows:
    """Where this step's beam groups sit in the logits batch."""

    metas: list[SequenceGroupMetadata]
    # The rows whose processed log-probs the sampler returns: each group's beams,
    # group by group (an index tensor, or a slice where they are a run of the
    # batch in order); in a batch of beams alone, every row in batch order
    # (slice(0, rows)) and ``positions`` says where each group's beams are. So the
    # sampler copies no row (each copy is a pass over (rows, vocab) float32: 43 MB
    # at 208 rows of Whisper's vocab).
    row_index: torch.Tensor | slice
    seq_ids: set[int]  # decoder sequences that are beams (the sampler's tokens for them are unused)
    positions: list[int] | None = None  # beam (group order) -> its row of the processed log-probs; None: the same


def num_candidates(params: BeamRowParams) -> int:
    """HF's ``beams_to_keep``: enough that k beams survive even if every eos id
    takes one candidate from each beam."""
    return max(2, 1 + len(params.all_stop_token_ids)) * params.beam.beam_width


def find_beam_rows(metas: list[SequenceGroupMetadata], batch_rows: dict[int, int],
                   device: torch.device) -> BeamRows | None:
    """``batch_rows``: decoder seq_id -> its row in the logits batch (every row)."""
    beam_metas = [m for m in metas if m.sampling_params.sampling_type is SamplingType.BEAM]
    if not beam_metas:
        return None
    rows = [batch_rows[sid] for m in beam_metas for sid in m.seq_data]
    seq_ids = {sid for m in beam_metas for sid in m.seq_data}
    if len(rows) == len(batch_rows):  # beams alone: every row, each once
        return BeamRows(beam_metas, slice(0, len(rows)), seq_ids, None if rows == sorted(rows) else rows)
    return BeamRows(beam_metas, rows_or_run(rows, device), seq_ids)


def rows_or_run(rows: list[int], device: torch.device) -> torch.Tensor | slice:
    """``rows`` as an index tensor, or as a slice where they are consecutive."""
    if rows and rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return to_device(rows, torch.long, device)


@torch.inference_mode()
def select_candidates(beam_rows: BeamRows, logprobs: torch.Tensor) -> dict[str, BeamCandidates]:
    """``logprobs`` (num_beam_rows, vocab): processed float32 log-probs in
    ``beam_rows.row_index`` order (``positions`` says where each beam is). The
    running score of beam j of a group is its sequence's ``cumulative_logprob``
    (HF's running_beam_scores).

    A group's best K over beams x vocab are among its beams' own best K each (a
    beam's running score is one constant over its row), so each row's top K is
    taken once, in place, and only those (rows, K) are gathered and ranked: HF's
    candidates and scores (the same float sums), without a copy of the rows or a
    (rows, vocab) sum (each a pass over 43 MB at 208 rows of Whisper's vocab)."""
    vocab = logprobs.shape[1]
    starts, start = [], 0
    buckets: dict[tuple[int, int], list[int]] = {}
    for g, m in enumerate(beam_rows.metas):
        starts.append(start)
        start += len(m.seq_data)
        buckets.setdefault((len(m.seq_data), num_candidates(m.sampling_params)), []).append(g)
    width = min(max(num_cand for _, num_cand in buckets), vocab)
    row_values, row_tokens = logprobs.topk(width, dim=-1)  # (rows, width), best first
    asked = [m.sampling_params.beam.renormalized_logprob for m in beam_rows.metas]
    norm = torch.logsumexp(logprobs, dim=-1) if any(asked) else None  # (rows,)
    out: dict[str, BeamCandidates] = {}
    for (k, num_cand), groups in buckets.items():
        index = [starts[g] + j for g in groups for j in range(k)]
        if beam_rows.positions is not None:
            index = [beam_rows.positions[i] for i in index]
        index = to_device(index, torch.long, logprobs.device)
        running = to_device([sd.cumulative_logprob for g in groups for sd in beam_rows.metas[g].seq_data.values()],
                            torch.float32, logprobs.device)
        c = min(num_cand, vocab)
        lps = row_values.index_select(0, index)[:, :c]  # (G * k, c)
        scores = (lps + running.view(-1, 1)).view(len(groups), k * c)
        values, flat = torch.topk(scores, k=min(num_cand, k * c))
        parents = flat // c
        tokens = row_tokens.index_select(0, index)[:, :c].reshape(len(groups), k * c).gather(1, flat)
        renormed = [None] * len(groups)
        if any(asked[g] for g in groups):
            renormed = (lps.reshape(len(groups), k * c).gather(1, flat)
                        - norm.index_select(0, index).view(len(groups), k).gather(1, parents)).tolist()
        values, parents, tokens = values.tolist(), parents.tolist(), tokens.tolist()
        for r, g in enumerate(groups):
            out[beam_rows.metas[g].request_id] = BeamCandidates(values[r], parents[r], tokens[r],
                                                               renormed[r] if asked[g] else None)
    return out
