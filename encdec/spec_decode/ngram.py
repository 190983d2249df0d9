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

Matching is a byte search (``bytes.find`` over the ids as int32, a C loop) for
each n from the longest down, the first occurrence at a token boundary; a
request's encoder ids are converted once. (A numpy pass per position and n
cost ~50 us a row, a tenth of a 64-row step on 2 cores; this is a few us.)

    encoder:  the cat sat on the mat .        decoder: <s> the cat sat
    suffix "the cat sat" (n=3) ends at encoder position 2 -> draft "on the mat"
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

TokenIds = Sequence[int] | np.ndarray


def _earliest(haystack: bytes, pattern: bytes, limit: int) -> int:
    """Token index of the earliest occurrence of ``pattern`` (int32 tokens) in
    ``haystack[:limit]`` (bytes) at a token boundary, or -1."""
    i = haystack.find(pattern, 0, limit)
    while i >= 0 and i % 4:
        i = haystack.find(pattern, i + 1, limit)
    return i // 4 if i >= 0 else -1


def _int32_bytes(ids: TokenIds) -> bytes:
    return np.asarray(ids, dtype=np.int32).tobytes()


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
        self._encoders: dict[int, tuple[TokenIds, bytes]] = {}  # id -> (encoder ids, their int32 bytes)

    @classmethod
    def from_config(cls, config) -> NgramProposer:
        """From a ``SpeculativeConfig`` of method "ngram"."""
        return cls(config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min)

    def propose(self, encoder_ids: TokenIds, decoder_ids: TokenIds, max_tokens: int | None = None) -> list[int]:
        """Up to ``min(k, max_tokens)`` draft ids for one request (none without a
        match, or where ``max_tokens`` is 0: the request's remaining budget)."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        num_dec = len(decoder_ids)
        if k <= 0 or num_dec < self.n_min:
            return []
        enc, dec = self._encoder_bytes(encoder_ids), _int32_bytes(decoder_ids)
        # A match needs a token after it: the encoder's can end anywhere but its
        # last position, the decoder's before the suffix's own end.
        enc_limit, dec_limit = 4 * (len(encoder_ids) - 1), 4 * (num_dec - 1)
        for n in range(min(self.n_max, num_dec), self.n_min - 1, -1):
            suffix = dec[-4 * n:]
            for side, ids, limit in ((enc, encoder_ids, enc_limit), (dec, decoder_ids, dec_limit)):
                start = _earliest(side, suffix, limit)
                if start >= 0:
                    return [int(t) for t in ids[start + n: start + n + k]]
        return []

    def _encoder_bytes(self, encoder_ids: TokenIds) -> bytes:
        """A request's encoder ids never change: their bytes are kept while the
        same list object comes back (a few requests' worth)."""
        key = id(encoder_ids)
        hit = self._encoders.get(key)
        if hit is not None and hit[0] is encoder_ids:
            return hit[1]
        if len(self._encoders) >= 1024:
            self._encoders.clear()
        data = _int32_bytes(encoder_ids)
        self._encoders[key] = (encoder_ids, data)
        return data

    def propose_batch(self, encoder_ids: Sequence[TokenIds], decoder_ids: Sequence[TokenIds],
                      max_tokens: Sequence[int] | None = None) -> list[list[int]]:
        """``propose`` for each request (lists of equal length; ``max_tokens``:
        each request's remaining budget, or None)."""
        if len(encoder_ids) != len(decoder_ids) or (max_tokens is not None and len(max_tokens) != len(decoder_ids)):
            raise ValueError(f"propose_batch: {len(encoder_ids)} encoder inputs, {len(decoder_ids)} decoder "
                             f"inputs{'' if max_tokens is None else f', {len(max_tokens)} budgets'}")
        limits = max_tokens if max_tokens is not None else [None] * len(decoder_ids)
        return [self.propose(e, d, m) for e, d, m in zip(encoder_ids, decoder_ids, limits)]
