"""Prefill attention over packed sequences in one call: the torch_native
backend's encoder, decoder-prompt and cross attention at prefill.

Sequences of one length (Whisper's 1500-frame windows, its decoder prompts) run
one batched SDPA call; any other mix runs flex_attention under a block mask
built from the sequence boundaries (each query tile's range of key tiles),
never by evaluating the mask over all (query, key) pairs: a batch of 64
Whisper windows is 96,000 encoder tokens. On CUDA flex_attention is compiled
once (a compile failure falls back to one SDPA call per sequence); on CPU it
runs eagerly, the reference path.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from encdec.attention.backends.abstract import PositionBias
from encdec.platform.device_tensors import to_device

logger = logging.getLogger(__name__)

FLEX_BLOCK = 128  # flex_attention's query/key tile


class FlexMask:
    """A prefill call's sequence lengths, and what its layers' calls read: built
    once per step and shared by every layer. The block mask and the positions
    (T5's score_mod) are built on first use: a step whose sequences all have
    one length (``uniform``) runs batched SDPA and never needs them."""

    def __init__(self, q_lens: list[int], kv_lens: list[int], causal: bool, device: torch.device) -> None:
        self.q_lens = q_lens  # query tokens per sequence, packed in this order
        self.kv_lens = kv_lens  # key tokens per sequence
        self.causal = causal
        self.device = device
        lq, lk = q_lens[0], kv_lens[0]
        # Every sequence of one query and one key length (causal: square).
        self.uniform = (q_lens.count(lq) == len(q_lens) and kv_lens.count(lk) == len(kv_lens)
                        and not (causal and lq != lk))

    @functools.cached_property
    def block_mask(self) -> BlockMask:
        return doc_block_mask(self.q_lens, self.kv_lens, causal=self.causal, device=self.device)

    @functools.cached_property
    def q_pos(self) -> torch.Tensor:
        """(sum(q_lens),) int64: each query's position in its sequence."""
        return _positions(self.q_lens, self.device)

    @functools.cached_property
    def kv_pos(self) -> torch.Tensor:
        """(sum(kv_lens),) int64: each key's."""
        return _positions(self.kv_lens, self.device)


def _positions(lens: list[int], device: torch.device) -> torch.Tensor:
    n = to_device(lens, torch.long, device)
    starts = torch.cumsum(n, 0) - n
    return torch.arange(sum(lens), device=device) - torch.repeat_interleave(starts, n, output_size=sum(lens))


def flex_mask(q_lens: list[int], kv_lens: list[int], *, causal: bool, device: torch.device) -> FlexMask:
    return FlexMask(q_lens, kv_lens, causal, device)


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
    if not mask.uniform:
        return None
    lq, lk, b = mask.q_lens[0], mask.kv_lens[0], len(mask.q_lens)
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
