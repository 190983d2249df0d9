"""A transcription as engine requests, for a driver that is not ``LLM`` (the server).

Interim: ``encdec.transcribe`` runs its windows through ``LLM._generate``; until
it offers an engine-agnostic job (the Whisper issue's ``TranscriptionJob``), this
is the same computation (same windows, prompts, params and segments, from
``encdec.transcribe``'s own helpers), so the server answers what
``LLM.transcribe`` answers. Replace with ``TranscriptionJob`` when it lands.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from encdec.audio import SAMPLE_RATE
from encdec.sampling_params import SamplingParams
from encdec.transcribe import Transcription, _prompt, _segments, _windows


class WindowJob:
    """``next_requests()`` -> ``[(ticket, prompt, params)]``; ``add_output(out, ticket)``
    for each; ``done``; ``result()``. ``committed_text()`` is the text of the windows
    finished in order so far (for streaming)."""

    def __init__(self, wav: np.ndarray, *, engine: Any, language: str | None, task: str,
                 timestamps: bool, prompt: str | None, temperature: float):
        from encdec.models.whisper import default_decoder_prompt, language_token

        gc, hf_config = engine.generation_config, engine.hf_config
        self.tokenizer = engine.tokenizer
        self.ts_begin, self.eot = gc.no_timestamps_token_id + 1, gc.eos_token_id
        multilingual = bool(getattr(gc, "is_multilingual", False))
        if multilingual and language is None:
            raise ValueError("language is required for a multilingual model in this build "
                             "(language detection arrives with the engine-agnostic TranscriptionJob)")
        if multilingual:
            token = language_token(gc, language)
            self.language = next(k[2:-2] for k, v in gc.lang_to_id.items() if v == token)
        else:
            self.language = "en"
        dec = default_decoder_prompt(hf_config, gc, language=language if multilingual else None,
                                     task=task, timestamps=timestamps)
        if language is not None and not multilingual:  # validates an English-only model's language
            default_decoder_prompt(hf_config, gc, language=language, task=task)
        if prompt:
            # HF get_prompt_ids: <|startofprev|> + " text", keeping at most max_length // 2 - 1 tokens.
            ids = self.tokenizer.encode(" " + prompt.strip(), add_special_tokens=False)
            dec = [gc.prev_sot_token_id] + ids[-(hf_config.max_target_positions // 2 - 1):] + dec
        self.timestamps = timestamps
        self.params = SamplingParams(temperature=temperature, max_tokens=None)
        self.windows = _windows(wav)
        self.duration = len(wav) / SAMPLE_RATE
        self._requests = [(i, _prompt(chunk, dec), self.params) for i, (_, chunk) in enumerate(self.windows)]
        self._segments: list[list | None] = [None] * len(self.windows)
        self.output_tokens = 0
        self.prompt_tokens = len(dec) * len(self.windows)

    def next_requests(self) -> list[tuple[int, Any, SamplingParams]]:
        out, self._requests = self._requests, []
        return out

    def add_output(self, output: Any, ticket: int) -> None:
        start, chunk = self.windows[ticket]
        offset = start / SAMPLE_RATE
        tokens = output.outputs[0].token_ids
        self.output_tokens += len(tokens)
        self._segments[ticket] = _segments(tokens, offset, offset + len(chunk) / SAMPLE_RATE,
                                           self.ts_begin, self.eot, self.tokenizer, self.timestamps)

    @property
    def done(self) -> bool:
        return all(s is not None for s in self._segments)

    def committed_text(self) -> str:
        text = ""
        for segs in self._segments:
            if segs is None:
                break
            text += "".join(s.text for s in segs)
        return text.strip()

    def result(self) -> Transcription:
        segs = [s for ws in self._segments for s in ws]
        t = Transcription(self.committed_text(), segs, self.language)
        for s in t.segments:
            s.text = s.text.strip()
        return t
