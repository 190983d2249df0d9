"""Marian (OPUS-MT) on the BART layout: post-norm blocks, no embedding layer
norm, static sinusoidal positions (Marian's table: the sines in the first half
of each row, the cosines in the second, rows from position 0), ``scale_embedding``,
``final_logits_bias``, and the decoder starting from <pad>.

OPUS-MT generation configs forbid <pad> as an output (``bad_words_ids:
[[pad]]``): HF's ``generate`` applies it to every request, and so does
``logits_processors()`` here for every single-token entry of that list.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from encdec.models.bart import BartForConditionalGeneration, Layout, start_then_forced_bos
from encdec.sample.logits_processor import BatchUpdate, LogitsProcessor


class MarianMTModel(BartForConditionalGeneration):
    layout = Layout(positions="sinusoidal", layernorm_embedding=False)
    model_name = "Marian"

    @staticmethod
    def decoder_vocab_size(cfg) -> int:
        shared = getattr(cfg, "share_encoder_decoder_embeddings", True)
        return cfg.vocab_size if shared else (cfg.decoder_vocab_size or cfg.vocab_size)

    @staticmethod
    def num_positions(cfg) -> int:
        return cfg.max_position_embeddings

    def sinusoid_table(self, num_positions: int, dim: int) -> torch.Tensor:
        """HF's ``MarianSinusoidalPositionalEmbedding.create_weight``: angles in
        float64, sines of the even features then cosines of the odd ones."""
        angle = np.array([[pos / np.power(10000, 2 * (j // 2) / dim) for j in range(dim)]
                          for pos in range(num_positions)])
        half = dim // 2 + dim % 2
        out = torch.empty(num_positions, dim)
        out[:, :half] = torch.FloatTensor(np.sin(angle[:, 0::2]))
        out[:, half:] = torch.FloatTensor(np.cos(angle[:, 1::2]))
        return out

    def position_rows(self, ids: torch.Tensor, positions: torch.Tensor, num_prefill_tokens: int) -> torch.Tensor:
        return positions


default_decoder_prompt = start_then_forced_bos  # OPUS-MT: [<pad>]


def banned_token_ids(generation_config) -> list[int]:
    """The single-token ``bad_words_ids`` of a generation config (OPUS-MT: <pad>)."""
    return sorted({ids[0] for ids in (getattr(generation_config, "bad_words_ids", None) or []) if len(ids) == 1})


class BannedTokensLogitsProcessor(LogitsProcessor):
    """Every row: the generation config's single-token bad words get -inf (HF's
    ``NoBadWordsLogitsProcessor`` for one-token entries)."""

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.banned = torch.tensor(banned_token_ids(config.generation_config), dtype=torch.long, device=device)

    def is_argmax_invariant(self) -> bool:
        return self.banned.numel() == 0

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        return None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.banned.numel():
            logits[:, self.banned] = float("-inf")
        return logits


def logits_processors() -> list[type]:
    """Registry hook: every Marian request gets the generation config's bad words."""
    return [BannedTokensLogitsProcessor]
