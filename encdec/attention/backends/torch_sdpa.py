"""Torch SDPA backend: the CPU path and the reference the xFormers backend is tested against.

Prefill: each packed sequence attends only to itself (a per-sequence loop over
SDPA calls is exactly a block-diagonal mask, without materialising it); the
non-causal ones of 32+ queries (encoder self-attention) run the C dense kernel
(``encdec/kernels/cpu``) where it is built.
Decode: every query row (one per sequence, or 1 + k for a sequence verifying
k drafts, causal among themselves: ``AttentionMetadata.decode_rows``) runs the C
paged kernel as a row of its own; without the kernel, self-attention gathers
every row's cached keys into one padded tensor with one index op per layer and
one masked SDPA call; cross-attention reads each request's encoder keys as a
zero-copy slice of the cache when its cross blocks form one ascending run (the
block manager allocates them that way), and gathers them otherwise.
A ``PositionBias`` (T5) enters self-attention as SDPA's additive mask per
prefill sequence (``bias.prefill(n)``, the C dense kernel not used then); at
decode the C paged kernel takes one (H, max_len) row of it by distance
(``bias_tables.distance_table``), or, without the kernel, ``bias.decode(seq_lens, max_len)``
goes under the padding mask. Cross-attention never takes a bias.
"""
from __future__ import annotations

from functools import cached_property

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
from encdec.attention.bias_tables import distance_table, offset_table
from encdec.kernels.cpu import paged_attention_cpu
from encdec.kernels.cpu.dense_attention_cpu import dense_attention
from encdec.platform.cpu_threads import single_thread


def contiguous_start(table: list[int]) -> int:
    """First block of ``table`` if it is one ascending run of blocks, else -1."""
    if not table:
        return -1
    first = table[0]
    if table[-1] - first != len(table) - 1:
        return -1
    for i, b in enumerate(table):
        if b != first + i:
            return -1
    return first


