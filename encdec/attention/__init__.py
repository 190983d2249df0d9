"""Attention: types, metadata, backends (registered by name, imported lazily) and the layer."""
from encdec.attention.backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionType,
)
from encdec.attention.layer import Attention
from encdec.attention.selector import get_attn_backend

__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionImpl",
    "AttentionMetadata",
    "AttentionType",
    "get_attn_backend",
]
