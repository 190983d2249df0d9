"""``hallucination_silence_threshold``: skip the silence around likely
hallucinations (openai/whisper's and faster-whisper's option, which needs word
timestamps). After a window is decoded and its words aligned:

- a segment is *anomalous* when its first 8 words (punctuation aside) are
  improbable (p < 0.15), very short (< 0.133 s) or very long (> 2 s): score >= 3,
  or about one point per word;
- an anomalous first segment that starts more than ``threshold`` seconds into
  the window: the window's text is dropped and decoding resumes at that segment;
- an anomalous segment with silence (a gap over ``threshold``, or the window's
  edge) before it and silence or another anomaly after it: it and what follows
  are dropped, and decoding resumes at its start (at least 1 s on).

Two additions of ours, both from the audio rather than the decoder's timing. A
word over silent audio (every 10 ms frame under it below -60 dBFS, where no
speech is) scores as a whole anomalous segment: tiny.en's "you" on digital
silence is probable (p = 0.39) and 1.4 s long, so the timing rule alone keeps
it. And a resumed window starts past the silent audio at the resume point
(the next frame with sound, or the end), so a run of silence costs one window,
not one per second of it.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from encdec.audio import N_FRAMES

FRAMES_PER_SECOND = 100
HOP = 160  # samples per 10 ms frame at 16 kHz
SILENT_RMS = 10 ** (-60 / 20)  # -60 dBFS: speech sits 30-40 dB above this
PUNCTUATION = "\"'“¿([{-\"'.。,，!！?？:：”)]}、"  # openai/whisper's, as faster-whisper has it


def silent_frames(wav: np.ndarray, num_frames: int) -> np.ndarray:
    """(num_frames,) bool: which 10 ms frames of ``wav`` (16 kHz, zero-padded or
    cut to ``num_frames`` frames, the job's feature frames) are below -60 dBFS."""
    padded = np.zeros(num_frames * HOP, np.float32)
    n = min(len(wav), len(padded))
    padded[:n] = wav[:n]
    rms = np.sqrt(np.mean(padded.reshape(num_frames, HOP).astype(np.float64) ** 2, axis=1))
    return rms < SILENT_RMS


class HallucinationFilter:
    """The rule for one file: ``threshold`` seconds, the file's silent frames."""

    def __init__(self, threshold: float, silent: np.ndarray):
        self.threshold = threshold
        self.silent = silent
        self.last_speech = 0.0  # end of the last kept word (seconds), across windows

    def apply(self, segments: list[Any], seek: int, num_frames: int) -> tuple[int, int | None]:
        """-> (how many of the window's ``segments`` to keep, the frame to resume
        at, or None for the window's own seek). Segments carry aligned ``words``."""
        keep, resume = self._cut(segments, seek, num_frames)
        if resume is not None:
            resume = self._past_silence(resume)
        for s in segments[:keep]:
            if s.words:
                self.last_speech = s.words[-1].end
        return keep, resume

    def _cut(self, segments: list[Any], seek: int, num_frames: int) -> tuple[int, int | None]:
        threshold, offset = self.threshold, seek / FRAMES_PER_SECOND
        window_end = (seek + N_FRAMES) / FRAMES_PER_SECOND
        spoken = [s for s in segments if s.words]
        if spoken and self._anomalous(spoken[0]):
            gap = _start(spoken[0]) - offset
            if gap > threshold:
                return 0, seek + round(gap * FRAMES_PER_SECOND)
        last_end = self.last_speech
        for i, s in enumerate(segments):
            if not s.words:
                continue
            if self._anomalous(s):
                after = next((x for x in segments[i + 1:] if x.words), None)
                next_start = after.words[0].start if after is not None else offset + num_frames / FRAMES_PER_SECOND
                before_silent = (_start(s) - last_end > threshold or _start(s) < threshold
                                 or _start(s) - offset < 2.0)
                after_silent = (next_start - _end(s) > threshold or self._anomalous(after)
                                or window_end - _end(s) < 2.0)
                if before_silent and after_silent:
                    if len(self.silent) / FRAMES_PER_SECOND - _end(s) < threshold:
                        return i, len(self.silent)
                    return i, round(max(offset + 1, _start(s)) * FRAMES_PER_SECOND)
            last_end = _end(s)
        return len(segments), None

    def _anomalous(self, segment: Any | None) -> bool:
        if segment is None or not segment.words:
            return False
        words = [w for w in segment.words if w.word not in PUNCTUATION][:8]
        score = sum(self._score(w) for w in words)
        return score >= 3 or score + 0.01 >= len(words)

    def _score(self, word: Any) -> float:
        duration = word.end - word.start
        score = 0.0
        if word.probability < 0.15:
            score += 1.0
        if duration < 0.133:
            score += (0.133 - duration) * 15
        if duration > 2.0:
            score += duration - 2.0
        return 3.0 if self._over_silence(word) else score

    def _over_silence(self, word: Any) -> bool:
        first = min(int(word.start * FRAMES_PER_SECOND), len(self.silent) - 1)
        last = max(first + 1, int(np.ceil(word.end * FRAMES_PER_SECOND)))
        return bool(self.silent[first:last].all())

    def _past_silence(self, frame: int) -> int:
        """The first frame with sound at or after ``frame`` (the end if none)."""
        sound = np.flatnonzero(~self.silent[frame:])
        return frame + int(sound[0]) if len(sound) else len(self.silent)


def _start(segment: Any) -> float:
    """Where its words start (faster-whisper moves a segment's start to its first word's)."""
    return segment.words[0].start


def _end(segment: Any) -> float:
    return segment.words[-1].end
