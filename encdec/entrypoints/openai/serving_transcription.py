"""``POST /v1/audio/transcriptions`` and ``/v1/audio/translations`` over ``AsyncLLMEngine``.

A file becomes a ``TranscriptionJob`` (the same one ``LLM.transcribe`` runs);
``run_job`` submits what the job asks for to the shared engine, next to
everyone else's requests, and feeds the outputs back. The result is written in
the asked format: json, text, srt, vtt (text/plain bodies, so the ``openai``
SDK returns ``str``) or verbose_json. ``stream=true`` sends
``transcript.text.delta`` events as windows finish in order, then
``transcript.text.done`` with the whole text and the usage, as the SDK's
``TranscriptionStreamEvent`` parses them.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError

from encdec.engine.async_llm_engine import AsyncLLMEngine, AsyncRequest, final_output
from encdec.entrypoints.openai.metrics import ServerMetrics
from encdec.entrypoints.openai.protocol import APIError, TranscriptionRequest
from encdec.entrypoints.openai.sse import DONE, SSEResponse, sse
from encdec.outputs import RequestOutput
from encdec.sampling_params import SamplingParams
from encdec.transcription import TranscribeOptions, Transcription, TranscriptionJob, format_transcription
from encdec.transcription.windows import segments_from_tokens



def _form_fields(form: Any) -> dict[str, Any]:
    """Multipart fields -> a dict for ``TranscriptionRequest`` (``x[]`` keys are lists)."""
    out: dict[str, Any] = {}
    for key in set(form.keys()) - {"file"}:
        if key.endswith("[]"):
            out[key[:-2]] = form.getlist(key)
        else:
            out[key] = form.get(key)
    return out


def _make_job(engine: Any, data: bytes, filename: str, options: TranscribeOptions) -> TranscriptionJob:
    """Uploaded bytes -> a job (which decodes them once; librosa reads paths, so
    through a temporary file). Runs off the event loop."""
    suffix = os.path.splitext(filename)[1][:10]
    with tempfile.NamedTemporaryFile(suffix=suffix) as f:
        f.write(data)
        f.flush()
        try:
            return TranscriptionJob(engine, f.name, options)
        except ValueError as e:
            msg = str(e).replace(f"audio file {f.name!r}", "it").removeprefix("audio input 0: ")
            raise APIError(400, f"could not decode the audio file {filename!r}: {msg}", param="file") from None


class TranscriptionServer:
    def __init__(self, engine: AsyncLLMEngine, model_name: str, metrics: ServerMetrics):
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics

    @staticmethod
    def supports(engine: AsyncLLMEngine) -> bool:
        gc = getattr(engine.engine, "generation_config", None)
        return getattr(gc, "no_timestamps_token_id", None) is not None

    async def handle(self, raw: Request, task: str, state: Any) -> Response:
        ctype = raw.headers.get("content-type", "")
        if not ctype.startswith("multipart/form-data"):
            raise APIError(415, f"send the audio as multipart/form-data (got content-type {ctype!r})",
                           param="file")
        limit = state.max_audio_bytes
        length = raw.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit + (1 << 20):
            raise APIError(413, f"the upload is {int(length)} bytes, over the server's limit of "
                           f"{limit} bytes of audio (--max-audio-mb)", param="file")
        try:
            form = await raw.form(max_files=1, max_fields=64)
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
            job = await asyncio.to_thread(_make_job, self.engine.engine, data, upload.filename or "audio",
                                          options)
        finally:
            await form.close()
        base = f"trsc-{uuid.uuid4().hex}"
        if req.stream:
            return SSEResponse(self._stream(job, base))
        result = await run_job(self.engine, job, request_id_prefix=base, is_disconnected=raw.is_disconnected)
        self.metrics.audio_seconds.inc(job.duration)
        return self._format(result, req, task)

    @staticmethod
    def _refuse_unsupported(req: TranscriptionRequest, task: str) -> None:
        if req.timestamp_granularities and req.response_format != "verbose_json":
            raise APIError(400, "timestamp_granularities needs response_format=verbose_json",
                           param="timestamp_granularities")
        if "word" in req.timestamp_granularities:
            raise APIError(400, "word timestamps are not available in this build",
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

    def _options(self, req: TranscriptionRequest, task: str) -> TranscribeOptions:
        """The request's options, refused (400) where this model cannot do them.
        ``validate`` runs without sampling params: with them it would run the
        engine's request check off the engine thread."""
        timestamps = req.response_format in ("srt", "vtt", "verbose_json")
        options = TranscribeOptions(language=req.language, task=task, timestamps=timestamps, prompt=req.prompt)
        try:
            options.validate(self.engine.engine)
        except ValueError as e:
            param = "language" if "language" in str(e) else "model"
            raise APIError(400, str(e), param=param) from None
        if req.temperature == 0.0:
            return options
        params = SamplingParams(temperature=req.temperature, max_tokens=None)
        return dataclasses.replace(options, sampling_params=params)

    def _format(self, t: Transcription, req: TranscriptionRequest, task: str) -> Response:
        fmt = req.response_format
        if fmt == "text":
            return PlainTextResponse(format_transcription(t, "txt"))
        if fmt in ("srt", "vtt"):
            return PlainTextResponse(format_transcription(t, fmt))
        usage = {"type": "duration", "seconds": round(t.duration, 3)}
        if fmt == "json":
            return JSONResponse({"text": t.text, "usage": usage})
        segments = [{"id": i, **asdict(s)} for i, s in enumerate(t.segments)]
        from transformers.models.whisper.tokenization_whisper import LANGUAGES  # code -> name

        # verbose_json names the language in full ("english"), as OpenAI does.
        return JSONResponse({"task": task, "language": LANGUAGES.get(t.language, t.language),
                             "duration": t.duration, "text": t.text, "segments": segments,
                             "usage": usage})

    async def _stream(self, job: TranscriptionJob, base: str) -> AsyncIterator[str]:
        queue: asyncio.Queue = asyncio.Queue()
        progress = JobProgress(self.engine.engine, lambda: queue.put_nowait(None))
        task = asyncio.ensure_future(run_job(self.engine, job, request_id_prefix=base, progress=progress))
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
            yield sse({"type": "transcript.text.done", "text": t.text, "usage": progress.usage()})
        except APIError as e:
            yield sse(e.response_body())
        except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
            yield sse(APIError(500, f"{type(e).__name__}: {e}", type="internal_error").response_body())
        finally:
            task.cancel()
        yield DONE


