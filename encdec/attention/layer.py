"""The attention layer models call: projections stay in the model, this owns
the backend call so that every model gets paging and packing for free."""
from __future__ import annotations

import torch
from torch import nn

from encdec.attention.backends.abstract import AttentionBackend, AttentionMetadata, AttentionType


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
    ) -> torch.Tensor:
        return self.impl.forward(query, key, value, kv_cache, attn_metadata, self.attn_type)
