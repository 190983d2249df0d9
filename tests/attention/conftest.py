"""Helpers for the attention tests: a block pool and AttentionMetadata built by hand,
field for field as the model runner builds it (see ``encdec.attention.backends.abstract``)."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from encdec.attention import AttentionBackend, AttentionMetadata

torch.set_num_threads(1)  # the machine's cores are shared


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockPool:
    """Hands out block numbers: the lowest free ones in order (tables that are one
    ascending run when allocated at once) or, when ``scattered``, random ones."""

    def __init__(self, num_blocks: int, *, scattered: bool, rng: random.Random):
        self.free = set(range(num_blocks))
        self.scattered = scattered
        self.rng = rng

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"block pool exhausted: want {n}, have {len(self.free)}")
        pool = sorted(self.free)
        blocks = self.rng.sample(pool, n) if self.scattered else pool[:n]
        self.free.difference_update(blocks)
        return blocks

    def release(self, blocks: list[int]) -> None:
        assert not self.free.intersection(blocks)
        self.free.update(blocks)


@dataclass
class SeqSpec:
    """One decoder sequence as a step sees it."""

    dec_len: int  # decoder tokens cached after this step (this step's included)
    enc_len: int  # its request's encoder tokens
    self_blocks: list[int] = field(default_factory=list)  # decoder self-attention block table
    cross_blocks: list[int] = field(default_factory=list)  # cross-attention block table

    def grow(self, pool: BlockPool, block_size: int) -> None:
        """Allocate blocks until the tables hold ``dec_len`` and ``enc_len`` tokens."""
        self.self_blocks += pool.allocate(cdiv(self.dec_len, block_size) - len(self.self_blocks))
        self.cross_blocks += pool.allocate(cdiv(self.enc_len, block_size) - len(self.cross_blocks))


def _slots(table: list[int], positions: range, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in positions]


def _prefix_sum(lens: list[int], device: torch.device | str) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def _table_tensor(tables: list[list[int]], device: torch.device | str) -> torch.Tensor:
    width = max([len(t) for t in tables] + [1])
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)


def make_attn_metadata(
    backend: type[AttentionBackend],
    *,
    prefills: list[SeqSpec],
    decodes: list[SeqSpec],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """A step of ``prefills`` (whole prompts, no cached context) then one token per
    decode sequence. Prefix sums run over the prefills only; per-sequence fields
    over all sequences, prefills first."""
    seqs = prefills + decodes
    q_lens = [s.dec_len for s in prefills]
    enc_prefill = [s.enc_len for s in prefills]
    slot_mapping = [x for s in prefills for x in _slots(s.self_blocks, range(s.dec_len), block_size)]
    slot_mapping += [x for s in decodes for x in _slots(s.self_blocks, range(s.dec_len - 1, s.dec_len), block_size)]
    cross_slots = [x for s in prefills for x in _slots(s.cross_blocks, range(s.enc_len), block_size)]
    seq_lens = [s.dec_len for s in seqs]
    enc_lens = [s.enc_len for s in seqs]
    tensor = lambda xs, dtype=torch.int32: torch.tensor(xs, dtype=dtype, device=device)  # noqa: E731
    return backend.make_metadata(
        num_prefills=len(prefills),
        num_prefill_tokens=sum(q_lens),
        num_decode_tokens=len(decodes),
        slot_mapping=tensor(slot_mapping, torch.long),
        seq_lens=seq_lens,
        seq_lens_tensor=tensor(seq_lens),
        max_prefill_seq_len=max(q_lens, default=0),
        max_decode_seq_len=max((s.dec_len for s in decodes), default=0),
        max_query_len=max(q_lens, default=1),
        query_start_loc=_prefix_sum(q_lens, device),
        seq_start_loc=_prefix_sum(q_lens, device),
        context_lens_tensor=tensor([0] * len(prefills) + [s.dec_len - 1 for s in decodes]),
        block_tables=_table_tensor([s.self_blocks for s in seqs], device),
        encoder_seq_lens=enc_lens,
        encoder_seq_lens_tensor=tensor(enc_lens),
        encoder_seq_start_loc=_prefix_sum(enc_prefill, device),
        max_encoder_seq_len=max(enc_lens, default=0),
        num_encoder_tokens=sum(enc_prefill),
        cross_slot_mapping=tensor(cross_slots, torch.long),
        cross_block_tables=_table_tensor([s.cross_blocks for s in seqs], device),
        block_size=block_size,
        block_tables_list=[list(s.self_blocks) for s in seqs],
        cross_block_tables_list=[list(s.cross_blocks) for s in seqs],
    )

