"""Transcription as jobs: one audio input -> one ``Transcription``, expressed as
a series of ordinary engine requests, so that any driver can run it.

The protocol (``SequentialJob`` and ``IndependentJob`` both speak it)::

    job = make_job(engine, audio, options, index=i)  # decodes the audio once
    while not job.done:
        for req in job.next_requests():       # JobRequest(ticket, prompt, params)
            submit req.prompt, req.params      # engine.process_request + add_processed_request
        ... when a submitted request finishes with RequestOutput `out`:
        job.add_output(out, req.ticket)        # may make new requests appear
    job.result()                               # -> Transcription

A job never touches the engine: it reads an ``EngineView`` (``tokenizer``,
``hf_config``, ``generation_config``, and ``call_model`` for word alignment,
which runs on the engine's own thread) and only says what to run next and folds
results in (``encdec.transcription.protocol``: the view, ``JobRequest`` and the
set-up both jobs share). One driver module (``encdec.transcription.driver``)
runs jobs: ``run_jobs`` (synchronous, all jobs of a call in one continuous
batch: ``LLM.transcribe``, through ``encdec.transcription.offline``) and
``run_job`` (asyncio, ``AsyncLLMEngine``: the HTTP server and the realtime
sessions).
``next_requests()`` hands each request out once; ``done`` is true when nothing
is open or pending; ``seconds_done`` / ``duration`` give progress in audio seconds;
``abandoned_tickets()`` names requests handed out that the job no longer needs
(the driver aborts them; their outputs, if they still come, are ignored);
``partial_text`` is the text decided so far (a prefix of the result's, for
streaming). ``make_job`` builds the job ``options.mode`` names: ``LLM.transcribe``
and the HTTP server both build their jobs with it.

Two jobs: ``SequentialJob`` (the default, ``mode="sequential"``): openai/whisper's
long-form algorithm as HF ``generate`` runs it, see ``encdec.transcription.sequential``;
and ``IndependentJob`` (``mode="independent"``; ``TranscriptionJob`` is its older name): language detection on multilingual
models when no language is given (one step restricted to language tokens), then
all 30 s windows of the file at once, cut at the quietest 100 ms of each
window's last 5 s; a window that fails the fallback thresholds is asked again at
the next temperature (a new ticket). The sequential job asks for one window at a time, and on each
output either asks for a retry of that window (new ticket, higher temperature)
or for the next window with the seek moved and the previous text in its prompt;
the driver admits a job's next request the step its previous one finishes, while
other files' requests keep the batch full. A sequential window's prompt carries
its log-mel (``multi_modal_data={"audio_features": ...}``, a slice of the whole
file's), which the engine encodes as it is.
"""
from __future__ import annotations

from typing import Any

from encdec.transcription.job import IndependentJob, TranscriptionJob
from encdec.transcription.options import TranscribeOptions
from encdec.transcription.protocol import EngineView, JobRequest, engine_view
from encdec.transcription.result import (
           FORMATS,
           Segment,
           Transcription,
           Word,
           format_transcription,
)
from encdec.transcription.sequential import SequentialJob

__all__ = ["FORMATS", "EngineView", "IndependentJob", "JobRequest", "Segment", "SequentialJob", "TranscribeOptions", "Transcription",
           "TranscriptionJob", "Word", "format_transcription", "make_job"]


def make_job(engine: Any, audio: Any, options: TranscribeOptions, *,
             index: int = 0) -> SequentialJob | IndependentJob:
    """The job for one audio input under ``options.mode`` ("sequential", the
    default, or "independent"); it decodes the audio here, so a bad input raises
    a ``ValueError`` naming "audio input ``index``" before anything is queued."""
    job_class = SequentialJob if options.mode == "sequential" else IndependentJob
    return job_class(engine_view(engine), audio, options, index=index)