class JobProgress:
    """What a driver learns of a job from the requests it submits: the usage, and
    the text of the windows finished in order (for ``transcript.text.delta``).

    A window's text is ``segments_from_tokens`` of its tokens without timestamps,
    as the job computes it (streams are json/text: no timestamps). Requests handed
    out while the job has no language are language detection, not windows."""

    AUDIO_TOKENS = 1500  # Whisper encoder positions per 30 s window

    def __init__(self, engine: Any, notify: Callable[[], None] | None = None):
        gc = engine.generation_config
        self.ts_begin, self.eot, self.tokenizer = gc.no_timestamps_token_id + 1, gc.eos_token_id, engine.tokenizer
        self.notify = notify
        self.windows: list[int] = []  # window tickets, in order
        self.texts: dict[int, str] = {}  # window ticket -> text, once finished
        self.requests = self.text_tokens = self.output_tokens = 0

    def handed_out(self, job: TranscriptionJob, batch: list[Any]) -> None:
        if job.language is not None:
            self.windows += [r.ticket for r in batch]

    def finished(self, output: RequestOutput, ticket: int) -> None:
        tokens = output.outputs[0].token_ids
        self.requests += 1
        self.text_tokens += len(output.prompt_token_ids)
        self.output_tokens += len(tokens)
        if ticket in self.windows:
            segs = segments_from_tokens(tokens, 0.0, 0.0, self.ts_begin, self.eot, self.tokenizer, False)
            self.texts[ticket] = "".join(s.text for s in segs)
        if self.notify is not None:
            self.notify()

    def text(self) -> str:
        done = []
        for ticket in self.windows:
            if ticket not in self.texts:
                break
            done.append(self.texts[ticket])
        return "".join(done).strip()

    def usage(self) -> dict[str, Any]:
        audio = self.AUDIO_TOKENS * self.requests
        return {"type": "tokens", "input_tokens": audio + self.text_tokens, "output_tokens": self.output_tokens,
                "total_tokens": audio + self.text_tokens + self.output_tokens,
                "input_token_details": {"audio_tokens": audio, "text_tokens": self.text_tokens}}


def _refusal(e: ValidationError) -> APIError:
    parts, first = [], None
    for err in e.errors():
        name = ".".join(str(x) for x in err.get("loc", ())) or "form"
        first = first or name
        parts.append(f"unsupported field {name!r}" if err.get("type") == "extra_forbidden"
                     else f"{name}: {err.get('msg')}")
    return APIError(400, "; ".join(parts), param=first)


async def run_job(engine: AsyncLLMEngine, job: TranscriptionJob, *, request_id_prefix: str,
                  is_disconnected: Callable | None = None, progress: JobProgress | None = None) -> Transcription:
    """Submit the job's requests as it asks for them (all of a batch validated
    before any is queued), feed back each output, return its result. Leaving early
    (an error, the client gone) aborts what is still running."""
    tasks: dict[asyncio.Future, int] = {}  # final output -> the job's ticket
    counter = 0
    try:
        while not job.done:
            batch = job.next_requests()
            if batch:
                if progress is not None:
                    progress.handed_out(job, batch)
                requests = [AsyncRequest(f"{request_id_prefix}-{counter + i}", r.prompt, r.params) for i, r in enumerate(batch)]
                counter += len(batch)
                try:
                    streams = await engine.add_requests(requests)
                except (ValueError, TypeError) as e:
                    raise APIError(400, str(e), param="file") from None
                for r, stream in zip(batch, streams):
                    tasks[asyncio.ensure_future(final_output(stream))] = r.ticket
            if not tasks:
                raise RuntimeError("the transcription job is not done but asks for no requests")
            done, _ = await asyncio.wait(list(tasks), timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            if not done and is_disconnected is not None and await is_disconnected():
                raise APIError(499, "client closed the request")
            for t in done:
                out, ticket = t.result(), tasks.pop(t)
                if out.error:
                    raise APIError(400, out.error, param="file")
                job.add_output(out, ticket)
                if progress is not None:
                    progress.finished(out, ticket)
        return job.result()
    finally:
        for t in tasks:
            t.cancel()
