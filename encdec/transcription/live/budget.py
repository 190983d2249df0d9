"""``PartialBudget``: how many partial passes may run at once, for all live
sessions of a server; and the engine priorities of live passes."""
from __future__ import annotations

from typing import Any

from encdec.transcription.live.turn import FINAL_PRIORITY, PARTIAL_PRIORITY


class PartialBudget:
    """How many partial passes may be in flight, for all sessions of a server at
    once (default 1; None: no cap but one per turn, ``LiveSession``). A pass that may not
    run is skipped, not queued: the next 100 ms of audio asks again, so partial
    passes never pile up and under overload they thin out first.

    Who runs first is the engine's: under the priority policy a final pass ranks
    ahead of partial passes, and both ahead of uploads (``pass_priorities``); while
    a final pass runs, less urgent requests wait before their encoder pass
    (``encdec.core.admission``: negative priorities hold encoder work back), and
    ``max_num_encoder_input_tokens`` spreads the encoder passes admitted together
    over steps. So this no longer holds partial passes back while a final pass is
    in flight: the engine does, for uploads too."""

    def __init__(self, limit: int | None = 1) -> None:
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"the partial pass limit must be an int >= 1 or None, got {limit!r}")
        self.limit, self.in_flight = limit, 0

    def take(self) -> bool:
        if self.limit is not None and self.in_flight >= self.limit:
            return False
        self.in_flight += 1
        return True

    def release(self) -> None:
        self.in_flight -= 1


def pass_priorities(engine: Any) -> tuple[int, int]:
    """(final, partial) request priorities: ``FINAL_PRIORITY``/``PARTIAL_PRIORITY``
    under the priority policy, else 0 (fcfs refuses any other): a server started
    with ``--scheduling-policy fcfs`` runs passes in arrival order, as asked."""
    if engine.scheduling_policy == "priority":
        return FINAL_PRIORITY, PARTIAL_PRIORITY
    return 0, 0
