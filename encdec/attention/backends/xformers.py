"""xFormers backend: one block-diagonal bias per step for each attention type.

Prefill (the bias objects vLLM's xFormers backend builds; seed 002)::

    ENCODER          BlockDiagonalMask(enc_lens, enc_lens)      square blocks
    ENCODER_DECODER  BlockDiagonalMask(dec_lens, enc_lens)      rectangular blocks
    DECODER          BlockDiagonalCausalMask(dec_lens)          causal square blocks

    dec_lens = [3, 2], enc_lens = [2, 4]  (cross):   k: e0 e0 e1 e1 e1 e1
                                               q d0   0  0  -  -  -  -
                                                 d0   0  0  -  -  -  -
                                                 d0   0  0  -  -  -  -
                                                 d1   -  -  0  0  0  0
                                                 d1   -  -  0  0  0  0

Decode: no mask beyond what paging implies. Each decode sequence's keys are
gathered from the paged cache into one packed tensor (one index op per layer),
and ``BlockDiagonalMask([1] * num_decodes, kv_lens)`` only says which packed
keys belong to which query; a sequence verifying k drafts (1 + k query rows,
``decode_query_lens``) takes ``BlockDiagonalCausalFromBottomRightMask(q_lens,
kv_lens)`` in self-attention (its rows are its newest positions). xFormers' paged biases
(``PagedBlockDiagonalPaddedKeysMask``) were not chosen: in 0.0.35 only
half-precision kernels take them (flash, flash3, ck, triton split-k, the last
with pages a multiple of its 64-key tile), while encdec's blocks are 16 tokens
or any size (5 included) and fp32 must work. Plain ``BlockDiagonalMask`` runs
on every xFormers kernel, cutlass fp32 included.

All biases are built once per step, cached on the metadata object (and on its
``prefill_metadata`` / ``decode_metadata`` views, which are themselves cached),
so every layer reuses them. Query lengths come from the Python ``seq_lens``
(prefill has no cached context here), so building them needs no device sync.

On CUDA the biases go to ``xformers.ops.memory_efficient_attention``. Elsewhere
the same bias objects are materialised (``bias.materialize``, once per step and
dtype) and applied as an additive mask with torch SDPA: a reference path, exact
in float32, that exercises all the metadata and mask logic without a GPU.

A ``PositionBias`` (T5) is added to that mask in its packed forms
(``packed_prefill`` for encoder and decoder prefill, ``packed_decode`` at
decode). xFormers' kernels take no block-diagonal mask plus a per-head tensor
bias, so with a bias the reference path runs on CUDA too: correct, not fast
(a fused GPU path is the GPU backend's work).
"""
from __future__ import annotations

from functools import cached_property

import torch
import torch.nn.functional as F

try:
    import xformers.ops as xops
    from xformers.ops.fmha.attn_bias import AttentionBias, BlockDiagonalCausalMask, BlockDiagonalMask
except ImportError as e:  # the selector turns this into "attention_backend='xformers' cannot run here"
    raise ImportError(
        f"the xformers attention backend needs the xformers package (pip install xformers): {e}"
    ) from e

from encdec.attention.backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionType,
    PositionBias,
    packed_slots,
    write_to_cache,
)


