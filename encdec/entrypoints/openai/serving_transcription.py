"""``POST /v1/audio/transcriptions`` and ``/v1/audio/translations`` over ``AsyncLLMEngine``.

A file becomes the job ``LLM.transcribe`` would make for the same options
(``encdec.transcription.make_job``: the sequential long-form algorithm by
default); ``run_job`` (``encdec.transcription.driver``) submits what the job
asks for to the shared engine, next to everyone else's requests, and feeds the
outputs back; its errors become HTTP errors here (``_run``). OpenAI's fields
map onto ``TranscribeOptions``: ``prompt`` is the ``initial_prompt``;
``temperature`` 0 means Whisper's automatic fallback through (0.0, 0.2, ...,
1.0) by the log-prob and compression-ratio thresholds, t > 0 decodes at t only; ``timestamp_granularities[]=word`` turns word timestamps on.
faster-whisper's ``beam_size`` and ``vad_filter`` are form fields of those names, as
its server (speaches) takes them; ``vad_filter=true`` needs the ``vad`` extra.
The result is written in the asked format: json, text, srt, vtt (text/plain
bodies, so the ``openai`` SDK returns ``str``) or verbose_json (OpenAI's segment
fields; ``segments`` unless only words were asked for, ``words`` when asked
for). ``stream=true`` sends ``transcript.text.delta`` events as windows are
decided, then ``transcript.text.done`` with the whole text and the usage, as the
SDK's ``TranscriptionStreamEvent`` parses them.
"""
from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError

from encdec.engine.async_llm_engine import AsyncLLMEngine
from encdec.entrypoints.openai.metrics import ServerMetrics
from encdec.entrypoints.openai.multipart import read_form
from encdec.entrypoints.openai.protocol import APIError, TranscriptionRequest
from encdec.structured_output.requests import request_constraint
from encdec.entrypoints.openai.sse import DONE, SSEResponse, sse
from encdec.transcription import TranscribeOptions, Transcription, format_transcription, make_job
from encdec.transcription.driver import ClientGone, JobProgress, run_job

# OpenAI's verbose_json segment fields, in its order
SEGMENT_FIELDS = ("id", "seek", "start", "end", "text", "tokens", "temperature", "avg_logprob",
                  "compression_ratio", "no_speech_prob")


def vad_installed() -> bool:
    """Whether ``vad_filter=true`` can run here (the ``vad`` extra: silero-vad)."""
    return importlib.util.find_spec("silero_vad") is not None


def _form_fields(form: Any) -> dict[str, Any]:
    """Multipart fields -> a dict for ``TranscriptionRequest`` (``x[]`` keys are lists)."""
    out: dict[str, Any] = {}
    for key in set(form.keys()) - {"file"}:
        if key.endswith("[]"):
            out[key[:-2]] = form.getlist(key)
        else:
            out[key] = form.get(key)
    return out


def _make_job(engine: Any, data: bytes, filename: str, options: TranscribeOptions) -> Any:
    """Uploaded bytes -> a job (which decodes them once; librosa reads paths, so
    through a temporary file). Runs off the event loop."""
    with tempfile.NamedTemporaryFile(suffix=_suffix(filename)) as f:
        f.write(data)
        f.flush()
        try:
            return make_job(engine, f.name, options)
        except ValueError as e:
            msg = str(e).replace(f"audio file {f.name!r}", "it").removeprefix("audio input 0: ")
            raise APIError(400, f"could not decode the audio file {filename!r}: {msg}", param="file") from None


def _suffix(filename: str) -> str:
    """The upload's extension, which decoders may go by (".mp3"), when it is a
    plain one; the name is the client's text (NUL bytes, slashes, any length)."""
    ext = os.path.splitext(filename)[1]
    return ext if re.fullmatch(r"\.[A-Za-z0-9]{1,9}", ext) else ""


