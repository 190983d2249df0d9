"""``SequentialJob``: openai/whisper's long-form algorithm, as HF ``generate``
runs it, as a job of ``encdec.transcription``'s protocol.

Per file, one 30 s window at a time::

    features = log-mel of the whole file (once)
    [language detection on the first 30 s, multilingual models without a language]
    while seek < end of clip:
        window = features[:, seek:seek + 3000]   (one tensor, shared by every retry)
        decode at temperatures[0], with P(<|nospeech|>) at SOT from its prefill
        while compression ratio > threshold or avg logprob < threshold:
            take the attempt at the next temperature   (same window features)
            (all failed: the best avg logprob under the ratio threshold)
        if avg logprob < threshold and P(no speech) > threshold: skip the window
        else: segments from timestamp pairs; seek to the last closing timestamp
        condition the next window on all earlier segments' tokens (if temperature < 0.5)

An attempt at a temperature > 0 samples ``best_of`` sequences (one request,
``n=best_of``: they share the window's cross-attention KV) and keeps the one
openai/whisper's ranker puts first (``decoding.attempt_result``), as
faster-whisper does; at temperature 0 it is greedy (or beams). A window's
first failed attempt asks for the next temperature alone; a second failure
asks for all the remaining temperatures at once, and they are judged in ladder
order as they come back: the first that passes is taken and the others are
abandoned (``abandoned_tickets``; the driver aborts them). The choice is the
one-at-a-time ladder's (each attempt's sampling is its own: with a seed, its
own stream), but a window whose retries run to the token limit (hallucination
loops: 224 steps each) costs two such runs, not one per temperature
(faster-whisper's five one after the other). The first retry goes alone
because it usually passes, and its rows would otherwise carry the hotter
temperatures' 20 samples to its end: tiny.en, the benchmark's 8 files, encoder
cached, 4 runs alternating, 26.35 s (all retries at once after the first
failure) -> 24.48 s, medians. The rows of one temperature cost less than their
number: decode steps are bound by reading memory, and the ``best_of`` rows read
one cross-attention table.

Every request is an ordinary engine request, so the windows of all files of a
call, and their retries, share the engine's continuous batching: a file's next
window is asked for the moment its previous one is decided. Retries carry the
window's features tensor itself, so with the engine's encoder cache they reuse
one encoder pass (``encoder_passes`` counts the passes run). P(no speech) is
HF's: the raw probability of ``<|nospeech|>`` after ``<|startoftranscript|>``,
read from the first attempt's prefill (``prompt_token_logprobs`` of its
``SamplingParams`` or ``BeamSearchParams``), not from a second pass.

Where HF and openai/whisper differ this follows HF (the tests compare against
it), except in two rules where it takes faster-whisper's, whose option names and
defaults it has: the compression ratio is over the text, not token ids (HF's
measure scores repetition far lower, so faster-whisper's 2.4 would rarely fire),
and when every temperature fails the window takes the attempt with the best
average log-prob under the ratio threshold, not the hottest (its segments show
the last temperature, as faster-whisper's do). Conditioning keeps all
earlier segments (the last 223 tokens) and is skipped for one window after a
retry at temperature >= 0.5, where openai/whisper drops the text before it;
``initial_prompt`` is the first "segment" of that history, and without
conditioning it is the prompt of every window. ``hotwords`` and ``prefix``
follow faster-whisper's ``get_prompt``; the prefix is kept in the first
window's transcript. The temperature > 0 retries sample from the full
distribution (openai/faster-whisper), not HF's default top-k 50.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from encdec.audio import N_FRAMES, N_SAMPLES, log_mel_spectrogram
from encdec.models.whisper_tokens import WhisperSpecialTokens, language_token
from encdec.outputs import RequestOutput
from encdec.sampling_params import SamplingParams
from encdec.transcription.decoding import attempt_params, attempt_result, score_attempt, window_constraint
from encdec.transcription.features import whole_file_log_mel, window_features
from encdec.transcription.options import TranscribeOptions
from encdec.transcription.protocol import JobBase, features_prompt, finished_completion, text_prompt_ids
from encdec.transcription.result import Segment, Transcription
from encdec.transcription.rules import (
    best_attempt,
    decoder_prompt,
    needs_fallback,
    previous_tokens,
    split_window,
)
from encdec.transcription.seek import FRAMES_PER_SECOND, Window, clip_frames
from encdec.transcription.silence_gate import SilenceGate


class SequentialJob(JobBase):
    """One audio input -> a ``Transcription`` by the sequential algorithm (module docstring)."""

    def __init__(self, engine: Any, audio: Any, options: TranscribeOptions, *, index: int = 0) -> None:
        super().__init__(engine, options, index=index)
        wav = self._load(audio)
        self._tmap, speech = None, True
        if options.vad_filter:  # decode the speech only; result() maps times back
            from encdec.transcription.vad import pack_speech, speech_regions

            regions = speech_regions(wav, **(options.vad_parameters or {}))
            speech = bool(regions)
            if speech:
                wav, _, self._tmap = pack_speech(wav, regions)
        hf, gc = self._hf_config, self._gc
        self._ids = WhisperSpecialTokens.of(gc)
        self._vocab, self._max_length = hf.vocab_size, hf.max_target_positions
        if len(wav) > N_SAMPLES:  # (n_mels, frames): HF's long-form features, the one log-mel of the file
            self._features = whole_file_log_mel(wav, hf.num_mel_bins)
        else:  # HF's short-form input: the audio padded to 30 s, then the log-mel (3000 frames)
            self._features = log_mel_spectrogram([wav], n_mels=hf.num_mel_bins)[0]
        # No speech at all: no window is decoded (a multilingual model still detects the language).
        self._clips = clip_frames(options.clip_timestamps, self._features.shape[1]) if speech else [(0, 0)]
        self._gate = SilenceGate(wav, self._features.shape[1], enabled=options.skip_digital_silence)
        self._silence = None
        if options.hallucination_silence_threshold is not None:
            from encdec.transcription.silence import HallucinationFilter, silent_frames

            self._silence = HallucinationFilter(options.hallucination_silence_threshold,
                                                silent_frames(wav, self._features.shape[1]))
        self._clip, self._seek = 0, self._clips[0][0]
        self._prompt_text = text_prompt_ids(self._tokenizer, options.initial_prompt)
        self._hotwords = text_prompt_ids(self._tokenizer, options.hotwords) or None
        self._prefix = text_prompt_ids(self._tokenizer, options.prefix) or None
        self._history: list[list[int]] = [self._prompt_text] if self._prompt_text else []
        self._condition = options.condition_on_previous_text
        base = options.sampling_params
        self._max_tokens = base.max_tokens if base is not None else None
        self._seed = base.seed if base is not None else None
        self.segments: list[Segment] = []
        self.language: str | None = None
        self.language_probability: float | None = None
        self.encoder_passes = 0  # requests that ran the encoder (retries don't, with the encoder cache)
        self.encoder_cache_reported = False  # some output said whether it reused an encoder pass
        self.windows_skipped = 0  # windows dropped by the no-speech rule
        self._abandoned: list[int] = []  # tickets the driver should abort (abandoned_tickets)
        self._dropped: set[int] = set()  # abandoned tickets whose output may still arrive
        self._window: Window | None = None
        self._finished = False
        self._multilingual = self._ids.is_multilingual
        if not self._multilingual:
            self._set_language("en", None)
        elif options.language is None:
            first = window_features(self._features, 0, min(N_FRAMES, self._features.shape[1]))
            lang_ids = sorted(self._ids.lang_to_id.values())
            detect = SamplingParams(temperature=0.0, max_tokens=1, allowed_token_ids=lang_ids,
                                    logprobs=self._vocab)
            self._ask("detect", [self._ids.sot], detect, first)
        else:
            token = language_token(gc, options.language)
            self._set_language(next(k[2:-2] for k, v in self._ids.lang_to_id.items() if v == token), None)

    # -- the protocol --------------------------------------------------------------
    def abandoned_tickets(self) -> list[int]:
        """Tickets handed out that the job no longer needs (retries made moot by
        an earlier temperature passing): the driver aborts them. An output of
        one that still arrives is ignored."""
        out, self._abandoned = self._abandoned, []
        return out

    def add_output(self, output: RequestOutput, ticket: int) -> None:
        kind = self._asked.pop(ticket, None)
        if kind is None and ticket in self._dropped:
            self._dropped.discard(ticket)
            return
        if kind is None:
            raise ValueError(f"audio input {self.index}: ticket {ticket} is not an open request of this job")
        completion = finished_completion(output, self.index)
        hit = getattr(getattr(output, "metrics", None), "encoder_cache_hit", None)
        self.encoder_cache_reported |= hit is not None
        if hit is not True:
            self.encoder_passes += 1
        if kind == "detect":
            lps = completion.logprobs[0]
            langs = {code: lps[tid].logprob for code, tid in self._ids.lang_to_id.items()}
            best = max(langs, key=langs.get)  # the sampled token: argmax over language tokens
            assert self._ids.lang_to_id[best] == completion.token_ids[0]
            norm = np.logaddexp.reduce(np.array(list(langs.values()), dtype=np.float64))
            self._set_language(best[2:-2], float(np.exp(langs[best] - norm)))
            return
        w = self._window
        assert w is not None
        index = w.open.pop(ticket)
        w.results[index] = attempt_result(output.outputs, self._ids.eot)
        if index == 0 and w.no_speech_at is not None:
            pos, token = w.no_speech_at
            w.no_speech_prob = float(np.exp(output.prompt_token_logprobs[pos][token]))
        self._advance(w)

    @property
    def done(self) -> bool:
        return self._finished and not self._asked and not self._ready

    @property
    def seconds_done(self) -> float:
        return self.duration if self.done else min(self._seek / FRAMES_PER_SECOND, self.duration)

    @property
    def partial_text(self) -> str:
        """The text of the windows decided so far, a prefix of ``result().text``
        (streaming drivers read it after each ``add_output``, before ``result()``)."""
        return "".join(s.text for s in self.segments).strip()

    def result(self) -> Transcription:
        if not self.done:
            raise RuntimeError(f"audio input {self.index}: result() before the job is done")
        if self._tmap is not None:  # packed speech time -> input time, once
            self._tmap.restore(self.segments)
            self._tmap = None
        text = "".join(s.text for s in self.segments).strip()
        for i, s in enumerate(self.segments):
            s.id, s.text = i, s.text.strip()
        return Transcription(text, self.segments, language=self.language,
                             language_probability=self.language_probability, duration=self.duration)

    # -- steps -----------------------------------------------------------------------
    def _ask(self, kind: str, dec: list[int], params: SamplingParams, features: Any) -> int:
        return self._new_request(kind, features_prompt(features, dec), params)  # kind: "detect" | "window"

    def _set_language(self, language: str, probability: float | None) -> None:
        from encdec.models.whisper import default_decoder_prompt

        self.language, self.language_probability = language, probability
        lang = language if self._multilingual else None
        self._init = default_decoder_prompt(None, self._gc, language=lang, task=self.options.task, timestamps=True)
        # openai/whisper aligns words after sot, language, task and <|notimestamps|>
        self._align_sot = default_decoder_prompt(None, self._gc, language=lang, task=self.options.task,
                                                 timestamps=False)
        self._next_window()

    def _next_window(self) -> None:
        while self._clip < len(self._clips):
            start, end = self._clips[self._clip]
            self._seek = self._gate.resume(max(self._seek, start), end)
            if self._seek < end:
                break
            self._clip += 1
        else:
            self._finished, self._window = True, None
            return
        n = min(end - self._seek, N_FRAMES)
        first = self._window is None and not self.segments
        opts, tb, half = self.options, self._ids.timestamp_begin, self._max_length // 2
        if self._condition and self._history:
            prev = previous_tokens(self._history, tb, half - 1)
        else:
            prev = self._prompt_text
        dec = decoder_prompt(self._init, prev_sot=self._ids.prev_sot, previous=prev, hotwords=self._hotwords,
                             prefix=self._prefix if first else None, timestamp_begin=tb, timestamps=True,
                             max_length=self._max_length)
        self._window = w = Window(self._seek, n, window_features(self._features, self._seek, n), dec, first)
        if opts.no_speech_threshold is not None and opts.log_prob_threshold is not None:
            # P(no speech): HF's no-speech token, scored raw after <|startoftranscript|>
            # by the first attempt's own prefill
            w.no_speech_at = (len(dec) - 1 - dec[::-1].index(self._ids.sot), self._ids.no_timestamps - 1)
        self._attempt(w, 0)

    def _attempt(self, w: Window, index: int) -> None:
        t = self.options.temperature[index]
        seed = None
        if t > 0 and self._seed is not None:  # reproducible sampling, one stream per window and attempt
            seed = self._seed + 1000 * w.seek + index
        asked = None
        if index == 0 and w.no_speech_at is not None:
            pos, token = w.no_speech_at
            asked = {pos: [token]}
        params = attempt_params(t, beam_size=self.options.beam_size, best_of=self.options.best_of,
                                max_tokens=self._max_tokens, seed=seed, prompt_token_logprobs=asked,
                                structured_outputs=window_constraint(self.options))
        w.open[self._ask("window", w.prompt, params, w.features)] = index

    def _advance(self, w: Window) -> None:
        """Judge the window's attempts in ladder order as far as they are back
        (the first carries P(no speech)); decide it on the first that passes, or,
        when every temperature fails, on ``best_attempt``."""
        opts = self.options

        def judge(ratio: float, avg: float) -> tuple[bool, bool]:
            return needs_fallback(ratio, avg, w.no_speech_prob,
                                  compression_ratio_threshold=opts.compression_ratio_threshold,
                                  log_prob_threshold=opts.log_prob_threshold,
                                  no_speech_threshold=opts.no_speech_threshold)

        while w.temp_index in w.results:
            ids, avg, ratio = self._score(w.results[w.temp_index])
            retry, skip = judge(ratio, avg)
            if retry and w.temp_index + 1 < len(opts.temperature):
                if w.temp_index == 0:  # the first failure: the next temperature alone
                    self._attempt(w, 1)
                elif w.temp_index == 1:  # the second: every remaining temperature at once
                    for i in range(2, len(opts.temperature)):
                        self._attempt(w, i)
                w.temp_index += 1
                continue
            if retry:  # every temperature failed; the no-speech rule judges the one taken
                scored = [self._score(w.results[i]) for i in range(len(opts.temperature))]
                ids, avg, ratio = best_attempt(scored, opts.compression_ratio_threshold)
                skip = judge(ratio, avg)[1]
            self._abandon(w)
            self._decide(w, ids, avg, ratio, skip)
            return

    def _score(self, result: tuple[list[int], float]) -> tuple[list[int], float, float]:
        return score_attempt(result, self._tokenizer, self._ids.eot)

    def _abandon(self, w: Window) -> None:
        """Give up the window's attempts still in flight (higher temperatures)."""
        unsent = {r.ticket for r in self._ready}
        for ticket in w.open:
            del self._asked[ticket]
            if ticket not in unsent:
                self._dropped.add(ticket)
                self._abandoned.append(ticket)
        self._ready = [r for r in self._ready if r.ticket not in w.open]
        w.open.clear()

    def _decide(self, w: Window, ids: list[int], avg: float, ratio: float, skip: bool) -> None:
        opts, eot = self.options, self._ids.eot
        t = opts.temperature[w.temp_index]
        self._condition = opts.condition_on_previous_text and t < 0.5
        if skip:
            self.windows_skipped += 1
            self._seek += w.num_frames
        else:
            out = ids[:-1] if ids and ids[-1] == eot else ids
            if w.first and self._prefix:  # the forced start belongs to the transcript
                out = w.prompt[len(w.prompt) - len(self._prefix) - 1:] + out
            segs, step = split_window(out, time_offset=w.seek * 0.01, seek_num_frames=w.num_frames,
                                      timestamp_begin=self._ids.timestamp_begin)
            new: list[Segment] = []
            for s in segs:
                text = self._tokenizer.decode([x for x in s.tokens if x < eot], skip_special_tokens=True)
                new.append(Segment(s.start, s.end, text, seek=w.seek, tokens=s.tokens, temperature=t,
                                   avg_logprob=avg, compression_ratio=ratio, no_speech_prob=w.no_speech_prob))
            resume = None
            if self._aligner is not None:
                self._add_words(w, new)
            if self._silence is not None:  # likely hallucinations in silence: dropped, decoding resumes later
                keep, resume = self._silence.apply(new, w.seek, w.num_frames)
                new = new[:keep]
            self._history += [s.tokens for s in new]
            self.segments += new
            if resume is not None:
                self._seek = resume
            else:  # a window must move on (HF would loop forever on <|0.00|><|0.00|> at its end)
                self._seek += step if step > 0 else w.num_frames
        self._next_window()

    def _add_words(self, w: Window, segments: list[Segment]) -> None:
        """Word timestamps for one decided window (an extra dense pass: the engine
        frees the window's cross K/V when its request ends)."""
        from encdec.transcription.alignment import assign_words

        runs = [[x for x in s.tokens if x < self._ids.eot] for s in segments]
        offset = w.seek * 0.01
        words = self._aligner.align_features(w.features, w.num_frames, self._align_sot,
                                             [x for r in runs for x in r], offset)
        assign_words(words, runs, segments, offset)

