"""Voice activity detection for ``vad_filter=True``: speech regions from Silero
VAD (PyPI ``silero-vad``, whose model ships in the wheel), packed into <= 30 s
windows of speech only, and a ``TimestampMap`` from packed time back to the
input's time. Silence is never decoded, and Whisper never sees it to hallucinate on.

``silero-vad`` is an optional dependency (extra ``vad``): it is imported only
when a VAD is asked for, never by ``import encdec``.
"""
from __future__ import annotations

import functools
import importlib.util
import math
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from encdec.audio import N_SAMPLES, SAMPLE_RATE
from encdec.transcription.windows import cut_windows

# faster-whisper's ``VadOptions`` defaults (longer silences than Silero's own, wide padding).
VAD_DEFAULTS: dict[str, Any] = {
    "threshold": 0.5,  # speech probability above which a 32 ms chunk is speech
    "neg_threshold": None,  # below which it is silence (None: threshold - 0.15)
    "min_speech_duration_ms": 0,  # shorter regions are dropped
    "max_speech_duration_s": math.inf,  # longer regions are split (at a silence if any)
    "min_silence_duration_ms": 2000,  # silences shorter than this do not end a region
    "speech_pad_ms": 400,  # padding added to each side of a region
}
# faster-whisper's ``BatchedInferencePipeline`` defaults, for ``mode="independent"``
# (its counterpart: windows decoded at once, no seek): a region ends at any 160 ms
# silence and lasts at most 30 s, so whole utterances pack tightly into windows.
# The 6-minute benchmark files: 9-10 windows, against 12 with VAD_DEFAULTS and 13 without VAD.
INDEPENDENT_VAD_DEFAULTS: dict[str, Any] = {**VAD_DEFAULTS, "min_silence_duration_ms": 160,
                                            "max_speech_duration_s": N_SAMPLES / SAMPLE_RATE}


_LOAD_LOCK = threading.Lock()  # jobs are built on several threads (encdec.transcription.offline)


def _silero_model() -> tuple[Any, bool]:
    with _LOAD_LOCK:  # one load, and one thread at a time around the import's thread-count change
        return _load_silero()


@functools.cache
def _load_silero() -> tuple[Any, bool]:
    """(model, is the batched "sequence" ONNX model). The sequence model (silero-vad
    >= 6.2 with onnxruntime) gives the streaming model's probabilities bit for bit
    in a few ONNX calls: 0.75 s for 240 s of audio here, against 3.7 s for the
    per-32-ms-frame JIT loop, which is the fallback."""
    import torch

    threads = torch.get_num_threads()
    try:
        from silero_vad import load_silero_vad
    except ImportError as e:
        raise ImportError("vad_filter=True needs the 'silero-vad' package: pip install 'encdec[vad]' "
                          "(or pip install silero-vad onnxruntime)") from e
    finally:
        # silero-vad's ``model`` module runs ``torch.set_num_threads(1)`` on import: without
        # this, every torch op in the process (our engine, HF beside it) ran on one thread
        # after the first vad_filter=True call.
        torch.set_num_threads(threads)
    try:
        if importlib.util.find_spec("onnxruntime") is None:
            raise ImportError("onnxruntime")
        return load_silero_vad(sequence=True), True
    except (ImportError, TypeError):  # no onnxruntime, or a silero-vad without the sequence model
        return load_silero_vad(), False


def speech_regions(wav: np.ndarray, *, defaults: dict[str, Any] = VAD_DEFAULTS,
                   **vad_parameters: Any) -> list[tuple[int, int]]:
    """(start, end) sample indices of the speech in ``wav`` (16 kHz float32),
    sorted and disjoint. ``vad_parameters`` override ``defaults`` (``VAD_DEFAULTS``
    or ``INDEPENDENT_VAD_DEFAULTS``); an unknown name raises ValueError."""
    unknown = sorted(set(vad_parameters) - set(VAD_DEFAULTS))
    if unknown:
        raise ValueError(f"vad_parameters: unknown {unknown}; known: {sorted(VAD_DEFAULTS)}")
    model, sequence = _silero_model()
    params = {**defaults, **vad_parameters}
    wav = np.ascontiguousarray(wav, np.float32)
    if sequence:
        from silero_vad import get_speech_timestamps_sequence

        found = get_speech_timestamps_sequence(wav, model, sampling_rate=SAMPLE_RATE, **params)
    else:
        import torch
        from silero_vad import get_speech_timestamps

        with torch.inference_mode():
            found = get_speech_timestamps(torch.from_numpy(wav), model, sampling_rate=SAMPLE_RATE, **params)
    return [(int(r["start"]), int(r["end"])) for r in found]


