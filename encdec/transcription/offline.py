"""``LLM.transcribe``: inputs and options checked, one job per input, all run
by ``driver.run_jobs`` in one continuous batch."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from encdec.transcription import make_job
from encdec.transcription.driver import run_jobs
from encdec.transcription.options import TranscribeOptions
from encdec.transcription.result import Transcription


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
