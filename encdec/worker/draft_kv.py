"""A self-draft's own bfloat16 copy of the K/V its rows read (``DraftKV``).

Why: on CPU a self-draft's decode step of one row streams its int8 weights and
its row's cross K/V, ``k`` times a proposal, and the target's float32 cross
K/V were two thirds of those bytes (tiny.en: 18 MB of K/V over a 30-second
window beside 8 MB of weights). In bfloat16 they are half that, and one row's
weights and K/V (17 MB) can stay in the last-level cache from one draft step
to the next. The copy of a sequence is made where the draft first reads it:
its request's cross K/V once, and the self K/V of the positions the target
verified since the sequence's last proposal (a few slots a step). The draft
writes the K/V of its own newest positions here, never into the target's
cache::

    target cache (float32)                 the copy (bfloat16, blocks of its own)
    seq 7: self  [12, 40, 41]      ->      self  [0, 1, 2]   positions [0, valid) copied
           cross [3, 4, .., 96]    ->      cross [3', .., 96']  once

Where the fused C draft step reads the copy (``draft_step.FusedDraft``), its
cross blocks hold int8 records instead (``kernels.cpu.cross_i8``): half of
bfloat16's bytes again, the largest stream of a one-row draft step of
Whisper (``choose_cross_int8``, once, before any sequence is copied). The
general path reads no int8, so it drafts from the target's cache then.

Rules that must hold: only drafts read the copy (the target verifies every
token on its own cache), so a copy that rounds, or is stale (a sequence
recomputed after preemption), costs acceptance, never exactness. Its memory
is capped (``max_bytes``): per sequence, half the bytes the target's cache
holds for it; a proposal whose rows do not fit drafts from the target's
cache, as a self-draft without a copy does. The cap comes out of the
engine's KV budget (``kv_cache_memory``) beside the target's cache:
``copy_budget`` says how much, the worker sizes the target's cache from the
rest, so the two together never exceed it. No torch state outside the
copy's own tensors.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from encdec.attention.backends.abstract import cache_slots_list
from encdec.kernels.cpu import cross_i8, paged_attention_cpu


def copy_budget(kv_bytes: int, ceiling: int) -> int:
    """The bytes a self-draft's copy may take of a KV budget of ``kv_bytes``
    (where it ``pays``): a third, at most ``ceiling``; the target's cache gets
    the rest, so the two never exceed the budget. Why a third: bfloat16 is half
    of float32, so a third copies every block the other two thirds can hold;
    more could never be filled, less leaves rows drafting from the float32 cache."""
    return min(ceiling, kv_bytes // 3)


def budget_with_copy(target_bytes: int) -> int:
    """The budget whose ``copy_budget`` split leaves ``target_bytes`` (even) to the target."""
    return target_bytes + target_bytes // 2


class _Seq:
    """One sequence's blocks in the copy, in table order."""

    __slots__ = ("self_blocks", "cross_blocks", "valid")

    def __init__(self, cross_blocks: list[int]):
        self.self_blocks: list[int] = []
        self.cross_blocks = cross_blocks
        self.valid = 0  # positions [0, valid) hold the target's K/V, rounded


