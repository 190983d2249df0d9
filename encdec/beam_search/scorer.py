"""HF's beam search rules for one step of many requests, as batched torch ops.

Mirrors transformers 5.x ``GenerationMixin._beam_search`` (steps d-g) and its
helpers ``_get_running_beams_for_next_iteration``, ``_update_finished_beams``,
``_check_early_stop_heuristic`` and ``_beam_search_has_unfinished_sequences``,
op for op in float32, so the chosen beams and the scores are HF's bit for bit.
Every request of a call has the same ``k`` (beams) and ``K`` (candidates); the
caller groups requests by them. Per-request scalars (lengths, length penalty,
early stopping) become ``(G, 1)`` columns.

Lengths are HF's: ``cur_len`` is the decoder length before this step's token,
``prompt_len`` what HF calls ``decoder_prompt_len``, ``max_length`` the total
decoder length at which a hypothesis must end.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_NEG = -1.0e9  # HF's "never pick this" offset


@dataclass
class RequestScalars:
    cur_len: int  # decoder tokens before this step's token
    prompt_len: int  # HF's decoder_prompt_len
    max_length: int  # total decoder length at which every candidate ends
    length_penalty: float
    early_stopping: bool | str


@dataclass
class BeamStep:
    """The step's decisions for ``G`` requests (rows)."""

    running: torch.Tensor  # (G, k) int64 candidate index of each next running beam, best first
    running_scores: torch.Tensor  # (G, k) float32 their summed log-probs
    pool_from: torch.Tensor  # (G, k) int64 into [old pool (k) | candidates (K)], best first
    pool_scores: torch.Tensor  # (G, k) float32 finished scores (-1e9-ish: empty slot)
    pool_finished: torch.Tensor  # (G, k) bool
    improvable: torch.Tensor  # (G,) bool HF's is_early_stop_heuristic_unsatisfied (sticky)
    done: torch.Tensor  # (G,) bool the request stops after this step


def _column(values: list[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).unsqueeze(1)  # (G, 1)


def beam_step(scalars: list[RequestScalars], cand_scores: torch.Tensor, cand_ends: torch.Tensor,
              pool_scores: torch.Tensor, pool_finished: torch.Tensor,
              improvable: torch.Tensor) -> BeamStep:
    """``cand_scores`` (G, K) float32: the top-K summed log-probs (HF's
    ``topk_log_probs``); ``cand_ends`` (G, K) bool: the candidate hits eos, a stop
    token or ``max_length`` (HF's ``next_token_hits_stopping_criteria``)."""
    num_beams = pool_scores.shape[1]
    early_true = _column([s.early_stopping is True for s in scalars], torch.bool)  # (G, 1)

    # e. the best k candidates that did not end keep running
    running_log_probs = cand_scores + cand_ends.to(torch.float32) * _NEG
    running = torch.topk(running_log_probs, k=num_beams)[1]  # (G, k)
    running_scores = running_log_probs.gather(1, running)

    # f. candidates ranked below k never enter the finished pool
    top_k = torch.zeros_like(cand_ends)
    top_k[:, :num_beams] = True
    just_finished = cand_ends & top_k
    denom = _column([float((s.cur_len + 1 - s.prompt_len) ** s.length_penalty) for s in scalars])
    finished_scores = cand_scores / denom
    full = torch.all(pool_finished, dim=1, keepdim=True) & early_true
    finished_scores += full.to(torch.float32) * _NEG
    finished_scores += (~improvable).unsqueeze(1).to(torch.float32) * _NEG
    finished_scores += (~just_finished) * _NEG
    merged_scores = torch.cat((pool_scores, finished_scores), dim=1)
    merged_finished = torch.cat((pool_finished, just_finished), dim=1)
    pool_from = torch.topk(merged_scores, k=num_beams)[1]  # (G, k)
    new_pool_scores = merged_scores.gather(1, pool_from)
    new_pool_finished = merged_finished.gather(1, pool_from)

    # g. can the best running beam still beat the worst finished one?
    best_len = [s.max_length - s.prompt_len if s.early_stopping == "never" and s.length_penalty > 0.0
                else s.cur_len + 1 - s.prompt_len for s in scalars]
    best_running = running_scores[:, :1] / _column([float(n ** s.length_penalty)
                                                   for n, s in zip(best_len, scalars)])
    worst_finished = torch.where(new_pool_finished, new_pool_scores.min(dim=1, keepdim=True)[0], _NEG)
    new_improvable = improvable & torch.any(best_running > worst_finished, dim=1)
    open_beam = ~(torch.all(new_pool_finished, dim=1) & early_true.squeeze(1))
    continues = ~torch.all(cand_ends, dim=1)
    done = ~(new_improvable & open_beam & continues)
    return BeamStep(running, running_scores, pool_from, new_pool_scores, new_pool_finished,
                    new_improvable, done)
