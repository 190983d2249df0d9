"""The batch-level logits processor contract (vLLM V1's, see seed 000).

A processor edits a ``(num_reqs, vocab)`` logits batch whose row ``i`` is the
request in slot ``i`` of the persistent batch. Before each step the batch tells
every processor how its slots changed, as one ``BatchUpdate``:

    removed   slot i emptied                      [A,B,C] -rm 1->   [A,x,C]
    added     slot i (re)filled with a request    [A,B,C] -add D@1-> [A,D,C]
    moved     UNIDIRECTIONAL s->d (d discarded)   [A,x,C,D] -3->1->  [A,D,C,x]
              SWAP s<->d                          [A,B,C,D] -3<->1-> [A,D,C,B]

Processors apply them in that order: removes, then adds, then moves (in list
order). Add indices are slot numbers before any move.
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from encdec.sampling_params import SamplingParams


class MoveDirectionality(enum.Enum):
    UNIDIRECTIONAL = enum.auto()  # s -> d; s becomes empty, d's old request is discarded
    SWAP = enum.auto()  # s <-> d


# (slot, params, prompt token ids, live output token ids). The output list is the
# one the engine appends to, so a processor that keeps it sees every new token.
AddedRequest = tuple[int, "SamplingParams", list[int], list[int]]
# (from slot, to slot, directionality)
MovedRequest = tuple[int, int, MoveDirectionality]
# Slot emptied without a replacement.
RemovedRequest = int


@dataclass(frozen=True)
class BatchUpdate:
    """How the persistent batch changed since the previous step."""

    batch_size: int  # rows after all the changes below
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """Base of built-in and custom processors.

    ``config`` exposes ``config.scheduler_config.max_num_seqs`` (the most rows a
    batch can have), so dense processors can preallocate per-slot state.
    """

    @abstractmethod
    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        raise NotImplementedError

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        """Raise ``ValueError`` for request parameters this processor cannot use;
        the engine calls it at request entry so a bad request never runs."""
        return None

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if ``apply`` never changes a row's argmax: such processors are
        skipped when the whole batch is greedy. Read once, at startup."""
        raise NotImplementedError

    def slots_acted_on(self, lookahead: int = 0) -> Collection[int] | None:
        """The batch slots ``apply`` may change by their own state (after the
        last ``update_state``) at the row's next ``1 + lookahead`` positions
        (processors that act at known lengths only may look); None: any slot. Speculative decoding verifies
        drafts only for greedy rows no processor that is not argmax-invariant
        acts on this way, so processors that keep per-slot state say which
        slots they hold. What a processor does alike to every row whatever its
        tokens goes in ``apply_static``."""
        return None

    def apply_static(self, logits: torch.Tensor) -> None:
        """Edit, in place, rows of any request the way ``apply`` edits every
        row regardless of its tokens (a fixed ban); speculative decoding runs
        it on draft rows. Default: nothing (``slots_acted_on`` covers all)."""
        return None

    def apply_at(self, logits: torch.Tensor, slots: Sequence[int], ahead: Sequence[Sequence[int]]) -> None:
        """Edit, in place, row ``i`` of ``logits`` as ``apply`` would edit slot
        ``slots[i]``'s row once its output had grown by ``ahead[i]`` (the draft
        tokens before that row): speculative decoding verifies draft rows with
        it, so a processor whose rules it computes per position here need not
        name those slots in ``slots_acted_on`` (Whisper's timestamp rules).
        Default: ``apply_static`` (the rest is in ``slots_acted_on``)."""
        self.apply_static(logits)

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called once per step before ``apply``; ``None`` means the batch's
        membership and order did not change (output lists may have grown)."""
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``(num_reqs, vocab)`` -> ``(num_reqs, vocab)``; may edit in place."""
        raise NotImplementedError