class DraftKV:
    """The copy: per layer (2, blocks, block_size, H, D) bfloat16, grown as
    sequences need blocks, up to ``max_bytes``. ``cross_int8``: its cross
    blocks hold int8 records (``kernels.cpu.cross_i8``: half the bytes a draft
    step streams; only the fused draft step reads them, ``draft_step.FusedDraft``),
    chosen before the first sequence (``choose_cross_int8``)."""

    def __init__(self, target_caches: list[torch.Tensor], block_size: int, max_bytes: int):
        self.target = target_caches
        self.block_size = block_size
        t = target_caches[0]
        self._block_shape = tuple(t.shape[2:])  # (block_size, H, D)
        self.cross_int8 = False
        block_bytes = 2 * len(target_caches) * t[0, 0].numel() * 2  # K and V, every layer, bfloat16
        self.max_blocks = max_bytes // block_bytes
        self.caches: list[torch.Tensor] = []
        self._free: list[int] = []
        self._seqs: dict[int, _Seq] = {}

    @staticmethod
    def wanted(target_caches: list[torch.Tensor]) -> bool:
        """A copy pays where the target's cache is float32 on CPU (a draft step
        streams it); a bfloat16 cache is already what the copy would be."""
        return bool(target_caches) and all(DraftKV.pays(c.device, c.dtype) for c in target_caches)

    @staticmethod
    def pays(device: torch.device, dtype: torch.dtype) -> bool:
        """Whether a target cache of ``dtype`` on ``device`` gets a copy (``wanted``)."""
        return torch.device(device).type == "cpu" and dtype == torch.float32

    def choose_cross_int8(self, wanted: bool) -> None:
        """Cross blocks as int8 records where ``wanted`` and a block holds its
        records (``cross_i8.fits``), else bfloat16; only before any sequence
        is copied (a copy in two formats could not be read)."""
        if self._seqs:
            raise RuntimeError("DraftKV.choose_cross_int8: sequences are already copied")
        self.cross_int8 = wanted and cross_i8.holds(*self._block_shape[1:], 2)  # the copy is bfloat16

    # -- the rows of a proposal ---------------------------------------------------
    def prepare(self, rows: list[Any]) -> bool:
        """Each row's K/V current in the copy, with blocks for the ``k``
        positions its draft steps write (``rows``: ``DraftRow``s); False,
        copying nothing more, where they do not all fit."""
        keep = {r.seq_id for r in rows}
        need = sum(self._blocks_short(r) for r in rows)
        if need > len(self._free):
            for sid in [s for s in self._seqs if s not in keep]:  # others first: they may never draft again
                self._release(sid)
        if need > len(self._free) and not self._grow(need):
            return False
        for r in rows:
            self._update(r)
        return True

    def self_table(self, seq_id: int) -> list[int]:
        return self._seqs[seq_id].self_blocks

    def cross_table(self, seq_id: int) -> list[int]:
        return self._seqs[seq_id].cross_blocks

    def forget(self, seq_ids: Any) -> None:
        for sid in seq_ids:
            self._release(sid)

    @property
    def blocks_used(self) -> int:
        return self._capacity() - len(self._free)

    # -- blocks ------------------------------------------------------------------------
    def _blocks_short(self, r: Any) -> int:
        """Blocks row ``r`` still lacks: its cross table's, and self blocks up to
        the last position its draft steps write (``len(token_ids) - 2 + k``)."""
        seq = self._seqs.get(r.seq_id)
        cross = len(r.meta.cross_block_table) if seq is None else 0
        have = 0 if seq is None else len(seq.self_blocks)
        return cross + max(0, -(-(len(r.token_ids) - 1 + r.k) // self.block_size) - have)

    def _grow(self, need: int) -> bool:
        """Room for ``need`` more blocks (capacity doubled, the blocks kept), or False."""
        used = self._capacity() - len(self._free)
        if used + need > self.max_blocks:
            return False
        cap = min(self.max_blocks, max(2 * self._capacity(), used + need))
        old = self.caches
        self.caches = [torch.empty(2, cap, *self._block_shape, dtype=torch.bfloat16) for _ in self.target]
        for new, prev in zip(self.caches, old):
            new[:, :prev.shape[1]] = prev
        self._free += range(self._capacity(old), cap)
        return True

    def _capacity(self, caches: list[torch.Tensor] | None = None) -> int:
        caches = self.caches if caches is None else caches
        return caches[0].shape[1] if caches else 0

    def _release(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self._free += seq.self_blocks + seq.cross_blocks

    def _take(self, n: int) -> list[int]:
        out, self._free = self._free[len(self._free) - n:], self._free[:len(self._free) - n]
        return out

    # -- copying -------------------------------------------------------------------------
    def _update(self, r: Any) -> None:
        """Row ``r``'s cross K/V (a new sequence) and its verified positions
        ``[valid, len(token_ids) - 1)`` copied; its self blocks grown."""
        seq = self._seqs.get(r.seq_id)
        if seq is None:
            cross = r.meta.cross_block_table
            seq = self._seqs[r.seq_id] = _Seq(self._take(len(cross)))
            if self.cross_int8:
                src, dst = torch.tensor(cross, dtype=torch.long), torch.tensor(seq.cross_blocks, dtype=torch.long)
                for t, c in zip(self.target, self.caches):
                    cross_i8.write_blocks(t, src, c, dst)
            else:
                self._copy_blocks(cross, seq.cross_blocks)
        short = -(-(len(r.token_ids) - 1 + r.k) // self.block_size) - len(seq.self_blocks)
        if short > 0:
            seq.self_blocks += self._take(short)
        end = len(r.token_ids) - 1  # the last token is this step's input: the target has no K/V for it yet
        if seq.valid < end:
            positions = list(range(seq.valid, end))
            src = cache_slots_list([r.meta.block_tables[r.seq_id]], [0] * len(positions), positions, self.block_size)
            dst = cache_slots_list([seq.self_blocks], [0] * len(positions), positions, self.block_size)
            self._copy_slots(src, dst)
        seq.valid = end

    def _copy_blocks(self, src: list[int], dst: list[int]) -> None:
        self._copy(src, dst, self._block_shape)

    def _copy_slots(self, src: list[int], dst: list[int]) -> None:
        self._copy(src, dst, self._block_shape[1:])

    def _copy(self, src: list[int], dst: list[int], unit: tuple[int, ...]) -> None:
        """Units (blocks or slots) ``src`` of every layer's target cache into
        ``dst`` of the copy, rounded: K units first, then V's, in one C pass
        (``round_units_bf16``), else torch's index_select and index_copy_
        (advanced indexing on dimension 1 ran ~50 ms a call on a pool of 3000 blocks)."""
        size = math.prod(unit)
        n_src, n_dst = self.target[0][0].numel() // size, self.caches[0][0].numel() // size  # units of K
        s = torch.tensor(src + [n_src + u for u in src], dtype=torch.long)
        d = torch.tensor(dst + [n_dst + u for u in dst], dtype=torch.long)
        for t, c in zip(self.target, self.caches):
            if paged_attention_cpu.round_units_bf16(t, c, s, d, size) is None:
                c.view(-1, *unit).index_copy_(0, d, t.view(-1, *unit).index_select(0, s).to(torch.bfloat16))
