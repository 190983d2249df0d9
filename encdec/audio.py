"""Audio in, Whisper log-mel features out.

``load_audio`` accepts what users have at hand (a path librosa can read, an
``(array, sample_rate)`` tuple, or a 16 kHz 1-D array) and returns 16 kHz mono
float32; problems surface as ``ValueError`` naming the input. Features are
computed in torch for a whole batch in one call (a few inputs per STFT, see
``_CHUNK``), the same recipe as
``transformers.WhisperFeatureExtractor``: zero-pad/trim to 30 s, periodic Hann
window, power spectrum without the last frame, Slaney mel filters, log10
clamped at 1e-10, floored at max - 8 per input, then ``(x + 4) / 4``.
"""
from __future__ import annotations

import functools
import math
import numbers
import os
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
CHUNK_SECONDS = 30
N_SAMPLES = CHUNK_SECONDS * SAMPLE_RATE  # 480000 samples per window
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3000 mel frames per window
# Sample rates an (array, sample_rate) input may have: telephone audio is 8 kHz,
# studio audio at most 384 kHz; outside this the rate is almost surely a mistake.
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 1000, 384000

__all__ = ["SAMPLE_RATE", "N_SAMPLES", "N_FRAMES", "load_audio", "log_mel_spectrogram",
           "mel_filters", "pad_or_trim"]


def _describe(audio: Any) -> str:
    if isinstance(audio, (str, os.PathLike)):
        return f"audio file {os.fspath(audio)!r}"
    return f"audio input of type {type(audio).__name__}"


def _to_mono_float(arr: Any, where: str) -> np.ndarray:
    if isinstance(arr, torch.Tensor):
        arr = arr.detach().cpu().numpy()
    if not isinstance(arr, np.ndarray):
        raise ValueError(f"{where}: expected a numpy array, got {type(arr).__name__}")
    if arr.dtype.kind in "iu":  # PCM integers -> [-1, 1)
        arr = arr.astype(np.float32) / float(np.iinfo(arr.dtype).max + 1)
    elif arr.dtype.kind != "f":
        raise ValueError(f"{where}: expected float or integer samples, got dtype {arr.dtype}")
    if arr.ndim == 2:
        # Channels are the short axis: (channels, n) as librosa gives, or (n, channels) as soundfile does.
        ch_axis = int(np.argmin(arr.shape))
        if arr.shape[ch_axis] > 8:
            raise ValueError(f"{where}: a 2-D array must be (channels, samples) with at most 8 "
                             f"channels, got shape {arr.shape}")
        arr = arr.mean(axis=ch_axis)
    elif arr.ndim != 1:
        raise ValueError(f"{where}: expected a 1-D array of samples (or 2-D with channels), "
                         f"got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{where}: audio is empty (0 samples)")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{where}: audio contains NaN or infinite samples")
    return np.ascontiguousarray(arr, dtype=np.float32)


def _sample_rate(sr: Any) -> int:
    """Hz as an int; ``16000.0`` (as soundfile and some libraries give) is fine,
    a fractional, non-positive or non-numeric rate is refused."""
    if isinstance(sr, (bool, np.bool_)) or not isinstance(sr, numbers.Real):
        raise ValueError(f"audio sample_rate must be a positive integer number of Hz, "
                         f"got {type(sr).__name__} {sr!r}")
    if not (math.isfinite(sr) and sr > 0 and float(sr).is_integer()):
        raise ValueError(f"audio sample_rate must be a positive integer number of Hz, got {sr!r}")
    if not MIN_SAMPLE_RATE <= sr <= MAX_SAMPLE_RATE:
        # (array, 1) would be read as hours of audio, (array, 10**7) as a click.
        raise ValueError(f"audio sample_rate must be between {MIN_SAMPLE_RATE} and {MAX_SAMPLE_RATE} Hz, "
                         f"got {sr!r}")
    return int(sr)


def _check_file(path: str, where: str) -> None:
    """Say what is wrong with a path before a decoder says it less clearly."""
    if not os.path.exists(path):
        raise ValueError(f"{where} does not exist")
    if os.path.isdir(path):
        raise ValueError(f"{where} is a directory, not an audio file")
    if not os.path.isfile(path):  # /dev/null, a FIFO, a socket: no length to read
        raise ValueError(f"{where} is not a regular file")


def _decode_failure(path: str, error: Exception) -> str:
    """Why a file could not be decoded, in the decoders' own words. librosa tries
    libsndfile, then audioread, and raises audioread's error, which is often
    empty (``NoBackendError()``, ``EOFError()``); libsndfile's says more."""
    import soundfile

    reasons = []
    try:
        soundfile.info(path)
    except Exception as e:  # LibsndfileError, or RuntimeError on old soundfile
        text = str(e).split(": ", 1)[-1] if str(e).startswith("Error opening") else str(e)
        if "not a regular file" in text:  # said by libsndfile when its MP3 decoder gives up
            text = "its decoder found no audio it can read"
        reasons.append(f"libsndfile: {text.rstrip('.')}")
    if str(error) or type(error).__name__ not in ("NoBackendError", "EOFError"):
        reasons.append(f"{type(error).__name__}: {error}")
    elif type(error).__name__ == "NoBackendError":
        reasons.append("audioread: no installed backend decodes this format (ffmpeg would)")
    else:
        reasons.append("audioread: the file ends inside its header")
    return "; ".join(reasons)


