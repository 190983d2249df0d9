"""Built-in processors: min-p, logit bias, min-tokens (vLLM V1's built-ins).

Each keeps a sparse ``{slot: state}`` map of the requests that use it, turns it
into index tensors only when the batch changes, and returns the logits untouched
when no request in the batch uses it, so an unused built-in costs a dict check.
"""
from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import torch

from encdec.sample.logits_processor.generation import GENERATION_LOGITS_PROCESSORS
from encdec.sample.logits_processor.interface import BatchUpdate, LogitsProcessor
from encdec.sample.logits_processor.state import process_dict_updates

if TYPE_CHECKING:
    from encdec.sampling_params import SamplingParams


class MinPLogitsProcessor(LogitsProcessor):
    """Drop tokens whose probability is below ``min_p`` times the row's top
    probability. Argmax-invariant: the top token always survives."""

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = torch.device(device)
        self.min_p_by_slot: dict[int, float] = {}
        self.min_p: torch.Tensor | None = None  # (batch_size, 1) on device

    def is_argmax_invariant(self) -> bool:
        return True

    def slots_acted_on(self, lookahead: int = 0) -> Collection[int]:
        return self.min_p_by_slot.keys()

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        process_dict_updates(
            self.min_p_by_slot, batch_update,
            lambda params, _p, _o: params.min_p if params.min_p > 0.0 else None,
        )
        if not self.min_p_by_slot:
            self.min_p = None
            return
        min_p = torch.zeros(batch_update.batch_size, 1, dtype=torch.float32)
        min_p[list(self.min_p_by_slot), 0] = torch.tensor(list(self.min_p_by_slot.values()))
        self.min_p = min_p.to(self.device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.min_p is None:
            return logits
        probs = logits.softmax(dim=-1)  # (num_reqs, vocab)
        threshold = probs.amax(dim=-1, keepdim=True) * self.min_p  # (num_reqs, 1)
        return logits.masked_fill_(probs < threshold, float("-inf"))


class LogitBiasLogitsProcessor(LogitsProcessor):
    """Add ``logit_bias[token]`` to the token's logit (OpenAI's logit_bias)."""

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = torch.device(device)
        self.bias_by_slot: dict[int, dict[int, float]] = {}
        self.index: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, cols)
        self.values: torch.Tensor | None = None  # (num_biased_entries,)

    def is_argmax_invariant(self) -> bool:
        return False

    def slots_acted_on(self, lookahead: int = 0) -> Collection[int]:
        return self.bias_by_slot.keys()

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        changed = process_dict_updates(
            self.bias_by_slot, batch_update, lambda params, _p, _o: params.logit_bias or None
        )
        if not changed:
            return
        rows = [slot for slot, bias in self.bias_by_slot.items() for _ in bias]
        cols = [tok for bias in self.bias_by_slot.values() for tok in bias]
        vals = [v for bias in self.bias_by_slot.values() for v in bias.values()]
        if not rows:
            self.index = self.values = None
            return
        self.index = (torch.tensor(rows, device=self.device), torch.tensor(cols, device=self.device))
        self.values = torch.tensor(vals, dtype=torch.float32, device=self.device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.index is None:
            return logits
        return logits.index_put_(self.index, self.values.to(logits.dtype), accumulate=True)


class MinTokensLogitsProcessor(LogitsProcessor):
    """Forbid every stop token (``params.all_stop_token_ids``: stop_token_ids and
    eos) until the request has ``min_tokens`` outputs. Reads the live output
    lists each step, so it works with ``batch_update=None`` too."""

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = torch.device(device)
        # slot -> (min_tokens, live output ids, stop ids to mask)
        self.by_slot: dict[int, tuple[int, list[int], set[int]]] = {}
        self.index: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, cols)

    def is_argmax_invariant(self) -> bool:
        return False

    def slots_acted_on(self, lookahead: int = 0) -> Collection[int]:
        return self.by_slot.keys()

    @staticmethod
    def _new_state(params: SamplingParams, _prompt: list[int], output: list[int]):
        stop_ids = params.all_stop_token_ids
        if params.min_tokens > 0 and stop_ids:
            return params.min_tokens, output, set(stop_ids)
        return None

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        changed = process_dict_updates(self.by_slot, batch_update, self._new_state)
        done = [s for s, (n, out, _) in self.by_slot.items() if len(out) >= n]
        for slot in done:
            del self.by_slot[slot]
        if not (changed or done):
            return
        rows = [slot for slot, (_, _, ids) in self.by_slot.items() for _ in ids]
        cols = [tok for _, _, ids in self.by_slot.values() for tok in ids]
        self.index = None if not rows else (
            torch.tensor(rows, device=self.device), torch.tensor(cols, device=self.device))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.index is None:
            return logits
        return logits.index_put_(self.index, logits.new_tensor(float("-inf")))


BUILTIN_LOGITS_PROCESSORS: tuple[type[LogitsProcessor], ...] = (
    MinTokensLogitsProcessor,
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    *GENERATION_LOGITS_PROCESSORS,  # HF's order: min length, n-grams, then forced BOS/EOS win
)
