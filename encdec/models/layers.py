"""Layers the model families share: ``Linear``, ``MultiHeadAttention`` with its
checkpoint name map (``fused_projection``, ``load_fused``) and ``FusedDecodeStep``.

``Linear`` is nn.Linear (the same parameter names, so checkpoints load unchanged)
whose CPU float32 or bfloat16 matmul runs on a oneDNN weight packed once
(``pack``), agreeing with ``F.linear`` to float32 rounding. Quantized, it
delegates every call to its ``quant_method`` (``encdec.quantization``: the
method owns how its weights are made and multiplied; the layer holds them).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from encdec.attention import Attention, AttentionBackend, AttentionMetadata, AttentionType
from encdec.attention.backends.abstract import PositionBias, write_to_cache
from encdec.attention.bias_tables import distance_table
from encdec.kernels.cpu import decoder_step_cpu, small_linear_cpu, small_linear_int8_cpu
from encdec.kernels.cpu.build import cpu_isa
from encdec.kernels.cpu.dense_attention_cpu import dense_attention
from encdec.models.activation import FUSED_ACTIVATIONS, apply_act_
from encdec.quantization.int8 import Int8LinearMethod


def onednn_available() -> bool:
    return (os.environ.get("ENCDEC_ONEDNN", "1") != "0" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class Linear(nn.Linear):
    packed: torch.Tensor | None = None
    fused_gelu = False  # packed: forward_gelu uses oneDNN's GELU post-op (gelu_path, chosen at pack time)
    small_rows = False  # packed: inputs of a few rows run small_linear_cpu on panels of the weight
    panels: torch.Tensor | None = None  # small_linear_cpu.pack(weight), made at the first call of a few rows
    quant_method: Int8LinearMethod | None = None  # quantize_int8: runs every call (None: the float weight)
    int8: object | None = None  # quant_method's: the int8 weight as its path runs it
    int8_panels: Any = None  # quant_method's: small_linear_int8_cpu.PackedInt8, made at the first call of a few rows
    int8_small_rows = False  # quant_method's: inputs of a few rows run small_linear_int8_cpu
    widened = False  # widen_to_float32: inputs of a narrower float dtype are widened to the weight's

    def pack(self) -> bool:
        """Prepack the weight for oneDNN (CPU, float32 or bfloat16); False where it
        does not apply. The small-row kernel's panels (float32 only) are made when a
        call of a few rows first comes (decoder weights and LM heads only: an
        encoder never sees one)."""
        w = self.weight
        if (w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16) or not onednn_available()
                or self.quant_method is not None):
            return False
        try:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach())
        except RuntimeError:  # bf16 where oneDNN runs no bf16 ISA (ONEDNN_MAX_CPU_ISA=AVX2): F.linear
            if w.dtype == torch.float32:
                raise
            return False
        self.fused_gelu = gelu_path() == "fused"
        self.small_rows = w.dtype == torch.float32 and small_linear_cpu.available()
        self.panels = None
        return True

    def quantize_int8(self, path: str) -> None:
        """Delegate to ``Int8LinearMethod(path)`` (``path`` one of ``INT8_PATHS``, as
        ``quantization.int8_path`` picks), which quantizes the loaded weight now
        and runs every later call; the float packing is dropped."""
        self.quant_method = Int8LinearMethod(path)
        self.quant_method.process_weights_after_loading(self)
        self.unpack()

    def widen_to_float32(self) -> None:
        """The weight and bias in float32, holding the same (narrower) values
        exactly, and inputs widened likewise: the output is the float32 sum of the
        narrow values' products, never rounded back to the narrow type. An LM head
        tied to its embedding unties: the embedding keeps its own."""
        self.weight = nn.Parameter(self.weight.detach().float(), requires_grad=False)
        if self.bias is not None:
            self.bias = nn.Parameter(self.bias.detach().float(), requires_grad=False)
        self.widened = True
        self.unpack()

    def int8_panel_weight(self) -> small_linear_int8_cpu.PackedInt8:
        """The int8 weight in the decode step's panels (``Int8LinearMethod.panel_weight``)."""
        return self.quant_method.panel_weight(self)

    def panel_weight(self) -> torch.Tensor:
        """The weight in small_linear_cpu's panels (made once, then kept)."""
        if self.panels is None:
            self.panels = small_linear_cpu.pack(self.weight)
        return self.panels

    def unpack(self) -> None:
        self.packed = self.panels = None
        self.small_rows = False

    def _packed(self, x: torch.Tensor, act: str, bias: torch.Tensor | None = None) -> torch.Tensor:
        bias = self.bias if bias is None else bias
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        rows = x2.shape[0]
        if rows == 0:
            return x.new_empty(*lead, self.out_features)
        if rows <= small_linear_cpu.MAX_ROWS and self.small_rows:  # a decode step's few rows
            out = small_linear_cpu.small_linear(x2, self.panel_weight(), self.out_features, bias, post=act)
            return out.view(*lead, self.out_features)
        bucket = _row_bucket(rows)
        if bucket != rows:  # zero rows, computed and dropped: see _row_bucket
            x2 = torch.cat([x2, x2.new_zeros(bucket - rows, x2.shape[1])])
        # oneDNN's post-ops: ReLU always (one pass less over the output); GELU per gelu_path
        fused = act == "relu" or (act == "gelu" and self.fused_gelu)
        out = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), self.packed, bias, act if fused else "none",
                                                 [], ("none" if act == "gelu" else "") if fused else "")
        out = out[:rows].view(*lead, self.out_features)
        return out if fused else apply_act_(out, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.widened:
            x = x.float()
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, "none")
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return self._packed(x, "none")

    def forward_bias(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """``self(x) + bias`` for a bias-free layer and a (out_features,) ``bias``
        (BART's ``final_logits_bias`` on its LM head): in the matmul where the
        float32 weight is packed (no second pass over the (rows, vocab) output;
        the same float32 sums), a separate add otherwise."""
        if (self.packed is None or self.bias is not None or self.weight.dtype != torch.float32
                or bias.dtype != torch.float32 or not bias.is_contiguous() or x.dtype != torch.float32):
            return self(x) + bias
        return self._packed(x, "none", bias)

    def forward_gelu(self, x: torch.Tensor) -> torch.Tensor:
        """``gelu(self(x))`` (exact, erf): when packed, fused into the matmul
        where it is the faster path (the small-row kernel; oneDNN's post-op per ``gelu_path``)."""
        return self.forward_act(x, "gelu")

    def forward_act(self, x: torch.Tensor, act: str) -> torch.Tensor:
        """``act(self(x))`` for ``act`` "gelu" (exact, erf), "relu" or "none": when
        packed, fused into the matmul (the small-row kernel's post-op; oneDNN's
        for ReLU, and for GELU per ``gelu_path``)."""
        if act not in (*FUSED_ACTIVATIONS, "none"):
            raise ValueError(f"Linear.forward_act: act must be 'gelu', 'relu' or 'none', got {act!r}")
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, act)
        if self.packed is None:
            return apply_act_(F.linear(x, self.weight, self.bias), act)
        return self._packed(x, act)


