"""T5, T5 v1.1, Flan-T5, mT5 and UMT5 in plain PyTorch.

What sets T5 apart from the BART layout:

- no position embeddings: a learned relative position bias per head, indexed by
  bucketed ``key position - query position`` (exact up to 16 (8 causal) apart,
  log-spaced to ``relative_attention_max_distance``; bidirectional in the
  encoder, causal in the decoder), owned by each stack's first block in the
  checkpoint and computed once per stack and step (``RelativePositionBias``,
  an ``encdec.attention`` ``PositionBias``) for every layer's self-attention
  (UMT5: one table per layer, each layer's own bias); cross-attention has none;
- no attention scaling, no biases, RMS norm without mean or bias, pre-norm
  blocks and a closing norm per stack;
- feed-forward ``wo(relu(wi(h)))`` or, gated (v1.1, Flan-T5, mT5),
  ``wo(gelu_new(wi_0(h)) * wi_1(h))``;
- the LM head tied to ``shared`` with the decoder output scaled by
  ``d_model ** -0.5`` (T5), or its own weights and no rescale (v1.1:
  ``tie_word_embeddings: false``; mT5: never rescaled, as HF's ``MT5ForConditionalGeneration``);
- the decoder starts from <pad>.

HF names map onto ours (``rename``); the q/k/v projections are fused at load time.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from encdec.attention import AttentionBackend, AttentionMetadata, AttentionType
from encdec.attention.backends.abstract import PositionBias
from encdec.models.bart import BartForConditionalGeneration
from encdec.kernels.cpu import decoder_step_cpu
from encdec.models.layers import FUSED_ACTIVATIONS, FusedDecodeStep, Linear, MultiHeadAttention, load_fused
from encdec.models.staged_encoder import EncoderState

DEFAULT_MAX_POSITIONS = 512  # T5's training length; a checkpoint's n_positions wins
# Relative positions have no table to run out of: ``max_model_len`` may exceed the
# default limit above, as HF's T5 takes inputs of any length (read by the worker).
LENGTH_UNBOUNDED = True


def relative_position_bucket(relative_position: torch.Tensor, *, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """HF's ``T5Attention._relative_position_bucket``, op for op (the float log
    decides the bucket edges): ``key - query`` -> bucket in [0, num_buckets)."""
    buckets = 0
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    large = max_exact + (torch.log(relative_position.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(is_small, relative_position, large)


class RelativePositionBias(PositionBias):
    """One stack's bias for one step: ``table`` (num_buckets, H) is the stack's
    ``relative_attention_bias`` weight; values are memoized by ``PositionBias``."""

    def __init__(self, table: torch.Tensor, *, bidirectional: bool, max_distance: int):
        self.table, self.bidirectional, self.max_distance = table, bidirectional, max_distance
        self.num_heads = table.shape[1]

    @property
    def device(self) -> torch.device:
        return self.table.device

    def compute(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        relative = key_positions[None, :] - query_positions[:, None]  # (Lq, Lk)
        bucket = relative_position_bucket(relative, bidirectional=self.bidirectional,
                                          num_buckets=self.table.shape[0], max_distance=self.max_distance)
        return F.embedding(bucket, self.table).permute(2, 0, 1).float()  # (H, Lq, Lk)


class RMSNorm(nn.Module):
    """``T5LayerNorm``: scale by the root mean square (float32), no mean, no bias."""

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # HF's ops in HF's order (bit for bit: a squared norm instead of the mean
        # square moved T5 beam scores 2e-4 from HF's), in one (n, d) buffer: the
        # squares' buffer takes the result, scaled in place. 51 -> 25 ms at
        # (17400, 768) on 2 threads (T5-base's encoder over 64 requests).
        squares = h.to(torch.float32).pow(2)
        variance = squares.mean(-1, keepdim=True).add_(self.eps)
        grads = torch.is_grad_enabled() and (h.requires_grad or self.weight.requires_grad)  # out= refuses them
        if grads or h.dtype != torch.float32 or self.weight.dtype != torch.float32:
            return self.weight * (h * torch.rsqrt(variance)).to(self.weight.dtype)
        return torch.mul(h, torch.rsqrt(variance), out=squares).mul_(self.weight)


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """HF's ``NewGELUActivation`` as written (not F.gelu(approximate="tanh"): other rounding)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


