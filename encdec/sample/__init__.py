"""Sampling: the V1 sampler, its metadata and batch-level logits processors."""
from __future__ import annotations

from encdec.sample.metadata import SamplingMetadata
from encdec.sample.sampler import (
    LogprobsTensors,
    Sampler,
    SamplerOutput,
    compute_prompt_logprobs,
)

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "compute_prompt_logprobs",
]
