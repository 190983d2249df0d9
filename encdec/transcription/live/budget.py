"""``PartialBudget``: when a partial pass may run, for all live sessions of a
server at once; and the engine priorities of live passes."""
from __future__ import annotations

from typing import Any

from encdec.transcription.live.turn import FINAL_PRIORITY, PARTIAL_PRIORITY


class PartialBudget:
    """When a partial pass may run, for all sessions of a server at once: at most
    ``limit`` in flight, and none while any session's final pass is in flight.

    A partial pass costs a whole 30 s encoder window (0.1-0.4 s on a CPU), and the
    engine admits every waiting request at its next step, priority or not: a
    partial admitted beside a final pass, or between its decode steps, delays the
    text a listener waits for by one encoder pass. A pass that may not run is
    skipped, not queued (the next 100 ms of audio asks again), so partial passes
    yield to finals and never pile up; under overload they thin out first. One in
    flight by default: then at most one partial's encoder pass stands between a
    turn's end and its final pass."""

    def __init__(self, limit: int = 1) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"the partial pass limit must be an int >= 1, got {limit!r}")
        self.limit, self.in_flight = limit, 0
        self.finals = 0  # final passes being built or run, all sessions

    def take(self) -> bool:
        if self.finals or self.in_flight >= self.limit:
            return False
        self.in_flight += 1
        return True

    def release(self) -> None:
        self.in_flight -= 1

    def final_begins(self) -> None:
        self.finals += 1

    def final_ends(self) -> None:
        assert self.finals > 0, "final_ends without final_begins"
        self.finals -= 1


def pass_priorities(engine: Any) -> tuple[int, int]:
    """(final, partial) request priorities: ``FINAL_PRIORITY``/``PARTIAL_PRIORITY``
    under the priority policy, else 0 (fcfs refuses any other): a server started
    with ``--scheduling-policy fcfs`` runs passes in arrival order, as asked."""
    if engine.scheduling_policy == "priority":
        return FINAL_PRIORITY, PARTIAL_PRIORITY
    return 0, 0
