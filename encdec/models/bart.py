"""BART (bart-base, bart-large, bart-large-cnn, distilbart) in plain PyTorch,
and the layout the BART-shaped families (Marian, M2M100/NLLB, mBART) share.

Tokens are packed (no padding); attention goes through ``encdec.attention``.
Parameter names follow Hugging Face so that loading is a name map plus the
quirks: learned positions offset by 2, ``final_logits_bias``, a tied
``lm_head``, ``scale_embedding`` and ``layernorm_embedding``. The q/k/v (self)
and k/v (cross) projections are fused at load time: one matmul instead of three.

Where the families differ is one ``Layout`` per model class:

    family   blocks     positions                 layernorm_embedding  stack layer_norm  final_logits_bias
    BART     post-norm  learned, rows +2          yes                  no                yes
    Marian   post-norm  sinusoidal [sin | cos]    no                   no                yes
    mBART    pre-norm   learned, rows +2          yes                  yes               yes
    M2M100   pre-norm   sinusoidal, pad offset    no                   yes               no
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from encdec.attention import AttentionBackend, AttentionMetadata, AttentionType
from encdec.kernels.cpu import decoder_step_cpu
from encdec.models.layers import FUSED_ACTIVATIONS, FusedDecodeStep, Linear, MultiHeadAttention, load_fused
from encdec.models.staged_encoder import EncoderState, run_layers
from encdec.platform.device_tensors import to_device

_ACT = {"gelu": F.gelu, "relu": F.relu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "swish": F.silu}

POSITION_OFFSET = 2  # BartLearnedPositionalEmbedding reserves two rows


@dataclass(frozen=True)
class Layout:
    """How a BART-shaped family arranges the same blocks (see the module docstring)."""

    pre_norm: bool = False  # each block h + f(LN(h)); else LN(h + f(h))
    positions: str = "learned"  # "learned" (an nn.Embedding, rows +2) or "sinusoidal" (a table, not loaded)
    layernorm_embedding: bool = True
    stack_layer_norm: bool = False  # encoder.layer_norm / decoder.layer_norm after the last layer
    final_logits_bias: bool = True


class _FFN:
    def _ffn(self, h: torch.Tensor) -> torch.Tensor:
        x = self.fc1.forward_act(h, self.fused_act) if self.fused_act else self.act(self.fc1(h))
        return self.fc2(x)


class BartEncoderLayer(_FFN, nn.Module):
    def __init__(self, cfg, backend, pre_norm: bool = False):
        super().__init__()
        d = cfg.d_model
        self.pre_norm = pre_norm
        self.self_attn = MultiHeadAttention(d, cfg.encoder_attention_heads, AttentionType.ENCODER, backend)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = Linear(d, cfg.encoder_ffn_dim)
        self.fc2 = Linear(cfg.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.act = _ACT[cfg.activation_function]
        self.fused_act = cfg.activation_function if cfg.activation_function in FUSED_ACTIVATIONS else None

    def forward(self, h: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        if self.pre_norm:
            h = h + self.self_attn(self.self_attn_layer_norm(h), None, md)
            return h + self._ffn(self.final_layer_norm(h))
        h = self.self_attn_layer_norm(h + self.self_attn(h, None, md))
        return self.final_layer_norm(h + self._ffn(h))


class BartDecoderLayer(_FFN, nn.Module):
    def __init__(self, cfg, backend, pre_norm: bool = False):
        super().__init__()
        d = cfg.d_model
        self.pre_norm = pre_norm
        self.self_attn = MultiHeadAttention(d, cfg.decoder_attention_heads, AttentionType.DECODER, backend)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = MultiHeadAttention(d, cfg.decoder_attention_heads,
                                          AttentionType.ENCODER_DECODER, backend)
        self.encoder_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = Linear(d, cfg.decoder_ffn_dim)
        self.fc2 = Linear(cfg.decoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.act = _ACT[cfg.activation_function]
        self.fused_act = cfg.activation_function if cfg.activation_function in FUSED_ACTIVATIONS else None

    def forward(self, h, kv_cache, md, encoder_hidden):
        # Self and cross KV share the layer's cache tensor: the block manager
        # hands them distinct block numbers from one pool.
        if self.pre_norm:
            h = h + self.self_attn(self.self_attn_layer_norm(h), kv_cache, md)
            h = h + self.encoder_attn(self.encoder_attn_layer_norm(h), kv_cache, md, encoder_hidden)
            return h + self._ffn(self.final_layer_norm(h))
        h = self.self_attn_layer_norm(h + self.self_attn(h, kv_cache, md))
        h = self.encoder_attn_layer_norm(h + self.encoder_attn(h, kv_cache, md, encoder_hidden))
        return self.final_layer_norm(h + self._ffn(h))


class _Stack(nn.Module):
    """Embeddings, layers and (pre-norm families) the closing layer norm of one side."""

    def __init__(self, cfg, layout: Layout, layer_cls, n_layers, backend, embed_tokens: nn.Embedding,
                 num_positions: int):
        super().__init__()
        d = cfg.d_model
        self.embed_tokens = embed_tokens
        self.embed_scale = math.sqrt(d) if cfg.scale_embedding else 1.0
        if layout.positions == "learned":
            self.embed_positions = nn.Embedding(num_positions, d)
        else:  # computed at load time (a meta-built model's buffers start empty)
            self.register_buffer("sinusoids", torch.zeros(num_positions, d), persistent=False)
        self.layernorm_embedding = nn.LayerNorm(d) if layout.layernorm_embedding else None
        self.layers = nn.ModuleList([layer_cls(cfg, backend, layout.pre_norm) for _ in range(n_layers)])
        self.layer_norm = nn.LayerNorm(d) if layout.stack_layer_norm else None

    def embed(self, ids: torch.Tensor, position_rows: torch.Tensor) -> torch.Tensor:
        """``position_rows``: rows of the position table (family offsets applied)."""
        pos = self.embed_positions(position_rows) if hasattr(self, "embed_positions") \
            else F.embedding(position_rows, self.sinusoids)
        h = self.embed_tokens(ids) * self.embed_scale + pos
        return h if self.layernorm_embedding is None else self.layernorm_embedding(h)

    def close(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.layer_norm is None else self.layer_norm(h)


class BartForConditionalGeneration(FusedDecodeStep, nn.Module):
    """Runner-facing interface: ``forward`` over packed tokens -> hidden states,
    ``compute_logits``, ``build_encoder_inputs``, ``load_weights``, and the cache
    geometry (``num_cache_layers``, ``num_kv_heads``, ``head_size``).

    Subclasses (the other BART-shaped families) set ``layout``, and override
    ``num_positions`` / ``position_rows`` / ``sinusoid_table`` for their positions."""

    layout = Layout()
    model_name = "BART"

    def __init__(self, hf_config, backend: type[AttentionBackend]):
        super().__init__()
        cfg = self.config = hf_config
        layout = self.layout
        dec_vocab = self.decoder_vocab_size(cfg)
        if getattr(cfg, "share_encoder_decoder_embeddings", True):
            self.shared = nn.Embedding(cfg.vocab_size, cfg.d_model)
            enc_embed = dec_embed = self.shared
        else:  # Marian checkpoints with separate source and target vocabularies
            enc_embed, dec_embed = nn.Embedding(cfg.vocab_size, cfg.d_model), nn.Embedding(dec_vocab, cfg.d_model)
        n_pos = self.num_positions(cfg)
        self.encoder = _Stack(cfg, layout, BartEncoderLayer, cfg.encoder_layers, backend, enc_embed, n_pos)
        self.decoder = _Stack(cfg, layout, BartDecoderLayer, cfg.decoder_layers, backend, dec_embed, n_pos)
        if layout.final_logits_bias:
            self.register_buffer("final_logits_bias", torch.zeros(1, dec_vocab))
        self.tied = getattr(cfg, "tie_word_embeddings", True)
        self.lm_head = Linear(cfg.d_model, dec_vocab, bias=False)
        if self.tied:
            self.lm_head.weight = dec_embed.weight
        self.vocab_size = dec_vocab
        self.num_cache_layers = cfg.decoder_layers  # one KV cache tensor per decoder layer
        self.num_kv_heads = cfg.decoder_attention_heads
        self.head_size = cfg.d_model // cfg.decoder_attention_heads
        # Decode steps run as one C call (FusedDecodeStep) where the kernel has the
        # activation: pre-norm families (mBART, M2M100, NLLB) have Whisper's decoder
        # layer; post-norm ones (BART; Marian's SiLU runs op by op) the same layer
        # with each norm after its residual add.
        self.fused_activation = cfg.activation_function
        self.fused_post_norm = not layout.pre_norm
        self.fused_decode = cfg.activation_function in decoder_step_cpu.ACTIVATIONS

    # -- family hooks --------------------------------------------------------------
    @staticmethod
    def decoder_vocab_size(cfg) -> int:
        return cfg.vocab_size

    @staticmethod
    def num_positions(cfg) -> int:
        return cfg.max_position_embeddings + POSITION_OFFSET

    def sinusoid_table(self, num_positions: int, dim: int) -> torch.Tensor:
        raise NotImplementedError(f"{self.model_name} has learned positions")

    def position_rows(self, ids: torch.Tensor, positions: torch.Tensor, num_prefill_tokens: int) -> torch.Tensor:
        """Rows of the position table for tokens at 0-based ``positions``."""
        return positions + POSITION_OFFSET

    # -- runner interface ------------------------------------------------------------
    def build_encoder_inputs(self, encoder_token_ids: list[list[int]], encoder_features: list,
                             device: torch.device) -> dict[str, torch.Tensor]:
        flat = [t for ids in encoder_token_ids for t in ids]
        positions = [p for ids in encoder_token_ids for p in range(len(ids))]
        return {
            "encoder_input_ids": to_device(flat, torch.long, device),
            "encoder_positions": to_device(positions, torch.long, device),
        }

    def encode(self, ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        return run_layers(self, self.encoder_start({"encoder_input_ids": ids, "encoder_positions": positions}, md))

    # -- the encoder pass in pieces (encdec.models.staged_encoder) ----------------
    encoder_row_granule: int | None = None  # layers run whole: a piece is whole layers

    @property
    def num_encoder_layers(self) -> int:
        return len(self.encoder.layers)

    def encoder_start(self, inputs: dict[str, torch.Tensor], md: AttentionMetadata) -> EncoderState:
        # Every encoder token is a prefill token: a whole sequence from position 0.
        ids = inputs["encoder_input_ids"]
        return EncoderState(self.encoder.embed(ids, self.position_rows(ids, inputs["encoder_positions"], ids.shape[0])),
                            md)

    def encoder_advance(self, state: EncoderState, layer: int, r0: int, r1: int) -> None:
        state.h = self.encoder.layers[layer](state.h, state.md)  # rows: always all of them

    def encoder_finish(self, state: EncoderState) -> torch.Tensor:
        return self.encoder.close(state.h)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata, encoder_input_ids: torch.Tensor | None = None,
                encoder_positions: torch.Tensor | None = None,
                encoder_hidden: torch.Tensor | None = None) -> torch.Tensor:
        # encoder_hidden: the prefills' encoder output, computed elsewhere (an encoder worker)
        enc = self.encoder_output(attn_metadata, encoder_input_ids, encoder_positions, encoder_hidden)
        rows = self.position_rows(input_ids, positions, attn_metadata.num_prefill_tokens)
        h = self.decoder.embed(input_ids, rows)  # (num_tokens, d_model)
        if enc is None and self._fused_decode_step(h, kv_caches, attn_metadata):
            return self.decoder.close(h)
        for i, layer in enumerate(self.decoder.layers):
            h = layer(h, kv_caches[i], attn_metadata, enc)
        return self.decoder.close(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.layout.final_logits_bias:
            return self.lm_head.forward_bias(hidden, self.final_logits_bias[0])
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names -> ours; q/k/v fused; tied copies (``shared``, the stacks'
        ``embed_tokens``, a tied ``lm_head``) fill one parameter, from whichever the
        checkpoint holds first; sinusoidal tables are computed, not read."""
        if self.tied:  # re-tie: materialising from meta unties
            self.lm_head.weight = self.decoder.embed_tokens.weight
        canonical: dict[str, str] = {}  # every name of a parameter -> its first name
        first_name: dict[int, str] = {}
        for name, p in self.named_parameters(remove_duplicate=False):
            canonical[name] = first_name.setdefault(id(p), name)
        filled: set[str] = set()

        def rename(name: str) -> str | None:
            target = canonical.get(name, name)
            if target in filled:
                return None  # a tied copy of a parameter already filled
            filled.add(target)
            return target

        def parameters_only() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = name.removeprefix("model.")
                if name == "final_logits_bias":  # a buffer, not a parameter
                    if self.layout.final_logits_bias:
                        self.final_logits_bias.copy_(tensor.view(1, -1))
                elif name.endswith("embed_positions.weight") and self.layout.positions != "learned":
                    continue  # a sinusoidal table some checkpoints carry: computed below
                else:
                    yield name, tensor

        load_fused(self, parameters_only(), rename, model=self.model_name,
                   optional=lambda name, part, parts: False)
        if self.layout.positions != "learned":
            for stack in (self.encoder, self.decoder):
                n, d = stack.sinusoids.shape
                stack.sinusoids.copy_(self.sinusoid_table(n, d))


def default_decoder_prompt(hf_config, generation_config, tokenizer) -> list[int]:
    """``[<DEC>, <BOS>]``: HF starts from <DEC> and forces <BOS> as the first
    generated token; putting it in the prompt gives the same sequence."""
    return [hf_config.decoder_start_token_id, hf_config.bos_token_id]


def start_then_forced_bos(hf_config, generation_config, tokenizer) -> list[int]:
    """The translation families' default decoder prompt, as HF's ``generate``
    begins with the checkpoint's defaults: the decoder start token, then the
    ``forced_bos_token_id`` (mBART-50's target language) where the generation
    config forces one; beam search counts that token as HF does (see
    ``encdec.beam_search``)."""
    start = generation_config.decoder_start_token_id
    if start is None:
        start = hf_config.decoder_start_token_id
    forced = generation_config.forced_bos_token_id
    return [start] if forced is None else [start, forced]
