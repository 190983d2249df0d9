"""The transcription driver: everything that runs jobs (``encdec.transcription``'s
protocol) on an engine. ``JobRouter`` is the core every driver shares: request
ids, which job and ticket each request in flight belongs to, routing a finished
output back to its job, and the requests a job gave up. A driver loops::

    batch = router.take(jobs)            # [(request id, job, JobRequest)], registered
    submit every request of batch        # all validated before any is queued
    ... a request finishes with output `out`:
    job = router.route(out)              # job.add_output(out, ticket); None if not ours
    abort router.abandoned([job])        # requests the job no longer needs
    batch = router.take([job])           # what it asks for next
    ... leaving early: abort router.open_ids()

``run_jobs`` runs it on an ``LLMEngine`` it steps itself (``LLM.transcribe``,
``LLM.transcribe_stream``); ``run_job`` on the shared ``AsyncLLMEngine`` (the
server, the realtime sessions: submit is ``add_requests``, abort is cancelling
a request's stream). All jobs of a call share the engine's continuous batching:
every request a job asks for is queued as soon as it is known. Requests go
through the engine's public entry only, with ids the router makes, and
everything a driver queued is aborted if anything raises. Bad requests raise
``ValueError``/``TypeError`` (the server answers 400), a client that left
raises ``ClientGone``.
"""
from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from encdec.engine.async_llm_engine import AsyncLLMEngine, AsyncRequest, final_output
from encdec.outputs import RequestOutput
from encdec.transcription.protocol import JobRequest
from encdec.transcription.result import Transcription

AUDIO_TOKENS_PER_SECOND = 50  # Whisper encoder positions per second of audio (1500 per 30 s window)


class ClientGone(Exception):
    """The client of an async job left: its requests were aborted."""


class JobRouter:
    def __init__(self, prefix: str) -> None:
        self._ids = (f"{prefix}{n}" for n in itertools.count())
        self._owner: dict[str, tuple[Any, int]] = {}  # request id -> (job, ticket), while in flight

    def take(self, jobs: Iterable[Any]) -> list[tuple[str, Any, JobRequest]]:
        """The requests ``jobs`` ask for now, each with a new request id, registered as in flight."""
        batch = []
        for job in jobs:
            for req in job.next_requests():
                rid = next(self._ids)
                self._owner[rid] = (job, req.ticket)
                batch.append((rid, job, req))
        return batch

    def route(self, output: RequestOutput) -> Any | None:
        """Give a finished output to the job that asked for it; returns that job,
        or None for a request not (or no longer) in flight here."""
        entry = self._owner.pop(output.request_id, None)
        if entry is None:
            return None
        job, ticket = entry
        job.add_output(output, ticket)
        return job

    def abandoned(self, jobs: Iterable[Any]) -> list[str]:
        """Request ids of what ``jobs`` gave up (``abandoned_tickets``), no longer in
        flight here: the driver aborts them."""
        dropped = {(id(job), t) for job in jobs for t in job.abandoned_tickets()}
        rids = [rid for rid, (job, t) in self._owner.items() if (id(job), t) in dropped]
        for rid in rids:
            del self._owner[rid]
        return rids

    def forget(self, request_ids: Iterable[str]) -> None:
        """Stop routing these requests (the driver aborted them)."""
        for rid in request_ids:
            self._owner.pop(rid, None)

    def open_ids(self) -> list[str]:
        return list(self._owner)

    def __len__(self) -> int:
        return len(self._owner)


def run_jobs(engine: Any, jobs: list[Any], *, use_tqdm: bool = True) -> list[Transcription]:
    """Drive ``jobs`` to completion on ``engine`` (an ``LLMEngine`` no one else
    steps meanwhile) and return their results in order."""
    router = JobRouter(f"transcribe-{uuid.uuid4().hex[:12]}-")
    bar = _ProgressBar(jobs) if use_tqdm else None
    try:
        # The first submission validates every request before queuing one.
        _submit(engine, router.take(jobs))
        while router:
            if not engine.has_unfinished_requests():
                raise RuntimeError(f"the engine has no unfinished requests but {len(router)} of this "
                                   "call's are open: were they aborted by someone else?")
            touched: dict[int, Any] = {}
            for out in engine.step():
                job = router.route(out)
                if job is not None:
                    touched[id(job)] = job
            dropped = router.abandoned(touched.values())
            if dropped:
                engine.abort_request(dropped)
            _submit(engine, router.take(touched.values()))
            if bar is not None and touched:
                bar.update(touched.values())
        stuck = [job.index for job in jobs if not job.done]
        if stuck:
            raise RuntimeError(f"audio inputs {stuck} asked for nothing more but are not done")
        return [job.result() for job in jobs]
    except BaseException:
        engine.abort_request(router.open_ids())  # leave the engine as this call found it
        raise
    finally:
        if bar is not None:
            bar.close()


def _submit(engine: Any, batch: list[tuple[str, Any, JobRequest]]) -> None:
    """Validate all of ``batch``, then queue all of it. One batched call (one
    log-mel batch for all audio windows); on a bad request, redo one by one to
    name the culprit's audio input."""
    if not batch:
        return
    try:
        processed = engine.process_requests([r.prompt for _, _, r in batch], [r.params for _, _, r in batch])
    except (ValueError, TypeError):
        processed = []
        for _, job, req in batch:
            try:
                processed.append(engine.process_request(req.prompt, req.params))
            except (ValueError, TypeError) as e:
                raise type(e)(f"audio input {job.index}: {e}") from None
    for (rid, _, _), (inputs, params) in zip(batch, processed):
        engine.add_processed_request(rid, inputs, params)


class _ProgressBar:
    """tqdm over audio seconds transcribed, with the real-time factor."""

    def __init__(self, jobs: list[Any]) -> None:
        from tqdm.auto import tqdm

        self.total = round(sum(job.duration for job in jobs), 1)
        self.bar = tqdm(total=self.total, desc="Transcribed audio", unit="s", dynamic_ncols=True)
        self.start = time.perf_counter()
        self.done = {id(job): 0.0 for job in jobs}  # seconds done per job

    def update(self, jobs: Any) -> None:
        for job in jobs:
            self.done[id(job)] = job.seconds_done
        done = sum(self.done.values())
        self.bar.n = min(round(done, 1), self.total)  # no float drift past the total
        self.bar.refresh()
        rtf = (time.perf_counter() - self.start) / max(done, 1e-9)
        self.bar.set_postfix_str(f"RTF {rtf:.3f} ({1 / max(rtf, 1e-9):.1f}x real time)")

    def close(self) -> None:
        self.bar.close()


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
    """The async driver: submit the job's requests as it asks for them (all of a
    batch validated before any is queued), feed back each output, return its
    result. A bad request raises ``ValueError``/``TypeError``. Leaving early
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
                streams = await engine.add_requests([AsyncRequest(rid, r.prompt, r.params, priority)
                                                     for rid, _, r in batch])
                for (rid, _, _), stream in zip(batch, streams):
                    tasks[asyncio.ensure_future(final_output(stream))] = rid
            if not tasks:
                raise RuntimeError("the transcription job is not done but asks for no requests")
            done, _ = await asyncio.wait(list(tasks), timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            if not done and is_disconnected is not None and await is_disconnected():
                raise ClientGone("client closed the request")
            for t in done:
                out = t.result()
                del tasks[t]
                if out.error:
                    raise ValueError(out.error)
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
