"""Whole-file log-mel features and the 30 s slices the sequential algorithm encodes.

HF ``generate`` (and openai/whisper) compute the log-mel of the whole file once,
clamp it to ``max - 8`` over the whole file, and encode ``features[:, seek:seek +
3000]`` padded with zeros; cutting the audio first would clamp per window and
pad with the log-mel of silence, which changes the decoding of the last window.
So the sequential job computes features here, once per file, and hands each
window's slice to the engine (``JobRequest.features``).
"""
from __future__ import annotations

import numpy as np
import torch

from encdec.audio import HOP_LENGTH, N_FFT, N_FRAMES, mel_filters


def whole_file_log_mel(wav: np.ndarray, n_mels: int) -> torch.Tensor:
    """16 kHz samples -> (n_mels, len(wav) // 160) features, as HF's
    ``WhisperFeatureExtractor(truncation=False)`` computes them."""
    audio = torch.as_tensor(np.ascontiguousarray(wav), dtype=torch.float32)
    window = torch.hann_window(N_FFT)
    stft = torch.stft(audio, N_FFT, HOP_LENGTH, window=window, return_complex=True)  # (201, n // 160 + 1)
    ri = torch.view_as_real(stft[:, :-1])  # (201, frames, 2): HF drops the last frame
    power = ri[..., 0] ** 2 + ri[..., 1] ** 2
    log_spec = (mel_filters(n_mels) @ power).clamp(min=1e-10).log10()  # (n_mels, frames)
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)  # over the whole file
    return (log_spec + 4.0) / 4.0


def window_features(features: torch.Tensor, seek: int, num_frames: int) -> torch.Tensor:
    """``features[:, seek:seek + num_frames]`` zero-padded to 3000 frames (HF's
    ``_get_input_segment``): a new tensor, so one window's retries share it."""
    out = features.new_zeros(features.shape[0], N_FRAMES)
    out[:, :num_frames] = features[:, seek: seek + num_frames]
    return out