_ACT = {"relu": F.relu, "gelu_new": gelu_new, "gelu": F.gelu, "silu": F.silu,
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class T5FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        if cfg.dense_act_fn not in _ACT:
            raise ValueError(f"T5 feed-forward activation {cfg.dense_act_fn!r} is not supported; "
                             f"supported: {sorted(_ACT)}")
        self.gated, self.act = cfg.is_gated_act, _ACT[cfg.dense_act_fn]
        self.fused_act = cfg.dense_act_fn if cfg.dense_act_fn in FUSED_ACTIVATIONS else None
        if self.gated:
            self.wi_0 = Linear(cfg.d_model, cfg.d_ff, bias=False)
            self.wi_1 = Linear(cfg.d_model, cfg.d_ff, bias=False)
        else:
            self.wi = Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.wo = Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.wo(self.act(self.wi_0(h)) * self.wi_1(h))
        if self.fused_act:
            return self.wo(self.wi.forward_act(h, self.fused_act))
        return self.wo(self.act(self.wi(h)))


def _attention(cfg, attn_type: AttentionType, backend) -> MultiHeadAttention:
    return MultiHeadAttention(cfg.d_model, cfg.num_heads, attn_type, backend, inner_dim=cfg.num_heads * cfg.d_kv,
                              bias=False, scale=1.0)


class T5EncoderLayer(nn.Module):
    def __init__(self, cfg, backend):
        super().__init__()
        self.self_attn = _attention(cfg, AttentionType.ENCODER, backend)
        self.self_attn_layer_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)
        self.ffn = T5FeedForward(cfg)
        self.final_layer_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def forward(self, h: torch.Tensor, md: AttentionMetadata, bias: RelativePositionBias) -> torch.Tensor:
        h = h + self.self_attn(self.self_attn_layer_norm(h), None, md, position_bias=bias)
        return h + self.ffn(self.final_layer_norm(h))


class T5DecoderLayer(nn.Module):
    def __init__(self, cfg, backend):
        super().__init__()
        self.self_attn = _attention(cfg, AttentionType.DECODER, backend)
        self.self_attn_layer_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)
        self.encoder_attn = _attention(cfg, AttentionType.ENCODER_DECODER, backend)
        self.encoder_attn_layer_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)
        self.ffn = T5FeedForward(cfg)
        self.final_layer_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def forward(self, h, kv_cache, md, encoder_hidden, bias: RelativePositionBias):
        h = h + self.self_attn(self.self_attn_layer_norm(h), kv_cache, md, position_bias=bias)
        h = h + self.encoder_attn(self.encoder_attn_layer_norm(h), kv_cache, md, encoder_hidden)
        return h + self.ffn(self.final_layer_norm(h))


class T5Stack(nn.Module):
    """One stack's layers, closing norm and relative position bias table(s):
    one table owned by the stack (T5, mT5; HF keeps it in block 0 and shares
    it), or one per layer (UMT5, ``per_layer_bias``)."""

    def __init__(self, cfg, layer_cls, n_layers: int, backend, *, causal: bool, per_layer_bias: bool = False):
        super().__init__()
        self.causal, self.per_layer_bias = causal, per_layer_bias
        if per_layer_bias:
            self.relative_attention_bias = nn.ModuleList(
                [nn.Embedding(cfg.relative_attention_num_buckets, cfg.num_heads) for _ in range(n_layers)])
        else:
            self.relative_attention_bias = nn.Embedding(cfg.relative_attention_num_buckets, cfg.num_heads)
        self.max_distance = cfg.relative_attention_max_distance
        self.layers = nn.ModuleList([layer_cls(cfg, backend) for _ in range(n_layers)])
        self.final_layer_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def position_bias(self, layer: int = 0) -> RelativePositionBias:
        """This step's bias of ``layer``'s self-attention (every layer's, where the table is shared)."""
        table = self.relative_attention_bias[layer] if self.per_layer_bias else self.relative_attention_bias
        return RelativePositionBias(table.weight, bidirectional=not self.causal, max_distance=self.max_distance)

    def layer_biases(self) -> list[RelativePositionBias]:
        """One bias per layer for this step; a shared table gives one object (memoized once)."""
        if self.per_layer_bias:
            return [self.position_bias(i) for i in range(len(self.layers))]
        return [self.position_bias()] * len(self.layers)


