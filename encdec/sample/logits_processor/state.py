"""Recording batch changes (``BatchUpdateBuilder``) and holding the loaded
processors (``LogitsProcessors``).

One step of the persistent batch, as seed 000 prescribes:

    1. remove finished requests           [A,B,C,D]  -A,C->  [x,B,x,D]
    2. add new ones into the lowest holes [E,B,x,D]           added (0, E)
       then past the end                                      removed [2]
    3. condense: highest row -> lowest hole (UNIDIRECTIONAL)  [E,B,D]  moved (3->2)
    4. optional swaps                     [B,E,D]             moved (0<->1)

Adds and removes must come before the first move of a step, because processors
apply removes, then adds, then moves.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from encdec.sample.logits_processor.interface import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MovedRequest,
    MoveDirectionality,
)

if TYPE_CHECKING:
    import torch

    from encdec.sampling_params import SamplingParams

T = TypeVar("T")


class BatchUpdateBuilder:
    """Accumulates one step's removes, adds and moves for ``get_and_reset``."""

    def __init__(self) -> None:
        self.removed: list[int] = []  # slots emptied and not refilled this step
        self.added: list[AddedRequest] = []
        self.moved: list[MovedRequest] = []
        self.batch_changed = False

    def check_no_moves(self, what: str) -> None:
        """Removes and adds must precede this step's first move."""
        if self.moved:
            raise RuntimeError(
                f"{what} after a move in the same step: processors apply removes and "
                "adds before moves; call refresh_metadata() first"
            )

    def remove(self, index: int) -> None:
        self.check_no_moves("remove")
        # A request added and removed within one step was never seen by a processor:
        # drop its add, and report the slot removed to discard what it replaced.
        self.added = [a for a in self.added if a[0] != index]
        self.removed.append(index)
        self.batch_changed = True

    def peek_removed(self) -> int | None:
        """Lowest emptied slot, where the next add goes."""
        return min(self.removed) if self.removed else None

    def add(self, index: int, params: SamplingParams, prompt_token_ids: list[int],
            output_token_ids: list[int]) -> None:
        self.check_no_moves("add")
        if index in self.removed:
            self.removed.remove(index)  # replaced, not removed (seed 000's example)
        self.added.append((index, params, prompt_token_ids, output_token_ids))
        self.batch_changed = True

    def move(self, src: int, dst: int, direction: MoveDirectionality) -> None:
        self.moved.append((src, dst, direction))
        self.batch_changed = True

    def get_and_reset(self, batch_size: int) -> BatchUpdate | None:
        """The step's ``BatchUpdate``, or ``None`` when nothing changed."""
        if not self.batch_changed:
            return None
        update = BatchUpdate(batch_size, tuple(sorted(self.removed)), tuple(self.added),
                             tuple(self.moved))
        self.removed, self.added, self.moved = [], [], []
        self.batch_changed = False
        return update


def process_dict_updates(
    req_entries: dict[int, T],
    batch_update: BatchUpdate | None,
    new_state: Callable[[SamplingParams, list[int], list[int]], T | None],
) -> bool:
    """Apply a ``BatchUpdate`` to a sparse ``{slot: state}`` map; ``new_state``
    returns None for requests the processor ignores. Returns whether it changed."""
    if batch_update is None:
        return False
    changed = False
    for index in batch_update.removed:
        changed |= req_entries.pop(index, None) is not None
    for index, params, prompt_ids, output_ids in batch_update.added:
        state = new_state(params, prompt_ids, output_ids)
        if state is not None:
            req_entries[index] = state
            changed = True
        else:
            changed |= req_entries.pop(index, None) is not None
    for src, dst, direction in batch_update.moved:
        a = req_entries.pop(src, None)
        b = req_entries.pop(dst, None)
        if a is not None:
            req_entries[dst] = a
        if direction is MoveDirectionality.SWAP and b is not None:
            req_entries[src] = b
        changed |= a is not None or b is not None
    return changed


class LogitsProcessors:
    """The engine's loaded processors, split by argmax invariance once, at startup,
    so the sampler can skip the invariant ones for an all-greedy batch."""

    def __init__(self, logitsprocs: Iterable[LogitsProcessor] = ()) -> None:
        self.argmax_invariant: list[LogitsProcessor] = []
        self.non_argmax_invariant: list[LogitsProcessor] = []
        self.all: tuple[LogitsProcessor, ...] = ()
        for proc in logitsprocs:
            self.add(proc)

    def add(self, proc: LogitsProcessor) -> None:
        if not isinstance(proc, LogitsProcessor):
            raise TypeError(f"expected a LogitsProcessor instance, got {type(proc).__name__}")
        group = self.argmax_invariant if proc.is_argmax_invariant() else self.non_argmax_invariant
        group.append(proc)
        self.all = (*self.argmax_invariant, *self.non_argmax_invariant)

    def validate_params(self, params: Any) -> None:
        """Every processor's ``validate_params``; the engine calls it at request entry."""
        for proc in self.all:
            type(proc).validate_params(params)

    def slots_changing_argmax(self, lookahead: int = 0) -> set[int] | None:
        """Batch slots whose argmax some processor may change at their next
        ``1 + lookahead`` positions; None: any."""
        out: set[int] = set()
        for proc in self.non_argmax_invariant:
            slots = proc.slots_acted_on(lookahead)
            if slots is None:
                return None
            out.update(slots)
        return out

    def slots_changing_probs(self, lookahead: int = 0) -> set[int] | None:
        """``slots_changing_argmax`` counting the argmax-invariant processors too
        (min-p): the slots whose sampling distribution some processor may change."""
        out = self.slots_changing_argmax(lookahead)
        for proc in self.argmax_invariant:
            slots = proc.slots_acted_on(lookahead)
            if slots is None or out is None:
                return None
            out.update(slots)
        return out

    def apply_static(self, logits: torch.Tensor) -> torch.Tensor:
        """Every processor's row-independent part (``LogitsProcessor.apply_static``) on ``logits``."""
        for proc in self.non_argmax_invariant:
            proc.apply_static(logits)
        return logits

    def apply_at(self, logits: torch.Tensor, slots: Sequence[int], ahead: Sequence[Sequence[int]]) -> torch.Tensor:
        """Every processor's ``LogitsProcessor.apply_at`` on ``logits`` (draft
        rows: row ``i`` is slot ``slots[i]`` with ``ahead[i]`` more tokens), in
        the order the sampler applies them."""
        for proc in self.non_argmax_invariant:
            proc.apply_at(logits, slots, ahead)
        return logits

    def get(self, cls: type[T]) -> T | None:
        return next((p for p in self.all if isinstance(p, cls)), None)

    def __len__(self) -> int:
        return len(self.all)
