"""Torch-native backend: the CUDA default, needing nothing beyond torch and triton.

One attention call per layer and attention type for the whole batch (STYLE 18)::

    ENCODER          flex_attention, block-diagonal mask over the packed encoder tokens
    DECODER prefill  flex_attention, block-diagonal causal mask over the packed prompts
    ENCODER_DECODER  flex_attention, rectangular blocks (prompt i x encoder i); when a
      prefill        prefill reads a cached cross table (encoder cache), the Triton
                     paged kernel over every prefill's cross table instead
    decode (self     one Triton paged-attention launch reading the cache in place by
      and cross)     block table (encdec/kernels/triton/paged_attention.py); decode rows
                     sharing a cross table form one group, whose keys are read once

A mixed step runs its prefill call and its decode launch. Every mask and group
table is built once per step by ``make_metadata`` from the runner's host lists
(no device sync) and shared by all layers; no forward loops over sequences.

The block masks are built directly from the sequence boundaries (each query
tile's range of key tiles), never by evaluating the mask over all
(query, key) pairs: a batch of 64 Whisper windows is 96,000 encoder tokens.

Where the Triton kernel declines (a CPU tensor without ``TRITON_INTERPRET=1``,
cache blocks not a power of two of 16+ keys) decode gathers each group's keys
with one index op and one masked SDPA call: the same math, for tests and CPU.
On CPU flex_attention runs eagerly; on CUDA it is compiled once.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from encdec.attention.backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionType,
    PositionBias,
    cache_slots,
    write_to_cache,
)
from encdec.device_tensors import to_device
from encdec.kernels.triton.paged_attention import paged_attention

logger = logging.getLogger(__name__)

FLEX_BLOCK = 128  # flex_attention's query/key tile
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


class FlexMask(NamedTuple):
    """A prefill call's block mask and the sequence lengths it was built from."""

    block_mask: BlockMask
    q_lens: list[int]  # query tokens per sequence, packed in this order
    kv_lens: list[int]  # key tokens per sequence
    causal: bool
    q_pos: torch.Tensor  # (sum(q_lens),) int64, each query's position in its sequence
    kv_pos: torch.Tensor  # (sum(kv_lens),) int64, each key's


def _positions(lens: list[int], device: torch.device) -> torch.Tensor:
    n = to_device(lens, torch.long, device)
    starts = torch.cumsum(n, 0) - n
    return torch.arange(sum(lens), device=device) - torch.repeat_interleave(starts, n, output_size=sum(lens))


def flex_mask(q_lens: list[int], kv_lens: list[int], *, causal: bool, device: torch.device) -> FlexMask:
    return FlexMask(doc_block_mask(q_lens, kv_lens, causal=causal, device=device), q_lens, kv_lens, causal,
                    _positions(q_lens, device), _positions(kv_lens, device))