# HF name (below ``encoder.``/``decoder.``) -> ours: T5's nested blocks flattened.
_RENAMES = [
    (r"block\.0\.layer\.0\.SelfAttention\.relative_attention_bias\.", "relative_attention_bias."),
    (r"block\.(\d+)\.layer\.0\.SelfAttention\.([qkv])\.", r"layers.\1.self_attn.\2_proj."),
    (r"block\.(\d+)\.layer\.0\.SelfAttention\.o\.", r"layers.\1.self_attn.out_proj."),
    (r"block\.(\d+)\.layer\.0\.layer_norm\.", r"layers.\1.self_attn_layer_norm."),
    (r"block\.(\d+)\.layer\.1\.EncDecAttention\.([qkv])\.", r"layers.\1.encoder_attn.\2_proj."),
    (r"block\.(\d+)\.layer\.1\.EncDecAttention\.o\.", r"layers.\1.encoder_attn.out_proj."),
    (r"block\.(\d+)\.layer\.(1|2)\.DenseReluDense\.", r"layers.\1.ffn."),
    (r"block\.(\d+)\.layer\.(1|2)\.layer_norm\.", r"layers.\1.FFN_OR_CROSS_NORM.\2."),
]


def rename(name: str) -> str | None:
    """An HF T5 parameter name -> ours (None: a weight HF ignores too)."""
    if name == "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight":
        return None
    side, _, rest = name.partition(".")
    if side not in ("encoder", "decoder"):
        return name
    for pattern, repl in _RENAMES:
        new, n = re.subn(f"^{pattern}", repl, rest)
        if n:
            rest = new
            break
    if ".FFN_OR_CROSS_NORM." in rest:  # encoder layer.1 and decoder layer.2: FF norm; decoder layer.1: cross
        i, sub, tail = re.match(r"layers\.(\d+)\.FFN_OR_CROSS_NORM\.(\d)\.(.*)", rest).groups()
        norm = "encoder_attn_layer_norm" if side == "decoder" and sub == "1" else "final_layer_norm"
        rest = f"layers.{i}.{norm}.{tail}"
    return f"{side}.{rest}"