class TorchSDPAMetadata(AttentionMetadata):
    """Adds index tensors derived once per step and shared by all layers."""

    @cached_property
    def prefill_bounds(self) -> list[tuple[int, int, int, int]]:
        """Per prefill sequence: (q_start, q_end, enc_start, enc_end)."""
        q = self.query_start_loc.tolist()
        e = self.encoder_seq_start_loc.tolist()
        if len(e) < len(q):  # a decoder-only step (no encoder tokens)
            e = [0] * len(q)
        return [(q[i], q[i + 1], e[i], e[i + 1]) for i in range(self.num_prefills)]

    @cached_property
    def decode_self_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(num_rows, max_len) cache slots of each decode query row's keys, and the
        (num_rows, 1, 1, max_len) mask of real (True) vs padding positions (or
        keys after a speculating row's position: ``decode_rows``)."""
        rows = self.decode_rows
        lens = rows.self_lens.to(torch.long)
        max_len = self.max_decode_seq_len
        pos = torch.arange(max_len, device=lens.device)
        blocks = rows.self_tables.to(torch.long)  # (num_rows, max_blocks)
        # Padding positions past a table's end read its last slot; masked below.
        in_table = pos.clamp(max=blocks.shape[1] * self.block_size - 1)
        index = torch.arange(blocks.shape[0], device=lens.device)[:, None]
        slots = cache_slots(blocks, index, in_table[None, :], self.block_size)  # (num_rows, max_len)
        mask = pos[None, :] < lens[:, None]
        slots = torch.where(mask, slots, torch.zeros_like(slots))
        return slots, mask[:, None, None, :]

    @cached_property
    def prefill_token_rows(self) -> torch.Tensor:
        """(num_prefill_tokens,) int64: each prefill token's sequence (its table row)."""
        q = self.query_start_loc[: self.num_prefills + 1].to(torch.long)
        return torch.repeat_interleave(torch.arange(self.num_prefills, device=q.device), q[1:] - q[:-1],
                                       output_size=self.num_prefill_tokens)

    @cached_property
    def prefill_self_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each prefill token as a paged query over its own prompt, causally:
        its sequence's self table row and its position + 1 (int32)."""
        rows = self.prefill_token_rows
        pos = torch.arange(self.num_prefill_tokens, device=rows.device) - self.query_start_loc.to(torch.long)[rows]
        return self.block_tables[rows].contiguous(), (pos + 1).to(torch.int32)

    @cached_property
    def prefill_cross_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each prefill token as a paged query over its request's encoder K/V:
        its cross table row and encoder length (int32)."""
        rows = self.prefill_token_rows
        return self.cross_block_tables[rows].contiguous(), self.encoder_seq_lens_tensor[rows].contiguous()

    @cached_property
    def cross_slices(self) -> list[tuple[int, int] | torch.Tensor]:
        """Per sequence of this view (decode, or prefill reading a cached cross
        table): (first_slot, length) of its encoder keys when they are
        contiguous in the cache, else the slot index tensor to gather."""
        tables = self.cross_block_tables_list
        if tables is None:
            tables = self.cross_block_tables.tolist()
        out: list[tuple[int, int] | torch.Tensor] = []
        for table, n in zip(tables, self.encoder_seq_lens):
            start = contiguous_start(table[: (n + self.block_size - 1) // self.block_size])
            if start >= 0:
                out.append((start * self.block_size, n))
            else:
                out.append(cache_slots(torch.tensor([table], dtype=torch.long), 0, torch.arange(n),
                                       self.block_size))
        return out


# The C dense kernel packs each head's keys once per call; below this many
# queries that costs more than it saves (measured: 25-35% faster than torch at
# 64-512 tokens, 20% slower for 2 queries over 300 keys).
_DENSE_MIN_QUERIES = 32


# Prefill loops whose every call is at most this many multiply-adds (queries x
# keys x heads x head size) run on one thread: torch's SDPA splits even a
# 2-query call over the threads, a parallel region that costs more than the
# work (and, with another process on a core, waits out its time slice).
_ONE_THREAD_MACS = 1 << 20


def _paged_prefill(md: AttentionMetadata, kv_cache: torch.Tensor | None, q: torch.Tensor, *, cross: bool) -> bool:
    """Whether a step's prefill queries run as paged queries over the cache (one
    C call, ``TorchSDPAImpl._decode_c``) in place of one SDPA call per sequence:
    the C kernel runs here, every prompt is short (fewer than
    ``_DENSE_MIN_QUERIES`` queries) and holds no earlier context (its keys start
    at slot 0 of its table), and the tables cover the lengths they are read to;
    cross-attention, where every sequence's call is small (``_ONE_THREAD_MACS``):
    each paged query reads its keys on its own, where SDPA reads them once for
    the sequence's queries (Whisper's 4-token prompts over 1500 frames: 10-35%
    slower paged). The K/V are in the cache already (written before, as SDPA's were)."""
    if not md.num_prefills or kv_cache is None or not _use_c_kernel(kv_cache, q):
        return False
    bounds = md.prefill_bounds
    if any(qe - qs >= _DENSE_MIN_QUERIES for qs, qe, _, _ in bounds):
        return False
    if cross:
        keys = max(md.encoder_seq_lens[: md.num_prefills])
        queries = max(qe - qs for qs, qe, _, _ in bounds)
        return (queries * keys * q.shape[1] * q.shape[2] <= _ONE_THREAD_MACS
                and md.cross_block_tables.shape[1] * md.block_size >= keys)
    return (all(n == qe - qs for n, (qs, qe, _, _) in zip(md.seq_lens, bounds))
            and md.block_tables.shape[1] * md.block_size >= max(qe - qs for qs, qe, _, _ in bounds))


def _one_thread(bounds: list[tuple[int, int, int, int]], width: int, device: torch.device) -> bool:
    """Whether a prefill loop over ``bounds`` (``prefill_bounds``) of heads x head
    size ``width`` runs on one thread (``_ONE_THREAD_MACS``): CPU, every call small."""
    if device.type != "cpu" or not bounds:
        return False
    q = max(qe - qs for qs, qe, _, _ in bounds)
    k = max(max(ee - es for _, _, es, ee in bounds), q)
    return q * k * width <= _ONE_THREAD_MACS


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
          causal: bool = False, mask: torch.Tensor | None = None, int8: bool = False) -> torch.Tensor:
    """q: (..., Lq, H, D), k/v: (..., Lk, H, D) -> (..., Lq, H, D). ``int8``: the
    dense C kernel's int8 products, where it runs (``TorchSDPAImpl.use_int8_dense``)."""
    if q.dim() == 3:
        # A batch dim of 1: on CPU, 3-D inputs miss the flash kernel (measured 2.7x
        # slower at 300 tokens, 3.2x at 512), and so does a 3-D mask beside 4-D
        # inputs (T5's (H, n, n) bias, 12 heads of 64 at 272 tokens: 3.65 vs 1.36 ms).
        return _sdpa(q[None], k[None], v[None], scale, causal=causal,
                     mask=mask if mask is None or mask.dim() == 4 else mask[None], int8=int8)[0]
    if not causal and mask is None and q.shape[-3] >= _DENSE_MIN_QUERIES:
        out = dense_attention(q, k, v, scale, int8=int8)  # None where the C kernel cannot run it
        if out is not None:
            return out
    out = F.scaled_dot_product_attention(
        q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2),
        attn_mask=mask, is_causal=causal, scale=scale,
        enable_gqa=k.shape[-2] != q.shape[-2],
    )
    return out.transpose(-3, -2)


