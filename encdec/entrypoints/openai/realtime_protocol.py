"""OpenAI's Realtime transcription-session protocol: the session's settings as
``session.update`` sets them, server events, and the ``error`` event, with the
shapes of the ``openai`` package's ``types/realtime``.

A transcription session (``type: "transcription"``) takes ``audio.input``:
``format`` (``audio/pcm`` at 24 kHz, OpenAI's rate, or 16 kHz, Whisper's),
``transcription`` (``model``, ``language``, ``prompt``) and ``turn_detection``
(``server_vad`` with ``threshold``, ``prefix_padding_ms``,
``silence_duration_ms``; ``null`` for turns the client commits). Fields left
out of an update keep their value; anything else is refused naming its path.
"""
from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import Any

from encdec.transcription.live import INPUT_RATES, MIN_TURN_CAP_S
from encdec.transcription.vad import SERVER_VAD_DEFAULTS

# The most decoded audio one input_audio_buffer.append may carry: 15 MiB, as OpenAI allows. A
# bigger one gets an ``error`` event and the session goes on: the server takes WebSocket messages
# up to WS_MAX_MESSAGE_BYTES (a 16 MiB chunk is 21.4 MiB of base64), past which the connection
# is closed with 1009 (message too big) before the session sees it.
MAX_APPEND_BYTES = 15 << 20
WS_MAX_MESSAGE_BYTES = 32 << 20
MIN_COMMIT_MS = 100  # OpenAI refuses to commit less audio than this


@dataclass(frozen=True)
class RealtimeLimits:
    """What one session may take (``encdec serve``'s ``--realtime-*`` flags)."""

    # a turn ends (final pass, ``completed``) when it reaches this length; OpenAI's server VAD
    # also ends turns at a limit of its own. 30 s is one Whisper window: every partial pass
    # covers the whole turn, the final pass is one window, and a turn's audio stays bounded.
    max_turn_s: float = 30.0
    idle_timeout_s: float = 300.0  # the session is closed after this long without a client event
    max_session_s: float = 3600.0  # and at this age, whatever it does (OpenAI's 60 minutes)

    def __post_init__(self) -> None:
        if not self.max_turn_s >= MIN_TURN_CAP_S:
            raise ValueError(f"--realtime-max-turn-seconds must be >= {MIN_TURN_CAP_S}, got {self.max_turn_s}")
        for flag, value in (("--realtime-idle-timeout", self.idle_timeout_s),
                            ("--realtime-max-session-seconds", self.max_session_s)):
            if not value > 0:
                raise ValueError(f"{flag} must be > 0 seconds, got {value}")


class RealtimeError(Exception):
    """A client event refused: sent back as an ``error`` event; the session goes on."""

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_value",
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.type = message, param, code, type

    def event(self, client_event_id: str | None) -> dict[str, Any]:
        return server_event("error", error={"type": self.type, "code": self.code, "message": self.message,
                                            "param": self.param, "event_id": client_event_id})


def server_event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "event_id": f"event_{uuid.uuid4().hex[:20]}", **fields}


@dataclass(frozen=True)
class SessionConfig:
    rate: int = 24000  # input samples per second (PCM16 mono little-endian)
    model: str | None = None  # audio.input.transcription.model (must be the served one, if given)
    language: str | None = None
    prompt: str | None = None
    # server_vad settings; None: the client commits each turn
    turn_detection: dict[str, Any] | None = field(default_factory=lambda: dict(SERVER_VAD_DEFAULTS))
    id: str = field(default_factory=lambda: f"sess_{uuid.uuid4().hex[:20]}")

    def session(self) -> dict[str, Any]:
        """The session object of ``session.created`` / ``session.updated``."""
        vad = None if self.turn_detection is None else {"type": "server_vad", **self.turn_detection}
        return {"type": "transcription", "id": self.id, "object": "realtime.transcription_session",
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": self.rate},
                                    "transcription": {"model": self.model, "language": self.language,
                                                      "prompt": self.prompt},
                                    "noise_reduction": None, "turn_detection": vad}},
                "include": []}

    def update(self, session: Any) -> SessionConfig:
        """This config with ``session.update``'s ``session`` applied."""
        _keys(session, "session", {"type", "audio", "include"}, required={"type"})
        if session["type"] != "transcription":
            raise RealtimeError(f"this server runs transcription sessions: session.type must be 'transcription', "
                                f"got {session['type']!r}", param="session.type")
        if session.get("include"):
            raise RealtimeError("session.include is not supported (no logprobs in events)", param="session.include")
        new: dict[str, Any] = {}
        audio = session.get("audio")
        if audio is not None:
            _keys(audio, "session.audio", {"input"})
            inp = audio.get("input")
            if inp is not None:
                _keys(inp, "session.audio.input", {"format", "transcription", "turn_detection", "noise_reduction"})
                if inp.get("noise_reduction") is not None:
                    raise RealtimeError("noise_reduction is not supported: set it to null",
                                        param="session.audio.input.noise_reduction")
                if "format" in inp:
                    new["rate"] = _format(inp["format"])
                if inp.get("transcription") is not None:
                    new.update(_transcription(inp["transcription"]))
                if "turn_detection" in inp:
                    new["turn_detection"] = _turn_detection(inp["turn_detection"])
        return dataclasses.replace(self, **new)


