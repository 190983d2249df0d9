"""HF generation-config processors: no-repeat n-grams, forced BOS and EOS.

Checkpoints such as bart-large-cnn ask for them in their generation config, and
HF's ``generate`` applies them to greedy, sampled and beam rows alike. Each reads
a row's whole decoder sequence (prompt + live outputs), as HF's ``input_ids``.

Options: ``params.no_repeat_ngram_size``; ``forced_bos_token_id`` and
``forced_eos_token_id`` in ``params.extra_args`` (``BeamSearchParams`` and
``LLM.get_default_sampling_params`` put them there). Min length is the built-in
min-tokens processor.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from encdec.sample.logits_processor.interface import BatchUpdate, LogitsProcessor
from encdec.sample.logits_processor.state import process_dict_updates

if TYPE_CHECKING:
    from encdec.sampling_params import SamplingParams


def _index(tokens_by_row: dict[int, Any], device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``{row: token ids}`` -> (rows, cols) for one indexed write; None if empty."""
    rows = [row for row, ids in tokens_by_row.items() for _ in ids]
    if not rows:
        return None
    cols = [t for ids in tokens_by_row.values() for t in ids]
    return torch.tensor(rows, device=device), torch.tensor(cols, device=device)


class _NGramState:
    """One row's n-grams, indexed incrementally: ``prefix (n-1 ids) -> next ids``."""

    def __init__(self, n: int, prompt: list[int], output: list[int]):
        self.n = n
        self.prompt = prompt
        self.output = output  # live list
        self.seen: dict[tuple[int, ...], set[int]] = {}
        self.indexed = 0  # n-grams ending before this position are in ``seen``

    def banned(self) -> set[int]:
        tokens = self.prompt + self.output
        n, cur_len = self.n, len(tokens)
        if cur_len + 1 < n:
            return set()
        for end in range(max(self.indexed, n), cur_len + 1):
            self.seen.setdefault(tuple(tokens[end - n:end - 1]), set()).add(tokens[end - 1])
        self.indexed = cur_len + 1
        return self.seen.get(tuple(tokens[cur_len + 1 - n:]), set())


class NoRepeatNGramLogitsProcessor(LogitsProcessor):
    """HF's ``NoRepeatNGramLogitsProcessor``: a token that would complete an
    n-gram already in the decoder sequence is banned (-inf)."""

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = torch.device(device)
        self.by_slot: dict[int, _NGramState] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    @staticmethod
    def _new_state(params: SamplingParams, prompt: list[int], output: list[int]) -> _NGramState | None:
        n = getattr(params, "no_repeat_ngram_size", 0)
        return _NGramState(n, prompt, output) if n > 0 else None

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.by_slot, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.by_slot:
            index = _index({slot: state.banned() for slot, state in self.by_slot.items()}, self.device)
            if index is not None:
                logits[index] = float("-inf")
        return logits


class ForcedBOSEOSLogitsProcessor(LogitsProcessor):
    """HF's ``ForcedBOSTokenLogitsProcessor`` (the first token after a one-token
    decoder prompt) and ``ForcedEOSTokenLogitsProcessor`` (the token that reaches
    ``max_tokens``): the row becomes -inf except the forced id(s), which get 0."""

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = torch.device(device)
        # slot -> (prompt len, live output, bos id or None, eos ids, total length at which eos is forced)
        self.by_slot: dict[int, tuple[int, list[int], int | None, list[int], int | None]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    @staticmethod
    def _new_state(params: SamplingParams, prompt: list[int], output: list[int]):
        extra = params.extra_args or {}
        bos, eos = extra.get("forced_bos_token_id"), extra.get("forced_eos_token_id")
        if bos is None and eos is None:
            return None
        eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        eos_at = None if not eos_ids or params.max_tokens is None else len(prompt) + params.max_tokens - 1
        return len(prompt), output, bos, eos_ids, eos_at

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.by_slot, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.by_slot:
            return logits
        forced = {}
        for slot, (prompt_len, output, bos, eos_ids, eos_at) in self.by_slot.items():
            cur_len = prompt_len + len(output)
            if cur_len == 1 and bos is not None:
                forced[slot] = [bos]
            elif cur_len == eos_at:
                forced[slot] = eos_ids
        index = _index(forced, self.device)
        if index is not None:
            logits[sorted(forced)] = float("-inf")
            logits[index] = 0.0
        return logits


GENERATION_LOGITS_PROCESSORS: tuple[type[LogitsProcessor], ...] = (
    NoRepeatNGramLogitsProcessor,
    ForcedBOSEOSLogitsProcessor,
)
