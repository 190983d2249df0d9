"""The attention backend interface (vLLM V0 shapes) and its metadata.

A step's tokens are packed without padding: the prefill sequences' tokens
first, then each decode sequence's query rows: one, or 1 + k where the step
verifies k draft tokens (speculative decoding; ``decode_query_lens``), which
attend causally among themselves. Encoder tokens of the prefill requests are
packed the same way. ``AttentionMetadata`` says where each
sequence starts and where its keys/values live in the paged cache.

Paged KV cache of one layer (self and cross blocks share the pool; the block
manager hands out block numbers)::

    kv_cache: (2, num_blocks, block_size, num_kv_heads, head_size)
               ^ 0 = key, 1 = value
    slot = block_number * block_size + offset_in_block
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any

import torch

from encdec.attention.backends.decode_rows import DecodeRows, check_decode_query_lens, decode_rows
from encdec.platform.device_tensors import to_device


class AttentionType(str, enum.Enum):
    DECODER = "decoder"  # decoder self-attention, causal
    ENCODER = "encoder"  # encoder self-attention, non-causal, no KV cache
    ENCODER_DECODER = "encoder_decoder"  # cross-attention: decoder queries, encoder keys


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built once by the model runner and shared by all layers."""

    num_prefills: int  # prefill sequences; they come first in the batch
    num_prefill_tokens: int  # decoder tokens of the prefill sequences
    num_decode_tokens: int  # decode query rows: one per decode sequence, or sum(decode_query_lens)
    slot_mapping: torch.Tensor  # (num_prefill_tokens + num_decode_tokens,) int64, decoder token -> cache slot
    seq_lens: list[int]  # per decoder sequence: context length including this step's tokens
    seq_lens_tensor: torch.Tensor  # (num_seqs,) int32, same as seq_lens
    max_prefill_seq_len: int
    max_decode_seq_len: int
    max_query_len: int
    query_start_loc: torch.Tensor  # (num_prefills + 1,) int32, prefix sum of query lengths
    seq_start_loc: torch.Tensor  # (num_prefills + 1,) int32, prefix sum of seq_lens
    context_lens_tensor: torch.Tensor  # (num_seqs,) tokens already cached before this step
    block_tables: torch.Tensor  # (num_seqs, max_blocks) int32 self-attention blocks, 0-padded
    # Encoder / cross-attention side.
    encoder_seq_lens: list[int]  # per decoder sequence: its request's encoder length
    encoder_seq_lens_tensor: torch.Tensor  # (num_seqs,) int32
    encoder_seq_start_loc: torch.Tensor  # (num_prefills + 1,) int32, packed encoder tokens (0 for a cached prefill)
    max_encoder_seq_len: int
    num_encoder_tokens: int  # packed encoder tokens of the prefill sequences (computed this step)
    cross_slot_mapping: torch.Tensor  # (num_encoder_tokens,) int64, encoder token -> cache slot
    cross_block_tables: torch.Tensor  # (num_seqs, max_cross_blocks) int32, 0-padded
    block_size: int  # token slots per cache block; must match the cache tensor
    # Python copies of the tables, so CPU paths can take views without a device sync.
    block_tables_list: list[list[int]] | None = None
    cross_block_tables_list: list[list[int]] | None = None
    # Per prefill sequence: True when its cross KV is already in the cache (the
    # encoder cache), so it has no encoder tokens this step and its cross-
    # attention reads the cache; None when every prefill brings its encoder.
    prefill_cross_cached: list[bool] | None = None
    # Per decode sequence: its query rows this step, its newest positions (1 + k
    # where k draft tokens are verified), causal among themselves; their K/V are
    # in ``slot_mapping`` and ``seq_lens`` counts them. None: one row each.
    decode_query_lens: list[int] | None = None

    def __post_init__(self) -> None:
        if self.decode_query_lens is not None:
            check_decode_query_lens(self.decode_query_lens, self.seq_lens[self.num_prefills:],
                                    self.num_decode_tokens)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def _view(self, sl: slice, **overrides: Any) -> AttentionMetadata:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        for key in ("seq_lens", "encoder_seq_lens", "block_tables_list", "cross_block_tables_list"):
            if data[key] is not None:
                data[key] = data[key][sl]
        for key in ("seq_lens_tensor", "context_lens_tensor", "block_tables",
                    "encoder_seq_lens_tensor", "cross_block_tables"):
            data[key] = data[key][sl]
        data.update(overrides)
        return type(self)(**data)

    @cached_property
    def prefill_metadata(self) -> AttentionMetadata | None:
        """The prefill sequences alone; keeps the cross fields."""
        if self.num_prefills == 0:
            return None
        return self._view(
            slice(0, self.num_prefills),
            num_decode_tokens=0,
            slot_mapping=self.slot_mapping[: self.num_prefill_tokens],
            max_decode_seq_len=0,
            decode_query_lens=None,
        )

    @cached_property
    def decode_metadata(self) -> AttentionMetadata | None:
        """The decode sequences alone; keeps the cross fields."""
        if self.num_decode_tokens == 0:
            return None
        empty = self.query_start_loc[:1]
        return self._view(
            slice(self.num_prefills, None),
            num_prefills=0,
            num_prefill_tokens=0,
            slot_mapping=self.slot_mapping[self.num_prefill_tokens:],
            max_prefill_seq_len=0,
            max_query_len=max(self.decode_query_lens) if self.decode_query_lens else 1,
            query_start_loc=empty,
            seq_start_loc=empty,
            encoder_seq_start_loc=empty,
            num_encoder_tokens=0,
            cross_slot_mapping=self.cross_slot_mapping[:0],
            prefill_cross_cached=None,
        )


    @cached_property
    def decode_query_start(self) -> list[int]:
        """Prefix sum of the decode sequences' query rows (host ints, from 0)."""
        lens = self.decode_query_lens or [1] * (self.num_seqs - self.num_prefills)
        out = [0]
        for n in lens:
            out.append(out[-1] + n)
        return out

    @cached_property
    def decode_rows(self) -> DecodeRows:
        """The decode sequences' attention inputs per query row (see ``DecodeRows``)."""
        return decode_rows(self)


