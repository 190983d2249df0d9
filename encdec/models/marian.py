"""Marian (OPUS-MT) on the BART layout: post-norm blocks, no embedding layer
norm, static sinusoidal positions (Marian's table: the sines in the first half
of each row, the cosines in the second, rows from position 0), ``scale_embedding``,
``final_logits_bias``, and the decoder starting from <pad>.

OPUS-MT generation configs forbid <pad> as an output (``bad_words_ids:
[[pad]]``): HF's ``generate`` applies it to every request, and so does the
engine for every family (``BadWordsLogitsProcessor``, a built-in).
"""
from __future__ import annotations

import numpy as np
import torch

from encdec.models.bart import BartForConditionalGeneration, Layout, start_then_forced_bos


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
