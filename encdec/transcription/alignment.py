"""Word timestamps: openai/whisper's ``find_alignment`` (HF's
``return_token_timestamps`` computes the same DTW) on our model.

The cross-attention weights of the checkpoint's alignment heads over one window,
for ``sot sequence + text tokens + eot``, are normalised per audio frame,
median-filtered (width 7), averaged over heads and aligned to the frames by DTW
on their negation; a token starts at the frame where the path first reaches its
row. Tokens are grouped into words (a word starts at a space or a special token),
punctuation is merged into its neighbour word as openai/whisper does, and a
word's probability is the mean of its tokens' probabilities.

Cost: the engine keeps no encoder output after prefill (only cross K/V in the
paged cache, freed when the request ends), so ``WordAligner`` re-runs the
window's encoder in a plain dense pass and one dense decoder pass over the
window's tokens: one extra encoder pass per window that has words.
"""
from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from scipy.ndimage import median_filter

from encdec.audio import HOP_LENGTH, SAMPLE_RATE, log_mel_spectrogram

FRAME_SECONDS = 2 * HOP_LENGTH / SAMPLE_RATE  # 0.02 s per encoder position
MEDIAN_FILTER_WIDTH = 7
PREPEND_PUNCTUATIONS = "\"'“¿([{-"
APPEND_PUNCTUATIONS = "\"'.。,，!！?？:：”)]}、"


@dataclass
class Word:
    start: float  # seconds from the start of the input
    end: float  # seconds from the start of the input, >= start
    word: str  # with its leading space, as decoded
    probability: float  # mean probability of its tokens


