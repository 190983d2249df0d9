"""Torch-native backend: the CUDA default, needing nothing beyond torch and triton.

One attention call per layer and attention type for the whole batch (STYLE 18)::

    ENCODER          flex_attention, block-diagonal mask over the packed encoder tokens
    DECODER prefill  flex_attention, block-diagonal causal mask over the packed prompts
    ENCODER_DECODER  flex_attention, rectangular blocks (prompt i x encoder i); when a
      prefill        prefill reads a cached cross table (encoder cache), the Triton
                     paged kernel over every prefill's cross table instead
    decode (self     one Triton paged-attention launch reading the cache in place by
      and cross)     block table (encdec/kernels/triton/paged_attention.py); decode rows
                     sharing a cross table form one group, whose keys are read once;
                     a sequence verifying k drafts is one self group of 1 + k causal rows

A mixed step runs its prefill call and its decode launch. Every mask and group
table is built once per step by ``make_metadata`` from the runner's host lists
(no device sync) and shared by all layers; no forward loops over sequences.

The prefill calls (flex_attention, or one batched SDPA call where every
sequence has the same length) live in ``packed_prefill``.

Where the Triton kernel declines (a CPU tensor without ``TRITON_INTERPRET=1``,
cache blocks not a power of two of 16+ keys) decode gathers each group's keys
with one index op and one masked SDPA call: the same math, for tests and CPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from encdec.attention.backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionType,
    PositionBias,
    cache_slots,
    write_to_cache,
)
from encdec.attention.backends.packed_prefill import (  # noqa: F401  (FLEX_BLOCK, uniform_batch, ...: tests and callers read them here)
    FLEX_BLOCK,
    FlexMask,
    doc_block_mask,
    flex,
    flex_mask,
    per_sequence,
    uniform_batch,
)
from encdec.kernels.triton.paged_attention import paged_attention
from encdec.platform.device_tensors import to_device

MAX_GROUP_ROWS = 16  # decode rows per shared-cross-table group: one query tile of the kernel


class PagedGroups(NamedTuple):
    """Query groups of one paged-attention launch (see kernels/triton/paged_attention)."""

    tables: torch.Tensor  # (num_groups, max_blocks) int32, each group's block table
    q_start_loc: torch.Tensor  # (num_groups + 1,) int32, prefix sum of the groups' query rows
    kv_lens: torch.Tensor  # (num_groups,) int32, keys each group reads
    max_q_len: int  # host copy: the longest group
    max_kv_len: int  # host copy: the longest kv_lens


def _i32(values: list[int], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.int32, device)


def shared_table_groups(tables: list[list[int]], lens: list[int],
                        max_rows: int = MAX_GROUP_ROWS) -> list[int]:
    """Start rows of the runs of consecutive rows with the same table and length
    (at most ``max_rows`` each), then the row count: the groups' prefix sum."""
    starts = []
    for i, (t, n) in enumerate(zip(tables, lens)):
        if not starts or t != tables[i - 1] or n != lens[i - 1] or i - starts[-1] >= max_rows:
            starts.append(i)
    return starts + [len(tables)]


