"""The n-gram proposer: drafts from the encoder input and the decoder's own
tokens; the longest match wins, the encoder at equal length, the earliest
match within a side; edge cases; and a brute-force reference of those rules on
random small-vocabulary sequences."""
from __future__ import annotations

import random

import numpy as np
import pytest

from encdec.spec_decode import NgramProposer, SpeculativeConfig


def test_copies_the_source_continuation():
    p = NgramProposer(3, 3, 1)
    enc = [0, 10, 11, 12, 13, 14, 15, 2]
    assert p.propose(enc, [2, 0, 10, 11]) == [12, 13, 14]
    assert p.propose(np.array(enc), np.array([2, 0, 10, 11])) == [12, 13, 14]  # numpy input


def test_no_match_short_decoder_and_budget():
    p = NgramProposer(4, 3, 2)
    assert p.propose([5, 6, 7, 8], [1, 2]) == []  # no 2-gram match anywhere
    assert p.propose([5, 6, 7, 8], [6]) == []  # fewer decoder tokens than prompt_lookup_min
    assert p.propose([5, 6, 7, 8, 9], [5, 6]) == [7, 8, 9]  # continuation shorter than k: what there is
    assert p.propose([5, 6, 7, 8, 9], [5, 6], max_tokens=2) == [7, 8]
    assert p.propose([5, 6, 7, 8, 9], [5, 6], max_tokens=0) == []
    assert p.propose([], [5, 6]) == []
    assert p.propose([7, 5, 6], [5, 6]) == []  # the match ends the encoder: nothing follows it


def test_longest_match_wins_across_sides():
    p = NgramProposer(2, 3, 1)
    # The encoder matches the last 2 tokens, the decoder its last 3: the decoder wins.
    enc = [8, 4, 5, 70, 71]
    dec = [3, 4, 5, 60, 61, 3, 4, 5]
    assert p.propose(enc, dec) == [60, 61]
    # The encoder matches 3 too: the tie goes to the encoder.
    assert p.propose([3, 4, 5, 70, 71], dec) == [70, 71]


def test_earliest_match_within_a_side_and_fallback_to_shorter_n():
    p = NgramProposer(2, 3, 2)
    enc = [1, 2, 30, 31, 9, 1, 2, 40, 41]
    assert p.propose(enc, [7, 1, 2]) == [30, 31]  # the first occurrence
    # No 3-gram: the 2-gram [1, 2] still matches (n from max down to min).
    assert p.propose(enc, [6, 6, 1, 2]) == [30, 31]


def test_decoder_repetition_proposes_the_cycle():
    p = NgramProposer(4, 2, 2)
    dec = [2, 0, 7, 8, 7, 8, 7, 8]
    assert p.propose([5, 6], dec) == [7, 8, 7, 8]


def test_batch_equals_one_by_one_and_checks_lengths():
    p = NgramProposer.from_config(SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}))
    encs = [[0, 10, 11, 12, 13, 2], [5, 5, 5], [9, 8, 7, 6]]
    decs = [[2, 0, 10], [1], [2, 0, 8]]
    assert p.propose_batch(encs, decs) == [p.propose(e, d) for e, d in zip(encs, decs)]
    assert p.propose_batch(encs, decs, [1, 3, 0]) == [[11], [], []]
    with pytest.raises(ValueError, match="propose_batch"):
        p.propose_batch(encs, decs[:2])
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(3, 2, 3)


def _reference(enc: list[int], dec: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """The rules spelled out, one n and one position at a time."""
    for n in range(min(n_max, len(dec)), n_min - 1, -1):
        suffix = dec[-n:]
        for side, last in ((enc, len(enc) - 2), (dec, len(dec) - 2)):  # encoder first: it wins ties
            for end in range(n - 1, last + 1):  # earliest first
                if side[end - n + 1: end + 1] == suffix:
                    return side[end + 1: end + 1 + k]
    return []


def test_matches_the_rules_on_random_sequences():
    rng = random.Random(0)
    for _ in range(400):
        vocab = rng.randint(2, 6)
        k, n_min = rng.randint(1, 5), rng.randint(1, 3)
        n_max = rng.randint(n_min, 5)
        enc = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
        dec = [rng.randrange(vocab) for _ in range(rng.randint(0, 20))]
        got = NgramProposer(k, n_max, n_min).propose(enc, dec)
        assert got == _reference(enc, dec, k, n_max, n_min), (enc, dec, k, n_max, n_min)


def test_config_and_proposer_import_no_torch():
    """Bookkeeping (torch-free) may build the config and call the proposer."""
    import subprocess
    import sys

    code = ("import sys, encdec.spec_decode as s; s.SpeculativeConfig;"
            "assert s.NgramProposer(2, 3, 1).propose([1, 2, 3], [1, 2]) == [3];"
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
