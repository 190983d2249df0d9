"""Decode query rows: a decode sequence may bring 1 + k query rows in a step
(speculative decoding verifies k draft tokens), its newest positions, causal
among themselves. This module turns the metadata's per-sequence fields into
per-row ones (``AttentionMetadata.decode_rows``), the form every kernel that
runs each row on its own reads, and checks ``decode_query_lens``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from encdec.platform.device_tensors import to_device

if TYPE_CHECKING:
    from encdec.attention.backends.abstract import AttentionMetadata


class DecodeRows(NamedTuple):
    """Decode attention inputs with one entry per query row, not per sequence:
    a kernel that runs each row on its own (the C paged kernels, a padded
    gather) reads a speculating sequence's rows as independent decode rows.

    Row j of a sequence of ``seq_len`` keys and ``q_len`` query rows sits at
    position ``seq_len - q_len + j`` and sees keys 0..that position: its self
    length is that + 1 (causal by length alone, since a row's keys are a
    prefix of its sequence's)::

        seq_len 7, q_len 3:   keys 0 1 2 3 4 5 6
            row 0 (pos 4)          x x x x x . .     self_lens 5
            row 1 (pos 5)          x x x x x x .               6
            row 2 (pos 6)          x x x x x x x               7

    Cross-attention rows see their request's whole encoder output. With one
    row per sequence these are the metadata's own tensors (no copy)."""

    self_tables: torch.Tensor  # (num_rows, max_blocks) int32, the row's sequence's self table
    self_lens: torch.Tensor  # (num_rows,) int32, keys the row sees (its position + 1)
    cross_tables: torch.Tensor  # (num_rows, max_cross_blocks) int32
    cross_lens: torch.Tensor  # (num_rows,) int32, its request's encoder length
    self_lens_list: list[int]  # host copy of self_lens
    seq_of_row: list[int] | None  # decode sequence (0-based among the decodes) of each row; None: row i is seq i


def check_decode_query_lens(query_lens: list[int], seq_lens: list[int], num_rows: int) -> None:
    """ValueError unless ``query_lens`` has one count >= 1 per decode sequence,
    none above its sequence's length, adding up to ``num_rows``."""
    if len(query_lens) != len(seq_lens):
        raise ValueError(f"decode_query_lens has {len(query_lens)} entries for {len(seq_lens)} decode sequences")
    for n, s in zip(query_lens, seq_lens):
        if not 1 <= n <= s:
            raise ValueError(f"decode_query_lens: each must be >= 1 and <= its seq_len, got {n} (seq_len {s})")
    if sum(query_lens) != num_rows:
        raise ValueError(f"decode_query_lens add up to {sum(query_lens)}, num_decode_tokens is {num_rows}")


def decode_rows(md: AttentionMetadata) -> DecodeRows:
    """``AttentionMetadata.decode_rows``: the decode sequences' tables and lengths
    repeated per query row, self lengths counted causally (``DecodeRows``)."""
    n = md.num_prefills
    seq_lens = md.seq_lens[n:]
    if md.decode_query_lens is None:
        return DecodeRows(md.block_tables[n:], md.seq_lens_tensor[n:], md.cross_block_tables[n:],
                          md.encoder_seq_lens_tensor[n:], seq_lens, None)
    q_lens = md.decode_query_lens
    seq_of_row = [i for i, q in enumerate(q_lens) for _ in range(q)]
    lens = [s - q + 1 + j for s, q in zip(seq_lens, q_lens) for j in range(q)]
    dev = md.seq_lens_tensor.device
    index = to_device(seq_of_row, torch.long, dev)
    return DecodeRows(md.block_tables[n:].index_select(0, index), to_device(lens, torch.int32, dev),
                      md.cross_block_tables[n:].index_select(0, index),
                      md.encoder_seq_lens_tensor[n:].index_select(0, index), lens, seq_of_row)
