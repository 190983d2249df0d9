"""How many more tokens each running row can take before the block manager has
to act for it, kept across steps so that a decode step asks it only for the
rows whose block fills.

Every running row is checked each step (``Scheduler._schedule_running``): most
rows' next token lands in a block they alone hold, and the check (the row's
table, its length, the block's reference count) cost ~1.2 us a row in Python,
a tenth of a small model's step at 256 rows. A row's room (free slots past
this step's writes) only shrinks by one a step while the same rows run in the
same order with the same lookahead: each step appended one token to each, and
nothing forks a single-sequence row's blocks. So while that holds, the check is
one vector subtraction, and only rows whose room went negative go to the
block manager. Anything else (a row joined, left or was preempted, a lookahead
changed) starts over from a full check (``None`` from ``due``). No torch.
"""
from __future__ import annotations

import operator
from collections.abc import Sequence as Seq

import numpy as np

from encdec.sequence import SequenceGroup


class SlotRoom:
    def __init__(self) -> None:
        self._rows: list[SequenceGroup] | None = None  # the rows the room is known for, in order
        self._room = np.zeros(0, dtype=np.int64)
        self._lookahead = 0

    def forget(self) -> None:
        """The rows changed in a way ``due`` cannot see (preempted, resumed)."""
        self._rows = None

    def due(self, running: Seq[SequenceGroup], lookahead: int) -> list[int] | None:
        """Indices of ``running`` whose next write (plus ``lookahead``, the same
        for every row) does not fit in the blocks they hold; None where room is
        not known for these rows (check them all, then ``record``)."""
        rows = self._rows
        if (rows is None or lookahead != self._lookahead or len(rows) != len(running)
                or not all(map(operator.is_, running, rows))):
            return None
        self._room -= 1
        return np.flatnonzero(self._room < 0).tolist()

    def record(self, running: Seq[SequenceGroup], room: list[int], lookahead: int) -> None:
        """Room of every row of ``running`` after this step's writes."""
        self._rows, self._lookahead = list(running), lookahead
        self._room = np.array(room, dtype=np.int64)

    def set(self, index: int, room: int) -> None:
        """A due row got its blocks: its room now."""
        self._room[index] = room
