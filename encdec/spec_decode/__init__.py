"""Speculative decoding's parts, each on its own (the engine's step calls them):

- ``SpeculativeConfig`` (``config``): vLLM's ``speculative_config`` dict, checked
  before anything loads; ``check_draft_compatible`` (``compat``): a draft
  checkpoint against its target, from configs and tokenizers.
- ``NgramProposer`` (``ngram``): drafts copied from the encoder input and the
  decoder's own tokens (numpy).
- ``draft_vocab_ids`` (``draft_vocab``): the token ids a draft's LM head keeps
  under ``draft_vocab_size`` (torch-free).
- ``accept_greedy``, ``rejection_sample`` (``acceptance``): the tokens each
  request keeps from a verification step, per request, batched (torch).

Nothing here touches requests, blocks or the scheduler. The config and the
proposer never import torch (bookkeeping may call them); the acceptance
functions are imported on first use.
"""
from __future__ import annotations

from typing import Any

from encdec.spec_decode.compat import check_draft_compatible
from encdec.spec_decode.config import SpeculativeConfig
from encdec.spec_decode.ngram import NgramProposer

_TORCH = ("PAD", "accept_greedy", "recovered_probs", "rejection_sample")

__all__ = ["NgramProposer", "SpeculativeConfig", "check_draft_compatible", *_TORCH]


def __getattr__(name: str) -> Any:
    if name in _TORCH:
        from encdec.spec_decode import acceptance

        return getattr(acceptance, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