class TranscriptionServer:
    def __init__(self, engine: AsyncLLMEngine, model_name: str, metrics: ServerMetrics):
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics

    @staticmethod
    def supports(engine: AsyncLLMEngine) -> bool:
        gc = getattr(engine, "generation_config", None)
        return getattr(gc, "no_timestamps_token_id", None) is not None

    async def handle(self, raw: Request, task: str, state: Any) -> Response:
        ctype = raw.headers.get("content-type", "")
        if not ctype.startswith("multipart/form-data"):
            raise APIError(415, f"send the audio as multipart/form-data (got content-type {ctype!r})",
                           param="file")
        limit = state.max_audio_bytes  # the body's size is capped as it streams (http_limits.BodyLimits)
        try:
            form = await read_form(raw, max_files=1, max_fields=64)  # RFC 5987 file names too
        except Exception as e:  # noqa: BLE001 - starlette's multipart errors, malformed bodies
            raise APIError(400, f"could not read the multipart form: {e}") from None
        try:
            upload = form.get("file")
            if upload is None or isinstance(upload, str):
                raise APIError(400, "file is required: the audio as a multipart file field", param="file")
            try:
                req = TranscriptionRequest.model_validate(_form_fields(form))
            except ValidationError as e:
                raise _refusal(e) from None
            state.check_model(req.model)
            self._refuse_unsupported(req, task)
            data = await upload.read()
            if len(data) > limit:
                raise APIError(413, f"the audio file is {len(data)} bytes, over the server's limit of "
                               f"{limit} bytes (--max-audio-mb)", param="file")
            if not data:
                raise APIError(400, "the audio file is empty", param="file")
            options = self._options(req, task)
            job = await asyncio.to_thread(_make_job, self.engine, data, upload.filename or "audio",
                                          options)
        finally:
            await form.close()
        base = f"trsc-{uuid.uuid4().hex}"
        if req.stream:
            return SSEResponse(self._stream(job, base))
        result = await _run(run_job(self.engine, job, request_id_prefix=base, is_disconnected=raw.is_disconnected))
        self.metrics.audio_seconds.inc(job.duration)
        return self._format(result, req, task)

    @staticmethod
    def _refuse_unsupported(req: TranscriptionRequest, task: str) -> None:
        if req.timestamp_granularities and req.response_format != "verbose_json":
            raise APIError(400, "timestamp_granularities needs response_format=verbose_json",
                           param="timestamp_granularities")
        if req.stream and req.response_format not in ("json", "text"):
            raise APIError(400, f"stream=true gives text events; response_format "
                           f"{req.response_format!r} cannot be streamed", param="stream")
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
        if req.stream_options is not None and req.stream_options.continuous_usage_stats:
            raise APIError(400, "continuous_usage_stats is not available for transcriptions (the "
                           "transcript.text.done event carries the usage)", param="stream_options")
        if not 0.0 <= req.temperature <= 1.0:
            raise APIError(400, f"temperature must be in [0, 1], got {req.temperature}", param="temperature")

    @staticmethod
    def options(req: TranscriptionRequest, task: str) -> TranscribeOptions:
        """The ``TranscribeOptions`` that ``LLM.transcribe`` runs for this request
        (module docstring); a value they refuse is a 400 naming the field."""
        if req.vad_filter and not vad_installed():
            raise APIError(400, "vad_filter=true needs the server's 'vad' extra (silero-vad), which is not "
                           "installed: pip install 'encdec[vad]'", param="vad_filter")
        kwargs: dict[str, Any] = {}
        if req.temperature > 0:  # 0: the default ladder, Whisper's automatic fallback
            kwargs["temperature"] = (req.temperature,)
        try:
            # the sequential mode: segments always carry times, whatever the format
            return TranscribeOptions(language=req.language, task=task, initial_prompt=req.prompt,
                                     word_timestamps="word" in req.timestamp_granularities,
                                     beam_size=req.beam_size, vad_filter=req.vad_filter,
                                     structured_outputs=request_constraint(req.structured_outputs), **kwargs)
        except (ValueError, TypeError) as e:
            fields = ("structured_outputs", "language", "prompt", "temperature", "beam_size", "vad_filter")
            name = next((f for f in fields if f in str(e)), None)
            raise APIError(400, str(e), param=name) from None

    def _options(self, req: TranscriptionRequest, task: str) -> TranscribeOptions:
        """``options``, refused (400) where this model cannot do them (``validate``
        reads the engine's configs only)."""
        options = self.options(req, task)
        try:
            options.validate(self.engine)
        except ValueError as e:
            param = "language" if "language" in str(e) else "model"
            raise APIError(400, str(e), param=param) from None
        limit = self.engine.engine.scheduler_config.max_num_seqs  # the engine refuses wider beams
        if options.beam_size > limit:
            raise APIError(400, f"beam_size is {options.beam_size}, more beams than this server runs at once "
                           f"(max_num_seqs={limit})", param="beam_size")
        return options

    def _format(self, t: Transcription, req: TranscriptionRequest, task: str) -> Response:
        fmt = req.response_format
        if fmt == "text":
            return PlainTextResponse(format_transcription(t, "txt"))
        if fmt in ("srt", "vtt"):
            return PlainTextResponse(format_transcription(t, fmt))
        usage = {"type": "duration", "seconds": round(t.duration, 3)}
        if fmt == "json":
            return JSONResponse({"text": t.text, "usage": usage})
        return JSONResponse({**verbose_json(t, task, req.timestamp_granularities), "usage": usage})

    async def _stream(self, job: Any, base: str) -> AsyncIterator[str]:
        queue: asyncio.Queue = asyncio.Queue()
        progress = JobProgress(lambda: queue.put_nowait(None))
        task = asyncio.ensure_future(_run(run_job(self.engine, job, request_id_prefix=base, progress=progress)))
        sent = ""
        try:
            while not task.done():
                getter = asyncio.ensure_future(queue.get())
                await asyncio.wait([getter, task], return_when=asyncio.FIRST_COMPLETED)
                getter.cancel()
                text = progress.text()
                if len(text) > len(sent) and text.startswith(sent):
                    yield sse({"type": "transcript.text.delta", "delta": text[len(sent):]})
                    sent = text
            t = task.result()
            if t.text != sent and t.text.startswith(sent):
                yield sse({"type": "transcript.text.delta", "delta": t.text[len(sent):]})
            self.metrics.audio_seconds.inc(job.duration)
            yield sse({"type": "transcript.text.done", "text": t.text, "usage": progress.usage(job.duration)})
        except APIError as e:
            yield sse(e.response_body())
        except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
            yield sse(APIError(500, f"{type(e).__name__}: {e}", type="internal_error").response_body())
        finally:
            task.cancel()
        yield DONE