class XFormersMetadata(AttentionMetadata):
    """Adds the step's xFormers biases, built on first use and shared by all layers."""

    @property
    def _device(self) -> torch.device:
        return self.seq_lens_tensor.device

    @cached_property
    def prefill_q_lens(self) -> list[int]:
        lens = self.seq_lens[: self.num_prefills]
        if sum(lens) != self.num_prefill_tokens:  # a prefill with cached context (chunked / prefix)
            raise NotImplementedError(
                f"xformers backend: prefill seq_lens {lens} do not add up to num_prefill_tokens "
                f"{self.num_prefill_tokens}; prefills with cached context are not supported")
        return lens

    @cached_property
    def prefill_encoder_lens(self) -> list[int]:
        """Encoder tokens each prefill brings this step (a cached one brings none)."""
        lens = self.encoder_seq_lens[: self.num_prefills]
        if self.prefill_cross_cached is not None:
            lens = [n for n, cached in zip(lens, self.prefill_cross_cached) if not cached]
        assert sum(lens) == self.num_encoder_tokens, (lens, self.num_encoder_tokens)
        return lens

    @cached_property
    def prefill_cross_slots(self) -> torch.Tensor:
        """Cache slots of every prefill's encoder keys, packed: read instead of
        the step's key/value when some prefill's cross KV is cached."""
        return packed_slots(self.cross_block_tables[: self.num_prefills],
                            self.encoder_seq_lens[: self.num_prefills], self.block_size)

    @cached_property
    def encoder_bias(self) -> BlockDiagonalMask:
        return BlockDiagonalMask.from_seqlens(self.prefill_encoder_lens, device=self._device)

    @cached_property
    def cross_prefill_bias(self) -> BlockDiagonalMask:
        return BlockDiagonalMask.from_seqlens(
            self.prefill_q_lens, self.encoder_seq_lens[: self.num_prefills], device=self._device)

    @cached_property
    def causal_prefill_bias(self) -> BlockDiagonalCausalMask:
        return BlockDiagonalCausalMask.from_seqlens(self.prefill_q_lens, device=self._device)

    @cached_property
    def decode_self(self) -> tuple[torch.Tensor, AttentionBias]:
        """Packed cache slots of every decode sequence's keys (this step's included) and
        the bias that groups them; only meaningful on ``decode_metadata``. A
        sequence verifying k drafts has 1 + k query rows over its keys, causal
        from the bottom right (its rows are its newest positions)."""
        assert self.num_prefills == 0, "use attn_metadata.decode_metadata"
        slots = packed_slots(self.block_tables, self.seq_lens, self.block_size)
        if self.decode_query_lens is not None:
            # Imported here: only speculative steps need it (the selector's probe and
            # its tests know the two masks above).
            from xformers.ops.fmha.attn_bias import BlockDiagonalCausalFromBottomRightMask
            return slots, BlockDiagonalCausalFromBottomRightMask.from_seqlens(
                self.decode_query_lens, self.seq_lens, device=self._device)
        return slots, BlockDiagonalMask.from_seqlens(
            [1] * self.num_seqs, self.seq_lens, device=self._device)

    @cached_property
    def decode_cross(self) -> tuple[torch.Tensor, BlockDiagonalMask]:
        """As ``decode_self`` for the encoder keys behind ``cross_block_tables``
        (every query row of a sequence sees all of them)."""
        assert self.num_prefills == 0, "use attn_metadata.decode_metadata"
        slots = packed_slots(self.cross_block_tables, self.encoder_seq_lens, self.block_size)
        return slots, BlockDiagonalMask.from_seqlens(
            self.decode_query_lens or [1] * self.num_seqs, self.encoder_seq_lens, device=self._device)

    def materialized(self, bias: AttentionBias, shape: tuple[int, int],
                     dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The additive (q_len, kv_len) mask of ``bias`` for the reference path, once per step."""
        cache = self.__dict__.setdefault("_materialized", {})
        key = (id(bias), dtype, device)
        if key not in cache:
            cache[key] = bias.materialize(shape, dtype=dtype, device=device)
        return cache[key]


def _use_kernel(device: torch.device) -> bool:
    """xFormers' kernels are CUDA-only; everything else takes the reference path."""
    return device.type == "cuda"


class XFormersImpl(AttentionImpl):
    supports_position_bias = True

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                bias: AttentionBias, md: XFormersMetadata,
                position_bias: torch.Tensor | None = None) -> torch.Tensor:
        """q: (Mq, H, D), k/v: (Mk, Hk, D), packed; bias over (Mq, Mk) -> (Mq, H, D);
        ``position_bias``: (H, Mq, Mk) added to it (reference path)."""
        Mq, H, D = q.shape
        Mk, Hk = k.shape[0], k.shape[1]
        if _use_kernel(q.device) and position_bias is None:
            if H == Hk:
                return xops.memory_efficient_attention(
                    q[None], k[None], v[None], attn_bias=bias, scale=self.scale)[0]
            # GQA: xFormers takes (B, M, G, H/G, D) with k/v broadcast by hand.
            g = H // Hk
            q5 = q.view(1, Mq, Hk, g, D)
            k5 = k[None, :, :, None].expand(1, Mk, Hk, g, D)
            v5 = v[None, :, :, None].expand(1, Mk, Hk, g, D)
            out = xops.memory_efficient_attention(q5, k5, v5, attn_bias=bias, scale=self.scale)
            return out.reshape(Mq, H, D)
        mask = md.materialized(bias, (Mq, Mk), q.dtype, q.device)  # (Mq, Mk), 0 or -inf
        if position_bias is not None:
            mask = mask + position_bias.to(q.dtype)  # (H, Mq, Mk)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),  # (H, M, D)
            attn_mask=mask, scale=self.scale, enable_gqa=H != Hk)
        return out.transpose(0, 1)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor,
                gathered: tuple[torch.Tensor, BlockDiagonalMask], md: XFormersMetadata,
                position_bias: torch.Tensor | None = None) -> torch.Tensor:
        slots, bias = gathered
        flat = kv_cache.view(2, -1, self.num_kv_heads, self.head_size)  # (2, num_slots, Hk, D)
        return self._attend(q, flat[0][slots], flat[1][slots], bias, md, position_bias)

    def forward(self, query, key, value, kv_cache, attn_metadata, attn_type=None,
                position_bias: PositionBias | None = None):
        attn_type = attn_type or self.attn_type
        pb = position_bias
        md = attn_metadata
        H, Hk, D = self.num_heads, self.num_kv_heads, self.head_size
        q = query.view(-1, H, D)  # (num_tokens, H, D)
        k = key.view(-1, Hk, D) if key is not None else None
        v = value.view(-1, Hk, D) if value is not None else None

        if attn_type == AttentionType.ENCODER:
            if md.num_encoder_tokens == 0:
                return query.new_empty(0, H * D)
            pmd = md.prefill_metadata
            extra = None if pb is None else pb.packed_prefill(pmd.prefill_encoder_lens)
            return self._attend(q, k, v, pmd.encoder_bias, pmd, extra).reshape(-1, H * D)

        if kv_cache is not None:
            assert kv_cache.shape[2] == md.block_size, (
                f"kv_cache block size {kv_cache.shape[2]} != attn_metadata.block_size {md.block_size}")
        P = md.num_prefill_tokens
        pmd, dmd = md.prefill_metadata, md.decode_metadata
        out = torch.empty_like(q)

        if attn_type == AttentionType.DECODER:
            if kv_cache is not None:
                write_to_cache(k, v, kv_cache, md.slot_mapping)
            if pmd is not None:
                extra = None if pb is None else pb.packed_prefill(pmd.prefill_q_lens)
                out[:P] = self._attend(q[:P], k[:P], v[:P], pmd.causal_prefill_bias, pmd, extra)
            if dmd is not None:
                extra = None if pb is None else pb.packed_decode(dmd.seq_lens, dmd.decode_query_lens)
                out[P:] = self._decode(q[P:], kv_cache, dmd.decode_self, dmd, extra)
            return out.view(-1, H * D)

        # ENCODER_DECODER: prefill queries see their request's encoder tokens (given as
        # key/value and written to the cache once); decode queries read the cache.
        # When some prefill's cross KV is cached (encoder cache), every prefill's
        # keys are read back from the cache after this step's writes.
        if pmd is not None:
            cached = md.prefill_cross_cached is not None and any(md.prefill_cross_cached)
            if k is None and not (cached and all(md.prefill_cross_cached)):
                raise ValueError("cross-attention prefill needs the encoder key/value")
            if k is not None and kv_cache is not None:
                write_to_cache(k, v, kv_cache, md.cross_slot_mapping)
            if cached:
                flat = kv_cache.view(2, -1, Hk, D)
                k, v = flat[0][pmd.prefill_cross_slots], flat[1][pmd.prefill_cross_slots]
            out[:P] = self._attend(q[:P], k, v, pmd.cross_prefill_bias, pmd)
        if dmd is not None:
            out[P:] = self._decode(q[P:], kv_cache, dmd.decode_cross, dmd)
        return out.view(-1, H * D)


class XFormersBackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "xformers"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return XFormersImpl

    @staticmethod
    def get_metadata_cls() -> type[AttentionMetadata]:
        return XFormersMetadata
