"""Whether two transcribers' WERs on the same audio differ by more than the test
set's own noise. The long-form benchmark's targets compare WERs at the third
decimal, and on its files two implementations of one algorithm (ours and
faster-whisper's, both greedy, same weights) differed by up to 0.02 a file either
way in ordinary misrecognitions; 0.003 over 8 files is about 20 words. So beside
each WER the benchmark prints the paired difference with a 95% interval:
errors are counted per spoken sentence (both sides against the same
sentences), and the sentences are resampled with replacement (the paired
bootstrap of Koehn 2004 and Bisani & Ney 2004, the usual test for MT and ASR
comparisons)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

RESAMPLES = 2000


@dataclass(frozen=True)
class WerDifference:
    """WER of side a minus side b over the same sentences, with the 2.5th and
    97.5th percentiles of that difference over bootstrap resamples."""
    diff: float
    low: float
    high: float

    def verdict(self) -> str:
        if self.high < 0:
            return "better"
        if self.low > 0:
            return "worse"
        return "level within noise"

    def __str__(self) -> str:
        return f"{self.diff:+.3f} (95% interval {self.low:+.3f}..{self.high:+.3f}): {self.verdict()}"


def wer_transform():
    """jiwer's transform for scoring: lower-case, "-" -> space, no punctuation,
    words (one place, so every WER and every error count agree)."""
    import jiwer

    return jiwer.Compose([jiwer.ToLowerCase(), jiwer.SubstituteRegexes({"-": " "}), jiwer.RemovePunctuation(),
                          jiwer.RemoveMultipleSpaces(), jiwer.Strip(), jiwer.ReduceToListOfListOfWords()])


def word_error_rate(reference: str, hypothesis: str) -> float:
    """jiwer WER after ``wer_transform`` (how tests and benchmarks score
    transcripts against the clips' sentences)."""
    import jiwer

    norm = wer_transform()
    return jiwer.wer(reference, hypothesis, reference_transform=norm, hypothesis_transform=norm)


def sentence_errors(sentences: Sequence[str], hypothesis: str) -> tuple[np.ndarray, np.ndarray]:
    """(errors, reference words) per sentence of one file's reference, from one
    alignment of the whole file, so their sums give exactly ``word_error_rate``
    of the joined sentences. A substitution or deletion counts at its reference
    word's sentence; an insertion at the sentence of the reference word before it."""
    import jiwer

    norm = wer_transform()
    words = np.array([len(norm(s)[0]) if s.strip() else 0 for s in sentences], dtype=np.int64)
    owner = np.repeat(np.arange(len(sentences)), words)
    errors = np.zeros(len(sentences), dtype=np.int64)
    out = jiwer.process_words(" ".join(sentences), hypothesis, reference_transform=norm, hypothesis_transform=norm)
    for chunk in out.alignments[0]:
        if chunk.type in ("substitute", "delete"):
            np.add.at(errors, owner[chunk.ref_start_idx:chunk.ref_end_idx], 1)
        elif chunk.type == "insert":
            errors[owner[max(chunk.ref_start_idx - 1, 0)]] += chunk.hyp_end_idx - chunk.hyp_start_idx
    return errors, words


def paired_difference(sentences: Sequence[Sequence[str]], hyps_a: Sequence[str], hyps_b: Sequence[str],
                      resamples: int = RESAMPLES, seed: int = 0) -> WerDifference:
    """WER(a) - WER(b) over files (``sentences[i]`` spoken in file i, ``hyps_x[i]``
    its transcript), with its bootstrap interval over all files' sentences."""
    if not len(sentences) == len(hyps_a) == len(hyps_b):
        raise ValueError(f"sentences, hyps_a and hyps_b must have one entry per file, got "
                         f"{len(sentences)}, {len(hyps_a)}, {len(hyps_b)}")
    a, b, n = [], [], []
    for sents, ha, hb in zip(sentences, hyps_a, hyps_b):
        ea, words = sentence_errors(sents, ha)
        a.append(ea)
        b.append(sentence_errors(sents, hb)[0])
        n.append(words)
    ea, eb, words = np.concatenate(a), np.concatenate(b), np.concatenate(n)
    if words.sum() == 0:
        raise ValueError("the reference sentences hold no words")
    idx = np.random.default_rng(seed).integers(0, len(words), size=(resamples, len(words)))
    diffs = (ea[idx].sum(1) - eb[idx].sum(1)) / np.maximum(words[idx].sum(1), 1)
    low, high = np.percentile(diffs, [2.5, 97.5])
    return WerDifference(float((ea.sum() - eb.sum()) / words.sum()), float(low), float(high))
