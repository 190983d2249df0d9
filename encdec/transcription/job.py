"""``IndependentJob``: one audio input -> one ``Transcription`` by the
independent-window algorithm, as a series of engine requests. The job decides
what to ask; a driver (``encdec.transcription.driver``) submits, steps and
routes outputs back. See ``encdec.transcription`` for the protocol and
``encdec.transcription.protocol`` for what every job shares."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from encdec.audio import HOP_LENGTH as HOP, SAMPLE_RATE
from encdec.outputs import RequestOutput
from encdec.sampling_params import BeamSearchParams, SamplingParams
from encdec.transcription.decoding import attempt_params, attempt_result, score_attempt, window_constraint
from encdec.transcription.options import TranscribeOptions
from encdec.transcription.protocol import JobBase, finished_completion, text_prompt_ids, window_prompt
from encdec.transcription.result import Segment, Transcription
from encdec.transcription.rules import best_attempt, needs_fallback, split_window
from encdec.transcription.windows import SILENCE_PEAK, cut_windows, segments_from_tokens


@dataclass
class _Piece:
    """Audio decoded by one request: a window, or the rest of one after an open ending."""

    start: int  # first sample, in the (packed) audio
    audio: np.ndarray  # 16 kHz samples, a view
    tokens: list[int] | None = None  # output ids, once decided (cut at the last closed segment)
    consumed: int = 0  # samples its segments cover; the rest is the next piece's
    # with fallback: (ids, average log-prob, compression ratio) per temperature tried
    attempts: list[tuple[list[int], float, float]] = field(default_factory=list)


class IndependentJob(JobBase):
    """One audio input (path, ``(array, sample_rate)`` or 16 kHz 1-D array) ->
    a ``Transcription``, as a series of engine requests.

    Today's algorithm: on a multilingual model without a language, one greedy
    step on ``<|startoftranscript|>`` over the language tokens of the first
    window; then every window of the file at once (windows are fixed by the
    audio alone, see ``cut_windows``), segments from each window's tokens.
    With timestamps, a window whose output ends in an open segment (its last
    timestamp starts one, as openai/whisper's seek rule reads it) keeps its
    closed segments and the rest of its audio is asked for again, as the
    sequential mode's seek would: Whisper often leaves a cut window's last
    sentence unsaid that way (tiny.en, a 6-minute file: WER 0.188 -> 0.119,
    six more requests of 4-12 s for 13 windows).
    """

    def __init__(self, engine: Any, audio: Any, options: TranscribeOptions, *, index: int = 0) -> None:
        from encdec.models.whisper import language_token

        super().__init__(engine, options, index=index)
        wav = self._load(audio)
        windows = cut_windows(wav)  # (start sample, 16 kHz samples), views of wav
        # VAD packs the speech into windows; result() maps times back.
        self._tmap, self._no_speech = None, False
        if options.vad_filter:
            from encdec.transcription.vad import INDEPENDENT_VAD_DEFAULTS, pack_speech, speech_regions

            regions = speech_regions(wav, defaults=INDEPENDENT_VAD_DEFAULTS, **(options.vad_parameters or {}))
            _, vad_windows, self._tmap = pack_speech(wav, regions)
            windows = vad_windows or windows[:1]  # no speech: one window, for language detection
            self._no_speech = not vad_windows
        self._multilingual = bool(getattr(self._gc, "is_multilingual", False))
        self._params = options.sampling_params or SamplingParams(temperature=0.0, max_tokens=None)
        if options.structured_outputs is not None:  # the caller's params, held to the options' constraint
            self._params = self._params.clone()
            self._params.structured_outputs = options.structured_outputs
        # The fallback ladder (rules.needs_fallback, as the sequential mode's and HF's batched
        # long-form generate's): only over our own params; a caller's sampling_params are kept.
        self._fallback = (options.sampling_params is None and len(options.temperature) > 1
                          and (options.compression_ratio_threshold is not None
                               or options.log_prob_threshold is not None))
        if self._fallback:
            self._params = self._attempt(0)
        elif options.beam_size > 1:  # every window by beam search (HF's short-form generate(num_beams=...))
            self._params = BeamSearchParams(options.beam_size, self._params.max_tokens,
                                            structured_outputs=window_constraint(options))
        self._prev = self._prompt_ids(options.initial_prompt)
        self._pieces = [_Piece(start, w) for start, w in windows]  # in time order
        self._dec: list[int] = []  # the windows' decoder prompt, once the language is known
        self.language: str | None = None  # language code, once known
        if not self._multilingual:
            self._start_windows("en")
        elif options.language is None:
            lang_ids = sorted(self._gc.lang_to_id.values())
            detect = SamplingParams(temperature=0.0, max_tokens=1, allowed_token_ids=lang_ids)
            self._ask(None, window_prompt(windows[0][1], [self._gc.decoder_start_token_id]), detect)
        else:
            token = language_token(self._gc, options.language)
            self._start_windows(next(k[2:-2] for k, v in self._gc.lang_to_id.items() if v == token))

    # -- the protocol --------------------------------------------------------------
    def abandoned_tickets(self) -> list[int]:
        """Tickets handed out that the job no longer needs: none here (every window is kept)."""
        return []

    def add_output(self, output: RequestOutput, ticket: int) -> None:
        """The finished output of the request this job handed out as ``ticket``."""
        if ticket not in self._asked:
            raise ValueError(f"audio input {self.index}: ticket {ticket} is not an open request of this job")
        completion = finished_completion(output, self.index)
        piece = self._asked.pop(ticket)
        tokens = list(completion.token_ids)
        if piece is None:
            by_id = {v: k[2:-2] for k, v in self._gc.lang_to_id.items()}
            self._start_windows(by_id[tokens[0]])
        elif self._fallback:
            self._judge(piece, attempt_result(output.outputs, self._gc.eos_token_id))
        else:
            self._decide(piece, tokens)

    @property
    def done(self) -> bool:
        return self.language is not None and not self._asked and not self._ready

    @property
    def seconds_done(self) -> float:
        """Seconds of audio transcribed so far (progress bars)."""
        if self.done:
            return self.duration
        return sum(p.consumed for p in self._pieces) / SAMPLE_RATE

    @property
    def partial_text(self) -> str:
        """The text of the leading windows finished so far, a prefix of
        ``result().text`` (for streaming drivers)."""
        if self._no_speech:
            return ""
        texts = []
        for p in self._pieces:
            if p.tokens is None:
                break
            texts += [s.text for s in self._window_segments(0.0, p.audio, p.tokens)]
        return "".join(texts).strip()

    def _window_segments(self, offset: float, window: np.ndarray, tokens: list[int]) -> list[Segment]:
        ts_begin, eot = self._gc.no_timestamps_token_id + 1, self._gc.eos_token_id
        return segments_from_tokens(tokens, offset, offset + len(window) / SAMPLE_RATE, ts_begin, eot,
                                    self._tokenizer, self.options.timestamps)

    def result(self) -> Transcription:
        if not self.done:
            raise RuntimeError(f"audio input {self.index}: result() before the job is done")
        ts_begin = self._gc.no_timestamps_token_id + 1
        segments: list[Segment] = []
        sot = None  # the decoder prompt words are aligned after (openai/whisper's sot_sequence)
        if self._aligner is not None:
            from encdec.models.whisper import default_decoder_prompt
            from encdec.transcription.alignment import words_for_segments

            sot = default_decoder_prompt(self._hf_config, self._gc, timestamps=False, task=self.options.task,
                                         language=self.language if self._multilingual else None)
        # No speech found by VAD: the one window decoded was for language detection only.
        for p in [] if self._no_speech else self._pieces:
            offset = p.start / SAMPLE_RATE
            window_segments = self._window_segments(offset, p.audio, p.tokens)
            if sot is not None and window_segments:
                words_for_segments(self._aligner, p.audio, sot, p.tokens, window_segments, offset, ts_begin)
            segments += window_segments
        if self._tmap is not None:
            self._tmap.restore(segments)
        text = "".join(s.text for s in segments).strip()
        for i, s in enumerate(segments):
            s.id, s.text = i, s.text.strip()
        return Transcription(text, segments, language=self.language, duration=self.duration)

    # -- steps -----------------------------------------------------------------------
    def _ask(self, piece: _Piece | None, prompt: dict, params: SamplingParams) -> None:
        self._new_request(piece, prompt, params)

    def _attempt(self, index: int) -> SamplingParams | BeamSearchParams:
        """The params of attempt ``index``, at ``options.temperature[index]`` (``decoding.attempt_params``)."""
        opts = self.options
        return attempt_params(opts.temperature[index], beam_size=opts.beam_size, best_of=opts.best_of,
                              max_tokens=None, seed=None, structured_outputs=window_constraint(opts))

    def _judge(self, piece: _Piece, result: tuple[list[int], float]) -> None:
        """An attempt of a piece is back: keep it, or, where it repeats itself or is
        unlikely (``needs_fallback``), ask the next temperature; when every one
        fails, keep ``best_attempt``'s. Independent windows carry no P(no speech),
        so an attempt of no text is kept as it is (retried, a silent window would
        be sampled until it says something)."""
        opts = self.options
        ids, avg, ratio = score_attempt(result, self._tokenizer, self._gc.eos_token_id)
        piece.attempts.append((ids, avg, ratio))
        retry, _ = needs_fallback(ratio, avg, None, compression_ratio_threshold=opts.compression_ratio_threshold,
                                  log_prob_threshold=opts.log_prob_threshold, no_speech_threshold=None)
        tried = len(piece.attempts)
        if retry and ids[:1] != [self._gc.eos_token_id] and tried < len(opts.temperature):
            self._ask(piece, window_prompt(piece.audio, self._dec), self._attempt(tried))
            return
        if retry and tried > 1:
            ids = best_attempt(piece.attempts, opts.compression_ratio_threshold)[0]
        self._decide(piece, ids)

    def _decide(self, piece: _Piece, tokens: list[int]) -> None:
        """Keep a piece's output; with timestamps, an open ending leaves its
        segment to a new piece: the rest of the audio, from the last closing
        timestamp (``split_window``'s seek step), decoded on its own."""
        piece.tokens, piece.consumed = tokens, len(piece.audio)
        if not self.options.timestamps or self._no_speech:  # no_speech: a window for language detection only
            return
        eot, frames = self._gc.eos_token_id, len(piece.audio) // HOP
        body = tokens[:-1] if tokens and tokens[-1] == eot else tokens
        segs, step = split_window(body, time_offset=0.0, seek_num_frames=frames,
                                  timestamp_begin=self._gc.no_timestamps_token_id + 1)
        rest = piece.audio[step * HOP:]
        if not 0 < step < frames or np.abs(rest).max() <= SILENCE_PEAK:
            return
        piece.tokens, piece.consumed = [t for s in segs for t in s.tokens], step * HOP
        tail = _Piece(piece.start + step * HOP, rest)
        self._pieces.insert(self._pieces.index(piece) + 1, tail)
        self._ask(tail, window_prompt(rest, self._dec), self._params)

    def _start_windows(self, language: str) -> None:
        from encdec.models.whisper import default_decoder_prompt

        self.language = language
        opts = self.options
        self._dec = self._prev + default_decoder_prompt(self._hf_config, self._gc,
                                                        language=language if self._multilingual else None,
                                                        task=opts.task, timestamps=opts.timestamps)
        for p in self._pieces:
            self._ask(p, window_prompt(p.audio, self._dec), self._params)

    def _prompt_ids(self, prompt: str | None) -> list[int]:
        """HF ``get_prompt_ids``: ``<|startofprev|>`` + " text", keeping at most
        ``max_length // 2 - 1`` text tokens."""
        if not prompt:
            return []
        text_ids = text_prompt_ids(self._tokenizer, prompt)
        return [self._gc.prev_sot_token_id] + text_ids[-(self._hf_config.max_target_positions // 2 - 1):]


TranscriptionJob = IndependentJob  # the older name