def _cross_kv(flat: torch.Tensor, sl: tuple[int, int] | torch.Tensor,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's cached encoder keys and values from ``flat`` (2, slots, Hk, D)
    in the queries' ``dtype`` (a bfloat16 cache under float32 weights is widened):
    a zero-copy slice for a contiguous run of the same dtype, else a gather
    (see ``cross_slices``)."""
    if isinstance(sl, tuple):
        k, v = flat[0, sl[0]: sl[0] + sl[1]], flat[1, sl[0]: sl[0] + sl[1]]
    else:
        k, v = flat[0][sl], flat[1][sl]
    return k.to(dtype), v.to(dtype)


def _encoder_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  pb: PositionBias | None) -> torch.Tensor:
    """One sequence's encoder self-attention, (n, H, D) each. With a bias: the
    C dense kernel reads it by offset (its header has the measurement), torch's
    SDPA takes the (H, n, n) matrix where the kernel cannot run."""
    n = q.shape[0]
    if pb is not None and n >= _DENSE_MIN_QUERIES:
        out = dense_attention(q[None], k[None], v[None], scale, offset_bias=offset_table(pb, n))
        if out is not None:
            return out[0]
    return _sdpa(q, k, v, scale, mask=None if pb is None else pb.prefill(n).to(q.dtype))


def _write_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``write_to_cache``; a bfloat16 cache under float32 weights in one C pass per
    tensor where the kernel runs (``paged_attention_cpu.write_bf16``), same values."""
    if k.shape[0] and kv_cache.dtype == torch.bfloat16 and k.dtype == torch.float32:
        kw = paged_attention_cpu.write_bf16(k, kv_cache[0], slots)
        vw = paged_attention_cpu.write_bf16(v, kv_cache[1], slots) if kw is not None else None
        if vw is not None:
            return kw, vw
    return write_to_cache(k, v, kv_cache, slots)


def _use_c_kernel(kv_cache: torch.Tensor, q: torch.Tensor) -> bool:
    """float32 queries over a float32 or bfloat16 CPU cache (paged_attention_cpu)."""
    return (q.dtype == torch.float32 and paged_attention_cpu.cache_ok(kv_cache)
            and paged_attention_cpu.available())


class TorchSDPAImpl(AttentionImpl):
    supports_position_bias = True

    def use_int8_dense(self) -> bool:
        """Granted: prefill cross-attention's sequences that take the dense C kernel
        run its int8 products (``dense_attention_cpu``'s ``int8``; the kernel runs
        float32 where this CPU lacks their VNNI)."""
        self.int8_dense = True
        return True

    def _decode_c(self, q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor,
                  lens: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Paged decode without copying KV (see encdec/kernels/cpu)."""
        return paged_attention_cpu.paged_decode_attention(q, kv_cache[0], kv_cache[1], tables, lens, self.scale,
                                                          position_bias=bias)

    def _paged_prefill_into(self, out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor | None,
                            md: TorchSDPAMetadata, *, cross: bool) -> bool:
        """The prefill rows of ``out`` as paged queries over the cache
        (``_paged_prefill``); False, nothing done, where that does not apply."""
        if not _paged_prefill(md, kv_cache, q, cross=cross):
            return False
        n = md.num_prefill_tokens
        paged = self._decode_c(q[:n], kv_cache, *(md.prefill_cross_tables if cross else md.prefill_self_tables))
        if paged is not None:
            out[:n] = paged
        return paged is not None

    def forward(self, query, key, value, kv_cache, attn_metadata, attn_type=None,
                position_bias: PositionBias | None = None):
        attn_type = attn_type or self.attn_type
        pb = position_bias
        md = attn_metadata
        H, Hk, D = self.num_heads, self.num_kv_heads, self.head_size
        q = query.view(-1, H, D)  # (num_tokens, H, D)
        k = key.view(-1, Hk, D) if key is not None else None
        v = value.view(-1, Hk, D) if value is not None else None
        out = torch.empty_like(q)

        small = _one_thread(md.prefill_bounds, H * D, q.device)
        if attn_type == AttentionType.ENCODER:
            # Encoder tokens of the prefill requests, packed by encoder_seq_start_loc
            # (none for a prefill whose cross KV is cached).
            small = small and _one_thread([(s, e, s, e) for _, _, s, e in md.prefill_bounds], H * D, q.device)
            with single_thread(small):
                for _, _, s, e in md.prefill_bounds:
                    if e > s:
                        out[s:e] = _encoder_sdpa(q[s:e], k[s:e], v[s:e], self.scale, pb)
            return out.view(-1, H * D)

        if attn_type == AttentionType.DECODER:
            if kv_cache is not None:
                k, v = _write_cache(k, v, kv_cache, md.slot_mapping)
            paged = pb is None and self._paged_prefill_into(out, q, kv_cache, md, cross=False)
            with single_thread(small):
                for qs, qe, _, _ in md.prefill_bounds if not paged else ():
                    if pb is None:
                        out[qs:qe] = _sdpa(q[qs:qe], k[qs:qe], v[qs:qe], self.scale, causal=True)
                    else:
                        mask = pb.prefill(qe - qs, causal=True).to(q.dtype)
                        out[qs:qe] = _sdpa(q[qs:qe], k[qs:qe], v[qs:qe], self.scale, mask=mask)
            dmd = md.decode_metadata
            if dmd is not None:
                self._decode_self(out[md.num_prefill_tokens:], q[md.num_prefill_tokens:], kv_cache, dmd, pb)
            return out.view(-1, H * D)

        # ENCODER_DECODER: prefill queries attend to their own request's encoder
        # tokens (given as key/value, written to the cache once); decode queries,
        # and prefills whose cross KV is cached, read the cache. Writes come
        # first: a cached prefill may read what another prefill writes now.
        cached = md.prefill_cross_cached or [False] * md.num_prefills
        if k is None and not all(cached):
            raise ValueError("cross-attention prefill needs the encoder's key/value")
        if k is not None and md.num_encoder_tokens:
            k, v = _write_cache(k, v, kv_cache, md.cross_slot_mapping)
        flat = kv_cache.view(2, -1, Hk, D) if any(cached) else None
        # int8_dense: Whisper's sequential prefill (the previous text, ~225 queries
        # over 1500 keys) 48 -> 39 ms a window, tiny.en int8 (AVX512-VNNI, 2 threads).
        paged = self._paged_prefill_into(out, q, kv_cache, md, cross=True)
        with single_thread(small and not any(cached)):  # a cached one's keys: not in prefill_bounds
            for i, (qs, qe, es, ee) in enumerate(md.prefill_bounds if not paged else ()):
                if cached[i]:
                    kc, vc = _cross_kv(flat, md.prefill_metadata.cross_slices[i], q.dtype)
                    out[qs:qe] = _sdpa(q[qs:qe], kc, vc, self.scale, int8=self.int8_dense)
                else:
                    out[qs:qe] = _sdpa(q[qs:qe], k[es:ee], v[es:ee], self.scale, int8=self.int8_dense)
        dmd = md.decode_metadata
        if dmd is not None and _use_c_kernel(kv_cache, q):
            rows = dmd.decode_rows
            out[md.num_prefill_tokens:] = self._decode_c(
                q[md.num_prefill_tokens:], kv_cache, rows.cross_tables, rows.cross_lens)
        elif dmd is not None:
            flat = kv_cache.view(2, -1, Hk, D)
            base, starts = md.num_prefill_tokens, dmd.decode_query_start
            for i, sl in enumerate(dmd.cross_slices):  # a sequence's rows at once: cross is not causal
                kc, vc = _cross_kv(flat, sl, q.dtype)
                a, b = base + starts[i], base + starts[i + 1]
                out[a:b] = _sdpa(q[a:b], kc, vc, self.scale)
        return out.view(-1, H * D)

    def _decode_self(self, out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor,
                     dmd: TorchSDPAMetadata, pb: PositionBias | None) -> None:
        """Decode self-attention of every query row (``decode_rows``: a speculating
        sequence's rows are causal by their lengths) into ``out``: the C paged
        kernel, or one gather and one masked SDPA call."""
        rows = dmd.decode_rows
        if _use_c_kernel(kv_cache, q):
            table = None if pb is None else distance_table(pb, dmd.max_decode_seq_len)
            out[:] = self._decode_c(q, kv_cache, rows.self_tables, rows.self_lens, table)
            return
        slots, mask = dmd.decode_self_index
        flat = kv_cache.view(2, -1, self.num_kv_heads, self.head_size)
        kd, vd = flat[0][slots].to(q.dtype), flat[1][slots].to(q.dtype)  # (R, L, Hk, D)
        if pb is not None:  # (R, H, 1, L): the rows' bias where real, -inf on padding
            bias = pb.decode(rows.self_lens_list, kd.shape[1]).to(q.dtype)[:, :, None, :]
            mask = torch.where(mask, bias, torch.full_like(bias, float("-inf")))
        out[:] = _sdpa(q[:, None], kd, vd, self.scale, mask=mask)[:, 0]


class TorchSDPABackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "torch_sdpa"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TorchSDPAImpl

    @staticmethod
    def get_metadata_cls() -> type[AttentionMetadata]:
        return TorchSDPAMetadata