class T5ForConditionalGeneration(FusedDecodeStep, nn.Module):
    """Runner-facing interface as ``BartForConditionalGeneration``'s. Decode steps
    run every decoder layer in one C call (``FusedDecodeStep``) where the FFN is
    not gated and its activation one the kernel runs (T5's ReLU; not v1.1's gated GELU)."""

    build_encoder_inputs = BartForConditionalGeneration.build_encoder_inputs
    rename = staticmethod(rename)  # HF names -> ours
    per_layer_bias = False  # UMT5: a relative position bias table in every layer
    model_name = "T5"

    def __init__(self, hf_config, backend: type[AttentionBackend]):
        super().__init__()
        cfg = self.config = hf_config
        self.shared = nn.Embedding(cfg.vocab_size, cfg.d_model)
        per_layer = self.per_layer_bias
        self.encoder = T5Stack(cfg, T5EncoderLayer, cfg.num_layers, backend, causal=False, per_layer_bias=per_layer)
        self.decoder = T5Stack(cfg, T5DecoderLayer, cfg.num_decoder_layers, backend, causal=True,
                               per_layer_bias=per_layer)
        self.lm_head = Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.shared.weight  # until a checkpoint brings its own (v1.1, mT5)
        self.output_scale = cfg.d_model**-0.5 if self.scales_decoder_output(cfg) else None
        self.vocab_size = cfg.vocab_size
        self.num_cache_layers = cfg.num_decoder_layers
        self.num_kv_heads = cfg.num_heads
        self.head_size = cfg.d_kv
        self.fused_decode = (not per_layer and not cfg.is_gated_act
                             and cfg.dense_act_fn in decoder_step_cpu.ACTIVATIONS)
        self.fused_activation = cfg.dense_act_fn

    @staticmethod
    def scales_decoder_output(cfg) -> bool:
        """HF's T5 and UMT5: the decoder output is rescaled by ``d_model ** -0.5``
        unless the config says ``tie_word_embeddings: false``."""
        return bool(getattr(cfg, "scale_decoder_outputs", getattr(cfg, "tie_word_embeddings", True)))

    encode = BartForConditionalGeneration.encode
    encoder_row_granule = None  # a piece of a split pass is whole layers
    num_encoder_layers = BartForConditionalGeneration.num_encoder_layers

    def encoder_start(self, inputs: dict[str, torch.Tensor], md: AttentionMetadata) -> EncoderState:
        return EncoderState(self.shared(inputs["encoder_input_ids"]), md, biases=self.encoder.layer_biases())

    def encoder_advance(self, state: EncoderState, layer: int, r0: int, r1: int) -> None:
        state.h = self.encoder.layers[layer](state.h, state.md, state.biases[layer])

    def encoder_finish(self, state: EncoderState) -> torch.Tensor:
        return self.encoder.final_layer_norm(state.h)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata, encoder_input_ids: torch.Tensor | None = None,
                encoder_positions: torch.Tensor | None = None,
                encoder_hidden: torch.Tensor | None = None) -> torch.Tensor:
        # encoder_hidden: the prefills' encoder output, computed elsewhere (an encoder worker)
        enc = self.encoder_output(attn_metadata, encoder_input_ids, encoder_positions, encoder_hidden)
        h = self.shared(input_ids)  # (num_tokens, d_model)
        biases = self.decoder.layer_biases()
        # The fused step takes one bias for every layer: never with per-layer tables (fused_decode False).
        if enc is None and self._fused_decode_step(h, kv_caches, attn_metadata, biases[0]):
            return self.decoder.final_layer_norm(h)
        for i, layer in enumerate(self.decoder.layers):
            h = layer(h, kv_caches[i], attn_metadata, enc, biases[i])
        return self.decoder.final_layer_norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden if self.output_scale is None else hidden * self.output_scale)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names -> ours; the embeddings' tied copies fill ``shared``; an
        ``lm_head.weight`` unlike ``shared`` (v1.1, mT5) gets its own parameter."""
        shared_names = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
        head: torch.Tensor | None = None
        seen_shared = False

        def model_weights() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal head, seen_shared
            for name, tensor in weights:
                if name == "lm_head.weight":
                    head = tensor
                elif name in shared_names:
                    if not seen_shared:
                        seen_shared = True
                        yield "shared.weight", tensor
                else:
                    yield name, tensor

        self.lm_head.weight = self.shared.weight  # re-tie: materialising from meta unties
        load_fused(self, model_weights(), self.rename, model=self.model_name,
                   optional=lambda name, part, parts: name == "shared.weight" and head is not None)
        if not seen_shared and head is None:
            raise ValueError(f"checkpoint lacks weights for {self.model_name}: ['shared.weight']")
        if not seen_shared:  # only the head: it is the tied embedding
            self.shared.weight.data.copy_(head)
        elif head is not None and not torch.equal(head, self.shared.weight.data):
            self.lm_head.weight = nn.Parameter(head.to(self.shared.weight.dtype).clone(), requires_grad=False)


class MT5ForConditionalGeneration(T5ForConditionalGeneration):
    """mT5 (``model_type: "mt5"``): T5 v1.1's layout. HF's ``MT5ForConditionalGeneration``
    never rescales the decoder output, whatever the config says of tied embeddings
    (hub configs say ``false`` and ship their own ``lm_head``)."""

    model_name = "mT5"

    @staticmethod
    def scales_decoder_output(cfg) -> bool:
        return False


def umt5_rename(name: str) -> str | None:
    """UMT5's names: each block's self-attention owns its bias table
    (``relative_attention_bias.{i}`` of the stack); the rest as T5's."""
    m = re.fullmatch(r"(encoder|decoder)\.block\.(\d+)\.layer\.0\.SelfAttention\.relative_attention_bias\.weight", name)
    return f"{m[1]}.relative_attention_bias.{m[2]}.weight" if m else rename(name)


class UMT5ForConditionalGeneration(T5ForConditionalGeneration):
    """UMT5 (``model_type: "umt5"``): T5 v1.1 with a relative position bias table
    in every layer's self-attention, not only the first block's; the output
    rescale follows ``scale_decoder_outputs`` as T5's does."""

    model_name = "UMT5"
    per_layer_bias = True
    rename = staticmethod(umt5_rename)


def default_decoder_prompt(hf_config, generation_config, tokenizer) -> list[int]:
    """``[<pad>]``: T5's decoder start."""
    start = generation_config.decoder_start_token_id
    return [hf_config.decoder_start_token_id if start is None else start]


def complete_generation_config(hf_config, generation_config, tokenizer_path: str) -> None:
    """T5 configs name no position limit (relative positions have none) and older
    ones no decoder start: the engine's length limit becomes ``n_positions``
    (512 where absent, T5's training length) and the start <pad>, as HF's T5 uses."""
    if getattr(hf_config, "max_position_embeddings", None) is None:
        hf_config.max_position_embeddings = getattr(hf_config, "n_positions", None) or DEFAULT_MAX_POSITIONS
    if hf_config.decoder_start_token_id is None:
        hf_config.decoder_start_token_id = hf_config.pad_token_id
    if generation_config.decoder_start_token_id is None:
        generation_config.decoder_start_token_id = hf_config.decoder_start_token_id
