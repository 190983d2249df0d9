"""The synthetic copy-heavy task the speculative decoding benchmark measures on: an
extractive summary. A document is synthetic sentences over a word vocabulary (by
default 3-5 sentences, 25-60 tokens: a small model on 2 cores learns to copy from
longer ones only in far more steps); some sentences start with the marker word, and
the summary is those sentences, copied in order. Every summary token is in the source, so drafts copied
from the encoder input (``ngram``) can be right; random weights never copy, which is
why the benchmark needs a model trained on this.

Pure Python (no torch): documents are lists of word ids into ``vocabulary()``, drawn
from a ``random.Random`` so a seed fixes them. Token ids follow BART's layout:
<s>=0, <pad>=1, </s>=2, <unk>=3, then ``.``, the marker, the words, <mask> last.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")
PERIOD = "."
MARKER = "note"
MASK = "<mask>"
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z")
_VOWELS = ("a", "e", "i", "o", "u")


@dataclass(frozen=True)
class CopyTask:
    """How documents are drawn (counts are inclusive ranges)."""

    num_words: int = 64                     # content words in the vocabulary
    sentences: tuple[int, int] = (3, 5)     # per document
    words: tuple[int, int] = (6, 10)        # per sentence, before its period
    marked: tuple[int, int] = (2, 3)        # sentences starting with the marker, copied to the summary

    def __post_init__(self) -> None:
        for name in ("sentences", "words", "marked"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"CopyTask.{name} must be a range 1 <= lo <= hi, got {(lo, hi)}")
        if self.marked[1] > self.sentences[0]:
            raise ValueError(f"CopyTask.marked {self.marked} can exceed the fewest sentences {self.sentences[0]}")
        if not 16 <= self.num_words <= len(_ONSETS) ** 3 * len(_VOWELS):
            raise ValueError(f"CopyTask.num_words must be in [16, {len(_ONSETS) ** 3 * len(_VOWELS)}], "
                             f"got {self.num_words}")

    def max_source_len(self) -> int:
        """Encoder tokens of the longest document, <s> and </s> included."""
        return self.sentences[1] * (self.words[1] + 2) + 2

    def max_summary_len(self) -> int:
        """Decoder tokens of the longest summary with its </s>."""
        return self.marked[1] * (self.words[1] + 2) + 1


def vocabulary(num_words: int) -> list[str]:
    """Every token in id order: BART's specials, the period, the marker, ``num_words``
    pronounceable three-syllable words (the same list for the same count), <mask>."""
    words = []
    for a in _ONSETS:
        for b in _ONSETS:
            for c in _ONSETS:
                for v in _VOWELS:
                    words.append(f"{a}{v}{b}{_VOWELS[len(words) % 5]}{c}{_VOWELS[(len(words) // 5) % 5]}")
    rng = random.Random(1234)  # a fixed spread over the syllables, not the first few onsets only
    rng.shuffle(words)
    return [*SPECIALS, PERIOD, MARKER, *sorted(words[:num_words]), MASK]


def first_word_id() -> int:
    return len(SPECIALS) + 2


def make_example(task: CopyTask, rng: random.Random) -> tuple[list[int], list[int]]:
    """(document, summary) as token ids without specials: the summary is the
    document's marked sentences in order, each with its period."""
    period, marker = len(SPECIALS), len(SPECIALS) + 1
    first = first_word_id()
    n = rng.randint(*task.sentences)
    marked = set(rng.sample(range(n), rng.randint(*task.marked)))
    doc: list[int] = []
    summary: list[int] = []
    for i in range(n):
        body = [rng.randrange(first, first + task.num_words) for _ in range(rng.randint(*task.words))]
        sentence = ([marker] if i in marked else []) + body + [period]
        doc += sentence
        if i in marked:
            summary += sentence
    return doc, summary


def make_examples(task: CopyTask, count: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """``count`` examples from ``seed`` (the same seed, the same examples)."""
    rng = random.Random(seed)
    return [make_example(task, rng) for _ in range(count)]
