"""The attention layer models call: projections stay in the model, this owns
the backend call so that every model gets paging and packing for free."""
from __future__ import annotations

import torch
from torch import nn

from encdec.attention.backends.abstract import AttentionBackend, AttentionMetadata, AttentionType, PositionBias


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        *,
        backend: type[AttentionBackend],
        num_kv_heads: int | None = None,
        attn_type: AttentionType = AttentionType.DECODER,
    ):
        super().__init__()
        self.attn_type = attn_type
        self.impl = backend.get_impl_cls()(num_heads, head_size, scale, num_kv_heads, attn_type)

    def forward(
        self,
        query: torch.Tensor,  # (num_q_tokens, num_heads * head_size)
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
        position_bias: PositionBias | None = None,
    ) -> torch.Tensor:
        """``position_bias``: T5's relative position bias for self-attention (see
        ``PositionBias``); cross-attention takes none."""
        if position_bias is None:
            return self.impl.forward(query, key, value, kv_cache, attn_metadata, self.attn_type)
        if self.attn_type == AttentionType.ENCODER_DECODER:
            raise ValueError("cross-attention takes no position bias")
        if not self.impl.supports_position_bias:
            raise ValueError(f"the {type(self.impl).__name__} attention backend takes no position bias "
                             f"(T5); use attention_backend='torch_sdpa' or 'xformers'")
        return self.impl.forward(query, key, value, kv_cache, attn_metadata, self.attn_type,
                                 position_bias=position_bias)
