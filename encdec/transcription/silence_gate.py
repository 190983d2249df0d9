"""The digital-silence gate of the sequential mode: a window whose audio is
digital silence is not decoded.

Whisper does not answer silence with silence: over a 30 s window of zeros
tiny.en says "you", or, conditioned on the text before, repeats the last
sentence, and the next windows condition on that, so a long silence can carry
a loop past the speech that follows it. openai/whisper's no-speech rule does not
catch it (the loop is confident). The gate looks at the audio instead: when
every 10 ms frame of the window's span has a peak under -70 dBFS (about ten
steps of 16-bit audio: zeros, dither, a muted input), the window is skipped and
decoding resumes 1 s before the next frame with sound, so one silent run costs
nothing however long it is, and no text from it conditions the next window.

What must hold: a window with any frame at or above the threshold is decoded
exactly as before, so on speech the transcript stays token-identical to HF's
long-form ``generate`` (which has no such gate).
"""
from __future__ import annotations

import numpy as np

from encdec.audio import N_FRAMES

HOP = 160  # samples per 10 ms feature frame at 16 kHz
SILENT_PEAK = 10 ** (-70 / 20)  # a frame whose every sample is under this is digital silence
LEAD_FRAMES = 100  # resume this much (1 s) before the sound, so its onset is not at the window's edge


class SilenceGate:
    """Which feature frames of one file are digital silence, and where a window
    starting in a silent run should start instead."""

    def __init__(self, wav: np.ndarray, num_frames: int, *, enabled: bool = True):
        self.enabled = enabled  # False: every window is decoded (HF's behaviour)
        n = min(len(wav), num_frames * HOP) if enabled else 0
        peaks = np.zeros(num_frames, np.float32)  # frames past the audio (padding) are silent
        full = n // HOP
        if full:
            peaks[:full] = np.abs(wav[:full * HOP]).reshape(full, HOP).max(axis=1)
        if n > full * HOP:
            peaks[full] = np.abs(wav[full * HOP:n]).max()
        self._sound = np.flatnonzero(peaks >= SILENT_PEAK)  # (frames with sound,) ascending

    def resume(self, seek: int, end: int) -> int:
        """``seek`` when the window from ``seek`` (up to 30 s, not past ``end``) has
        a frame with sound; else where decoding should go on: 1 s before the next
        sound, or ``end`` if there is none before it."""
        n = min(end - seek, N_FRAMES)
        if n <= 0 or not self.enabled:
            return seek
        i = np.searchsorted(self._sound, seek)
        sound = int(self._sound[i]) if i < len(self._sound) else end
        if sound < seek + n:
            return seek
        # sound < end here means the window was a full 30 s: the lead stays past ``seek``
        return end if sound >= end else sound - LEAD_FRAMES