@dataclass
class TorchNativeMetadata(AttentionMetadata):
    """Adds the step's flex masks and paged groups, built once by ``make_metadata``."""

    encoder_mask: FlexMask | None = None  # ENCODER prefill over the computed encoder tokens
    causal_mask: FlexMask | None = None  # DECODER prefill
    cross_mask: FlexMask | None = None  # ENCODER_DECODER prefill when no prefill's cross KV is cached
    prefill_cross: PagedGroups | None = None  # ENCODER_DECODER prefill when one is (reads the cache)
    decode_self: PagedGroups | None = None
    decode_cross: PagedGroups | None = None

    def build(self) -> None:
        """Fill the fields above from the runner's fields (host lists, no sync)."""
        dev, n = self.seq_lens_tensor.device, self.num_prefills
        if n:
            q_lens = self.seq_lens[:n]
            if sum(q_lens) != self.num_prefill_tokens:
                raise NotImplementedError(
                    f"torch_native backend: prefill seq_lens {q_lens} do not add up to "
                    f"num_prefill_tokens {self.num_prefill_tokens} (prefills with cached context)")
            cached = self.prefill_cross_cached or [False] * n
            enc_lens = [e for e, c in zip(self.encoder_seq_lens[:n], cached) if not c]
            if self.num_encoder_tokens:
                self.encoder_mask = flex_mask(enc_lens, enc_lens, causal=False, device=dev)
            self.causal_mask = flex_mask(q_lens, q_lens, causal=True, device=dev)
            if any(cached):
                self.prefill_cross = PagedGroups(
                    self.cross_block_tables[:n], self.query_start_loc, self.encoder_seq_lens_tensor[:n],
                    max(q_lens), max(self.encoder_seq_lens[:n]))
            else:
                self.cross_mask = flex_mask(q_lens, self.encoder_seq_lens[:n], causal=False, device=dev)
        if self.num_decode_tokens:
            self._build_decode(n, dev)

    def _build_decode(self, n: int, dev: torch.device) -> None:
        """Decode groups: self, one group per sequence (its 1 + k rows causal when it
        verifies drafts); cross, runs of rows sharing a table (a speculating
        sequence's rows always do)."""
        q_lens = self.decode_query_lens
        self.decode_self = PagedGroups(
            self.block_tables[n:], _i32(self.decode_query_start, dev) if q_lens else
            torch.arange(self.num_decode_tokens + 1, dtype=torch.int32, device=dev),
            self.seq_lens_tensor[n:], max(q_lens) if q_lens else 1, self.max_decode_seq_len)
        tables = self.cross_block_tables_list
        tables = tables[n:] if tables is not None else self.cross_block_tables[n:].tolist()
        enc = self.encoder_seq_lens[n:]
        rows, cross_tables = self.decode_rows, self.cross_block_tables[n:]
        if rows.seq_of_row is not None:  # per query row
            tables, enc = [tables[i] for i in rows.seq_of_row], [enc[i] for i in rows.seq_of_row]
            cross_tables = rows.cross_tables
        starts = shared_table_groups(tables, enc)
        first = to_device(starts[:-1], torch.long, dev)
        self.decode_cross = PagedGroups(
            cross_tables[first], _i32(starts, dev), rows.cross_lens[first],
            max(b - a for a, b in zip(starts, starts[1:])), max(enc))