class PositionBias(ABC):
    """An additive attention bias that depends only on a query's and a key's
    positions in their sequence (T5's relative position bias): the one hook
    through which a model gives a bias to self-attention.

    A model builds one per layer stack and step and passes it to each layer's
    ``Attention.forward(..., position_bias=...)``; the matrices below are memoized
    on it, so each is computed once per stack, not once per layer. Positions count
    from a sequence's first token (a decoder's from its decoder prompt). Backends
    that take a bias set ``AttentionImpl.supports_position_bias``; torch_sdpa's C
    paged decode kernel reads it as one (heads, distance) table per step
    (``bias_tables.distance_table``) and its C dense kernel (encoder self-attention)
    as one (heads, offset) table per length (``bias_tables.offset_table``), both
    relying on T5's bias depending on ``key - query`` alone; cross-attention never
    takes one. A GPU backend gets the same object: ``compute`` for any
    positions, or the packed forms below.
    """

    num_heads: int

    @abstractmethod
    def compute(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """(H, Lq, Lk) float32 bias of queries at ``query_positions`` (Lq,) over
        keys at ``key_positions`` (Lk,), both int64 on the bias's device."""

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    def _memo(self, key: tuple, make) -> torch.Tensor:
        cache = self.__dict__.setdefault("_memo_cache", {})
        if key not in cache:
            cache[key] = make()
        return cache[key]

    def prefill(self, n: int, *, causal: bool = False) -> torch.Tensor:
        """(H, n, n): one sequence's n tokens over each other; ``causal`` adds -inf
        above the diagonal (a decoder prefill)."""
        def make() -> torch.Tensor:
            pos = torch.arange(n, device=self.device)
            bias = self.compute(pos, pos)
            if causal:
                bias = bias.masked_fill(torch.ones(n, n, dtype=torch.bool, device=self.device).triu(1), float("-inf"))
            return bias
        return self._memo(("prefill", n, causal), make)

    def decode(self, seq_lens: list[int], num_keys: int) -> torch.Tensor:
        """(B, H, num_keys): each decode query (position ``seq_len - 1``) over keys
        at positions 0..num_keys-1 (past a row's length: values to be masked)."""
        def make() -> torch.Tensor:
            q = torch.tensor(seq_lens, dtype=torch.long, device=self.device) - 1
            return self.compute(q, torch.arange(num_keys, device=self.device)).transpose(0, 1)
        return self._memo(("decode", tuple(seq_lens), num_keys), make)

    def packed_prefill(self, lens: list[int]) -> torch.Tensor:
        """(H, M, M), M = sum(lens): ``prefill`` blocks of packed sequences on the
        diagonal, 0 elsewhere (the caller's block-diagonal mask hides those)."""
        def make() -> torch.Tensor:
            total = sum(lens)
            out = torch.zeros(self.num_heads, total, total, device=self.device)
            start = 0
            for n in lens:
                out[:, start:start + n, start:start + n] = self.prefill(n)
                start += n
            return out
        return self._memo(("packed_prefill", tuple(lens)), make)

    def packed_decode(self, seq_lens: list[int], query_lens: list[int] | None = None) -> torch.Tensor:
        """(H, R, sum(seq_lens)): each decode query row over the packed keys, its own
        sequence's keys at their offset, 0 elsewhere (masked by the caller). One
        row per sequence, or ``query_lens[i]`` rows for sequence i, its newest
        positions (``AttentionMetadata.decode_query_lens``; R = their sum)."""
        q_lens = query_lens or [1] * len(seq_lens)

        def make() -> torch.Tensor:
            row_lens = [s - q + 1 + j for s, q in zip(seq_lens, q_lens) for j in range(q)]
            rows = self.decode(row_lens, max(seq_lens))  # (R, H, max_len), row r at position row_lens[r] - 1
            out = torch.zeros(self.num_heads, len(row_lens), sum(seq_lens), device=self.device)
            start, r = 0, 0
            for n, q in zip(seq_lens, q_lens):
                out[:, r:r + q, start:start + n] = rows[r:r + q, :, :n].transpose(0, 1)
                start, r = start + n, r + q
            return out
        return self._memo(("packed_decode", tuple(seq_lens), tuple(q_lens)), make)


class AttentionImpl(ABC):
    """One layer's attention computation over packed tokens."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        attn_type: AttentionType = AttentionType.DECODER,
    ):
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.attn_type = attn_type

    # True where ``forward`` takes ``position_bias`` (a ``PositionBias`` for
    # ENCODER and DECODER self-attention); ``Attention`` refuses a bias otherwise.
    supports_position_bias = False
    # True once ``use_int8_dense`` was granted: prefill cross-attention's two
    # products run in int8 where this impl's dense kernel runs them.
    int8_dense = False

    def use_int8_dense(self) -> bool:
        """Ask for prefill cross-attention's q k^T and P v in int8 (the engine's
        ``quantization="int8"``); returns whether this impl has such a path and
        will take it. The default: no int8 path, False, nothing changes."""
        return False

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # (num_q_tokens, num_heads * head_size)
        key: torch.Tensor | None,  # (num_kv_tokens, num_kv_heads * head_size) or None in cross decode
        value: torch.Tensor | None,
        kv_cache: torch.Tensor | None,  # see module docstring; None for ENCODER
        attn_metadata: AttentionMetadata,
        attn_type: AttentionType | None = None,
    ) -> torch.Tensor:  # (num_q_tokens, num_heads * head_size)
        ...


class AttentionBackend(ABC):
    @staticmethod
    @abstractmethod
    def get_name() -> str: ...

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]: ...

    @staticmethod
    def get_metadata_cls() -> type[AttentionMetadata]:
        return AttentionMetadata

    @classmethod
    def make_metadata(cls, **fields_: Any) -> AttentionMetadata:
        return cls.get_metadata_cls()(**fields_)

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def swap_blocks(src: torch.Tensor, dst: torch.Tensor, src_to_dst: torch.Tensor) -> None:
        """Copy whole blocks between two caches of one layer (device <-> CPU swap)."""
        if src_to_dst.numel() == 0:
            return
        s = src_to_dst[:, 0].to(src.device)
        d = src_to_dst[:, 1].to(dst.device)
        # A device->CPU copy must finish before the CPU reads it: block there.
        dst[:, d] = src[:, s].to(dst.device, non_blocking=dst.device.type != "cpu")

    @staticmethod
    def copy_blocks(kv_caches: list[torch.Tensor], src_to_dst: torch.Tensor) -> None:
        """Copy-on-write copies within the device cache, every layer."""
        if src_to_dst.numel() == 0:
            return
        s = src_to_dst[:, 0].to(kv_caches[0].device)
        d = src_to_dst[:, 1].to(kv_caches[0].device)
        for cache in kv_caches:
            cache[:, d] = cache[:, s]


def write_to_cache(
    key: torch.Tensor,  # (n, num_kv_heads, head_size)
    value: torch.Tensor,
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_size)
    slot_mapping: torch.Tensor,  # (n,)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write ``key`` and ``value`` to their slots; return them as the cache now
    holds them, in their own dtype: themselves, or, in a narrower cache (a
    bfloat16 cache under float32 weights), rounded to it and widened back. Prefill
    attention reads what this returns, so a token attends to the same K/V whether
    they were just computed or read back from the cache (an encoder-cache hit, a
    recompute after preemption, every decode step)."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    out = []
    for i, x in enumerate((key, value)):
        narrow = x.to(flat.dtype)  # x itself, or its one rounding, shared by the cache and the caller
        if x.shape[0]:
            flat[i].index_copy_(0, slot_mapping, narrow)
        out.append(narrow if narrow.dtype == x.dtype else narrow.to(x.dtype))
    return out[0], out[1]


def cache_slots(block_tables: torch.Tensor, rows: torch.Tensor | int,
                positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot of token ``positions`` of the sequences in ``rows`` of
    ``block_tables`` (indices broadcast as in ``block_tables[rows, ...]``).
    With ``cache_slots_list`` (the same on host lists), the one place Python
    computes ``slot = block * block_size + offset``; the C kernels do the same
    in their own loops."""
    blocks = block_tables[rows, positions // block_size]
    return blocks * block_size + positions % block_size


def cache_slots_list(tables: list[list[int]], rows: list[int], positions: list[int],
                     block_size: int) -> list[int]:
    """``cache_slots`` on host lists: token i's slot, of the sequence whose table is
    ``tables[rows[i]]``, at position ``positions[i]``. For a step of a few tokens
    (a decode step) this is one comprehension where ``cache_slots`` is five
    tensor ops (measured: a one-row decode step's ``prepare`` spent a third of
    its time on them)."""
    return [tables[r][p // block_size] * block_size + p % block_size for r, p in zip(rows, positions)]


def packed_slots(block_tables: torch.Tensor, lens: list[int], block_size: int) -> torch.Tensor:
    """Cache slots of every sequence's first ``lens[i]`` tokens, packed back to back
    (row ``i`` of ``block_tables`` is sequence ``i``); int64, on the tables' device.

    Built from Python lengths, so no device sync."""
    device = block_tables.device
    total = sum(lens)
    lens_t = to_device(lens, torch.long, device)  # (B,)
    row = torch.repeat_interleave(torch.arange(len(lens), device=device), lens_t, output_size=total)
    starts = torch.cumsum(lens_t, 0) - lens_t  # (B,)
    pos = torch.arange(total, device=device) - starts[row]  # (total,) position inside its sequence
    return cache_slots(block_tables.to(torch.long), row, pos, block_size)