def doc_block_mask(q_lens: list[int], kv_lens: list[int], *, causal: bool,
                   device: torch.device) -> BlockMask:
    """flex_attention's mask for packed sequences: query token of sequence i sees
    the key tokens of sequence i (and, causal, only those at or before it).
    Each query tile's key tiles are the span of the sequences it touches."""
    Q, KV = sum(q_lens), sum(kv_lens)
    q_doc = torch.repeat_interleave(torch.arange(len(q_lens), device=device),
                                    to_device(q_lens, torch.long, device), output_size=Q)  # (Q,)
    kv_doc = torch.repeat_interleave(torch.arange(len(kv_lens), device=device),
                                     to_device(kv_lens, torch.long, device), output_size=KV)  # (KV,)
    kv_start = to_device([0] + kv_lens, torch.long, device).cumsum(0)  # (num_seqs + 1,)
    nq, nkv = -(-Q // FLEX_BLOCK), -(-KV // FLEX_BLOCK)
    tile_first = torch.arange(nq, device=device) * FLEX_BLOCK  # first query of each tile
    tile_last = (tile_first + FLEX_BLOCK - 1).clamp(max=Q - 1)
    lo = kv_start[q_doc[tile_first]] // FLEX_BLOCK  # (nq,) first key tile
    end = kv_start[q_doc[tile_last] + 1]  # one past the last key the tile's sequences own
    if causal:  # a query sees keys up to itself (packed positions align: no cached context)
        end = torch.minimum(end, tile_last + 1)
    hi = -(-end // FLEX_BLOCK)  # (nq,) one past the last key tile
    counts = (hi - lo).to(torch.int32)
    indices = (lo[:, None] + torch.arange(nkv, device=device)[None, :]).clamp(max=nkv - 1).to(torch.int32)

    if causal:
        def mask_mod(b, h, q, kv):
            return (q_doc[q] == kv_doc[kv]) & (q >= kv)
    else:
        def mask_mod(b, h, q, kv):
            return q_doc[q] == kv_doc[kv]
    return BlockMask.from_kv_blocks(counts[None, None], indices[None, None], BLOCK_SIZE=FLEX_BLOCK,
                                    mask_mod=mask_mod, seq_lengths=(Q, KV))


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
            num = self.num_decode_tokens
            self.decode_self = PagedGroups(
                self.block_tables[n:], torch.arange(num + 1, dtype=torch.int32, device=dev),
                self.seq_lens_tensor[n:], 1, self.max_decode_seq_len)
            tables = self.cross_block_tables_list
            tables = tables[n:] if tables is not None else self.cross_block_tables[n:].tolist()
            enc = self.encoder_seq_lens[n:]
            starts = shared_table_groups(tables, enc)
            first = to_device(starts[:-1], torch.long, dev)
            self.decode_cross = PagedGroups(
                self.cross_block_tables[n:][first], _i32(starts, dev), self.encoder_seq_lens_tensor[n:][first],
                max(b - a for a, b in zip(starts, starts[1:])), max(enc))


@functools.cache
def _compiled_flex():
    # dynamic: a step's token counts change every step; one compilation serves them.
    return torch.compile(flex_attention, dynamic=True, fullgraph=True)


_flex_failure: list[str] = []  # why compiled flex_attention failed on CUDA, once it has


def _size_generic() -> contextlib.AbstractContextManager:
    """Compile for sizes in general: dynamo otherwise specializes every size of 1,
    here the block masks' tile counts, so a step whose queries or keys fit one
    128-token tile compiled its own graphs. Measured with inductor on CPU, seven
    prefill shape sets (causal and not, 1 to 8 tiles) compiled 6 graphs, 3 with
    this, each 4-14 s on first use (an H100 run saw one land mid-benchmark, 3.6 s).
    A torch without the option compiles as before (``patch`` would raise only on
    entering, inside the compiled call, and send every prefill to the fallback)."""
    try:
        from torch.fx.experimental import _config as fx_config
    except ImportError:
        return contextlib.nullcontext()
    if not hasattr(fx_config, "backed_size_oblivious"):
        return contextlib.nullcontext()
    return fx_config.patch(backed_size_oblivious=True)


def compiled_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: FlexMask, scale: float,
                  bias: PositionBias | None = None) -> torch.Tensor:
    """``flex``'s CUDA path, one compiled flex_attention call (it runs on CPU too: the tests)."""
    with _size_generic():
        return _run_flex(_compiled_flex(), q, k, v, mask, scale, bias)


def _score_mod(mask: FlexMask, bias: PositionBias):
    """T5's position bias as a flex score_mod: one (H, Lq, Lk) table over the
    step's longest sequences (memoized on the bias, shared by the stack's layers),
    read at each query's and key's position in its sequence."""
    lq, lk = max(mask.q_lens), max(mask.kv_lens)
    table = bias._memo(("flex_table", lq, lk), lambda: bias.compute(
        torch.arange(lq, device=bias.device), torch.arange(lk, device=bias.device)).float())
    q_pos, kv_pos = mask.q_pos, mask.kv_pos

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, q_pos[q_idx], kv_pos[kv_idx]]
    return score_mod


