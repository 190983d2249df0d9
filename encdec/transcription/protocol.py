"""What every transcription job shares: the engine view it reads, the request
it asks for (``JobRequest``), the window prompts, the Whisper text prompt, and
the set-up of a job (its audio decoded once, the engine's configs, the word
aligner, the ticket bookkeeping behind ``next_requests``).

A job never touches the engine: it reads an ``EngineView`` (``tokenizer``,
``hf_config``, ``generation_config``, and ``call_model`` for work that needs
the model itself, run on the thread that owns the engine). ``LLMEngine`` is
driven by its caller's thread, so there the model is called in place;
``AsyncLLMEngine``'s thread owns its engine, so work that needs the model goes
to that thread as a command (``AsyncLLMEngine.call_model``) and the job waits
for the result off the event loop. A job never holds the model.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from encdec.audio import SAMPLE_RATE, load_audio
from encdec.inputs import PromptType
from encdec.outputs import RequestOutput
from encdec.sampling_params import SamplingParams
from encdec.transcription.options import TranscribeOptions


@dataclass(frozen=True)
class EngineView:
    hf_config: Any
    generation_config: Any
    tokenizer: Any
    # call_model(fn) -> fn(model), run on the thread that owns the engine (blocks until done)
    call_model: Callable[[Callable[[Any], Any]], Any]


def engine_view(engine: Any) -> EngineView:
    """The view of an ``LLMEngine``, an ``AsyncLLMEngine`` or a view."""
    if isinstance(engine, EngineView):
        return engine
    if hasattr(engine, "call_model"):  # AsyncLLMEngine: the model lives on its thread
        return EngineView(engine.hf_config, engine.generation_config, engine.tokenizer, engine.call_model)
    return EngineView(engine.hf_config, engine.generation_config, engine.tokenizer,
                      lambda fn: fn(engine.model))


@dataclass(frozen=True)
class JobRequest:
    """One engine request a job asks for."""

    ticket: int  # job-local id; give it back with the output to ``add_output``
    prompt: PromptType  # audio window (16 kHz array) or its log-mel features + decoder prompt ids
    params: SamplingParams


def finished_completion(output: RequestOutput, index: int):
    """The completion of a finished job request; errors and aborts raise, naming the input."""
    if getattr(output, "error", None):
        raise ValueError(f"audio input {index}: {output.error}")
    completion = output.outputs[0]
    if completion.finish_reason == "abort":
        raise RuntimeError(f"audio input {index}: request {output.request_id} was aborted")
    return completion


def window_prompt(window: np.ndarray, dec_ids: list[int]) -> dict:
    """A window's 16 kHz samples (the engine computes their log-mel) + decoder prompt ids."""
    return {"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": (window, SAMPLE_RATE)}},
            "decoder_prompt": {"prompt_token_ids": dec_ids}}


def features_prompt(features: Any, dec_ids: list[int]) -> dict:
    """A window's (n_mels, 3000) log-mel, encoded as it is, + decoder prompt ids.
    The same tensor for every attempt at a window: one encoder pass with the
    engine's encoder cache."""
    return {"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio_features": features}},
            "decoder_prompt": {"prompt_token_ids": dec_ids}}


def text_prompt_ids(tokenizer: Any, text: str | None) -> list[int]:
    """The ids of " text" (Whisper's text prompts: ``initial_prompt``, ``hotwords``, ``prefix``)."""
    return tokenizer.encode(" " + text.strip(), add_special_tokens=False) if text else []


class JobBase:
    """The set-up and ticket bookkeeping both jobs share: the engine's configs and
    tokenizer, the word aligner when asked for, and the requests asked for."""

    def __init__(self, engine: Any, options: TranscribeOptions, *, index: int = 0) -> None:
        engine = engine_view(engine)
        self.index = index  # position of this input in its call, for error messages
        self.options = options
        self.duration = 0.0  # seconds of audio (``_load``)
        self._hf_config, self._gc, self._tokenizer = engine.hf_config, engine.generation_config, engine.tokenizer
        self._aligner = None
        if options.word_timestamps:
            from encdec.transcription.alignment import WordAligner

            self._aligner = WordAligner(engine.call_model, engine.hf_config, engine.generation_config,
                                        engine.tokenizer)
        self.num_requests = 0  # engine requests asked for
        self._asked: dict[int, Any] = {}  # ticket -> what the request is for
        self._ready: list[JobRequest] = []  # asked for, not yet handed out

    def _load(self, audio: Any) -> np.ndarray:
        """The input's 16 kHz samples: its one decode (and resample); a bad input
        raises a ``ValueError`` naming "audio input ``index``"."""
        try:
            wav = load_audio(audio)
        except ValueError as e:
            raise ValueError(f"audio input {self.index}: {e}") from None
        self.duration = len(wav) / SAMPLE_RATE
        return wav

    def next_requests(self) -> list[JobRequest]:
        """Requests to submit now, each handed out once; [] while waiting on outputs."""
        out, self._ready = self._ready, []
        return out

    def _new_request(self, what: Any, prompt: dict, params: Any) -> int:
        """Ask for one request (its ticket is never reused: a retry gets its own)."""
        ticket = self.num_requests
        self.num_requests += 1
        self._asked[ticket] = what
        self._ready.append(JobRequest(ticket, prompt, params))
        return ticket
