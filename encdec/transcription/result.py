"""What a transcription returns, and its text formats (txt, json, srt, vtt)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass
class Segment:
    start: float  # seconds from the start of the input
    end: float  # seconds from the start of the input, >= start
    text: str
    words: list | None = None  # alignment.Word per word, with word_timestamps=True (k-words)


@dataclass
class Transcription:
    text: str
    segments: list[Segment] = field(default_factory=list)
    language: str | None = None  # language code ("en", "de"), detected or given
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
    return json.dumps(asdict(t), ensure_ascii=False, indent=2) + "\n"


def to_srt(t: Transcription) -> str:
    blocks = [f"{i}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text}\n"
              for i, s in enumerate(t.segments, 1)]
    return "\n".join(blocks)


def to_vtt(t: Transcription) -> str:
    blocks = [f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text}\n" for s in t.segments]
    return "WEBVTT\n\n" + "\n".join(blocks)


FORMATS = {"txt": to_txt, "json": to_json, "srt": to_srt, "vtt": to_vtt}


def format_transcription(t: Transcription, fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {sorted(FORMATS)}, got {fmt!r}")
    return FORMATS[fmt](t)
