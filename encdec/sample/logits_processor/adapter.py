"""Wrapping vLLM V0-style request-level callables as a batch-level processor.

The wrapped callable runs once per row that uses it, in Python: fine for a
rarely used processor, too slow for a hot one (write a ``LogitsProcessor``).
"""
from __future__ import annotations

import inspect
from abc import abstractmethod
from collections.abc import Callable, Collection
from functools import partial
from typing import TYPE_CHECKING, Any, Union

import torch

from encdec.sample.logits_processor.interface import BatchUpdate, LogitsProcessor
from encdec.sample.logits_processor.state import process_dict_updates

if TYPE_CHECKING:
    from encdec.sampling_params import SamplingParams

RequestLogitsProcessor = Union[
    # (output token ids, logits row (vocab,)) -> logits row
    Callable[[list[int], torch.Tensor], torch.Tensor],
    # (prompt token ids, output token ids, logits row) -> logits row
    Callable[[list[int], list[int], torch.Tensor], torch.Tensor],
]


def _num_positional(fn: Callable[..., Any]) -> int:
    params = inspect.signature(fn).parameters.values()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in kinds for p in params)


class AdapterLogitsProcessor(LogitsProcessor):
    """Subclass it and implement ``new_req_logits_processor(params)``, returning a
    request-level callable, or None for requests it should leave alone.

    The callable gets the live output list (and the decoder prompt, for the
    3-argument form), so it always sees the tokens generated so far.
    """

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.req_info: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        raise NotImplementedError

    def is_argmax_invariant(self) -> bool:
        # Unknown callables may change anything; subclasses that know better override.
        return False

    def slots_acted_on(self, lookahead: int = 0) -> Collection[int]:
        return self.req_info.keys()  # requests it returned no callable for are left alone

    def _new_state(self, params: SamplingParams, prompt_ids: list[int],
                   output_ids: list[int]) -> Callable[[torch.Tensor], torch.Tensor] | None:
        req_lp = self.new_req_logits_processor(params)
        if req_lp is None:
            return None
        arity = _num_positional(req_lp)
        if arity == 3:
            return partial(req_lp, prompt_ids, output_ids)
        if arity == 2:
            return partial(req_lp, output_ids)
        raise TypeError(
            f"{type(self).__name__}.new_req_logits_processor returned a callable taking "
            f"{arity} positional arguments; expected (output_ids, logits) or "
            "(prompt_ids, output_ids, logits)"
        )

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.req_info, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, fn in self.req_info.items():
            out = fn(logits[row])  # (vocab,); a view, so in-place edits land directly
            if out is not None and out.data_ptr() != logits[row].data_ptr():
                logits[row] = out
        return logits