def load_audio(audio: Any, sampling_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Path (str or ``os.PathLike``), ``(array, sample_rate)`` (any integral rate,
    int or float) or 1-D array (already at ``sampling_rate``) -> mono float32 at
    ``sampling_rate``."""
    import librosa

    where = _describe(audio)
    if isinstance(audio, (str, os.PathLike)):
        path = os.fspath(audio)
        _check_file(path, where)
        try:
            with warnings.catch_warnings():  # librosa warns before falling back to audioread
                warnings.simplefilter("ignore")
                arr, _ = librosa.load(path, sr=sampling_rate, mono=True)
        except Exception as e:  # librosa/soundfile/audioread raise many types
            raise ValueError(f"{where} cannot be read as audio: {_decode_failure(path, e)}") from None
        return _to_mono_float(arr, where)
    if isinstance(audio, tuple):
        if len(audio) != 2:
            raise ValueError(f"audio tuple must be (array, sample_rate), got {len(audio)} items")
        arr, sr = audio
        sr = _sample_rate(sr)
        arr = _to_mono_float(arr, "audio array")
        if sr != sampling_rate:
            arr = librosa.resample(arr, orig_sr=sr, target_sr=sampling_rate).astype(np.float32)
        return arr
    if isinstance(audio, (np.ndarray, torch.Tensor)):
        return _to_mono_float(audio, "audio array")
    raise ValueError(f"audio must be a path, an (array, sample_rate) tuple or a 1-D array, "
                     f"got {type(audio).__name__}")


def resample_stream_chunk(samples: np.ndarray, rate: int) -> np.ndarray:
    """A live stream's chunk at ``rate`` (16 or 24 kHz) -> 16 kHz, chunk by chunk:
    24 kHz is resampled 2:3 polyphase, whose chunk edges do not matter to a voice
    detector (a whole file goes through ``load_audio``'s resampler instead)."""
    if rate == SAMPLE_RATE:
        return samples
    if rate != 24000:
        raise ValueError(f"a live stream's sample rate must be 16000 or 24000, got {rate}")
    from scipy.signal import resample_poly

    return resample_poly(samples, 2, 3).astype(np.float32)


def pad_or_trim(audio: torch.Tensor, length: int = N_SAMPLES) -> torch.Tensor:
    """Zero-pad or cut the last axis to ``length`` samples."""
    n = audio.shape[-1]
    if n > length:
        return audio[..., :length]
    return torch.nn.functional.pad(audio, (0, length - n)) if n < length else audio


@functools.lru_cache(maxsize=4)
def mel_filters(n_mels: int, device: str = "cpu") -> torch.Tensor:
    """(n_mels, 201) Slaney-scale, Slaney-normalised filters (as HF and openai/whisper use)."""
    import librosa

    fb = librosa.filters.mel(sr=SAMPLE_RATE, n_fft=N_FFT, n_mels=n_mels, fmin=0.0, fmax=8000.0,
                             htk=False, norm="slaney", dtype=np.float64)
    return torch.from_numpy(fb).to(device, torch.float32)


# Inputs per STFT call. On CPU, chunks of a few windows keep the STFT's
# intermediates (4.8 MB of complex spectrum per window) in cache: 16 windows took
# ~16 ms each in chunks of 1-4 and ~48 ms each in one call (1 thread, noisy
# shared host). Chunks also bound memory when a call brings hundreds of windows.
_CHUNK = {"cpu": 4}
_CHUNK_OTHER = 64


def log_mel_spectrogram(audios: Sequence[np.ndarray | torch.Tensor], n_mels: int = 80,
                        device: str | torch.device = "cpu") -> torch.Tensor:
    """16 kHz mono waveforms -> (B, n_mels, 3000) log-mel features, a few inputs per STFT call."""
    if len(audios) == 0:
        return torch.empty(0, n_mels, N_FRAMES)
    device = torch.device(device)
    chunk = _CHUNK.get(device.type, _CHUNK_OTHER)
    if len(audios) <= chunk:
        return _log_mel(audios, n_mels, device)
    return torch.cat([_log_mel(audios[i: i + chunk], n_mels, device) for i in range(0, len(audios), chunk)])


def _log_mel(audios: Sequence[np.ndarray | torch.Tensor], n_mels: int, device: torch.device) -> torch.Tensor:
    # The window is zero audio after the longest input; frames whose 400-sample
    # window lies in that zero run have zero power, so the STFT runs only up to
    # a margin past it (exact: the reflect padding there mirrors zeros too).
    longest = max(min(int(np.shape(a)[-1]), N_SAMPLES) for a in audios)
    used = min(N_SAMPLES, -(-(longest + 3 * N_FFT // 2) // HOP_LENGTH) * HOP_LENGTH)
    wav = torch.zeros(len(audios), used)  # (B, used), each input copied in once
    for i, a in enumerate(audios):
        a = torch.as_tensor(a, dtype=torch.float32)[:used]
        wav[i, :a.shape[-1]] = a
    wav = wav.to(device)
    window = torch.hann_window(N_FFT, device=wav.device)
    stft = torch.stft(wav, N_FFT, HOP_LENGTH, window=window, return_complex=True)  # (B, 201, used/160 + 1)
    frames = min(N_FRAMES, stft.shape[-1])
    # re^2 + im^2 rather than abs() ** 2: no square root, half the time (measured, 1 thread).
    ri = torch.view_as_real(stft[..., :frames])  # (B, 201, frames, 2)
    power = ri[..., 0] ** 2 + ri[..., 1] ** 2  # (B, 201, frames)
    mel = power.new_zeros(len(audios), n_mels, N_FRAMES)
    mel[..., :frames] = mel_filters(n_mels, str(wav.device)) @ power  # (B, n_mels, 3000)
    log_spec = mel.clamp(min=1e-10).log10()
    floor = log_spec.amax(dim=(1, 2), keepdim=True) - 8.0  # per input
    return (torch.maximum(log_spec, floor) + 4.0) / 4.0
