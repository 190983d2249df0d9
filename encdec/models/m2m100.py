"""M2M100 and NLLB (NLLB checkpoints are ``M2M100ForConditionalGeneration``) on
the BART layout: pre-norm blocks, closing layer norms on both stacks,
``scale_embedding``, no embedding layer norm, no ``final_logits_bias``, and
fairseq's sinusoidal positions counted past <pad>.

Positions (HF's ``create_position_ids_from_input_ids``): a token's row of the
table is ``pad + n``, n = its count among the sequence's non-<pad> tokens; a
<pad> token takes row ``pad``, which is zeros. A decode step counts the cached
length instead (HF's ``cache_length``), <pad> tokens included::

    prefill  ids   </s>  fra   <pad>  x          decode  (cache 4)  y
             rows   2     3     1     4                             6

The target language is the first generated token: forced by the generation
config's ``forced_bos_token_id`` (HF) or given as the decoder prompt
``[</s>, <tgt_lang>]``; the tokenizer's ``src_lang`` code opens the encoder input.
"""
from __future__ import annotations

import math

import torch

from encdec.models.bart import BartForConditionalGeneration, Layout, start_then_forced_bos

POSITION_OFFSET = 2  # M2M100SinusoidalPositionalEmbedding's extra rows


class M2M100ForConditionalGeneration(BartForConditionalGeneration):
    layout = Layout(pre_norm=True, positions="sinusoidal", layernorm_embedding=False, stack_layer_norm=True,
                    final_logits_bias=False)
    model_name = "M2M100"

    @staticmethod
    def num_positions(cfg) -> int:
        return cfg.max_position_embeddings + POSITION_OFFSET

    def sinusoid_table(self, num_positions: int, dim: int) -> torch.Tensor:
        """HF's ``M2M100SinusoidalPositionalEmbedding.get_embedding``, op for op
        (float32): [sin | cos] halves, row ``pad`` zero."""
        half = dim // 2
        step = math.log(10000) / (half - 1)
        freq = torch.exp(torch.arange(half, dtype=torch.int64).float() * -step)
        angle = torch.arange(num_positions, dtype=torch.int64).float().unsqueeze(1) * freq.unsqueeze(0)
        table = torch.cat([torch.sin(angle), torch.cos(angle)], dim=1).view(num_positions, -1)
        if dim % 2:
            table = torch.cat([table, torch.zeros(num_positions, 1)], dim=1)
        table[self.config.pad_token_id, :] = 0
        return table

    def admits_prompt(self, token_ids: list[int]) -> bool:
        # A <pad> in the prompt shifts the prefill positions after it (position_rows).
        return self.config.pad_token_id not in token_ids

    def position_rows(self, ids: torch.Tensor, positions: torch.Tensor, num_prefill_tokens: int) -> torch.Tensor:
        pad = self.config.pad_token_id
        real = ids != pad
        rows = positions + (pad + 1)  # decode tokens: the cached length, <pad> tokens included
        P = num_prefill_tokens
        if P:  # prefill tokens: each sequence's non-<pad> tokens counted from its start
            r = real[:P].long()
            count = r.cumsum(0)  # (P,) across the packed sequences
            start = torch.arange(P, device=ids.device) - positions[:P]  # each token's sequence start
            rows[:P] = count - (count[start] - r[start]) + pad
        return torch.where(real, rows, pad)


default_decoder_prompt = start_then_forced_bos  # [</s>], or [</s>, <tgt_lang>] when the config forces it
