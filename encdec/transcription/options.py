"""``TranscribeOptions``: faster-whisper's transcription options, checked once
per call (types here, model-dependent values in ``validate(engine)``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from encdec.sampling_params import SamplingParams, StructuredOutputsParams
from encdec.structured_output.params import check_structured

MODES = ("sequential", "independent")
TASKS = ("transcribe", "translate")


@dataclass(frozen=True)
class TranscribeOptions:
    """How to transcribe; the same for every input of a call. Names and meanings
    are faster-whisper's ``transcribe`` options; ``mode`` picks the algorithm:

    - ``"sequential"`` (default): openai/whisper's long-form algorithm as HF
      ``generate`` runs it (seek to the last timestamp, temperature fallback,
      no-speech skip, conditioning on the previous text): what users of the other
      Whisper runtimes get, token-identical to HF at temperature 0; the fallback
      rules (text compression ratio, the best attempt when all fail) are
      faster-whisper's (``transcription.sequential``).
    - ``"independent"``: every 30 s window at once, cut at quiet points, no
      fallback or conditioning (faster on one long file, no retries).
    """

    language: str | None = None  # code or name ("de", "german"); None: detect per file (multilingual)
    task: str = field(default="transcribe", metadata={"choices": TASKS})  # transcribe, or translate to English
    # independent mode: True decodes timestamp tokens (segments by them), None/False <|notimestamps|>;
    # the sequential mode always decodes them (it seeks by them): False is refused there
    timestamps: bool | None = None
    beam_size: int = 1  # > 1: beam search of this width at temperature 0 (transcription.decoding)
    best_of: int = 5  # samples per fallback attempt (temperature > 0); the most likely is kept
    temperature: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)  # tried in order on fallback (CLI: 0,0.2,0.4)
    compression_ratio_threshold: float | None = 2.4  # retry when a window's ratio is above this
    log_prob_threshold: float | None = -1.0  # retry when a window's avg logprob is below this
    no_speech_threshold: float | None = 0.6  # skip when P(no speech) is above this and logprob low
    condition_on_previous_text: bool = True  # previous windows' tokens as <|startofprev|> prompt
    initial_prompt: str | None = field(  # text the speech continues (names, spelling)
        default=None, metadata={"aliases": ("--prompt",)})
    prefix: str | None = None  # text the first window's transcript must start with
    hotwords: str | None = None  # words to bias towards, as a <|startofprev|> prompt (no prefix)
    clip_timestamps: tuple[float, ...] | None = None  # [start, end, ...] seconds to transcribe (CLI: 0,10.5)
    sampling_params: SamplingParams | None = None  # per window; None: greedy up to the decoder's length
    # the text tokens of each decoded window (one request: up to 30 s of audio) held to a
    # JSON schema, regex, choice or grammar; timestamp, language and task tokens pass as
    # the model's rules decide (encdec.structured_output.manager); None: free text
    structured_outputs: StructuredOutputsParams | None = None
    word_timestamps: bool = False  # Segment.words from cross-attention alignment (one extra pass per window)
    # sequential mode, with word_timestamps: skip silences longer than this (s) around likely
    # hallucinations (faster-whisper's rule; transcription.silence)
    hallucination_silence_threshold: float | None = None
    # sequential mode: a window that is digital silence (every 10 ms under -70 dBFS peak) is not
    # decoded, where Whisper would write "you" or repeat the text before; False: HF's behaviour
    # (transcription.silence_gate)
    skip_digital_silence: bool = True
    vad_filter: bool = False  # decode only Silero VAD speech regions, packed together
    vad_parameters: dict | None = None  # overrides of vad.VAD_DEFAULTS (independent: INDEPENDENT_VAD_DEFAULTS)
    # sequential: openai/whisper's long-form algorithm with fallback and conditioning;
    # independent: all 30 s windows at once, no conditioning; a window that fails the
    # thresholds is decoded again at the next temperature, as HF's batched long-form does.
    mode: str = field(default="sequential", metadata={"choices": MODES})

    def __post_init__(self) -> None:
        for name in ("language", "initial_prompt", "prefix", "hotwords"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a str, got {type(value).__name__}")
        if not isinstance(self.task, str):
            raise ValueError(f"task must be 'transcribe' or 'translate', got {self.task!r}")
        for name in ("timestamps", "condition_on_previous_text", "word_timestamps", "vad_filter",
                     "skip_digital_silence"):
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)) and not (name == "timestamps" and value is None):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "sequential" and self.timestamps is not None and not self.timestamps:
            raise ValueError("timestamps=False applies to mode='independent': the sequential mode always "
                             "decodes timestamp tokens (it seeks by them); leave timestamps unset (None)")
        for name in ("beam_size", "best_of"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        temps = (self.temperature,) if isinstance(self.temperature, (int, float)) else self.temperature
        try:
            temps = tuple(float(t) for t in temps)
        except (TypeError, ValueError):
            raise ValueError(f"temperature must be a float or a sequence of floats, got {self.temperature!r}") \
                from None
        if not temps or any(not 0.0 <= t <= 2.0 for t in temps):
            raise ValueError(f"temperature must be one or more values in [0, 2], got {self.temperature!r}")
        object.__setattr__(self, "temperature", temps)
        for name in ("compression_ratio_threshold", "log_prob_threshold", "no_speech_threshold"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ValueError(f"{name} must be a number or None, got {value!r}")
        _check_hallucination_silence_threshold(self)
        if self.clip_timestamps is not None:
            object.__setattr__(self, "clip_timestamps", _clips(self.clip_timestamps))
        if self.vad_parameters is not None:
            _check_vad_parameters(self.vad_parameters, self.vad_filter)
        if self.vad_filter and self.clip_timestamps is not None:
            raise ValueError("give vad_filter or clip_timestamps, not both (both choose what to decode)")
        if self.sampling_params is not None and not isinstance(self.sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(self.sampling_params).__name__}")
        object.__setattr__(self, "structured_outputs", check_structured(self.structured_outputs))
        if self.structured_outputs is not None and self.sampling_params is not None \
                and self.sampling_params.structured_outputs is not None:
            raise ValueError("structured_outputs given twice: in the options and in sampling_params; give one")
        if self.beam_size > 1 and self.mode == "independent" and self.sampling_params is not None \
                and self.sampling_params.temperature > 0:
            raise ValueError(f"beam_size={self.beam_size} decodes every window by beam search, which does "
                             f"not sample: sampling_params.temperature must be 0, got "
                             f"{self.sampling_params.temperature}")

    def validate(self, engine: Any) -> None:
        """Refuse what this engine's model cannot do (not Whisper, an unknown
        language, translate on an English-only model, sampling params' token ids
        outside its vocabulary) before any input is decoded or any request
        queued; the engine checks the rest of the params with the first requests.
        ``engine``: an ``LLMEngine``, ``AsyncLLMEngine`` or ``EngineView`` (read only)."""
        from encdec.models.whisper import default_decoder_prompt

        gc = getattr(engine, "generation_config", None)
        if getattr(gc, "no_timestamps_token_id", None) is None:
            raise ValueError(f"transcribe needs a Whisper model; this engine runs "
                             f"{getattr(getattr(engine, 'hf_config', None), 'model_type', '?')}")
        default_decoder_prompt(engine.hf_config, gc, language=self.language, task=self.task,
                               timestamps=self.timestamps)
        if self.sampling_params is not None:
            self.sampling_params.clone().verify_against(engine.hf_config.vocab_size)


def _check_hallucination_silence_threshold(options: TranscribeOptions) -> None:
    value = options.hallucination_silence_threshold
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"hallucination_silence_threshold must be a number of seconds > 0 or None, got {value!r}")
    if not options.word_timestamps:
        raise ValueError("hallucination_silence_threshold needs word_timestamps=True: it finds hallucinations "
                         "by their words' probabilities and timing")
    if options.mode != "sequential":
        raise ValueError("hallucination_silence_threshold applies to mode='sequential' (it moves the seek "
                         f"of the next window), got mode={options.mode!r}")


def _check_vad_parameters(value: Any, vad_filter: bool) -> None:
    from encdec.transcription.vad import VAD_DEFAULTS

    if not isinstance(value, dict):
        raise TypeError(f"vad_parameters must be a dict, got {type(value).__name__}")
    unknown = sorted(set(value) - set(VAD_DEFAULTS))
    if unknown:
        raise ValueError(f"vad_parameters: unknown {unknown}; known: {sorted(VAD_DEFAULTS)}")
    if not vad_filter:
        raise ValueError("vad_parameters given without vad_filter=True")
    merged = {**VAD_DEFAULTS, **value}
    for name, v in value.items():
        if name == "neg_threshold" and v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
            raise ValueError(f"vad_parameters[{name!r}] must be a number, got {v!r}")
        if name == "threshold" and not 0 < v < 1:
            raise ValueError(f"vad_parameters['threshold'] is a speech probability: it must be in (0, 1), got {v!r}")
        if name == "neg_threshold" and not 0 <= v < merged["threshold"]:
            raise ValueError(f"vad_parameters['neg_threshold'] must be in [0, threshold={merged['threshold']}), "
                             f"got {v!r}")
        if name == "max_speech_duration_s" and not v > 0:
            raise ValueError(f"vad_parameters['max_speech_duration_s'] must be > 0 seconds, got {v!r}")
        if name.endswith("_ms") and not 0 <= v < float("inf"):
            raise ValueError(f"vad_parameters[{name!r}] must be >= 0 milliseconds, got {v!r}")


def _clips(value: Any) -> tuple[float, ...]:
    """faster-whisper's ``clip_timestamps``: a list of seconds (or "0,10.5,20"),
    start/end pairs; a missing last end means "to the end of the file"."""
    if isinstance(value, str):
        value = [v for v in value.split(",") if v.strip()]
    try:
        out = tuple(float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"clip_timestamps must be a list of seconds, got {value!r}") from None
    if not out or any(t < 0 for t in out) or any(b <= a for a, b in zip(out, out[1:])):
        raise ValueError(f"clip_timestamps must be increasing non-negative seconds, got {list(out)}")
    return out