async def _run(job_run: Awaitable[Transcription]) -> Transcription:
    """A job run by the driver, its errors as HTTP errors: a request the engine
    refuses is a 400 on the file (on structured_outputs where its constraint is
    what the engine cannot compile), a client that left a 499."""
    try:
        return await job_run
    except (ValueError, TypeError) as e:
        param = "structured_outputs" if str(e).startswith("structured_outputs") else "file"
        raise APIError(400, str(e), param=param) from None
    except ClientGone:
        raise APIError(499, "client closed the request") from None


def _refusal(e: ValidationError) -> APIError:
    parts, first = [], None
    for err in e.errors():
        name = ".".join(str(x) for x in err.get("loc", ())) or "form"
        first = first or name
        parts.append(f"unsupported field {name!r}" if err.get("type") == "extra_forbidden"
                     else f"{name}: {err.get('msg')}")
    return APIError(400, "; ".join(parts), param=first)


def verbose_json(t: Transcription, task: str, granularities: list[str]) -> dict[str, Any]:
    """OpenAI's verbose_json body (usage aside): the language named in full
    ("english"); ``segments`` with OpenAI's fields unless only ``word`` was asked
    for, ``words`` ({word, start, end}, the word without its leading space) when it was."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES  # code -> name

    body: dict[str, Any] = {"task": task, "language": LANGUAGES.get(t.language, t.language),
                            "duration": t.duration, "text": t.text}
    if not granularities or "segment" in granularities:
        body["segments"] = [{f: getattr(s, f) for f in SEGMENT_FIELDS} for s in t.segments]
    if "word" in granularities:
        body["words"] = [{"word": w.word.strip(), "start": w.start, "end": w.end}
                         for s in t.segments for w in s.words or []]
    return body