def paged_torch(q: torch.Tensor, kv_cache: torch.Tensor, groups: PagedGroups, scale: float, *,
                causal: bool, out: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """``paged_attention``'s math in torch where the kernel declines: each group's
    keys gathered by one index op (padded to the longest), one masked SDPA call,
    the groups' rows written to ``out`` (rows in no group are left alone)."""
    _, _, bs, Hk, D = kv_cache.shape
    dev, G = q.device, groups.kv_lens.shape[0]
    M, L = groups.max_q_len, groups.max_kv_len
    q_start = groups.q_start_loc.to(torch.long)
    q_len = q_start[1:] - q_start[:-1]  # (G,)
    rows = torch.arange(M, device=dev)
    q_valid = rows[None, :] < q_len[:, None]  # (G, M)
    q_idx = torch.where(q_valid, q_start[:-1, None] + rows[None, :], 0)
    pos = torch.arange(L, device=dev).clamp(max=groups.tables.shape[1] * bs - 1)
    slots = cache_slots(groups.tables.to(torch.long), torch.arange(G, device=dev)[:, None], pos[None, :], bs)
    kv_len = groups.kv_lens.to(torch.long)
    written = torch.arange(L, device=dev)[None, :] < kv_len[:, None]  # (G, L): the group's own keys
    keep = written[:, None, :]  # (G, 1, L)
    if causal:
        q_pos = kv_len[:, None] - q_len[:, None] + rows[None, :]  # (G, M)
        keep = keep & (torch.arange(L, device=dev)[None, None, :] <= q_pos[:, :, None])
    flat = kv_cache.view(2, -1, Hk, D)
    # Slots past a group's length are padding: whatever their blocks hold (the cache
    # is never zeroed, so maybe NaN) must not reach the result, and a masked score
    # does not stop it (-inf + NaN is NaN, and a 0 weight times a NaN value is NaN).
    padding = ~written[:, :, None, None]
    k = flat[0][slots].masked_fill_(padding, 0.0)  # (G, L, Hk, D), gathered copies: zeroed in place
    v = flat[1][slots].masked_fill_(padding, 0.0)
    mask = keep[:, None]  # (G, 1, M|1, L)
    if bias is not None:  # (num_q, H, >= L) per query row -> (G, H, M, L), -inf where not kept
        rows = bias[q_idx][..., :L].transpose(1, 2).to(q.dtype)
        mask = rows.masked_fill(~mask, float("-inf"))
    res = F.scaled_dot_product_attention(
        q[q_idx].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # (G, H, M|L, D)
        attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != Hk)
    out[q_idx[q_valid]] = res.transpose(1, 2)[q_valid]  # (G, M, H, D) -> the groups' rows


class TorchNativeImpl(AttentionImpl):
    supports_position_bias = True  # T5: a flex score_mod in prefill, a bias operand in decode

    def _paged(self, q: torch.Tensor, kv_cache: torch.Tensor, groups: PagedGroups, *,
               causal: bool, out: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """One launch: write the groups' outputs into ``out`` (a view)."""
        done = paged_attention(q, kv_cache[0], kv_cache[1], groups.tables, groups.q_start_loc,
                               groups.kv_lens, scale=self.scale, causal=causal,
                               max_q_len=groups.max_q_len, out=out, bias=bias)
        if done is None:
            paged_torch(q, kv_cache, groups, self.scale, causal=causal, out=out, bias=bias)

    def forward(self, query, key, value, kv_cache, attn_metadata, attn_type=None,
                position_bias: PositionBias | None = None):
        pb = position_bias
        attn_type = attn_type or self.attn_type
        md = attn_metadata
        H, Hk, D = self.num_heads, self.num_kv_heads, self.head_size
        q = query.view(-1, H, D)  # (num_tokens, H, D)
        k = key.view(-1, Hk, D) if key is not None else None
        v = value.view(-1, Hk, D) if value is not None else None

        if attn_type == AttentionType.ENCODER:
            if md.num_encoder_tokens == 0:
                return query.new_empty(0, H * D)
            return flex(q, k, v, md.encoder_mask, self.scale, pb).reshape(-1, H * D)

        P = md.num_prefill_tokens
        out = torch.empty_like(q)
        if attn_type == AttentionType.DECODER:
            write_to_cache(k, v, kv_cache, md.slot_mapping)
            if md.causal_mask is not None:
                out[:P] = flex(q[:P], k[:P], v[:P], md.causal_mask, self.scale, pb)
            if md.decode_self is not None:
                # q_len 1 per group: every cached key is visible, no causal test needed;
                # a speculating sequence's 1 + k rows are causal among themselves.
                rows = None if pb is None else pb.decode(md.decode_rows.self_lens_list,
                                                         md.decode_self.max_kv_len).float()  # (R, H, L)
                self._paged(q[P:], kv_cache, md.decode_self, causal=md.decode_self.max_q_len > 1, out=out[P:],
                            bias=rows)
            return out.view(-1, H * D)

        # ENCODER_DECODER: this step's encoder K/V go to the cache once; prefill
        # queries see them (or, with the encoder cache, read every prefill's
        # cross table after those writes); decode queries read the cache.
        if md.num_prefills:
            if k is None and md.prefill_cross is None:
                raise ValueError("cross-attention prefill needs the encoder's key/value")
            if k is not None and md.num_encoder_tokens:
                write_to_cache(k, v, kv_cache, md.cross_slot_mapping)
            if md.prefill_cross is not None:
                self._paged(q[:P], kv_cache, md.prefill_cross, causal=False, out=out[:P])
            else:
                out[:P] = flex(q[:P], k, v, md.cross_mask, self.scale)
        if md.decode_cross is not None:
            self._paged(q[P:], kv_cache, md.decode_cross, causal=False, out=out[P:])
        return out.view(-1, H * D)


class TorchNativeBackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "torch_native"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TorchNativeImpl

    @staticmethod
    def get_metadata_cls() -> type[AttentionMetadata]:
        return TorchNativeMetadata

    @classmethod
    def make_metadata(cls, **fields_: Any) -> AttentionMetadata:
        md = TorchNativeMetadata(**fields_)
        md.build()
        return md
