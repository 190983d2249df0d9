"""Example custom processors (seed 001), loadable by FQCN for end-to-end tests:

    LLM(..., logits_processors=["tests.sample.dummy_processor:DummyLogitsProcessor"])
    llm.generate(prompt, SamplingParams(extra_args={"target_token": 67}))

Every token of a request with ``target_token`` is that token.
"""
from __future__ import annotations

from typing import Any

import torch

from encdec.sample.logits_processor import (
    AdapterLogitsProcessor,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    RequestLogitsProcessor,
)
from encdec.sampling_params import SamplingParams


def _target_token(params: SamplingParams) -> Any:
    return params.extra_args.get("target_token") if params.extra_args else None


def _validate_target_token(params: SamplingParams) -> None:
    target = _target_token(params)
    if target is not None and (isinstance(target, bool) or not isinstance(target, int) or target < 0):
        raise ValueError(f"target_token must be a non-negative int, got {target!r}")


class DummyLogitsProcessor(LogitsProcessor):
    """Masks every token but ``extra_args["target_token"]``; sparse ``{slot: token}``
    state, updated by hand to show the BatchUpdate protocol."""

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        _validate_target_token(params)

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.req_info: dict[int, int] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.req_info.pop(index, None)
        for index, params, _, _ in batch_update.added:
            self.validate_params(params)
            target = _target_token(params)
            if target is not None:
                self.req_info[index] = target
            else:
                self.req_info.pop(index, None)
        for src, dst, direction in batch_update.moved:
            a = self.req_info.pop(src, None)
            b = self.req_info.pop(dst, None)
            if a is not None:
                self.req_info[dst] = a
            if direction is MoveDirectionality.SWAP and b is not None:
                self.req_info[src] = b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.req_info:
            return logits
        rows = torch.tensor(list(self.req_info), dtype=torch.long, device=logits.device)
        cols = torch.tensor(list(self.req_info.values()), dtype=torch.long, device=logits.device)
        keep = logits[rows, cols].clone()  # (num_targeted,)
        logits[rows] = float("-inf")
        logits[rows, cols] = keep
        return logits


class DummyPerReqLogitsProcessor:
    """A V0-style request-level processor: keep only ``target_token``."""

    def __init__(self, target_token: int) -> None:
        self.target_token = target_token

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        keep = logits[self.target_token].item()
        logits[:] = float("-inf")
        logits[self.target_token] = keep
        return logits


class WrappedPerReqLogitsProcessor(AdapterLogitsProcessor):
    """``DummyPerReqLogitsProcessor`` wrapped for the batch-level engine."""

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        _validate_target_token(params)

    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        target = _target_token(params)
        return None if target is None else DummyPerReqLogitsProcessor(target)