def _keys(value: Any, where: str, known: set[str], *, required: set[str] = frozenset()) -> None:
    if not isinstance(value, dict):
        raise RealtimeError(f"{where} must be an object, got {type(value).__name__}", param=where)
    unknown = sorted(set(value) - known)
    if unknown:
        raise RealtimeError(f"{where}: unknown field {unknown[0]!r}", param=f"{where}.{unknown[0]}",
                            code="unknown_parameter")
    missing = sorted(required - set(value))
    if missing:
        raise RealtimeError(f"{where}.{missing[0]} is required", param=f"{where}.{missing[0]}",
                            code="missing_required_parameter")


def _format(fmt: Any) -> int:
    where = "session.audio.input.format"
    if fmt is None:
        return 24000
    _keys(fmt, where, {"type", "rate"})
    if fmt.get("type", "audio/pcm") != "audio/pcm":
        raise RealtimeError(f"audio format {fmt.get('type')!r} is not supported: send 'audio/pcm' "
                            "(16-bit little-endian mono)", param=f"{where}.type")
    rate = fmt.get("rate", 24000)
    if isinstance(rate, bool) or rate not in INPUT_RATES:
        raise RealtimeError(f"audio/pcm rate must be one of {list(INPUT_RATES)}, got {rate!r}",
                            param=f"{where}.rate")
    return int(rate)


def _transcription(t: Any) -> dict[str, Any]:
    where = "session.audio.input.transcription"
    if isinstance(t, dict) and "structured_outputs" in t:
        raise RealtimeError("structured_outputs is not supported in realtime sessions (a turn's partial text "
                            "is decoded again as audio arrives); send the audio to POST "
                            "/v1/audio/transcriptions with the structured_outputs form field",
                            param=f"{where}.structured_outputs", code="unsupported_parameter")
    _keys(t, where, {"model", "language", "prompt"})
    out = {}
    for name in ("model", "language", "prompt"):
        if name in t:
            if t[name] is not None and not isinstance(t[name], str):
                raise RealtimeError(f"{where}.{name} must be a string, got {type(t[name]).__name__}",
                                    param=f"{where}.{name}")
            out[name] = t[name] or None
    return out


def _turn_detection(td: Any) -> dict[str, Any] | None:
    where = "session.audio.input.turn_detection"
    if td is None:
        return None
    _keys(td, where, {"type", *SERVER_VAD_DEFAULTS, "create_response", "interrupt_response", "idle_timeout_ms"},
          required={"type"})
    if td["type"] != "server_vad":
        raise RealtimeError(f"turn_detection type {td['type']!r} is not supported: use 'server_vad' or null",
                            param=f"{where}.type")
    if td.get("idle_timeout_ms") is not None:
        raise RealtimeError("idle_timeout_ms is not supported", param=f"{where}.idle_timeout_ms")
    out = dict(SERVER_VAD_DEFAULTS)
    for name in SERVER_VAD_DEFAULTS:
        value = td.get(name)
        if value is None:
            continue
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1) if name == "threshold" \
            else (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 10_000)
        if not ok:
            limits = "a number in (0, 1)" if name == "threshold" else "an int in [0, 10000] (ms)"
            raise RealtimeError(f"{where}.{name} must be {limits}, got {value!r}", param=f"{where}.{name}")
        out[name] = value
    return out
