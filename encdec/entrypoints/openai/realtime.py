"""``GET /v1/realtime?intent=transcription``: OpenAI's Realtime transcription
session over a WebSocket, for many live streams sharing one engine.

The client streams base64 PCM16 (``input_audio_buffer.append``); a turn starts
at speech (``server_vad``: Silero, ``input_audio_buffer.speech_started``) or at
the first audio after a commit (manual turns), and ends at the speech's end
(``speech_stopped``) or the client's ``input_audio_buffer.commit``. While it
grows, partial passes give ``conversation.item.input_audio_transcription.delta``
events (words two passes agree on, ``encdec.transcription.live``); its end
gives ``input_audio_buffer.committed``, the final pass, the last ``delta`` and
``...completed`` (the whole transcript, as ``LLM.transcribe`` gives it for the
turn's samples, and the usage), or ``...failed``. Passes are transcription jobs
driven by ``run_job`` next to every other request, final passes first: they rank
ahead under the priority policy (``encdec serve``'s default), and no partial pass
of any session starts while one is in flight (``PartialBudget``). Leaving (or a
turn's end) cancels what a session still runs, which aborts its requests. A bad client
event gets an ``error`` event in OpenAI's shape and the session goes on.
``session.close`` (the event OpenAI's realtime translation sessions take)
finishes the open turn, answers ``session.closed``, and refuses later events.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import uuid
from typing import Any

import numpy as np

from encdec.engine.async_llm_engine import AsyncLLMEngine
from encdec.entrypoints.openai.realtime_protocol import (
    MAX_APPEND_BYTES,
    MIN_COMMIT_MS,
    RealtimeError,
    SessionConfig,
    server_event,
)
from encdec.entrypoints.openai.transcription_jobs import JobProgress, run_job
from encdec.transcription import TranscribeOptions
from encdec.transcription.live import (
    FINAL_PRIORITY,
    PARTIAL_EVERY_S,
    PARTIAL_PRIORITY,
    Turn,
    pcm16_to_float,
)

logger = logging.getLogger("encdec")
CLIENT_EVENTS = ("session.update", "input_audio_buffer.append", "input_audio_buffer.commit",
                 "input_audio_buffer.clear", "session.close")


class _OpenTurn:
    """The turn being spoken: its item, where it starts in the session's audio, its partial pass."""

    def __init__(self, rate: int, start: int, partial_every: float) -> None:
        self.item_id = f"item_{uuid.uuid4().hex[:20]}"
        self.turn = Turn(rate, partial_every=partial_every)
        self.start = self.fed = start  # session sample where it starts / up to which it has audio
        self.partial: asyncio.Task | None = None  # the partial pass in flight
        self.asking = False  # a partial pass is being built
        self.passes = 0


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
    turn's end and its final pass. realtime_bench, 4 streams on 2 cores: final p95
    alike on an idle host (1.04 s with 1, 1.02 s with 2), better with 1 when another
    process takes a core (1.5-1.9 s against 2.0 s)."""

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


def pass_priorities(engine: AsyncLLMEngine) -> tuple[int, int]:
    """(final, partial) request priorities: ``FINAL_PRIORITY``/``PARTIAL_PRIORITY``
    under the priority policy, else 0 (fcfs refuses any other): a server started
    with ``--scheduling-policy fcfs`` runs passes in arrival order, as asked."""
    if engine.scheduling_policy == "priority":
        return FINAL_PRIORITY, PARTIAL_PRIORITY
    return 0, 0


class RealtimeSession:
    def __init__(self, ws: Any, engine: AsyncLLMEngine, *, served_model: str, metrics: Any,
                 partial_every: float = PARTIAL_EVERY_S, budget: PartialBudget | None = None) -> None:
        self.ws, self.engine, self.served_model, self.metrics = ws, engine, served_model, metrics
        self.partial_every = partial_every
        self.budget = budget or PartialBudget()
        self.final_priority, self.partial_priority = pass_priorities(engine)
        self.config = SessionConfig()
        self.options = TranscribeOptions()
        self.vad: Any = None
        self._vad_key: Any = None
        self._send_lock = asyncio.Lock()
        self._audio = np.zeros(0, np.float32)  # session audio at the input rate, from sample _base
        self._base = 0
        self._total = 0  # samples received since the session began
        self.open: _OpenTurn | None = None
        self.finals: set[asyncio.Task] = set()
        self._last_final: asyncio.Task | None = None
        self._previous_item: str | None = None
        self.closed = False

    # -- the connection ---------------------------------------------------------------
    async def serve(self) -> None:
        await self._set_vad()
        await self.send(server_event("session.created", session=self.config.session()))
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    return
                await self._on_message(message.get("text"), message.get("bytes"))
        finally:
            self._cancel_all()

    async def send(self, event: dict[str, Any]) -> None:
        async with self._send_lock:
            try:
                await self.ws.send_text(json.dumps(event))
            except Exception:  # noqa: BLE001 - the client is gone; serve() ends on its disconnect
                pass

    def _cancel_all(self) -> None:
        tasks = list(self.finals) + ([self.open.partial] if self.open and self.open.partial else [])
        for t in tasks:
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
        if config.rate != self.config.rate and (self.open is not None or self._total):
            raise RealtimeError("the input format cannot change once audio was sent",
                                param="session.audio.input.format")
        try:
            options = TranscribeOptions(language=config.language, initial_prompt=config.prompt)
            options.validate(self.engine)
        except (ValueError, TypeError) as e:
            raise RealtimeError(str(e), param="session.audio.input.transcription.language") from None
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
        await self._add_audio(samples)

    async def _on_commit(self, event: dict) -> None:
        turn = self.open
        if turn is None or turn.turn.duration * 1000 < MIN_COMMIT_MS:
            raise RealtimeError(f"the input audio buffer holds less than {MIN_COMMIT_MS} ms of audio to commit",
                                code="input_audio_buffer_commit_empty")
        if self.vad is not None:
            await self._set_vad(force=True)  # the turn ends here: the detector starts over
        await self._end_turn(self._total)

    async def _on_clear(self, event: dict) -> None:
        if self.open is not None and self.open.partial is not None:
            self.open.partial.cancel()
        self.open = None
        self._trim()
        if self.vad is not None:
            await self._set_vad(force=True)
        await self.send(server_event("input_audio_buffer.cleared"))

    async def _on_session_close(self, event: dict) -> None:
        if self.open is not None and self.open.turn.num_samples:
            await self._end_turn(self._total)
        self.closed = True
        if self.finals:
            await asyncio.wait(list(self.finals))
        await self.send(server_event("session.closed"))

    # -- audio and turns ----------------------------------------------------------------------
    async def _set_vad(self, force: bool = False) -> None:
        td = self.config.turn_detection
        key = None if td is None else tuple(sorted(td.items()))
        if key == self._vad_key and not force:
            return
        self._vad_key = key
        if td is None:
            self.vad = None
            return
        from encdec.transcription.vad import SpeechTurns

        self.vad = await asyncio.to_thread(SpeechTurns, td["threshold"], td["prefix_padding_ms"],
                                           td["silence_duration_ms"])

    async def _add_audio(self, samples: np.ndarray) -> None:
        start = self._total
        self._audio = np.concatenate([self._audio, samples])
        self._total += len(samples)
        rate = self.config.rate
        if self.vad is None:
            if self.open is None:
                self.open = _OpenTurn(rate, start, self.partial_every)
        else:
            events = await asyncio.to_thread(self.vad.feed, _to_16k(samples, rate))
            for kind, ms in events:
                at = min(max(ms * rate // 1000, self._base), self._total)
                if kind == "started":
                    self.open = _OpenTurn(rate, at, self.partial_every)
                    await self.send(server_event("input_audio_buffer.speech_started", audio_start_ms=ms,
                                                 item_id=self.open.item_id))
                elif self.open is not None:
                    await self.send(server_event("input_audio_buffer.speech_stopped", audio_end_ms=ms,
                                                 item_id=self.open.item_id))
                    await self._end_turn(at)
        if self.open is not None:
            self._feed(self.open, self._total)
            await self._maybe_partial(self.open)
        else:
            self._trim()

    def _feed(self, turn: _OpenTurn, end: int) -> None:
        """Give the turn the session's audio up to sample ``end``."""
        if end > turn.fed:
            turn.turn.append(self._audio[turn.fed - self._base:end - self._base])
            turn.fed = end

    def _trim(self) -> None:
        """Keep only what a turn starting now could reach back to (its prefix padding)."""
        keep = self._total - self.config.rate  # 1 s: more than any prefix padding used in practice
        if self.config.turn_detection is not None:
            keep = self._total - (self.config.turn_detection["prefix_padding_ms"] + 500) * self.config.rate // 1000
        keep = max(keep, self._base)
        self._audio, self._base = self._audio[keep - self._base:], keep

    async def _maybe_partial(self, turn: _OpenTurn) -> None:
        if turn.partial is not None or turn.asking or self.open is not turn or not turn.turn.partial_due():
            return  # one partial pass at a time per stream: never queue one behind another
        if not self.budget.take():
            return  # every partial slot is busy: skip this one rather than queue it
        turn.asking = True  # building the job (off the loop): no second pass meanwhile
        try:
            job = await asyncio.to_thread(turn.turn.partial_job, self.engine, self.options)
        except BaseException:
            self.budget.release()
            raise
        finally:
            turn.asking = False
        if self.open is not turn:  # the turn ended while the job was built
            self.budget.release()
            return
        turn.passes += 1
        turn.partial = asyncio.ensure_future(self._run_partial(turn, job, f"rt-{turn.item_id}-p{turn.passes}"))

    async def _run_partial(self, turn: _OpenTurn, job: Any, prefix: str) -> None:
        try:
            result = await run_job(self.engine, job, request_id_prefix=prefix, priority=self.partial_priority)
        except Exception as e:  # noqa: BLE001 - a partial pass that fails leaves the final pass to say so
            logger.warning("realtime partial pass failed: %r", e)
            return
        finally:
            turn.partial = None
            self.budget.release()
        if self.open is not turn:  # the turn ended meanwhile: its final pass has the last word
            return
        delta = turn.turn.agreement.partial(result.text)  # words agreed here are sent, none held back
        if delta:
            await self.send(server_event("conversation.item.input_audio_transcription.delta",
                                         item_id=turn.item_id, content_index=0, delta=delta))
        await self._maybe_partial(turn)

    async def _end_turn(self, end: int) -> None:
        turn, self.open = self.open, None
        if turn is None:
            return
        self._feed(turn, end)
        if turn.partial is not None:
            turn.partial.cancel()  # superseded by the final pass
        await self.send(server_event("input_audio_buffer.committed", item_id=turn.item_id,
                                     previous_item_id=self._previous_item))
        self._previous_item = turn.item_id
        self._trim()
        self.budget.final_begins()  # from here no partial pass starts, in any session
        try:
            job = await asyncio.to_thread(turn.turn.final_job, self.engine, self.options)
        except BaseException:
            self.budget.final_ends()
            raise
        task = asyncio.ensure_future(self._run_final(turn, job, self._last_final))
        task.add_done_callback(lambda _: self.budget.final_ends())  # however it ends, cancelled unstarted too
        self._last_final = task
        self.finals.add(task)
        task.add_done_callback(self.finals.discard)

    async def _run_final(self, turn: _OpenTurn, job: Any, before: asyncio.Task | None) -> None:
        progress = JobProgress()
        try:
            result = await run_job(self.engine, job, request_id_prefix=f"rt-{turn.item_id}-final", progress=progress,
                                   priority=self.final_priority)
        except Exception as e:  # noqa: BLE001 - reported in-band as OpenAI does
            message = getattr(e, "message", None) or f"{type(e).__name__}: {e}"
            await self.send(server_event("conversation.item.input_audio_transcription.failed", item_id=turn.item_id,
                                         content_index=0, error={"type": "server_error", "code": None,
                                                                 "message": message, "param": None}))
            return
        if before is not None and not before.done():
            await asyncio.wait([before])  # turns complete in the order they were spoken
        delta = turn.turn.agreement.final(result.text)
        if delta:
            await self.send(server_event("conversation.item.input_audio_transcription.delta", item_id=turn.item_id,
                                         content_index=0, delta=delta))
        self.metrics.audio_seconds.inc(turn.turn.duration)
        await self.send(server_event("conversation.item.input_audio_transcription.completed",
                                     item_id=turn.item_id, content_index=0, transcript=result.text,
                                     usage=progress.usage(turn.turn.duration)))


def _to_16k(samples: np.ndarray, rate: int) -> np.ndarray:
    """The VAD's input: 24 kHz chunks resampled 2:3 (polyphase); chunk edges do not matter to it."""
    if rate == 16000:
        return samples
    from scipy.signal import resample_poly

    return resample_poly(samples, 2, 3).astype(np.float32)
