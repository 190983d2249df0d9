"""The scheduler's side of speculative decoding: which running rows may carry
draft tokens this step, and at most how many (the slots it gives them).

A row speculates when its request is one sequence, not a beam search, and asks
nothing that reads a verified position's own state: no penalties, no grammar
(structured outputs). Log-probs are fine: each kept token reports what the
sampler would have reported at its position (``encdec.sample.draft_logprobs``).
Greedy rows keep drafts equal to the target's tokens; rows that sample keep
them by rejection sampling (the target's distribution). Logits processors are the model runner's to check (it
knows which batch rows they act on; a row they act on gets no drafts:
``worker/draft_rows.py``). ``reason`` says why a request never speculates, and
its output says so (``RequestOutput.metrics.spec_decode_off``). No torch here.
"""
from __future__ import annotations

from typing import Any

from encdec.sampling_params import SamplingType
from encdec.sequence import SequenceGroup
from encdec.spec_decode import SpeculativeConfig


def reason(params: Any) -> str | None:
    """Why a request with these params never speculates; None if it may."""
    if params is None or params.sampling_type is SamplingType.BEAM:
        return "beam search"
    if params.n != 1 or (params.best_of or 1) != 1:
        return "n > 1"
    if (params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0):
        return "penalties"
    if getattr(params, "structured_outputs", None) is not None:
        return "structured outputs"
    if params.allowed_token_ids is not None or params.bad_words:
        return "allowed_token_ids or bad_words"
    return None


class Speculation:
    """``config``: the engine's ``SpeculativeConfig``; ``max_model_len``: no
    draft goes past the model's positions."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len

    def active(self, num_running: int) -> bool:
        """Whether rows may carry drafts in a step of ``num_running`` requests
        (``disable_by_batch_size``)."""
        limit = self.config.disable_by_batch_size
        return limit is None or num_running <= limit

    def max_drafts(self, group: SequenceGroup) -> int:
        """Draft tokens the group's row may carry this step (0: none): ``k``,
        fewer near ``max_tokens`` (a draft past it could never be kept) or
        the model's last position, none before ``min_tokens`` (the processor
        that holds eos back reads each position's length)."""
        seqs = group.seqs
        params = group.sampling_params
        if len(seqs) != 1 or reason(params) is not None:
            return 0
        seq = seqs[0]
        out = seq.get_output_len()
        if out < params.min_tokens:
            return 0
        room = self.k
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - out - 1)
        return max(0, min(room, self.max_model_len - seq.get_len()))
