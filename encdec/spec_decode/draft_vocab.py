"""Which token ids a draft's LM head keeps (``speculative_config.draft_vocab_size``).

A draft step of a small model is dominated by its LM head (Whisper tiny.en:
51 864 rows of 384, a third of a draft step), yet nearly every draft the target
keeps is a common token. EAGLE-3 and FR-Spec restrict the draft's head to a
frequent subset of the vocabulary, counted on a corpus. Here no corpus is
needed: byte-level BPE vocabularies (GPT-2's, Whisper's, BART's) number their
tokens in merge order and SentencePiece ones (T5, Marian, mBART, M2M100) by
score, so the lowest ids are the most frequent pieces and ``draft_vocab_size``
N keeps the ids ``0 .. N-1``. To those it adds every id the decoding rules
need: the config's special tokens (eos, pad, bos, decoder start, forced bos
and eos, no-timestamps, forced decoder ids) and, where special tokens sit
after the text tokens, every id from the first such token above N to the end
of the vocabulary (Whisper: end-of-text, start-of-transcript, languages,
tasks, no-timestamps and all timestamp tokens).

The subset only changes which drafts can be proposed: the target verifies
every draft against its full vocabulary, so a token outside the subset costs
acceptance (the draft proposes something else there), never exactness.
Torch-free: the ids are plain ints; ``worker/draft_head.py`` gathers the rows.
"""
from __future__ import annotations

from typing import Any

# Config and generation-config fields that name a token the decoding rules use.
_SPECIAL_FIELDS = ("eos_token_id", "pad_token_id", "bos_token_id", "decoder_start_token_id",
                   "forced_bos_token_id", "forced_eos_token_id", "no_timestamps_token_id")


def special_token_ids(*configs: Any) -> set[int]:
    """Every token id the configs (an HF config, a generation config, or None)
    name in ``_SPECIAL_FIELDS`` (an int or a list of ints) or in
    ``forced_decoder_ids`` ([[position, id], ...])."""
    ids: set[int] = set()
    for cfg in configs:
        if cfg is None:
            continue
        for name in _SPECIAL_FIELDS:
            value = getattr(cfg, name, None)
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                    ids.add(v)
        for pair in getattr(cfg, "forced_decoder_ids", None) or ():
            if isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[1], int):
                ids.add(pair[1])
    return ids


def draft_vocab_ids(size: int | None, vocab_size: int, special_ids: set[int]) -> list[int] | None:
    """The ids a draft head of ``size`` keeps, ascending: ``0 .. size-1``, the
    ``special_ids`` and every id from the lowest special id at or above
    ``size`` up to ``vocab_size``. None where that is the whole vocabulary
    (``size`` None or >= ``vocab_size``): the full head, nothing gathered."""
    if size is None or size >= vocab_size:
        return None
    above = [i for i in special_ids if size <= i < vocab_size]
    tail = range(min(above), vocab_size) if above else range(0)
    ids = sorted(set(range(size)) | set(tail) | {i for i in special_ids if 0 <= i < vocab_size})
    return None if len(ids) >= vocab_size else ids
