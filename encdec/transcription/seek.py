"""Where the sequential algorithm's windows lie and what one holds while it is
decided: ``clip_frames`` (faster-whisper's ``clip_timestamps`` as frame ranges
the seek walks through) and ``Window`` (its features, prompt and attempts)."""
from __future__ import annotations

from typing import Any

FRAMES_PER_SECOND = 100  # log-mel frames (10 ms hops)


class Window:
    """The window being decided: its features and the outputs of its attempts."""

    def __init__(self, seek: int, num_frames: int, features: Any, prompt: list[int], first: bool) -> None:
        self.seek, self.num_frames, self.features, self.prompt = seek, num_frames, features, prompt
        self.first = first  # the first window of the file (carries the prefix)
        self.temp_index = 0  # the attempt being judged
        self.no_speech_prob: float | None = None
        # (prompt position of SOT, no-speech token): the first attempt reports P(no speech)
        self.no_speech_at: tuple[int, int] | None = None
        self.results: dict[int, tuple[list[int], float]] = {}  # temp index -> (output ids incl. eos, sum of logprobs)
        self.open: dict[int, int] = {}  # ticket -> temp index, attempts in flight


def clip_frames(clips: tuple[float, ...] | None, num_frames: int) -> list[tuple[int, int]]:
    """faster-whisper's ``clip_timestamps`` (seconds, start/end pairs) -> frame ranges."""
    if not clips:
        return [(0, num_frames)]
    frames = [min(round(t * FRAMES_PER_SECOND), num_frames) for t in clips]
    if len(frames) % 2:
        frames.append(num_frames)
    return [(s, e) for s, e in zip(frames[::2], frames[1::2]) if e > s] or [(0, 0)]