@dataclass(frozen=True)
class TimestampMap:
    """Seconds in the packed (speech-only) audio -> seconds in the input."""

    packed_starts: tuple[float, ...]  # where each region starts in the packed audio (s), ascending
    original_starts: tuple[float, ...]  # where it starts in the input (s)
    lengths: tuple[float, ...]  # its length (s)

    def original(self, t: float, *, is_end: bool = False) -> float:
        """The input time of packed time ``t``; an end time at a region boundary
        maps to the end of the region before it, not the start of the next."""
        if not self.packed_starts:
            return t
        side = "left" if is_end else "right"
        i = max(int(np.searchsorted(self.packed_starts, t, side=side)) - 1, 0)
        return self.original_starts[i] + min(t - self.packed_starts[i], self.lengths[i])

    def restore(self, segments: list[Any]) -> None:
        """Move ``segments`` and their words from packed time to input time, in place."""
        for s in segments:
            for item in [s, *(s.words or [])]:
                item.start, item.end = self.original(item.start), self.original(item.end, is_end=True)


def pack_speech(wav: np.ndarray, regions: list[tuple[int, int]]
                ) -> tuple[np.ndarray, list[tuple[int, np.ndarray]], TimestampMap]:
    """Concatenate the ``regions`` of ``wav`` -> (packed audio, windows of at most
    30 s as (packed start sample, samples), the map back). Whole regions are
    packed greedily into windows; a region longer than 30 s is cut by
    ``cut_windows`` (at its quietest points)."""
    packed = np.concatenate([wav[s:e] for s, e in regions]) if regions else wav[:0]
    windows: list[tuple[int, np.ndarray]] = []
    pos, win_start = 0, 0
    for s, e in regions:
        n = e - s
        if pos + n - win_start > N_SAMPLES and pos > win_start:  # close the open window
            windows.append((win_start, packed[win_start:pos]))
            win_start = pos
        if n > N_SAMPLES:
            windows += [(pos + off, w) for off, w in cut_windows(packed[pos:pos + n])]
            win_start = pos + n
        pos += n
    if pos > win_start:
        windows.append((win_start, packed[win_start:pos]))
    starts = np.cumsum([0] + [e - s for s, e in regions[:-1]]) if regions else []
    tmap = TimestampMap(tuple(float(p) / SAMPLE_RATE for p in starts),
                        tuple(s / SAMPLE_RATE for s, _ in regions),
                        tuple((e - s) / SAMPLE_RATE for s, e in regions))
    return packed, windows, tmap


# OpenAI's server_vad defaults (Realtime API turn detection)
SERVER_VAD_DEFAULTS: dict[str, Any] = {"threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 500}
FRAME = 512  # samples of 16 kHz audio per Silero streaming call (32 ms)


def _streaming_silero() -> Any:
    """A new Silero model with its own streaming state (ONNX when onnxruntime is there)."""
    with _LOAD_LOCK:
        _load_silero()  # the import, with torch's thread count kept
        from silero_vad import load_silero_vad

        return load_silero_vad(onnx=importlib.util.find_spec("onnxruntime") is not None)


class SpeechTurns:
    """OpenAI's ``server_vad`` turn detection over streaming Silero VAD: 16 kHz
    audio in, ``("started", ms)`` / ``("stopped", ms)`` out, in milliseconds of
    the stream's audio. A turn starts at the first frame with P(speech) >=
    ``threshold`` (reported ``prefix_padding_ms`` earlier) and stops once
    ``silence_duration_ms`` of frames have stayed below ``threshold - 0.15``
    (reported at that moment: the turn includes the silence, as OpenAI's does)."""

    def __init__(self, threshold: float = 0.5, prefix_padding_ms: int = 300, silence_duration_ms: int = 500) -> None:
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"threshold must be in (0, 1), got {threshold}")
        for name, v in (("prefix_padding_ms", prefix_padding_ms), ("silence_duration_ms", silence_duration_ms)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        self.threshold, self.prefix_ms, self.silence_ms = threshold, prefix_padding_ms, silence_duration_ms
        self._model = _streaming_silero()
        self._pending = np.zeros(0, np.float32)
        self._frames = 0  # frames fed so far
        self.speaking = False
        self._silence_from: int | None = None  # frame where the current silence began

    def reset(self) -> None:
        """Start over as a new detector would (its clock too), keeping the loaded model."""
        self._model.reset_states()
        self._pending = np.zeros(0, np.float32)
        self._frames = 0
        self.speaking, self._silence_from = False, None

    def feed(self, wav16: np.ndarray) -> list[tuple[str, int]]:
        import torch

        audio = np.concatenate([self._pending, np.asarray(wav16, np.float32)])
        n = len(audio) // FRAME
        self._pending = audio[n * FRAME:]
        events = []
        for i in range(n):
            p = float(self._model(torch.from_numpy(audio[i * FRAME:(i + 1) * FRAME].copy()), SAMPLE_RATE))
            start_ms = self._frames * FRAME * 1000 // SAMPLE_RATE
            self._frames += 1
            if not self.speaking:
                if p >= self.threshold:
                    self.speaking, self._silence_from = True, None
                    events.append(("started", max(0, start_ms - self.prefix_ms)))
                continue
            if p >= self.threshold:
                self._silence_from = None
            elif p < self.threshold - 0.15 and self._silence_from is None:
                self._silence_from = start_ms
            end_ms = self._frames * FRAME * 1000 // SAMPLE_RATE
            if self._silence_from is not None and end_ms - self._silence_from >= self.silence_ms:
                self.speaking, self._silence_from = False, None
                events.append(("stopped", end_ms))
        return events
