"""A decode step with the same rows as the step before, packed from that step's
inputs instead of row by row.

Most steps of a busy engine decode the same sequences in the same order as the
step before (``SchedulerOutputs.same_rows``: nothing joined, left, was
preempted or moved). Each row is then one token further: its position and
length grow by one, its input is the token just appended, and its block
tables are the same lists, a few of them a block longer. Packing such a step
row by row (``DecoderRows.add_decodes``: ~0.6 us a row) and building its
tensors from Python lists was a fifth of a small model's step at 256 rows;
here it is a handful of tensor ops and one pass over the rows for their
tokens (vLLM V1's persistent batch does the same with its ``InputBatch``).
Only synchronous steps come here: with async scheduling the next step is
packed before this one's tokens exist.
"""
from __future__ import annotations

import operator
from typing import Any

import numpy as np
import torch

from encdec.attention.backends.abstract import AttentionBackend, cache_slots, cache_slots_list
from encdec.platform.device_tensors import array_to_device, padded_to_device, to_device
from encdec.sequence import SequenceData, SequenceGroupMetadata

_LAST_TOKEN = SequenceData.get_last_token_id


class PaddedTables:
    """The last step's padded block tables on the device, reused while a step's
    rows hold the same table objects and nothing wrote into a table in place
    (copy-on-write, swap-in): a decode step's tables grow one block per row
    every ``block_size`` tokens, cross tables never. Building them took ~0.1 ms
    a step at 256 rows; a step where some tables grew writes those rows into a
    copy (a copy: the last step may still read its tensor). The tables are
    held, so their ids are not reused while the cache compares against them."""

    def __init__(self) -> None:
        self._tables: list[list[int]] = []
        self._lens: list[int] = []
        self._tensor: torch.Tensor | None = None

    def get(self, tables: list[list[int]], device: torch.device, moved: bool) -> torch.Tensor:
        lens = list(map(len, tables))
        old = self._tensor
        if (moved or old is None or len(lens) != len(self._lens)
                or not all(map(operator.is_, tables, self._tables))):
            self._tensor = padded_to_device(tables, device)
        elif lens != self._lens:
            grown = [i for i, (a, b) in enumerate(zip(lens, self._lens)) if a != b]
            if max(lens[i] for i in grown) > old.shape[1]:
                self._tensor = padded_to_device(tables, device)
            else:
                rows = np.zeros((len(grown), old.shape[1]), dtype=np.int32)
                for j, i in enumerate(grown):
                    rows[j, :lens[i]] = tables[i]
                self._tensor = old.clone()
                self._tensor[to_device(grown, torch.long, device)] = array_to_device(rows, device)
        self._tables, self._lens = list(tables), lens
        return self._tensor


class SteadyDecode:
    """``remember`` a decode-only step's packed inputs; ``advance`` gives the
    next step's when its rows are the same, else None (pack it the usual way).
    ``host_slots_max``: up to this many rows the cache slots are computed on
    the host lists, as ``prepare`` does."""

    def __init__(self, backend: type[AttentionBackend], block_size: int, host_slots_max: int):
        self.backend = backend
        self.block_size = block_size
        self.host_slots_max = host_slots_max
        self._metas: list[SequenceGroupMetadata] | None = None
        self._state: dict[str, Any] = {}

    def forget(self) -> None:
        self._metas = None

    def remember(self, metas: list[SequenceGroupMetadata], seq_datas: list[SequenceData], rows: list,
                 positions: torch.Tensor, metadata: dict[str, Any]) -> None:
        """The decode-only step just packed: its metadata's rows (one per
        sequence), their data, sampled rows, positions and ``make_metadata``
        arguments."""
        self._metas = list(metas)
        self._state = dict(seq_datas=seq_datas, rows=rows, positions=positions, metadata=metadata,
                           table_rows=None)

    def advance(self, metas: list[SequenceGroupMetadata], device: torch.device,
                tables: Any) -> dict[str, Any] | None:
        """``ModelInput``'s input ids, positions, attention metadata and sampled
        rows, by name, of a step whose rows are the remembered step's, one token
        further; None if they are not. ``tables``: the runner's ``PaddedTables``
        of self tables."""
        last = self._metas
        if last is None or len(metas) != len(last) or not all(map(operator.is_, metas, last)):
            return None
        st = self._state
        k = dict(st["metadata"])
        pos = st["positions"] + 1
        seq_lens = [n + 1 for n in k["seq_lens"]]
        tokens = to_device(list(map(_LAST_TOKEN, st["seq_datas"])), torch.long, device)
        block_tables = tables.get(k["block_tables_list"], device, False)
        if len(seq_lens) <= self.host_slots_max:
            rows = range(len(seq_lens))
            slots = to_device(cache_slots_list(k["block_tables_list"], rows, [n - 1 for n in seq_lens],
                                               self.block_size), torch.long, device)
        else:
            if st["table_rows"] is None:
                st["table_rows"] = torch.arange(len(seq_lens), device=device)
            slots = cache_slots(block_tables.to(torch.long), st["table_rows"], pos, self.block_size)
        k.update(slot_mapping=slots, seq_lens=seq_lens, seq_lens_tensor=k["seq_lens_tensor"] + 1,
                 context_lens_tensor=k["seq_lens_tensor"], max_decode_seq_len=k["max_decode_seq_len"] + 1,
                 block_tables=block_tables)
        st["metadata"], st["positions"] = k, pos
        return dict(input_ids=tokens, positions=pos, attn_metadata=self.backend.make_metadata(**k),
                    sampled_rows=st["rows"])
