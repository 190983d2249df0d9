"""``GET /v1/realtime?intent=transcription``: OpenAI's Realtime transcription
session over a WebSocket, for many live streams sharing one engine. This
handler parses client events and does the I/O; the turns are a
``LiveSession``'s (``encdec.transcription.live``), whose events it sends.

The client streams base64 PCM16 (``input_audio_buffer.append``); a turn starts
at speech (``server_vad``: Silero, ``input_audio_buffer.speech_started``) or at
the first audio after a commit (manual turns), and ends at the speech's end
(``speech_stopped``) or the client's ``input_audio_buffer.commit``. While it
grows, partial passes give ``conversation.item.input_audio_transcription.delta``
events (words two passes agree on); its end
gives ``input_audio_buffer.committed``, the final pass, the last ``delta`` and
``...completed`` (the whole transcript, as ``LLM.transcribe`` gives it for the
turn's samples, and the usage), or ``...failed``. A final pass's temperature
fallback samples as a seeded ``LLM.transcribe`` does (``sampling_params.seed``;
the session's ``seed``, ``REALTIME_SEED`` by default, as OpenAI's events carry
none): a turn's transcript depends on its samples alone, not on what else the
server runs, so a client can check it against ``LLM.transcribe`` of the samples
it sent (``audio_start_ms`` to ``audio_end_ms``). Passes are transcription jobs
driven by ``run_job`` next to every other request, final passes first: they rank
ahead under the priority policy (``encdec serve``'s default), which also holds less
urgent requests' encoder passes while one runs; ``PartialBudget`` caps partial
passes in flight across sessions. Leaving (or a
turn's end) cancels what a session still runs, which aborts its requests. A bad client
event gets an ``error`` event in OpenAI's shape and the session goes on.
``session.close`` (the event OpenAI's realtime translation sessions take)
finishes the open turn, answers ``session.closed``, and refuses later events.

Limits (``RealtimeLimits``, ``encdec serve --realtime-*``): a turn ends when it
reaches 30 s (``--realtime-max-turn-seconds``; OpenAI's server VAD ends long
turns at a limit of its own too): it is committed and transcribed as if the
client had committed it, at the quietest 100 ms of its last 5 s, and the next
turn goes on from there (with server VAD, ``speech_stopped`` and
``speech_started`` at the cut). A session with no client event for 300 s
(``--realtime-idle-timeout``), or older than 60 minutes
(``--realtime-max-session-seconds``), gets an ``error`` event
(``session_idle_timeout``, ``session_expired``) and is closed. An append of
more than 15 MiB of audio gets an ``error`` event and the session goes on.
Memory: appends are kept as a list of chunks (``LiveSession``), merged only
when a pass needs a turn's samples; a cleared or ended turn's audio is freed.
A refused handshake (bad key, model or intent) is logged at INFO.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import contextvars
import json
import logging
import time
from typing import Any

from encdec.engine.async_llm_engine import AsyncLLMEngine
from encdec.entrypoints.openai.realtime_protocol import (
    MAX_APPEND_BYTES,
    MIN_COMMIT_MS,
    RealtimeError,
    RealtimeLimits,
    SessionConfig,
    server_event,
)
from encdec.sampling_params import SamplingParams
from encdec.transcription import TranscribeOptions
from encdec.transcription.driver import JobProgress, run_job
from encdec.transcription.live import (
    PARTIAL_EVERY_S,
    LiveSession,
    LiveTurn,
    PartialBudget,
    SpeechStarted,
    SpeechStopped,
    TurnEnded,
    pass_priorities,
    pcm16_to_float,
)

logger = logging.getLogger("encdec")
CLIENT_EVENTS = ("session.update", "input_audio_buffer.append", "input_audio_buffer.commit",
                 "input_audio_buffer.clear", "session.close")
REALTIME_SEED = 0  # a session's seed for its final passes' fallback sampling, unless given


def session_options(language: str | None = None, prompt: str | None = None, *,
                    seed: int = REALTIME_SEED) -> TranscribeOptions:
    """A session's transcription options: ``LLM.transcribe``'s defaults with the
    session's language and prompt, and the seed its temperature fallback samples
    with, passed as a seeded ``transcribe`` call passes it (greedy windows read no
    seed). Unseeded, a final that falls back would take whatever the engine's
    generator holds after every other request: the same audio, another transcript."""
    return TranscribeOptions(language=language, initial_prompt=prompt,
                             sampling_params=SamplingParams(temperature=0.0, max_tokens=None, seed=seed))


class RealtimeSession:
    def __init__(self, ws: Any, engine: AsyncLLMEngine, *, served_model: str, metrics: Any,
                 partial_every: float = PARTIAL_EVERY_S, budget: PartialBudget | None = None,
                 limits: RealtimeLimits | None = None, seed: int = REALTIME_SEED) -> None:
        self.ws, self.engine, self.served_model, self.metrics = ws, engine, served_model, metrics
        self.partial_every = partial_every
        self.budget = budget or PartialBudget()
        self.limits = limits or RealtimeLimits()
        self.final_priority, self.partial_priority = pass_priorities(engine)
        self.config = SessionConfig()
        self.seed = seed
        self.options = session_options(seed=seed)
        self.live = self._live_session(self.config.rate)
        self._vad_key: Any = None
        self._send_lock = asyncio.Lock()
        self._partials: dict[LiveTurn, asyncio.Task] = {}  # partial pass in flight, per turn
        self.finals: set[asyncio.Task] = set()
        self._last_final: asyncio.Task | None = None
        self._previous_item: str | None = None
        self.closed = False

    # -- the connection ---------------------------------------------------------------
    async def serve(self) -> None:
        await self._set_vad()
        await self.send(server_event("session.created", session=self.config.session()))
        ends = time.monotonic() + self.limits.max_session_s
        try:
            while True:
                left = ends - time.monotonic()
                try:
                    message = await asyncio.wait_for(self.ws.receive(), min(self.limits.idle_timeout_s, left))
                except asyncio.TimeoutError:
                    await self._expire(idle=left > self.limits.idle_timeout_s)
                    return
                if message["type"] == "websocket.disconnect":
                    return
                await self._on_message(message.get("text"), message.get("bytes"))
        finally:
            self._cancel_all()

    async def _expire(self, *, idle: bool) -> None:
        """Say why the session ends (an ``error`` event), then close the connection."""
        if idle:
            error = RealtimeError(f"no client event for {self.limits.idle_timeout_s:g} s: the session is closed",
                                  code="session_idle_timeout")
        else:
            error = RealtimeError(f"the session reached its maximum duration of {self.limits.max_session_s:g} s",
                                  code="session_expired")
        await self.send(error.event(None))
        try:
            await self.ws.close(code=1000)
        except Exception:  # noqa: BLE001 - the client is already gone
            pass

    def _live_session(self, rate: int) -> LiveSession:
        return LiveSession(rate, partial_every=self.partial_every, max_turn_s=self.limits.max_turn_s)

    async def send(self, event: dict[str, Any]) -> None:
        async with self._send_lock:
            try:
                await self.ws.send_text(json.dumps(event))
            except Exception:  # noqa: BLE001 - the client is gone; serve() ends on its disconnect
                pass

    def _cancel_all(self) -> None:
        for t in list(self.finals) + list(self._partials.values()):
            t.cancel()  # cancelling a pass cancels its streams: the engine aborts its requests

    async def _on_message(self, text: str | None, data: bytes | None) -> None:
        event_id = None
        try:
            if text is None:
                raise RealtimeError("send client events as JSON text frames, not binary", code="invalid_json")
            try:
                event = json.loads(text)
            except json.JSONDecodeError as e:
                raise RealtimeError(f"the event is not valid JSON: {e}", code="invalid_json") from None
            if not isinstance(event, dict):
                raise RealtimeError("the event must be a JSON object", code="invalid_json")
            event_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
            kind = event.get("type")
            if kind not in CLIENT_EVENTS:
                raise RealtimeError(f"Invalid value: {kind!r}. This transcription session takes "
                                    f"{', '.join(CLIENT_EVENTS)}", param="type")
            if self.closed:
                raise RealtimeError(f"the session is closed (session.close): {kind} is refused",
                                    code="session_closed")
            await getattr(self, "_on_" + kind.replace(".", "_").replace("input_audio_buffer_", ""))(event)
        except RealtimeError as e:
            await self.send(e.event(event_id))

    # -- client events ----------------------------------------------------------------------
    async def _on_session_update(self, event: dict) -> None:
        config = self.config.update(event.get("session"))
        if config.model is not None and config.model != self.served_model:
            raise RealtimeError(f"The model `{config.model}` does not exist; this server serves "
                                f"`{self.served_model}`", param="session.audio.input.transcription.model",
                                code="model_not_found")
        if config.rate != self.config.rate and (self.live.open is not None or self.live.total):
            raise RealtimeError("the input format cannot change once audio was sent",
                                param="session.audio.input.format")
        try:
            options = session_options(config.language, config.prompt, seed=self.seed)
            options.validate(self.engine)
        except (ValueError, TypeError) as e:
            raise RealtimeError(str(e), param="session.audio.input.transcription.language") from None
        if config.rate != self.config.rate:  # no audio yet: a session at the new rate
            self.live, self._vad_key = self._live_session(config.rate), None
        self.config, self.options = config, options
        await self._set_vad()
        await self.send(server_event("session.updated", session=self.config.session()))

    async def _on_append(self, event: dict) -> None:
        audio = event.get("audio")
        if not isinstance(audio, str):
            raise RealtimeError("audio must be a base64 string of PCM16 samples", param="audio")
        if len(audio) > MAX_APPEND_BYTES * 4 // 3 + 4:
            raise RealtimeError(f"the audio chunk is over {MAX_APPEND_BYTES} bytes: send smaller appends",
                                param="audio", code="input_audio_buffer_append_too_large")
        try:
            data = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError) as e:
            raise RealtimeError(f"audio is not valid base64: {e}", param="audio") from None
        try:
            samples = pcm16_to_float(data)
        except ValueError as e:
            raise RealtimeError(str(e), param="audio") from None
        if self.live.vad is None:
            events = self.live.feed(samples)
        else:  # the voice detector runs off the event loop
            events = await asyncio.to_thread(self.live.feed, samples)
        await self._on_live_events(events)
        turn = self.live.partial_due()
        if turn is not None:
            await self._maybe_partial(turn)

    async def _on_commit(self, event: dict) -> None:
        turn = self.live.open
        if turn is None or turn.turn.duration * 1000 < MIN_COMMIT_MS:
            raise RealtimeError(f"the input audio buffer holds less than {MIN_COMMIT_MS} ms of audio to commit",
                                code="input_audio_buffer_commit_empty")
        await self._on_live_events(self.live.commit())

    async def _on_clear(self, event: dict) -> None:
        turn = self.live.clear()
        if turn is not None and turn in self._partials:
            self._partials[turn].cancel()
        await self.send(server_event("input_audio_buffer.cleared"))

    async def _on_session_close(self, event: dict) -> None:
        await self._on_live_events(self.live.finish())
        self.closed = True
        if self.finals:
            await asyncio.wait(list(self.finals))
        await self.send(server_event("session.closed"))

    # -- the session's events ----------------------------------------------------------------
    async def _set_vad(self) -> None:
        td = self.config.turn_detection
        key = None if td is None else tuple(sorted(td.items()))
        if key == self._vad_key:
            return
        self._vad_key = key
        if td is None:
            self.live.set_vad(None)
            return
        from encdec.transcription.vad import SpeechTurns

        self.live.set_vad(await asyncio.to_thread(SpeechTurns, td["threshold"], td["prefix_padding_ms"],
                                                  td["silence_duration_ms"]))

    async def _on_live_events(self, events: list[Any]) -> None:
        for e in events:
            if isinstance(e, SpeechStarted):
                await self.send(server_event("input_audio_buffer.speech_started", audio_start_ms=e.audio_start_ms,
                                             item_id=e.turn.item_id))
            elif isinstance(e, SpeechStopped):
                await self.send(server_event("input_audio_buffer.speech_stopped", audio_end_ms=e.audio_end_ms,
                                             item_id=e.turn.item_id))
            elif isinstance(e, TurnEnded):
                await self._end_turn(e.turn)

    async def _maybe_partial(self, turn: LiveTurn) -> None:
        if not self.budget.take():
            return  # every partial slot is busy: skip this one rather than queue it
        self.live.begin_partial(turn)  # one partial pass per turn at a time: never queued behind another
        try:
            job = await asyncio.to_thread(turn.partial_job, self.engine, self.options)
        except BaseException:
            self.budget.release()
            self.live.end_partial(turn, None)
            raise
        if self.live.open is not turn:  # the turn ended while the job was built
            self.budget.release()
            self.live.end_partial(turn, None)
            return
        prefix = f"rt-{turn.item_id}-p{turn.passes}"
        self._partials[turn] = asyncio.ensure_future(self._run_partial(turn, job, prefix))

    async def _run_partial(self, turn: LiveTurn, job: Any, prefix: str) -> None:
        text = None
        try:
            text = (await run_job(self.engine, job, request_id_prefix=prefix, priority=self.partial_priority)).text
        except Exception as e:  # noqa: BLE001 - a partial pass that fails leaves the final pass to say so
            logger.warning("realtime partial pass failed: %r", e)
            return
        finally:
            self._partials.pop(turn, None)
            self.budget.release()
            partial = self.live.end_partial(turn, text)
        if partial is not None:
            await self.send(server_event("conversation.item.input_audio_transcription.delta",
                                         item_id=turn.item_id, content_index=0, delta=partial.delta))
        turn = self.live.partial_due()
        if turn is not None:
            await self._maybe_partial(turn)

    async def _end_turn(self, turn: LiveTurn) -> None:
        if turn in self._partials:
            self._partials[turn].cancel()  # superseded by the final pass
        await self.send(server_event("input_audio_buffer.committed", item_id=turn.item_id,
                                     previous_item_id=self._previous_item))
        self._previous_item = turn.item_id
        job = await asyncio.to_thread(turn.final_job, self.engine, self.options)
        task = asyncio.ensure_future(self._run_final(turn, job, self._last_final))
        self._last_final = task
        self.finals.add(task)
        task.add_done_callback(self.finals.discard)

    async def _run_final(self, turn: LiveTurn, job: Any, before: asyncio.Task | None) -> None:
        progress = JobProgress()
        try:
            result = await run_job(self.engine, job, request_id_prefix=f"rt-{turn.item_id}-final", progress=progress,
                                   priority=self.final_priority)
        except Exception as e:  # noqa: BLE001 - reported in-band as OpenAI does
            message = str(e) if type(e) is ValueError else f"{type(e).__name__}: {e}"
            await self.send(server_event("conversation.item.input_audio_transcription.failed", item_id=turn.item_id,
                                         content_index=0, error={"type": "server_error", "code": None,
                                                                 "message": message, "param": None}))
            return
        if before is not None and not before.done():
            await asyncio.wait([before])  # turns complete in the order they were spoken
        final = self.live.final_text(turn, result.text)
        if final.delta:
            await self.send(server_event("conversation.item.input_audio_transcription.delta", item_id=turn.item_id,
                                         content_index=0, delta=final.delta))
        self.metrics.audio_seconds.inc(turn.turn.duration)
        await self.send(server_event("conversation.item.input_audio_transcription.completed",
                                     item_id=turn.item_id, content_index=0, transcript=result.text,
                                     usage=progress.usage(turn.turn.duration)))


_REFUSED = contextvars.ContextVar("encdec_realtime_refused", default=False)
_HANDSHAKE_NOT_COMPLETED = "ASGI callable returned without completing handshake."


class _RefusalLogFilter(logging.Filter):
    """uvicorn's WebSocket protocol logs every handshake answered with an HTTP
    response instead of an accept at ERROR ("returned without completing
    handshake"); a refusal of ours is logged at INFO by ``refuse_handshake``
    instead. The mark is a context variable of the connection's task, so an
    application bug that returns without a handshake still logs its ERROR."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_REFUSED.get() and record.getMessage() == _HANDSHAKE_NOT_COMPLETED)


_FILTER = _RefusalLogFilter()


async def refuse_handshake(ws: Any, response: Any, reason: str) -> None:
    """Answer a WebSocket handshake with ``response`` (an HTTP error in OpenAI's
    shape), logged at INFO: a refused client is not a server error."""
    logger.info("WebSocket %s refused: %s", ws.url.path, reason)
    uvicorn_log = logging.getLogger("uvicorn.error")
    if _FILTER not in uvicorn_log.filters:
        uvicorn_log.addFilter(_FILTER)
    _REFUSED.set(True)
    await ws.send_denial_response(response)
