"""Speech -> text for whole files of any length: ``transcribe(llm, audio)`` (what
``LLM.transcribe`` calls) and ``run_jobs(engine, jobs)``, the synchronous driver
of transcription jobs (the protocol is described in ``encdec.transcription``,
the driver core in ``encdec.transcription.driver``).

All jobs of a call share the engine's continuous batching: every request a job
asks for is queued as soon as it is known, so a batch of short files and one
long file keep the batch full, and a file's windows start the step its language
is detected. Requests go through the engine's public entry only
(``process_request`` -> ``add_processed_request`` -> ``step``), with ids this
module makes, and everything it queued is aborted if anything raises.
"""
from __future__ import annotations

import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from encdec.transcription.driver import JobRouter
from encdec.transcription.job import IndependentJob, JobRequest, TranscriptionJob
from encdec.transcription.options import TranscribeOptions
from encdec.transcription.result import (
    FORMATS,
    Segment,
    Transcription,
    format_transcription,
)
from encdec.transcription import make_job
from encdec.transcription.sequential import SequentialJob
from encdec.transcription.windows import (
    SEARCH_SAMPLES,
    cut_windows,
    segments_from_tokens,
)

__all__ = ["FORMATS", "SEARCH_SAMPLES", "IndependentJob", "JobRequest", "Segment", "SequentialJob", "TranscribeOptions",
           "Transcription", "TranscriptionJob", "format_transcription", "run_jobs", "transcribe"]

# Older names, kept for callers and tests of the pure helpers.
_windows, _segments = cut_windows, segments_from_tokens


def _as_inputs(audio: Any) -> list[Any]:
    """One input (path, (array, sr), 1-D array) or a list of them -> a list."""
    if isinstance(audio, (str, os.PathLike, np.ndarray)) or _is_array_and_rate(audio):
        return [audio]
    if isinstance(audio, (list, tuple)):
        if not audio:
            raise ValueError("audio is an empty list: give at least one input")
        return list(audio)
    if hasattr(audio, "shape"):  # a torch tensor
        return [audio]
    raise ValueError(f"audio must be a path, an (array, sample_rate) tuple, a 1-D array, "
                     f"or a list of those; got {type(audio).__name__}")


def _is_array_and_rate(audio: Any) -> bool:
    """``(samples, sample_rate)``: one input, not a list of two (rates may be floats)."""
    return (isinstance(audio, tuple) and len(audio) == 2 and hasattr(audio[0], "shape")
            and isinstance(audio[1], (int, float, np.number)) and not isinstance(audio[1], bool))


def transcribe(llm: Any, audio: Any, options: TranscribeOptions | None = None, *, use_tqdm: bool = True,
               prompt: str | None = None, **option_kwargs: Any) -> list[Transcription]:
    """One ``Transcription`` per input of ``audio`` (one input or a list), with
    faster-whisper's options: a ``TranscribeOptions`` (which documents them and
    ``mode``) or its fields by keyword, not both. ``prompt`` is the older name of
    ``initial_prompt``. Every option and input is checked, and every input decoded,
    before anything is queued: a bad input ``i`` raises a ``ValueError`` naming
    "audio input i"."""
    engine, options = resolve_options(llm, options, prompt=prompt, **option_kwargs)
    return run_jobs(engine, _make_jobs(engine, _as_inputs(audio), options), use_tqdm=use_tqdm)


def resolve_options(llm: Any, options: TranscribeOptions | None = None, *, prompt: str | None = None,
                    **option_kwargs: Any) -> tuple[Any, TranscribeOptions]:
    """(the LLM's engine, the call's checked ``TranscribeOptions``): a ``TranscribeOptions``
    or its fields by keyword, not both; ``prompt`` is the older name of ``initial_prompt``."""
    engine = getattr(llm, "llm_engine", None)
    if engine is None:
        raise ValueError("transcribe needs an encdec LLM (with llm_engine) running a Whisper model")
    if prompt is not None:
        if option_kwargs.get("initial_prompt") is not None:
            raise ValueError("give initial_prompt or its older name prompt, not both")
        option_kwargs["initial_prompt"] = prompt
    if options is None:
        options = TranscribeOptions(**option_kwargs)
    elif not isinstance(options, TranscribeOptions):
        raise TypeError(f"options must be a TranscribeOptions, got {type(options).__name__}")
    elif option_kwargs:
        raise TypeError(f"give a TranscribeOptions or keyword options, not both (got options and "
                        f"{sorted(option_kwargs)})")
    options.validate(engine)
    return engine, options


def _make_jobs(engine: Any, inputs: list[Any], options: TranscribeOptions) -> list[Any]:
    """One job per input, built ``torch.get_num_threads()`` at a time when VAD runs:
    Silero VAD (ONNX Runtime, one thread, GIL released) is the single-threaded part
    of building a job, 0.8 s per 6-minute file here, so two files' VAD run in the
    time of one. A bad input still raises for the lowest index, before anything is queued."""
    workers = min(len(inputs), torch.get_num_threads()) if options.vad_filter else 1
    if workers <= 1:
        return [make_job(engine, a, options, index=i) for i, a in enumerate(inputs)]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="encdec-job") as pool:
        return list(pool.map(lambda ia: make_job(engine, ia[1], options, index=ia[0]), enumerate(inputs)))


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
