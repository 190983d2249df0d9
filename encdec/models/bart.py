"""BART (bart-base, bart-large, bart-large-cnn, distilbart) in plain PyTorch.

Tokens are packed (no padding); attention goes through ``encdec.attention``.
Parameter names follow Hugging Face so that loading is a name map plus the
quirks: learned positions offset by 2, ``final_logits_bias``, a tied
``lm_head``, ``scale_embedding`` and ``layernorm_embedding``. The q/k/v (self)
and k/v (cross) projections are fused at load time: one matmul instead of three.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from encdec.attention import AttentionBackend, AttentionMetadata, AttentionType
from encdec.models.layers import Linear, MultiHeadAttention, load_fused

_ACT = {"gelu": F.gelu, "relu": F.relu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "swish": F.silu}

POSITION_OFFSET = 2  # BartLearnedPositionalEmbedding reserves two rows


class _FFNInput:
    def _ffn_in(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc1.forward_gelu(h) if self.exact_gelu else self.act(self.fc1(h))


class BartEncoderLayer(_FFNInput, nn.Module):
    def __init__(self, cfg, backend):
        super().__init__()
        d = cfg.d_model
        self.self_attn = MultiHeadAttention(d, cfg.encoder_attention_heads, AttentionType.ENCODER, backend)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = Linear(d, cfg.encoder_ffn_dim)
        self.fc2 = Linear(cfg.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.act = _ACT[cfg.activation_function]
        self.exact_gelu = cfg.activation_function == "gelu"

    def forward(self, h: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        h = self.self_attn_layer_norm(h + self.self_attn(h, None, md))
        return self.final_layer_norm(h + self.fc2(self._ffn_in(h)))


class BartDecoderLayer(_FFNInput, nn.Module):
    def __init__(self, cfg, backend):
        super().__init__()
        d = cfg.d_model
        self.self_attn = MultiHeadAttention(d, cfg.decoder_attention_heads, AttentionType.DECODER, backend)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = MultiHeadAttention(d, cfg.decoder_attention_heads,
                                          AttentionType.ENCODER_DECODER, backend)
        self.encoder_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = Linear(d, cfg.decoder_ffn_dim)
        self.fc2 = Linear(cfg.decoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.act = _ACT[cfg.activation_function]
        self.exact_gelu = cfg.activation_function == "gelu"

    def forward(self, h, kv_cache, md, encoder_hidden):
        # Self and cross KV share the layer's cache tensor: the block manager
        # hands them distinct block numbers from one pool.
        h = self.self_attn_layer_norm(h + self.self_attn(h, kv_cache, md))
        h = self.encoder_attn_layer_norm(h + self.encoder_attn(h, kv_cache, md, encoder_hidden))
        return self.final_layer_norm(h + self.fc2(self._ffn_in(h)))


class _Stack(nn.Module):
    def __init__(self, cfg, layer_cls, n_layers, backend, shared: nn.Embedding):
        super().__init__()
        self.embed_tokens = shared
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.scale_embedding else 1.0
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings + POSITION_OFFSET, cfg.d_model)
        self.layernorm_embedding = nn.LayerNorm(cfg.d_model)
        self.layers = nn.ModuleList([layer_cls(cfg, backend) for _ in range(n_layers)])

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(ids) * self.embed_scale + self.embed_positions(positions + POSITION_OFFSET)
        return self.layernorm_embedding(h)


class BartForConditionalGeneration(nn.Module):
    """Runner-facing interface: ``forward`` over packed tokens -> hidden states,
    ``compute_logits``, ``build_encoder_inputs``, ``load_weights``, and the cache
    geometry (``num_cache_layers``, ``num_kv_heads``, ``head_size``)."""

    def __init__(self, hf_config, backend: type[AttentionBackend]):
        super().__init__()
        cfg = self.config = hf_config
        self.shared = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.encoder = _Stack(cfg, BartEncoderLayer, cfg.encoder_layers, backend, self.shared)
        self.decoder = _Stack(cfg, BartDecoderLayer, cfg.decoder_layers, backend, self.shared)
        self.register_buffer("final_logits_bias", torch.zeros(1, cfg.vocab_size))
        self.lm_head = Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.shared.weight  # tied
        self.vocab_size = cfg.vocab_size
        self.num_cache_layers = cfg.decoder_layers  # one KV cache tensor per decoder layer
        self.num_kv_heads = cfg.decoder_attention_heads
        self.head_size = cfg.d_model // cfg.decoder_attention_heads

    def build_encoder_inputs(self, encoder_token_ids: list[list[int]], encoder_features: list,
                             device: torch.device) -> dict[str, torch.Tensor]:
        flat = [t for ids in encoder_token_ids for t in ids]
        positions = [p for ids in encoder_token_ids for p in range(len(ids))]
        return {
            "encoder_input_ids": torch.tensor(flat, dtype=torch.long, device=device),
            "encoder_positions": torch.tensor(positions, dtype=torch.long, device=device),
        }

    def encode(self, ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        h = self.encoder.embed(ids, positions)  # (num_encoder_tokens, d_model)
        for layer in self.encoder.layers:
            h = layer(h, md)
        return h

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata, encoder_input_ids: torch.Tensor | None = None,
                encoder_positions: torch.Tensor | None = None) -> torch.Tensor:
        enc = None
        if encoder_input_ids is not None and encoder_input_ids.numel():
            enc = self.encode(encoder_input_ids, encoder_positions, attn_metadata)
        h = self.decoder.embed(input_ids, positions)  # (num_tokens, d_model)
        for i, layer in enumerate(self.decoder.layers):
            h = layer(h, kv_caches[i], attn_metadata, enc)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) + self.final_logits_bias

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names -> ours; q/k/v fused; missing tied embeddings taken from ``shared``."""
        self.lm_head.weight = self.shared.weight  # re-tie: materialising from meta unties
        tied = ("lm_head.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
        seen_shared = False

        def rename(name: str) -> str | None:
            nonlocal seen_shared
            if name in tied:
                if seen_shared:
                    return None  # one of the tied copies already filled ``shared``
                name = "shared.weight"
            seen_shared |= name == "shared.weight"
            return name

        def parameters_only() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = name.removeprefix("model.")
                if name == "final_logits_bias":  # a buffer, not a parameter
                    self.final_logits_bias.copy_(tensor.view(1, -1))
                else:
                    yield name, tensor

        load_fused(self, parameters_only(), rename, model="BART",
                   optional=lambda name, part, parts: name.endswith("embed_tokens.weight"))


def default_decoder_prompt(hf_config, generation_config, tokenizer) -> list[int]:
    """``[<DEC>, <BOS>]``: HF starts from <DEC> and forces <BOS> as the first
    generated token; putting it in the prompt gives the same sequence."""
    return [hf_config.decoder_start_token_id, hf_config.bos_token_id]
