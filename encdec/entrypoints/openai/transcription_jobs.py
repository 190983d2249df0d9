"""Transcription jobs (``encdec.transcription``) driven from the server's event loop.

``run_job`` is the asyncio twin of ``encdec.transcribe.run_jobs``: it submits what
a job asks for to the shared ``AsyncLLMEngine`` (next to everyone else's
requests), feeds each finished output back, and returns the job's result. Both
drive jobs through the same core, ``encdec.transcription.driver.JobRouter``.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from encdec.engine.async_llm_engine import AsyncLLMEngine, AsyncRequest, final_output
from encdec.entrypoints.openai.protocol import APIError
from encdec.outputs import RequestOutput
from encdec.transcription import Transcription
from encdec.transcription.driver import JobRouter

AUDIO_TOKENS_PER_SECOND = 50  # Whisper encoder positions per second of audio (1500 per 30 s window)


class JobProgress:
    """What a driver learns of a job as it runs: the usage, and the text decided
    so far (``job.partial_text`` after each output, for ``transcript.text.delta``)."""

    def __init__(self, notify: Callable[[], None] | None = None):
        self.notify = notify  # called after every finished request
        self.latest = ""  # the job's partial text after its last output
        self.text_tokens = self.output_tokens = 0

    def finished(self, output: RequestOutput, text: str) -> None:
        self.text_tokens += len(output.prompt_token_ids)
        self.output_tokens += sum(len(c.token_ids) for c in output.outputs)
        self.latest = text
        if self.notify is not None:
            self.notify()

    def text(self) -> str:
        return self.latest

    def usage(self, duration: float) -> dict[str, Any]:
        """Token usage: the audio counts by its length (``duration`` seconds, as
        the encoder sees it), whatever the encoder cache saved: an upload sent
        twice costs the same. Text and output tokens are those of every request
        the job ran, retries included."""
        audio = round(AUDIO_TOKENS_PER_SECOND * duration)
        return {"type": "tokens", "input_tokens": audio + self.text_tokens, "output_tokens": self.output_tokens,
                "total_tokens": audio + self.text_tokens + self.output_tokens,
                "input_token_details": {"audio_tokens": audio, "text_tokens": self.text_tokens}}


async def run_job(engine: AsyncLLMEngine, job: Any, *, request_id_prefix: str,
                  is_disconnected: Callable | None = None, progress: JobProgress | None = None,
                  priority: int = 0) -> Transcription:
    """Submit the job's requests as it asks for them (all of a batch validated
    before any is queued), feed back each output, return its result. Leaving early
    (an error, the client gone) aborts what is still running. With word
    timestamps a job runs a dense alignment pass (on the engine thread, through
    ``AsyncLLMEngine.call_model``) as it folds outputs in: it waits off the event loop.
    ``priority`` ranks every request of the job under the priority policy (smaller
    first); offline uploads keep the default 0, live passes rank ahead of them."""
    off_loop = bool(getattr(job.options, "word_timestamps", False))
    router = JobRouter(f"{request_id_prefix}-")
    tasks: dict[asyncio.Future, str] = {}  # final output -> its request id
    try:
        while not job.done:
            batch = router.take([job])
            if batch:
                try:
                    streams = await engine.add_requests([AsyncRequest(rid, r.prompt, r.params, priority)
                                                         for rid, _, r in batch])
                except (ValueError, TypeError) as e:
                    raise APIError(400, str(e), param="file") from None
                for (rid, _, _), stream in zip(batch, streams):
                    tasks[asyncio.ensure_future(final_output(stream))] = rid
            if not tasks:
                raise RuntimeError("the transcription job is not done but asks for no requests")
            done, _ = await asyncio.wait(list(tasks), timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            if not done and is_disconnected is not None and await is_disconnected():
                raise APIError(499, "client closed the request")
            for t in done:
                out = t.result()
                del tasks[t]
                if out.error:
                    raise APIError(400, out.error, param="file")
                if off_loop:
                    await asyncio.to_thread(router.route, out)
                else:
                    router.route(out)
                if progress is not None:
                    progress.finished(out, job.partial_text)
            cancel_streams(tasks, router.abandoned([job]))  # retries made moot: stop them
        return await asyncio.to_thread(job.result) if off_loop else job.result()
    finally:
        cancel_streams(tasks, list(tasks.values()))


def cancel_streams(tasks: dict[asyncio.Future, str], request_ids: list[str]) -> None:
    """Cancel the streams of ``request_ids`` (cancelling a stream aborts its request)."""
    dropped = set(request_ids)
    for t in [t for t, rid in tasks.items() if rid in dropped]:
        del tasks[t]
        t.cancel()
