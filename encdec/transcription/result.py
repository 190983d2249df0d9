"""What a transcription returns, and its text formats (txt, json, srt, vtt)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass
class Word:
    start: float  # seconds from the start of the input
    end: float  # seconds from the start of the input
    word: str
    probability: float


@dataclass
class Segment:
    """faster-whisper's segment fields. ``avg_logprob`` is the mean logprob of the
    window's output tokens (eos included, as HF and openai/whisper count it);
    ``compression_ratio`` is the one the fallback rule tested (HF's: zlib over the
    window's token ids); both describe the window the segment came from."""

    start: float  # seconds from the start of the input
    end: float  # seconds from the start of the input, >= start
    text: str
    id: int = 0  # index in its Transcription
    seek: int = 0  # 10 ms feature frame where its window starts
    tokens: list[int] = field(default_factory=list)  # its output ids, timestamp tokens included
    temperature: float = 0.0  # of the decoding that produced it (> 0: after fallback)
    avg_logprob: float | None = None
    compression_ratio: float | None = None
    no_speech_prob: float | None = None  # P(<|nospeech|>) at <|startoftranscript|>; None if not computed
    words: list[Word] | None = None  # None unless word timestamps were asked for


@dataclass
class Transcription:
    text: str
    segments: list[Segment] = field(default_factory=list)
    language: str | None = None  # language code ("en", "de"), detected or given
    language_probability: float | None = None  # softmax over language tokens; None if given or English-only
    duration: float = 0.0  # seconds of input audio


def _clock(seconds: float, sep: str) -> str:
    ms = int(round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def to_txt(t: Transcription) -> str:
    return t.text + "\n"


def to_json(t: Transcription) -> str:
    segs = [{"start": s.start, "end": s.end, "text": s.text} for s in t.segments]
    return json.dumps({"text": t.text, "segments": segs, "language": t.language, "duration": t.duration},
                      ensure_ascii=False, indent=2) + "\n"


def to_verbose_json(t: Transcription) -> str:
    """OpenAI's ``verbose_json``: every field, every segment field."""
    return json.dumps(asdict(t), ensure_ascii=False, indent=2) + "\n"


def to_srt(t: Transcription) -> str:
    blocks = [f"{i}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text}\n"
              for i, s in enumerate(t.segments, 1)]
    return "\n".join(blocks)


def to_vtt(t: Transcription) -> str:
    blocks = [f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text}\n" for s in t.segments]
    return "WEBVTT\n\n" + "\n".join(blocks)


FORMATS = {"txt": to_txt, "json": to_json, "verbose_json": to_verbose_json, "srt": to_srt, "vtt": to_vtt}


def format_transcription(t: Transcription, fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {sorted(FORMATS)}, got {fmt!r}")
    return FORMATS[fmt](t)
