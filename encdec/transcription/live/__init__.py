"""Live transcription: one sans-I/O turn state machine (``LiveSession``) that
``LLM.transcribe_stream`` and the Realtime WebSocket handler both drive, the
turn it grows (``Turn``, ``Agreement``) and the partial-pass policy across
sessions (``PartialBudget``)."""
from __future__ import annotations

from encdec.transcription.live.budget import PartialBudget, pass_priorities
from encdec.transcription.live.session import (
    MIN_TURN_CAP_S,
    Final,
    LiveSession,
    LiveTurn,
    Partial,
    SpeechStarted,
    SpeechStopped,
    TurnEnded,
)
from encdec.transcription.live.turn import (
    FINAL_PRIORITY,
    INPUT_RATES,
    MAX_PARTIAL_S,
    PARTIAL_EVERY_S,
    PARTIAL_PRIORITY,
    Agreement,
    Turn,
    partial_options,
    pcm16_to_float,
)

__all__ = ["FINAL_PRIORITY", "INPUT_RATES", "MAX_PARTIAL_S", "MIN_TURN_CAP_S", "PARTIAL_EVERY_S", "PARTIAL_PRIORITY", "Agreement",
           "Final", "LiveSession", "LiveTurn", "Partial", "PartialBudget", "SpeechStarted", "SpeechStopped", "Turn",
           "TurnEnded", "partial_options", "pass_priorities", "pcm16_to_float"]
