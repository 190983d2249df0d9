"""The n-gram proposer (``method="ngram"``): drafts copied from what a request
already holds, no model.

For each request: take the decoder's last n tokens (n from ``prompt_lookup_max``
down to ``prompt_lookup_min``), find them in the **encoder input ids** (the
source a summary or translation copies from) and in the **decoder's own
tokens** (before that suffix), and propose the up-to-k tokens that followed the
match. Rules, in order:

1. the longest n wins, whichever side it is on (a longer match is the more
   specific context);
2. at equal n the encoder wins: an encoder/decoder model copies from its
   source, and the source's continuation is text not yet copied, where a
   match in the decoder's own tokens predicts the output repeating itself
   (which summaries and translations rarely do, and ``no_repeat_ngram_size``
   forbids);
3. within one side, the earliest match (vLLM's and HF's prompt lookup take the
   first one too; a document is copied front to back).

Matching is vectorised over positions (numpy): for each candidate end position
of a match, the match length grows one token at a time from the end, ``n_max``
array passes in all, whatever the sequence length.

    encoder:  the cat sat on the mat .        decoder: <s> the cat sat
    suffix "the cat sat" (n=3) ends at encoder position 2 -> draft "on the mat"
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

TokenIds = Sequence[int] | np.ndarray


def match_lengths(haystack: np.ndarray, suffix: np.ndarray) -> np.ndarray:
    """(len(haystack),) int: for each position i, how many of ``suffix``'s last
    tokens ``haystack`` ends with at i (``haystack[i - j] == suffix[-1 - j]`` for
    j < that count), up to ``len(suffix)``."""
    n = len(haystack)
    ends = np.arange(n)
    lengths = np.zeros(n, dtype=np.int64)
    alive = np.ones(n, dtype=bool)
    for j in range(len(suffix)):
        idx = ends - j
        ok = alive & (idx >= 0)
        ok[ok] = haystack[idx[ok]] == suffix[-1 - j]
        alive = ok
        if not alive.any():
            break
        lengths += alive
    return lengths


def _best(haystack: np.ndarray, suffix: np.ndarray, n_min: int, last_end: int) -> tuple[int, int]:
    """(n, end) of the longest match of ``n_min``+ tokens ending at or before
    ``last_end`` (the earliest such end), or (0, -1)."""
    if last_end < 0:
        return 0, -1
    lengths = match_lengths(haystack[: last_end + 1], suffix)
    n = int(lengths.max(initial=0))
    if n < n_min:
        return 0, -1
    return n, int(np.argmax(lengths == n))


class NgramProposer:
    """Drafts for requests from n-gram matches (see the module docstring)."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int, prompt_lookup_min: int):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({prompt_lookup_min}) must be >= 1 and <= prompt_lookup_max "
                             f"({prompt_lookup_max})")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.k = num_speculative_tokens
        self.n_max = prompt_lookup_max
        self.n_min = prompt_lookup_min

    @classmethod
    def from_config(cls, config) -> NgramProposer:
        """From a ``SpeculativeConfig`` of method "ngram"."""
        return cls(config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min)

    def propose(self, encoder_ids: TokenIds, decoder_ids: TokenIds, max_tokens: int | None = None) -> list[int]:
        """Up to ``min(k, max_tokens)`` draft ids for one request (none without a
        match, or where ``max_tokens`` is 0: the request's remaining budget)."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        dec = np.asarray(decoder_ids, dtype=np.int64)
        if k <= 0 or len(dec) < self.n_min:
            return []
        enc = np.asarray(encoder_ids, dtype=np.int64)
        suffix = dec[-min(self.n_max, len(dec)):]
        # A match needs a token after it: the encoder's can end anywhere but its
        # last position, the decoder's before the suffix's own end.
        n_enc, end_enc = _best(enc, suffix, self.n_min, len(enc) - 2)
        n_dec, end_dec = _best(dec, suffix, self.n_min, len(dec) - 2)
        if n_enc == 0 and n_dec == 0:
            return []
        if n_enc >= n_dec:
            return enc[end_enc + 1: end_enc + 1 + k].tolist()
        return dec[end_dec + 1: end_dec + 1 + k].tolist()

    def propose_batch(self, encoder_ids: Sequence[TokenIds], decoder_ids: Sequence[TokenIds],
                      max_tokens: Sequence[int] | None = None) -> list[list[int]]:
        """``propose`` for each request (lists of equal length; ``max_tokens``:
        each request's remaining budget, or None)."""
        if len(encoder_ids) != len(decoder_ids) or (max_tokens is not None and len(max_tokens) != len(decoder_ids)):
            raise ValueError(f"propose_batch: {len(encoder_ids)} encoder inputs, {len(decoder_ids)} decoder "
                             f"inputs{'' if max_tokens is None else f', {len(max_tokens)} budgets'}")
        limits = max_tokens if max_tokens is not None else [None] * len(decoder_ids)
        return [self.propose(e, d, m) for e, d, m in zip(encoder_ids, decoder_ids, limits)]
