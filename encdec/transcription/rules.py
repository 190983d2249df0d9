"""The pure rules of the sequential long-form algorithm: decoder prompts, the
fallback tests, and splitting a window's tokens into segments and a seek step.

Each follows HF ``WhisperForConditionalGeneration.generate`` (long-form), which
is what the exactness tests compare against; where openai/whisper or
faster-whisper differ, the docstring says how.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

TIME_PRECISION = 0.02  # seconds per timestamp token
INPUT_STRIDE = 2  # feature frames per encoder position (one timestamp step = 2 frames)


def compression_ratio(text: str) -> float:
    """faster-whisper's and openai/whisper's: zlib over the attempt's text (UTF-8,
    timestamps left out). HF compresses the token ids instead, a measure on which
    repetition scores far lower (HF suggests a threshold of 1.35 for it): at the
    2.4 that faster-whisper users pass, a window of one phrase repeated 13 times
    scores 2.0 on token ids and is kept, while its text scores above 2.4 and is
    retried, as faster-whisper retries it."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


def needs_fallback(ratio: float, avg_logprob: float, no_speech_prob: float | None, *,
                   compression_ratio_threshold: float | None, log_prob_threshold: float | None,
                   no_speech_threshold: float | None) -> tuple[bool, bool]:
    """(retry at the next temperature, skip the window as silence): HF ``_need_fallback``."""
    retry = compression_ratio_threshold is not None and ratio > compression_ratio_threshold
    low = log_prob_threshold is not None and avg_logprob < log_prob_threshold
    retry = retry or low
    skip = (no_speech_threshold is not None and log_prob_threshold is not None and low
            and no_speech_prob is not None and no_speech_prob > no_speech_threshold)
    return (False, True) if skip else (retry, False)


def best_attempt(attempts: list[tuple[list[int], float, float]],
                 compression_ratio_threshold: float | None) -> tuple[list[int], float, float]:
    """faster-whisper's choice when every temperature failed: of the (ids, average
    log-prob, compression ratio) attempts, the best average among those under the
    ratio threshold, else among all. (HF and openai/whisper keep the last, the
    hottest, which is the likeliest to be noise.)"""
    under = [a for a in attempts
             if compression_ratio_threshold is not None and a[2] <= compression_ratio_threshold]
    return max(under or attempts, key=lambda a: a[1])


def previous_tokens(history: list[list[int]], timestamp_begin: int, cut_off: int) -> list[int]:
    """HF ``_pad_to_max_length(skip_ending_double_timestamps=True)``: every earlier
    segment's tokens (the last of two closing timestamps dropped), the last
    ``cut_off`` of them. (openai/whisper keeps the text since the last prompt
    reset, which HF approximates by not conditioning after a hot retry.)"""
    flat: list[int] = []
    for seg in history:
        flat += seg[:-1] if len(seg) > 2 and seg[-2] >= timestamp_begin else seg
    return flat[-cut_off:] if cut_off > 0 else []


def decoder_prompt(init: list[int], *, prev_sot: int, previous: list[int], hotwords: list[int] | None,
                   prefix: list[int] | None, timestamp_begin: int, timestamps: bool, max_length: int) -> list[int]:
    """faster-whisper's ``get_prompt``: ``<|startofprev|>`` + hotwords (only
    without a prefix) + previous tokens, the SOT sequence ``init`` (with
    ``<|notimestamps|>`` when timestamps are off), then ``<|0.00|>`` + the prefix."""
    half = max_length // 2
    out: list[int] = []
    hot = hotwords if hotwords and not prefix else None
    if previous or hot:
        out.append(prev_sot)
        if hot:
            out += hot[: half - 1]
        if previous:
            out += previous[-(half - 1):]
    out += init
    if prefix:
        if timestamps:
            out.append(timestamp_begin)
        out += prefix[: half - 1]
    return out


@dataclass
class WindowSegment:
    start: float  # seconds from the start of the input
    end: float  # seconds from the start of the input
    tokens: list[int]  # output ids of this segment, timestamps included


def split_window(tokens: list[int], *, time_offset: float, seek_num_frames: int,
                 timestamp_begin: int) -> tuple[list[WindowSegment], int]:
    """HF ``_retrieve_segment``: a window's output (eos removed) -> its segments
    and how many feature frames to move ``seek``. A window that ends in an open
    segment is cut at its last closing timestamp, and the seek goes there."""
    is_ts = [t >= timestamp_begin for t in tokens]
    single_ending = is_ts[-2:] == [False, True]
    cuts = [i + 1 for i in range(len(is_ts) - 1) if is_ts[i] and is_ts[i + 1]]
    if cuts:
        if single_ending:
            cuts.append(len(tokens))
        else:
            cuts[-1] += 1  # the last pair's closing timestamp stays in its segment
        segs, last = [], 0
        for i, cut in enumerate(cuts):
            piece = tokens[last:cut]
            end_idx = -1 if i < len(cuts) - 1 or single_ending else -2
            segs.append(WindowSegment(time_offset + (piece[0] - timestamp_begin) * TIME_PRECISION,
                                      time_offset + (piece[end_idx] - timestamp_begin) * TIME_PRECISION, piece))
            last = cut
        if single_ending:
            return segs, seek_num_frames
        return segs, (tokens[last - 2] - timestamp_begin) * INPUT_STRIDE
    stamps = [t for t in tokens if t >= timestamp_begin]
    end_pos = int(seek_num_frames * 0.01 / TIME_PRECISION)  # HF: frames * 10 ms / 20 ms, truncated
    if stamps and stamps[-1] != timestamp_begin:
        end_pos = stamps[-1] - timestamp_begin
    return [WindowSegment(time_offset, time_offset + end_pos * TIME_PRECISION, list(tokens))], seek_num_frames