def _run_flex(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: FlexMask, scale: float,
              bias: PositionBias | None) -> torch.Tensor:
    out = fn(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],  # (1, H, N, D)
             score_mod=None if bias is None else _score_mod(mask, bias),
             block_mask=mask.block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def per_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: FlexMask, scale: float,
                 bias: PositionBias | None = None) -> torch.Tensor:
    """``flex``'s result by one SDPA call per sequence: the fallback where compiled
    flex_attention fails on CUDA (one launch per sequence: slower, still exact)."""
    out = torch.empty_like(q)
    qs = ks = 0
    for nq, nk in zip(mask.q_lens, mask.kv_lens):
        add = None if bias is None else bias.prefill(nq, causal=mask.causal).to(q.dtype)  # self-attention: nq == nk
        out[qs: qs + nq] = F.scaled_dot_product_attention(
            q[qs: qs + nq].transpose(0, 1), k[ks: ks + nk].transpose(0, 1), v[ks: ks + nk].transpose(0, 1),
            attn_mask=add, is_causal=mask.causal and add is None, scale=scale,
            enable_gqa=q.shape[1] != k.shape[1]).transpose(0, 1)
        qs, ks = qs + nq, ks + nk
    return out


def uniform_batch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: FlexMask,
                  scale: float) -> torch.Tensor | None:
    """``flex``'s result by one batched SDPA call when every sequence has the same
    query length and the same key length (Whisper's encoder: 1500 frames a
    window; its decoder prompts), None otherwise. There the packed tokens are a
    (B, L, H, D) batch with no mask but causality, and SDPA runs FlashAttention on
    CUDA, which tiles 1500-token windows without flex's partial mask tiles."""
    lq, lk = mask.q_lens[0], mask.kv_lens[0]
    if mask.q_lens.count(lq) != len(mask.q_lens) or mask.kv_lens.count(lk) != len(mask.kv_lens) \
            or (mask.causal and lq != lk):
        return None
    b = len(mask.q_lens)
    out = F.scaled_dot_product_attention(
        q.view(b, lq, *q.shape[1:]).transpose(1, 2), k.view(b, lk, *k.shape[1:]).transpose(1, 2),
        v.view(b, lk, *v.shape[1:]).transpose(1, 2), is_causal=mask.causal, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1])  # (B, H, Lq, D)
    return out.transpose(1, 2).reshape(q.shape)


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: FlexMask, scale: float,
         bias: PositionBias | None = None) -> torch.Tensor:
    """Packed q (Nq, H, D), k/v (Nk, Hk, D) under ``mask`` -> (Nq, H, D): one call.
    Sequences of one length: one batched SDPA call (``uniform_batch``). Otherwise
    CUDA: compiled (a compile failure is logged once and the step falls back to
    ``per_sequence``); CPU: eager, the reference path."""
    if bias is None:
        out = uniform_batch(q, k, v, mask, scale)
        if out is not None:
            return out
    if q.is_cuda and not _flex_failure:
        try:
            return compiled_flex(q, k, v, mask, scale, bias)
        except Exception as e:  # inductor/triton compile errors; the fallback below is exact
            _flex_failure.append(f"{type(e).__name__}: {str(e)[:300]}")
            logger.warning("compiled flex_attention failed (%s); prefill attention runs one SDPA call "
                           "per sequence instead (slower)", _flex_failure[0])
    if q.is_cuda:
        return per_sequence(q, k, v, mask, scale, bias)
    with warnings.catch_warnings():  # eager on CPU is the intent (the reference path)
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
        return _run_flex(flex_attention, q, k, v, mask, scale, bias)


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
                # q_len 1 per group: every cached key is visible, no causal test needed.
                rows = None if pb is None else pb.decode(md.seq_lens[md.num_prefills:],
                                                         md.decode_self.max_kv_len).float()  # (B, H, L)
                self._paged(q[P:], kv_cache, md.decode_self, causal=False, out=out[P:], bias=rows)
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
