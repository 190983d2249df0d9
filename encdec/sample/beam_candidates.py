"""Candidate selection for beam search: each beam group's top-K continuations
(the engine side, ``encdec.beam_search``, turns them into beams).

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

from encdec.beam_search.rows import BeamRowParams
from encdec.device_tensors import to_device
from encdec.sequence import SequenceGroupMetadata


@dataclass
class BeamCandidates:
    """One group's K best continuations, best first (HF's topk order)."""

    scores: list[float]  # summed log-probs (float32 values)
    parents: list[int]  # the beam (slot in the group's seq order) each extends
    tokens: list[int]  # the token each appends
    # the token's log-prob with its row renormalised after the processors' masks (what
    # HF's Whisper fallback rule averages; the search ranks on `scores`); None unless
    # the request's BeamSearchParams.renormalized_logprob
    token_logprobs: list[float] | None = None


@dataclass
class BeamRows:
    """Where this step's beam groups sit in the logits batch."""

    metas: list[SequenceGroupMetadata]
    row_index: torch.Tensor  # (num_beam_rows,) batch row of each group's beams, group by group
    seq_ids: set[int]  # decoder sequences that are beams (the sampler's tokens for them are unused)


def num_candidates(params: BeamRowParams) -> int:
    """HF's ``beams_to_keep``: enough that k beams survive even if every eos id
    takes one candidate from each beam."""
    return max(2, 1 + len(params.all_stop_token_ids)) * params.beam.beam_width


def find_beam_rows(metas: list[SequenceGroupMetadata], batch_rows: dict[int, int],
                   device: torch.device) -> BeamRows | None:
    """``batch_rows``: decoder seq_id -> its row in the logits batch."""
    beam_metas = [m for m in metas if isinstance(m.sampling_params, BeamRowParams)]
    if not beam_metas:
        return None
    rows = [batch_rows[sid] for m in beam_metas for sid in m.seq_data]
    return BeamRows(beam_metas, to_device(rows, torch.long, device),
                    {sid for m in beam_metas for sid in m.seq_data})


@torch.inference_mode()
def select_candidates(beam_rows: BeamRows, logprobs: torch.Tensor) -> dict[str, BeamCandidates]:
    """``logprobs`` (num_beam_rows, vocab): processed float32 log-probs in
    ``beam_rows.row_index`` order. The running score of beam j of a group is its
    sequence's ``cumulative_logprob`` (HF's running_beam_scores)."""
    vocab = logprobs.shape[1]
    starts, start = [], 0
    buckets: dict[tuple[int, int], list[int]] = {}
    for g, m in enumerate(beam_rows.metas):
        starts.append(start)
        start += len(m.seq_data)
        buckets.setdefault((len(m.seq_data), num_candidates(m.sampling_params)), []).append(g)
    out: dict[str, BeamCandidates] = {}
    for (k, num_cand), groups in buckets.items():
        index = to_device([starts[g] + j for g in groups for j in range(k)], torch.long, logprobs.device)
        running = to_device([sd.cumulative_logprob for g in groups for sd in beam_rows.metas[g].seq_data.values()],
                            torch.float32, logprobs.device)
        rows = logprobs.index_select(0, index).view(len(groups), k, vocab)
        scores = rows + running.view(-1, k, 1)
        values, flat = torch.topk(scores.view(len(groups), k * vocab), k=min(num_cand, k * vocab))
        renormed = [None] * len(groups)
        if any(beam_rows.metas[g].sampling_params.beam.renormalized_logprob for g in groups):
            norm = torch.logsumexp(rows, dim=-1)  # (G, k)
            renormed = (rows.view(len(groups), k * vocab).gather(1, flat) - norm.gather(1, flat // vocab)).tolist()
        values, flat = values.tolist(), flat.tolist()
        for r, g in enumerate(groups):
            asked = beam_rows.metas[g].sampling_params.beam.renormalized_logprob
            out[beam_rows.metas[g].request_id] = BeamCandidates(
                values[r], [i // vocab for i in flat[r]], [i % vocab for i in flat[r]],
                renormed[r] if asked else None)
    return out