def gelu_path(isa: str | None = None) -> str:
    """How a packed ``forward_gelu`` runs for ``isa`` (default the kernels' ISA,
    ``build.cpu_isa()``): "fused" (oneDNN's post-op) or "separate" (matmul, then
    torch's GELU in place). Same values either way; the post-op's erf is slow
    below AVX-512."""
    return "fused" if (isa or cpu_isa()) == "avx512" else "separate"


ROW_BUCKET = 32  # rows
ROW_BUCKET_MAX = 1024  # rows; larger inputs (encoder windows: 1500 per window) run as they are


def _row_bucket(rows: int) -> int:
    """The row count a packed matmul of ``rows`` rows runs at. oneDNN builds a
    primitive per input shape (milliseconds each) and keeps 1024 in its cache;
    decoder prefills of every prompt length (Whisper's conditioned long-form
    windows: 1-224 tokens, times each layer's weight shapes) would build one per
    length and overflow it. Row counts past 32 are rounded up to a multiple of
    32, so at most 32 shapes per weight exist below 1024 rows; decode batches
    (<= 32 rows) run unpadded. Each output row depends on its input row only, so
    the padding changes no result."""
    if rows <= ROW_BUCKET or rows >= ROW_BUCKET_MAX or rows % ROW_BUCKET == 0:
        return rows
    return -(-rows // ROW_BUCKET) * ROW_BUCKET


def pack_linears(model: nn.Module) -> int:
    """Prepack every ``Linear`` of ``model`` (after its weights are loaded and it
    is on its device); returns how many were packed."""
    return sum(m.pack() for m in model.modules() if isinstance(m, Linear))


class MultiHeadAttention(nn.Module):
    """BART's and Whisper's attention block (as openai/whisper's ``MultiHeadAttention``
    serves both self and cross attention): self-attention projects q/k/v in one
    fused matmul (``qkv_proj``), cross-attention projects q (``q_proj``) from the
    decoder and k/v (``kv_proj``) once from the encoder output. Checkpoints' HF
    ``q_proj``/``k_proj``/``v_proj`` map onto these rows (``fused_projection``);
    Whisper's bias-free ``k_proj`` leaves its part of the fused bias zero.

    ``forward`` runs over packed tokens through ``encdec.attention`` (paged KV for
    the decoder); ``forward_encoder`` runs unpacked self-attention over a fixed-length
    batch ``(B, T, d)`` (Whisper's 30 s encoder), on the dense C kernel where it can.
    ``backend=None`` builds a block that runs only ``forward_encoder``.

    T5's options: ``inner_dim`` (heads x head size, when not ``d_model``),
    ``bias=False`` (no projection biases), ``scale=1.0`` (no query scaling), and
    ``forward(..., position_bias=...)`` for its relative position bias.
    """

    def __init__(self, d_model: int, num_heads: int, attn_type: AttentionType,
                 backend: type[AttentionBackend] | None, *, inner_dim: int | None = None,
                 bias: bool = True, scale: float | None = None):
        super().__init__()
        inner = inner_dim or d_model
        self.num_heads, self.head_dim = num_heads, inner // num_heads
        self.scale = self.head_dim**-0.5 if scale is None else scale
        self.attn_type = attn_type
        if attn_type == AttentionType.ENCODER_DECODER:
            self.q_proj = Linear(d_model, inner, bias=bias)
            self.kv_proj = Linear(d_model, 2 * inner, bias=bias)  # fused k_proj, v_proj
        else:
            self.qkv_proj = Linear(d_model, 3 * inner, bias=bias)  # fused q_proj, k_proj, v_proj
        self.out_proj = Linear(inner, d_model, bias=bias)
        self.attn = None if backend is None else Attention(
            num_heads, self.head_dim, self.scale, backend=backend, attn_type=attn_type)

    def forward(self, h: torch.Tensor, kv_cache: torch.Tensor | None, md: AttentionMetadata,
                encoder_hidden: torch.Tensor | None = None,
                position_bias: PositionBias | None = None) -> torch.Tensor:  # (num_tokens, d)
        if self.attn_type == AttentionType.ENCODER_DECODER:
            q, k, v = self.q_proj(h), None, None  # k/v only at prefill: decode steps read the cache
            if encoder_hidden is not None and encoder_hidden.shape[0]:
                k, v = self.kv_proj(encoder_hidden).chunk(2, dim=-1)  # (num_encoder_tokens, inner) each
        else:
            q, k, v = self.qkv_proj(h).chunk(3, dim=-1)  # (num_tokens, inner) each
        return self.out_proj(self.attn(q, k, v, kv_cache, md, position_bias))

    int8_attention = False  # forward_encoder's q k^T and P v in int8 (use_int8_attention)

    def use_int8_attention(self) -> None:
        """quantization="int8": ``forward_encoder``'s q k^T and P v in int8 where the
        dense C kernel runs them (``dense_attention_cpu``), and a cross-attention's
        prefill likewise through its backend (``AttentionImpl.use_int8_dense``)."""
        self.int8_attention = True
        if self.attn is not None and self.attn_type == AttentionType.ENCODER_DECODER:
            self.attn.impl.use_int8_dense()

    def forward_encoder(self, h: torch.Tensor) -> torch.Tensor:  # (B, T, d), no mask
        qkv = self.encoder_qkv(h)
        return self.encoder_attend(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])

    def encoder_qkv(self, h: torch.Tensor) -> torch.Tensor:
        """(B, T, d) -> (B, T, 3, H, D): every row's q, k and v, so that a later
        call may attend any subset of the rows (an encoder pass split by rows)."""
        B, T, _ = h.shape
        return self.qkv_proj(h).view(B, T, 3, self.num_heads, self.head_dim)

    def encoder_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, T_q, H, D) over k, v (B, T_k, H, D), unmasked -> (B, T_q, d)
        after ``out_proj``. Each query row's result depends on its own row and
        the keys only (the C kernel quantizes each query row on its own)."""
        B, T = q.shape[:2]
        a = dense_attention(q, k, v, self.scale, int8=self.int8_attention)  # (B, T_q, H, D)
        if a is None:  # no C kernel for this machine / dtype / device
            # (B, H, T, D) views; 4-D takes torch's flash kernel
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        return self.out_proj(a.reshape(B, T, -1))


def fused_projection(name: str) -> tuple[str, int, int]:
    """An HF parameter name -> (our parameter, row chunk, chunks): ``*.{q,k,v}_proj.*``
    of a self-attention go to rows 0/1/2 of ``qkv_proj``, cross-attention's
    (``encoder_attn``) ``k_proj``/``v_proj`` to rows 0/1 of ``kv_proj``; any other
    name maps to itself."""
    for i, proj in enumerate(("q_proj", "k_proj", "v_proj")):
        if f".{proj}." not in name:
            continue
        prefix, kind = name.split(f".{proj}.")
        if prefix.endswith(".encoder_attn"):
            return (name, 0, 1) if proj == "q_proj" else (f"{prefix}.kv_proj.{kind}", i - 1, 2)
        return f"{prefix}.qkv_proj.{kind}", i, 3
    return name, 0, 1


def load_fused(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], rename: Callable[[str], str | None],
               *, model: str, optional: Callable[[str, int, int], bool]) -> None:
    """Copy HF-named ``weights`` into ``module``: ``rename`` maps a checkpoint name to
    an HF name relative to ``module`` (None: skip it), ``fused_projection`` to the
    rows of our fused parameter. Unknown names, wrong shapes and parameters left
    unfilled (except where ``optional(name, part, parts)``) raise ValueError."""
    params = dict(module.named_parameters())
    loaded: set[tuple[str, int]] = set()
    for ckpt_name, tensor in weights:
        hf_name = rename(ckpt_name)
        if hf_name is None:
            continue
        name, part, parts = fused_projection(hf_name)
        if name not in params:
            raise ValueError(f"unexpected weight {ckpt_name!r} for {model}")
        target = params[name].data
        rows = target.shape[0] // parts
        if tuple(tensor.shape) != (rows, *target.shape[1:]):
            raise ValueError(f"weight {ckpt_name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {(rows, *target.shape[1:])}")
        target[part * rows:(part + 1) * rows].copy_(tensor)
        loaded.add((name, part))
    missing = []
    for name in params:
        parts = 3 if ".qkv_proj." in name else 2 if ".kv_proj." in name else 1
        missing += [f"{name}[{p}/{parts}]" if parts > 1 else name for p in range(parts)
                    if (name, p) not in loaded and not optional(name, p, parts)]
    if missing:
        raise ValueError(f"checkpoint lacks weights for {model}: {missing[:5]}")


class FusedDecodeStep:
    """For a model whose ``decoder.layers`` are pre-norm layers (Whisper's; the
    pre-norm BART families'; T5's non-gated ones): a decode-only CPU step runs every layer in one C
    call (``decoder_step_cpu``: the same math, one parallel region, no per-op
    overhead). ``fused_decode`` False runs them op by op (tests compare the two);
    ``fused_activation`` names the FFN's activation; ``fused_post_norm``: the
    layers are post-norm (BART's). The weights are checked, packed and their
    pointers taken on the first step."""

    fused_decode: bool = True
    fused_activation: str = "gelu"
    fused_post_norm: bool = False
    _fused_weights: Any = None  # decoder_step_cpu.DecoderWeights, or None: the kernel cannot run these weights
    _fused_checked: bool = False
    draft_embeds_by_sum: bool = False  # draft_step_parts applies (Whisper's forward)

    def fuses_decode_steps(self) -> bool:
        """Whether a decode-only CPU step runs as one C call (the runner splits a
        step that admits requests so that its decode rows still do)."""
        if not self.fused_decode:
            return False
        if not self._fused_checked:
            self._fused_weights = decoder_step_cpu.decoder_weights(list(self.decoder.layers), self.fused_activation,
                                                                   post_norm=self.fused_post_norm)
            self._fused_checked = True
        return self._fused_weights is not None

    def draft_step_parts(self) -> tuple[Any, torch.Tensor, torch.Tensor, nn.LayerNorm] | None:
        """What a draft's whole CPU step (``worker/draft_step``) runs: the fused
        step's ``DecoderWeights``, the embeddings and the final norm, where
        ``forward`` is h = embed_tokens[t] + embed_positions[p], the layers, then
        ``decoder.layer_norm`` (``draft_embeds_by_sum``); else None."""
        if not (self.draft_embeds_by_sum and self.fuses_decode_steps()):
            return None
        d = self.decoder
        return self._fused_weights, d.embed_tokens.weight, d.embed_positions.weight, d.layer_norm

    def encoder_output(self, md: AttentionMetadata, encoder_input_ids: torch.Tensor | None = None,
                       encoder_positions: torch.Tensor | None = None,
                       encoder_hidden: torch.Tensor | None = None) -> torch.Tensor | None:
        """The step's prefills' encoder output (packed per request), or None: run
        here from their tokens, or computed elsewhere (an encoder worker) and given."""
        if encoder_input_ids is not None and encoder_input_ids.numel():
            return self.encode(encoder_input_ids, encoder_positions, md)
        return encoder_hidden

    def admits_prompt(self, token_ids: list[int]) -> bool:
        """Whether a prefill of this decoder prompt may run as decode rows from
        position 0 (``write_cross_kv``): its tokens' positions are those decode
        rows get (not so where they count tokens: M2M100's)."""
        return True

    def write_cross_kv(self, kv_caches: list[torch.Tensor], md: AttentionMetadata, **encoder_inputs: Any) -> None:
        """The encoder pass of prefills that then run as rows of the fused decode
        step (``step_plan.admits_as_decodes``), and every layer's cross K/V written
        to their cross tables (``md.cross_slot_mapping``), as a prefill's first
        pass through the layers writes it: that step reads it from the cache."""
        enc = self.encoder_output(md, **encoder_inputs)
        if enc is None or not enc.shape[0]:
            return
        for layer, cache in zip(self.decoder.layers, kv_caches):
            k, v = layer.encoder_attn.kv_proj(enc).chunk(2, dim=-1)
            shape = (-1, cache.shape[-2], cache.shape[-1])
            write_to_cache(k.reshape(shape), v.reshape(shape), cache, md.cross_slot_mapping)

    def _fused_decode_step(self, h: torch.Tensor, kv_caches: list[torch.Tensor], md: AttentionMetadata,
                           position_bias: PositionBias | None = None) -> bool:
        """``h`` updated in place by every decoder layer (T5: ``position_bias`` in
        self-attention); False, having done nothing, where that does not apply."""
        if md.num_prefill_tokens or md.num_encoder_tokens or h.device.type != "cpu" or not self.fuses_decode_steps():
            return False
        table = None
        if position_bias is not None:
            table = distance_table(position_bias, md.decode_metadata.max_decode_seq_len)
        rows = md.decode_rows  # per query row: a sequence verifying drafts has several
        return decoder_step_cpu.decode_step(
            h, self._fused_weights, kv_caches, md.slot_mapping, rows.self_tables, rows.self_lens,
            rows.cross_tables, rows.cross_lens, position_bias=table) is not None
