"""What the sampler needs to know about the batch (vLLM V1's ``SamplingMetadata``).

Built by ``InputBatch.refresh_metadata``; row ``i`` of every tensor is row ``i``
of the logits. Fields that no request in the batch uses are ``None`` (or empty),
which is how the sampler skips whole steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from encdec.sample.logits_processor.state import LogitsProcessors
from encdec.structured_output.bitmask import BatchBitmask


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor | None  # (num_reqs,) float32, 0 for greedy rows; None if all greedy
    all_greedy: bool  # no row samples randomly: argmax only
    all_random: bool  # no greedy row: skip the argmax
    top_p: torch.Tensor | None  # (num_reqs,) float32, 1.0 = off; None if no row uses it
    top_k: torch.Tensor | None  # (num_reqs,) int64, vocab_size = off; None if no row uses it
    generators: dict[int, torch.Generator]  # row -> generator, for seeded rows only
    max_num_logprobs: int | None  # largest `logprobs` in the batch; None if no row asks
    processed_logprobs_rows: torch.Tensor | None  # (k,) int64 ascending: rows whose logprobs are processed
    raw_logprobs: bool  # some row reports raw log-probs (logprobs_mode="raw_logprobs")

    no_penalties: bool  # every row has repetition 1, frequency 0, presence 0
    prompt_token_ids: torch.Tensor | None  # (num_reqs, max_prompt_len) int64, padded with vocab_size; None if no_penalties
    frequency_penalties: torch.Tensor  # (num_reqs,) float32
    presence_penalties: torch.Tensor  # (num_reqs,) float32
    repetition_penalties: torch.Tensor  # (num_reqs,) float32
    output_token_ids: list[list[int]]  # the live output lists, in row order

    allowed_token_ids_mask: torch.Tensor | None  # (num_reqs, vocab) bool, True = disallowed
    bad_words_token_ids: dict[int, list[list[int]]]  # row -> bad words as token-id sequences

    logitsprocs: LogitsProcessors  # built-in and custom batch-level processors
    # structured outputs' grammar masks of this step's constrained rows; set by the
    # model runner every step (the rest of the metadata may be last step's)
    token_bitmask: BatchBitmask | None = None