def alignment_heads(hf_config: Any, generation_config: Any) -> list[tuple[int, int]]:
    """(layer, head) pairs: the checkpoint's (CTranslate2 config / HF generation
    config ``alignment_heads``), else the upper half of the decoder layers' heads
    (openai/whisper's default)."""
    heads = getattr(generation_config, "alignment_heads", None)
    if heads:
        return [(int(layer), int(head)) for layer, head in heads]
    n_layers, n_heads = hf_config.decoder_layers, hf_config.decoder_attention_heads
    return [(layer, head) for layer in range(n_layers // 2, n_layers) for head in range(n_heads)]


def dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Minimum-cost monotonic path through ``cost`` (rows, cols) from (0, 0) to the
    end, steps down/right/diagonal -> (row indices, col indices) along the path.
    Ties break as openai/whisper's ``dtw_cpu`` (left, then up)."""
    n, m = cost.shape
    acc = np.full((n + 1, m + 1), np.inf)
    acc[0, 0] = 0.0
    trace = np.zeros((n + 1, m + 1), np.int8)  # 0 diagonal, 1 from above, 2 from the left
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            c0, c1, c2 = acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1]
            if c0 < c1 and c0 < c2:
                acc[i, j], trace[i, j] = cost[i - 1, j - 1] + c0, 0
            elif c1 < c0 and c1 < c2:
                acc[i, j], trace[i, j] = cost[i - 1, j - 1] + c1, 1
            else:
                acc[i, j], trace[i, j] = cost[i - 1, j - 1] + c2, 2
    rows, cols = np.empty(n + m, np.int64), np.empty(n + m, np.int64)
    i, j, k = n, m, 0
    while i > 0 or j > 0:
        rows[k], cols[k] = i - 1, j - 1
        k += 1
        if i == 0:
            j -= 1
        elif j == 0:
            i -= 1
        elif trace[i, j] == 0:
            i, j = i - 1, j - 1
        elif trace[i, j] == 1:
            i -= 1
        else:
            j -= 1
    return rows[:k][::-1].copy(), cols[:k][::-1].copy()


try:  # the DTW's double loop is ~1000x faster compiled; numba is optional
    import numba

    dtw = numba.njit(cache=False)(dtw)  # type: ignore[assignment]
except ImportError:  # pragma: no cover - numba absent
    pass


def token_start_times(weights: np.ndarray, num_positions: int, *, rows: slice) -> np.ndarray:
    """Alignment-head weights (heads, tokens, 1500) -> the time (s) at which the
    DTW path first reaches each of ``rows``, over the first ``num_positions``
    encoder positions. Normalisation is over all tokens, as openai/whisper's."""
    w = weights[:, :, :num_positions]
    w = (w - w.mean(axis=-2, keepdims=True)) / w.std(axis=-2, keepdims=True)
    if w.shape[-1] > MEDIAN_FILTER_WIDTH // 2:  # torch's "reflect" padding is scipy's "mirror"
        w = median_filter(w, size=(1, 1, MEDIAN_FILTER_WIDTH), mode="mirror")
    rows, cols = dtw(-w.mean(axis=0)[rows].astype(np.float64))
    jumps = np.diff(rows, prepend=-1).astype(bool)
    return cols[jumps] * FRAME_SECONDS


def split_words(tokens: list[int], tokenizer: Any, eot: int) -> tuple[list[str], list[list[int]]]:
    """Text tokens -> words (openai/whisper's ``split_tokens_on_spaces``): tokens
    that decode to a whole unicode character are grouped; a word starts at a
    leading space, at punctuation, or at a special token."""
    pieces: list[tuple[str, list[int]]] = []
    current: list[int] = []
    for t in tokens:
        current.append(t)
        text = tokenizer.decode(current, skip_special_tokens=False)
        if "\ufffd" not in text:
            pieces.append((text, current))
            current = []
    words: list[str] = []
    groups: list[list[int]] = []
    for text, ids in pieces:
        if not words or ids[0] >= eot or text.startswith(" ") or text.strip() in string.punctuation:
            words.append(text)
            groups.append(list(ids))
        else:
            words[-1] += text
            groups[-1] += ids
    return words, groups


def merge_punctuations(words: list[Word], tokens: list[list[int]]) -> None:
    """openai/whisper's rule, in place: opening punctuation joins the next word,
    closing punctuation the previous one (the merged-away entry becomes empty)."""
    i = len(words) - 2
    j = len(words) - 1
    while i >= 0:  # prepend: right to left
        prev, cur = words[i], words[j]
        if prev.word.startswith(" ") and prev.word.strip() in PREPEND_PUNCTUATIONS:
            cur.word = prev.word + cur.word
            tokens[j] = tokens[i] + tokens[j]
            prev.word, tokens[i] = "", []
        else:
            j = i
        i -= 1
    i, j = 0, 1
    while j < len(words):  # append: left to right
        prev, cur = words[i], words[j]
        if not prev.word.endswith(" ") and cur.word in APPEND_PUNCTUATIONS:
            prev.word = prev.word + cur.word
            tokens[i] = tokens[i] + tokens[j]
            cur.word, tokens[j] = "", []
        else:
            i = j
        j += 1


class WordAligner:
    """Word timestamps for decoded windows of one model; see the module doc."""

    def __init__(self, call_model: Any, hf_config: Any, generation_config: Any, tokenizer: Any) -> None:
        # call_model(fn) -> fn(model) on the thread that owns the engine (``engine_view``)
        self.call_model, self.tokenizer = call_model, tokenizer
        self.heads = alignment_heads(hf_config, generation_config)
        self.n_mels = hf_config.num_mel_bins
        self.eot = generation_config.eos_token_id

    def align(self, window: np.ndarray, sot_sequence: list[int], text_tokens: list[int],
              offset: float) -> list[tuple[Word, list[int]]]:
        """(word, its tokens) for the words of ``text_tokens`` (the window's text tokens, no timestamps or
        specials) spoken in ``window`` (16 kHz samples, <= 30 s) decoded after
        ``sot_sequence``; times in seconds plus ``offset``."""
        if not text_tokens:
            return []
        feats = torch.as_tensor(log_mel_spectrogram([window], n_mels=self.n_mels)[0])
        return self.align_features(feats, len(window) // HOP_LENGTH, sot_sequence, text_tokens, offset)

    def align_features(self, features: torch.Tensor, num_frames: int, sot_sequence: list[int],
                       text_tokens: list[int], offset: float) -> list[tuple[Word, list[int]]]:
        """``align`` on a window's log-mel ``features`` (n_mels, 3000) whose first
        ``num_frames`` 10 ms frames are audio: the sequential job's windows are
        slices of the whole file's features, which cutting the audio would not give."""
        if not text_tokens:
            return []
        logits, weights = self.call_model(lambda model: self._dense_pass(model, features, [
            *sot_sequence, *text_tokens, self.eot]))
        n_sot = len(sot_sequence)
        # Row r (input token r) predicts token r + 1: rows n_sot-1 .. predict the text and eot.
        probs = torch.softmax(logits[n_sot - 1:-1, : self.eot].float(), dim=-1)
        token_probs = probs[torch.arange(len(text_tokens)), torch.tensor(text_tokens)].cpu().numpy()
        num_frames = min(num_frames, 2 * weights.shape[-1])
        matrix = weights.float().cpu().numpy()  # (heads, rows, 1500)
        # Normalise over all rows (as openai/whisper), then keep the rows that predict text + eot.
        times = token_start_times(matrix, max(num_frames // 2, 1), rows=slice(n_sot - 1, -1))
        names, groups = split_words(text_tokens + [self.eot], self.tokenizer, self.eot)
        bounds = np.cumsum([0] + [len(g) for g in groups[:-1]])  # token index where each word starts
        words = [Word(offset + float(times[bounds[k]]), offset + float(times[bounds[k + 1]]), names[k],
                      float(token_probs[bounds[k]:bounds[k + 1]].mean()))
                 for k in range(len(groups) - 1)]  # the last group is eot
        tokens = [list(g) for g in groups[:-1]]
        merge_punctuations(words, tokens)
        return [(w, t) for w, t in zip(words, tokens) if w.word]


    def _dense_pass(self, model: Any, features: torch.Tensor, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoder and a dense decoder pass over ``ids`` (engine thread): logits and the heads' weights."""
        param = next(model.parameters())
        with torch.inference_mode():
            enc = model.encode(features[None].to(param.device))[0]
            return model.cross_attention_weights(enc, torch.tensor(ids, device=param.device), self.heads)


def text_runs(tokens: list[int], ts_begin: int, eot: int, tokenizer: Any) -> list[list[int]]:
    """A window's output ids -> the text tokens of each segment, in the order and
    with the rule of ``windows.segments_from_tokens`` (a run ends at a timestamp
    token; runs whose text is blank make no segment)."""
    runs, current = [], []
    for t in tokens:
        if t >= ts_begin:
            if current:
                runs.append(current)
            current = []
        elif t < eot:
            current.append(t)
    if current:
        runs.append(current)
    return [r for r in runs if tokenizer.decode(r, skip_special_tokens=True).strip()]


def words_for_segments(aligner: WordAligner, window: np.ndarray, sot_sequence: list[int], tokens: list[int],
                       segments: list[Any], offset: float, ts_begin: int) -> None:
    """Set ``segment.words`` for the ``segments`` one window's ``tokens`` made
    (``windows.segments_from_tokens``), aligned on the window's audio."""
    runs = text_runs(tokens, ts_begin, aligner.eot, aligner.tokenizer)
    if len(runs) != len(segments):
        raise RuntimeError(f"word timestamps: {len(runs)} text runs for {len(segments)} segments")
    words = aligner.align(window, sot_sequence, [t for r in runs for t in r], offset)
    assign_words(words, runs, segments, offset)


def assign_words(words: list[tuple[Word, list[int]]], runs: list[list[int]], segments: list[Any],
                 offset: float) -> None:
    """Give each word (aligned over the text ``runs`` of one window, one run per
    segment, possibly empty) to the segment of its first token, clamped inside it
    and monotonic within the window."""
    owner = np.repeat(np.arange(len(runs)), [len(r) for r in runs])  # segment of each text token
    first = np.cumsum([0] + [len(ids) for _, ids in words])  # index of each word's first token
    durations = [w.end - w.start for w, _ in words if w.end > w.start]
    # openai/whisper's cap: DTW gives a segment's first word the silence before it.
    max_duration = 2 * min(0.7, float(np.median(durations))) if durations else 0.0
    last_end = offset
    for seg in segments:
        seg.words = []
    for (w, _), tok in zip(words, first[:-1]):
        seg = segments[int(owner[int(tok)])]
        w.start = min(max(w.start, seg.start, last_end), seg.end)
        w.end = min(max(w.end, w.start), seg.end)
        if not seg.words and max_duration and w.end - w.start > max_duration:
            w.start = w.end - max_duration
        last_end = w.end
        seg.words.append(w)
