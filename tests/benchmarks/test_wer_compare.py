"""The long-form benchmark's paired WER comparison: per-sentence error counts that
add up to the file's WER, and a bootstrap interval that tells a real gap from the
noise of a few words."""
from __future__ import annotations

import pytest

from benchmarks.wer_compare import WerDifference, paired_difference, sentence_errors
from benchmarks.wer_compare import word_error_rate

SENTENCES = [f"the quick brown fox number {i} jumps over the lazy dog" for i in range(60)]


def test_sentence_errors_add_up_to_the_files_wer():
    sents = ["The cat sat.", "A dog-house stands here", "birds sing at dawn"]
    hyp = "the cat sat on it a dog house here birds bring at at dawn"  # 2 inserted, 1 deleted, 1 wrong, 1 more
    errors, words = sentence_errors(sents, hyp)
    assert list(words) == [3, 5, 4]
    assert list(errors) == [2, 1, 2]  # insertions count at the sentence before them
    assert errors.sum() / words.sum() == pytest.approx(word_error_rate(" ".join(sents), hyp))


def _with_errors(every: int, word: str = "lazy", offset: int = 0) -> list[str]:
    """The sentences with one word wrong in every ``every``-th (from ``offset``)."""
    return [s.replace(word, word[0] + "x" + word[1:]) if i % every == offset else s for i, s in enumerate(SENTENCES)]


def test_same_transcripts_are_level_and_a_wide_gap_is_worse():
    perfect, poor = " ".join(SENTENCES), " ".join(_with_errors(1))
    same = paired_difference([SENTENCES], [poor], [poor])
    assert (same.diff, same.low, same.high) == (0.0, 0.0, 0.0) and same.verdict() == "level within noise"
    worse = paired_difference([SENTENCES], [poor], [perfect])
    assert worse.diff == pytest.approx(1 / 11) and worse.low > 0 and worse.verdict() == "worse"
    better = paired_difference([SENTENCES], [perfect], [poor])
    assert better.high < 0 and better.verdict() == "better"


def test_a_few_words_apart_are_level_within_noise():
    """Two sides with their own wrong words, 6 and 7 in 660 over two files: the
    interval of the 0.0015 gap spans zero."""
    a, b = _with_errors(10), _with_errors(10, "brown", offset=5)
    b[1] = b[1].replace("fox", "box")
    files = [SENTENCES[:30], SENTENCES[30:]]
    d = paired_difference(files, [" ".join(a[:30]), " ".join(a[30:])], [" ".join(b[:30]), " ".join(b[30:])])
    assert d.diff == pytest.approx(-1 / 660)
    assert d.low < 0 < d.high and d.verdict() == "level within noise"
    assert str(d).startswith("-0.002 (95% interval -")


def test_files_must_line_up():
    with pytest.raises(ValueError, match="one entry per file"):
        paired_difference([SENTENCES], ["a"], ["a", "b"])


def test_verdict_reads_the_interval():
    assert WerDifference(0.004, 0.001, 0.007).verdict() == "worse"
    assert WerDifference(-0.004, -0.007, -0.001).verdict() == "better"
    assert WerDifference(0.004, -0.001, 0.009).verdict() == "level within noise"
