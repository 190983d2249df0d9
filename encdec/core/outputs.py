"""What a step's model runner hands the scheduler (``Scheduler.update``):
typed, torch-free, one owner applies each part.

    samples          per sampled decoder sequence: the tokens it appends this
                     step (one today; several once a drafter's tokens are
                     verified), each with its log-probs when asked
    single           the rows that append one token without log-probs (most
                     rows of most steps), column-wise: no object per row
    beam_candidates  per beam group (``SamplingType.BEAM``): the sampler's top-K
                     continuations over its beams; the scheduler's beam search
                     turns them into the group's next beams
    prompt logprobs  per prefill that asked, once

What goes the other way with a step, a request's mask of the tokens it may
sample (structured outputs), has its place in ``SchedulerOutputs.token_masks``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from encdec.sequence import Logprob


@dataclass(slots=True)  # one per row per step: slots make it cheaper to build
class SampledTokens:
    """The tokens one decoder sequence (a persistent-batch row) appends this step."""

    seq_id: int
    sampled_token_ids: list[int]  # in order; the stop checker may end the sequence before the last
    # per token of sampled_token_ids: its log-prob, then the request's top-k; [] unless asked
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)


@dataclass
class BeamCandidates:
    """One beam group's K best continuations, best first (HF's topk order)."""

    scores: list[float]  # summed log-probs (float32 values)
    parents: list[int]  # the beam (slot in the group's seq order) each extends
    tokens: list[int]  # the token each appends
    # the token's log-prob with its row renormalised after the processors' masks (what
    # HF's Whisper fallback rule averages; the search ranks on `scores`); None unless
    # the request's BeamSearchParams.renormalized_logprob
    token_logprobs: list[float] | None = None


@dataclass(slots=True)
class SingleTokens:
    """One token per row, no log-probs: ``token_ids[i]`` is sequence ``seq_ids[i]``'s."""

    seq_ids: list[int]
    token_ids: list[int]


@dataclass
class ModelRunnerOutput:
    samples: list[SampledTokens]  # one per sampled decoder sequence that is not a beam (and not in single)
    single: SingleTokens | None = None
    # speculative decoding: draft tokens this step verified, and how many of them were kept
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_drafts: int = 0  # rows that carried drafts (vLLM's num_drafts)
    # request_id -> per decoder-prompt position: {token id: Logprob} (None for the first)
    prompt_logprobs: dict[str, list[dict[int, Logprob] | None]] = field(default_factory=dict)
    # request_id -> {prompt position: {token id: raw log-prob}} (SamplingParams.prompt_token_logprobs)
    prompt_token_logprobs: dict[str, dict[int, dict[int, float]]] = field(default_factory=dict)
    # request_id -> its candidates, for beam groups (their rows are in no sample)
    beam_candidates: dict[str, BeamCandidates] = field(default_factory=dict)
