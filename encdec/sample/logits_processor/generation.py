"""HF generation-config processors: no-repeat n-grams, bad words, forced BOS and EOS.

Checkpoints such as bart-large-cnn ask for them in their generation config, and
HF's ``generate`` applies them to greedy, sampled and beam rows alike. Each reads
a row's whole decoder sequence (prompt + live outputs), as HF's ``input_ids``.

Options: ``params.no_repeat_ngram_size``; ``forced_bos_token_id`` and
``forced_eos_token_id`` in ``params.extra_args`` (``BeamSearchParams`` and
``LLM.get_default_sampling_params`` put them there). Min length is the built-in
min-tokens processor. The checkpoint's ``bad_words_ids`` apply to every request,
as HF's ``generate`` applies its generation config's (OPUS-MT forbids <pad>).
"""
from __future__ import annotations

from collections.abc import Collection
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

    def slots_acted_on(self, lookahead: int = 0) -> Collection[int]:
        return self.by_slot.keys()

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

    def slots_acted_on(self, lookahead: int = 0) -> Collection[int]:
        """Only rows whose forced BOS or EOS falls in the next ``1 + lookahead`` positions."""
        out = []
        for slot, (prompt_len, output, bos, _, eos_at) in self.by_slot.items():
            cur_len = prompt_len + len(output)
            if (bos is not None and cur_len <= 1) or (eos_at is not None and cur_len <= eos_at <= cur_len + lookahead):
                out.append(slot)
        return out

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


def _tail(prompt: list[int], output: list[int], n: int) -> list[int]:
    """The last ``n`` ids of ``prompt + output`` (n <= their total length)."""
    if n <= len(output):
        return output[len(output) - n:]
    return prompt[len(prompt) - (n - len(output)):] + output


class BadWordsLogitsProcessor(LogitsProcessor):
    """HF's ``NoBadWordsLogitsProcessor`` over the generation config's
    ``bad_words_ids``, on every row: a one-token entry is always -inf (except an
    entry that is just an eos id, which HF drops); a longer one bans its last
    token where the row's decoder sequence (prompt + outputs) ends with the rest."""

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = torch.device(device)
        gen = getattr(config, "generation_config", None)  # none in a stand-in config (loading.py)
        words = getattr(gen, "bad_words_ids", None) or []
        if not isinstance(words, list) or not all(
                isinstance(w, list) and w and all(isinstance(t, int) and t >= 0 for t in w) for w in words):
            raise ValueError(f"the checkpoint's generation config has bad_words_ids={words!r}: "
                             "expected a list of non-empty lists of token ids >= 0")
        eos = getattr(gen, "eos_token_id", None)
        eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        words = [w for w in words if not (len(w) == 1 and w[0] in eos_ids)]
        self.single = torch.tensor(sorted({w[0] for w in words if len(w) == 1}), dtype=torch.long, device=device)
        self.multi = [(w[:-1], w[-1]) for w in words if len(w) > 1]
        self.by_slot: dict[int, tuple[list[int], list[int]]] = {}  # slot -> (prompt, live output)

    def is_argmax_invariant(self) -> bool:
        return self.single.numel() == 0 and not self.multi

    def slots_acted_on(self, lookahead: int = 0) -> Collection[int]:
        return self.by_slot.keys()  # the multi-token words' rows; one-token bans: apply_static

    def apply_static(self, logits: torch.Tensor) -> None:
        if self.single.numel():
            logits[:, self.single] = float("-inf")

    def _new_state(self, params: SamplingParams, prompt: list[int], output: list[int]):
        return (prompt, output) if self.multi else None

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.by_slot, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        self.apply_static(logits)
        if self.multi and self.by_slot:
            banned = {}
            for slot, (prompt, output) in self.by_slot.items():
                length = len(prompt) + len(output)
                hits = [last for prefix, last in self.multi
                        if len(prefix) <= length and _tail(prompt, output, len(prefix)) == prefix]
                if hits:
                    banned[slot] = hits
            index = _index(banned, self.device)
            if index is not None:
                logits[index] = float("-inf")
        return logits


GENERATION_LOGITS_PROCESSORS: tuple[type[LogitsProcessor], ...] = (
    NoRepeatNGramLogitsProcessor,
    BadWordsLogitsProcessor,  # HF's order: bad words before forced BOS/EOS, which win
    ForcedBOSEOSLogitsProcessor,
)
