"""``SilenceGate``: which windows are digital silence, and where decoding resumes."""
from __future__ import annotations

import numpy as np

from encdec.audio import N_FRAMES
from encdec.transcription.silence_gate import HOP, LEAD_FRAMES, SilenceGate

SR = 16000


def gate_over(*parts: np.ndarray) -> tuple[SilenceGate, int]:
    wav = np.concatenate(parts).astype(np.float32)
    frames = len(wav) // HOP
    return SilenceGate(wav, frames), frames


def tone(seconds: float, db: float) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    return (10 ** (db / 20) * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


def test_a_silent_window_resumes_a_second_before_the_sound():
    gate, frames = gate_over(tone(2, -20), np.zeros(SR * 100), tone(2, -20))
    sound = 102 * 100  # the second tone's first frame
    assert gate.resume(0, frames) == 0  # the first window has the tone
    assert gate.resume(200, frames) == sound - LEAD_FRAMES  # 200 .. 3200: all zeros
    assert gate.resume(sound - N_FRAMES + 1, frames) == sound - N_FRAMES + 1  # its last frame has sound
    assert gate.resume(sound - N_FRAMES, frames) == sound - LEAD_FRAMES


def test_trailing_silence_ends_the_clip_and_a_short_tail_counts():
    gate, frames = gate_over(tone(1, -20), np.zeros(SR * 40))
    assert gate.resume(100, frames) == frames  # nothing with sound after it: the end
    assert gate.resume(100, 150) == 150  # a clip's end bounds the window
    gate, frames = gate_over(np.zeros(SR * 5), tone(0.01, -20))  # a 10 ms sound in a short input
    assert gate.resume(0, frames) == 0


def test_the_threshold_is_digital_silence_not_quiet_speech():
    rng = np.random.default_rng(0)
    dither = rng.integers(-2, 3, SR * 40) / 32768  # +-2 steps of 16-bit audio: silence
    gate, frames = gate_over(dither, tone(1, -20))
    assert gate.resume(0, frames) == 40 * 100 - LEAD_FRAMES
    quiet = tone(40, -60)  # far under speech level, but sound: decoded as HF would
    gate, frames = gate_over(quiet)
    assert gate.resume(0, frames) == 0


def test_frames_past_the_audio_are_silent():
    """Short-form input is padded to 3000 frames: the padding is silence."""
    gate = SilenceGate(np.zeros(SR * 4, np.float32), N_FRAMES)
    assert gate.resume(0, N_FRAMES) == N_FRAMES
    gate = SilenceGate(tone(4, -20), N_FRAMES)
    assert gate.resume(0, N_FRAMES) == 0


def test_a_disabled_gate_decodes_every_window():
    gate = SilenceGate(np.zeros(SR * 40, np.float32), 4000, enabled=False)
    assert gate.resume(0, 4000) == 0 and gate.resume(500, 4000) == 500
