"""What the model runner packs for a step and runs later: ``ModelInput`` (one
packed forward) and ``StepPlan`` (a step packed on the host, not yet run:
the engine plans step N+1 while step N runs on the device)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from encdec.attention.backends.abstract import AttentionMetadata
from encdec.core.scheduler_outputs import SchedulerOutputs
from encdec.platform.device_tensors import to_device
from encdec.sequence import SequenceGroupMetadata
from encdec.worker.prefill_rows import SampledRow


@dataclass
class ModelInput:
    """One step's packed model inputs, built by ``prepare`` (scheduler -> model)."""

    input_ids: torch.Tensor  # (num_tokens,) int64 decoder tokens: prefill sequences', then one per decode
    positions: torch.Tensor  # (num_tokens,) int64 decoder position of each token
    attn_metadata: AttentionMetadata  # where each sequence's tokens and KV live; shared by all layers
    encoder_inputs: dict[str, Any]  # keyword args of the model's encoder for the step's prefills; {} if none
    sampled_rows: list[SampledRow]  # every sequence sampled this step, prefills first
    # (index in input_ids, its sequence's data) of rows scheduled ahead: their input
    # token is the one the step before samples, written in by ``run`` once appended
    owed: list[tuple[int, Any]]
    # speculative decoding: (seq_id, index of its first draft row, its drafts) per speculating row
    drafts: list[tuple[int, int, list[int]]] = field(default_factory=list)

    def fill_owed(self) -> None:
        if self.owed:
            index = to_device([i for i, _ in self.owed], torch.long, self.input_ids.device)
            tokens = to_device([sd.get_last_token_id() for _, sd in self.owed], torch.long, self.input_ids.device)
            self.input_ids.index_copy_(0, index, tokens)


@dataclass
class StepPlan:
    """A step packed on the host, not yet run (``plan``, then ``run``): the
    engine plans step N+1 while step N runs on the device (async scheduling)."""

    metas: list[SequenceGroupMetadata]
    sched: SchedulerOutputs
    parts: list[ModelInput]  # one packed step, or (prefills, decode rows: a graph's or the CPU's fused step)
    bucket: int | None  # the CUDA graph the (last) part replays; None: eager
    small: bool  # a small CPU decode step: one thread
    blocks_moved: bool = False  # the step's swaps and copies done while planning (a draft model reads the cache)
