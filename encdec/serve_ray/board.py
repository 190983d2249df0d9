"""Where the engine replicas of ``encdec serve --ray`` leave their metrics, so
that any replica answers ``/metrics`` for all of them (labelled by replica:
``asgi_relay.merge_metrics``)."""
from __future__ import annotations

import time
from typing import Any

BOARD = "encdec-metrics-board"


class MetricsBoard:
    """The last metrics text of each replica (a Ray actor, no CPU)."""

    def __init__(self) -> None:
        self.texts: dict[str, tuple[float, bytes]] = {}

    def put(self, replica: str, text: bytes) -> None:
        self.texts[replica] = (time.monotonic(), text)

    def snapshot(self, max_age: float) -> dict[str, bytes]:
        now = time.monotonic()
        return {r: text for r, (t, text) in self.texts.items() if now - t <= max_age}


def metrics_board() -> Any:
    """The board actor, made by whichever process asks first; if its owner dies
    with it, the next caller makes another (it refills within a push period)."""
    import ray

    return ray.remote(MetricsBoard).options(name=BOARD, get_if_exists=True, num_cpus=0).remote()
