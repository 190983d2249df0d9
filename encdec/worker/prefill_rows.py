"""The prefill side of packing a step (``EncoderDecoderModelRunner.prepare``):
each prefill's decoder tokens whole, or, past the leading tokens whose K/V
the prefix cache holds or an earlier chunk computed (chunked prefill), as
decode query rows over them (the attention's ``decode_query_lens``: causal
among themselves, reading the cache); and the encoder inputs of the prefills
that run the encoder. Those past computed tokens come after the prefills
that start at token 0 (the scheduler orders them so)::

    tokens:  [ prefills from token 0 | prefill rows past computed tokens | decode rows ]

A chunk that is not its prefill's last (``do_sample`` False) computes its
tokens' K/V and adds no sampled row. A first chunk runs its request's whole
encoder input: the cross K/V every decoder token attends to must exist before
the first one does, and an encoder pass cannot be split by tokens.
"""
from __future__ import annotations

from collections.abc import Collection
from typing import Any, NamedTuple

from encdec.sequence import SequenceGroupMetadata


class SampledRow(NamedTuple):
    """A decoder sequence sampled this step."""

    seq_id: int
    hidden_index: int  # row of the step's packed hidden states whose logits it samples from
    meta: SequenceGroupMetadata  # its group's scheduler metadata


def split_prompts(metas: list[SequenceGroupMetadata]) -> tuple[list[SequenceGroupMetadata],
                                                                 list[SequenceGroupMetadata]]:
    """The step's prefills, and those of them that start at token 0: the others
    (past prefix-cached tokens) come last (the scheduler admits them so) and run
    as decode rows (``PrefillRows.add_cached_prefill``)."""
    prompts = [m for m in metas if m.is_prompt]
    return prompts, [m for m in prompts if not next(iter(m.seq_data.values())).get_num_computed_tokens()]


class EncoderRows:
    """The encoder side of a step: what its prefills' encoder computes."""

    def __init__(self, prefills: list[SequenceGroupMetadata]):
        self.computed = [0 if m.cross_kv_cached else len(m.encoder_seq_data.prompt_token_ids)
                         for m in prefills]  # per prefill: encoder tokens computed this step (0: cached)
        run = [m for m in prefills if not m.cross_kv_cached]
        self.tokens = [m.encoder_seq_data.prompt_token_ids for m in run]  # of the prefills that run it
        self.features = [m.encoder_inputs for m in run]


class PrefillRows:
    """The decoder rows of a step (lists, one entry per token or per sequence)
    and the prefills' part of packing them; ``DecoderRows`` adds the decodes."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.positions: list[int] = []
        self.table_rows: list[int] = []  # per token: its sequence's row in the block tables
        self.seq_lens: list[int] = []
        self.q_lens: list[int] = []  # per prefill: tokens computed
        self.enc_lens: list[int] = []
        self.tables: list[list[int]] = []
        self.cross_tables: list[list[int]] = []
        self.rows: list[SampledRow] = []
        self.owed: list[tuple[int, Any]] = []  # (token index, sequence data) of rows scheduled ahead
        self.cached_q_lens: list[int] = []  # per prefill past cached tokens: its query rows

    def _add_table(self, m: SequenceGroupMetadata, seq_id: int, seq_len: int) -> None:
        self.seq_lens.append(seq_len)
        self.tables.append(m.block_tables[seq_id])
        self.enc_lens.append(len(m.encoder_seq_data.prompt_token_ids))
        self.cross_tables.append(m.cross_block_table)

    def add_prefill(self, m: SequenceGroupMetadata) -> None:
        # A group's sequences share their prompt (n > 1 forks it): compute it
        # once, through the first sequence, and sample every sequence from that
        # last hidden state. A first chunk: its first token_chunk_size tokens.
        sid0, sd = next(iter(m.seq_data.items()))
        ids = sd.get_token_ids()[: m.token_chunk_size]
        n = len(ids)
        self.table_rows += [len(self.tables)] * n
        self.tokens += ids
        self.positions += range(n)
        self.q_lens.append(n)
        self._add_table(m, sid0, n)
        self._add_rows(m)

    def _add_rows(self, m: SequenceGroupMetadata) -> None:
        """Every sequence of the prefill samples from its last token's row; none
        where it is a chunk before its last."""
        if m.do_sample:
            last = len(self.tokens) - 1
            self.rows += [SampledRow(sid, last, m) for sid in m.seq_data]

    def add_cached_prefill(self, m: SequenceGroupMetadata) -> None:
        """A prefill whose leading tokens' K/V the prefix cache holds or earlier
        chunks computed: its next ``token_chunk_size`` tokens as decode query
        rows over them (causal among themselves: the attention's
        ``decode_query_lens``), reading its cross K/V from the cache. Packed
        after the prefills from token 0, before the decodes."""
        sid0, sd = next(iter(m.seq_data.items()))
        ids = sd.get_token_ids()
        c = sd.get_num_computed_tokens()
        n = min(len(ids), c + m.token_chunk_size)
        if not m.cross_kv_cached or not 0 < c < n:
            raise RuntimeError(f"request {m.request_id}: a prefill past {c} computed of {len(ids)} tokens "
                               "needs its cross K/V cached and a token left to compute")
        self.table_rows += [len(self.tables)] * (n - c)
        self.tokens += ids[c:n]
        self.positions += range(c, n)
        self.cached_q_lens.append(n - c)
        self._add_table(m, sid0, n)
        self._add_rows(m)

    def decode_query_lens(self, num_prefills: int) -> tuple[list[int] | None, list[int]]:
        """Per decode sequence its query rows (None: one each) and, per sequence,
        the keys before its first query row (prefills: none)."""
        num_decodes = len(self.seq_lens) - num_prefills
        cached = self.cached_q_lens
        query_lens = cached + [1] * (num_decodes - len(cached)) if cached else None
        lens = query_lens or [1] * num_decodes
        return query_lens, [0] * num_prefills + [k - q for k, q in zip(self.seq_lens[num_prefills:], lens)]


class DecoderRows(PrefillRows):
    """The decoder side of a step, packed token by token: prefills whole (or
    past their cached tokens), then one token per decoding sequence (and its
    drafts: ``draft_rows.add_draft_decodes``)."""

    def __init__(self) -> None:
        super().__init__()
        self.decode_q: list[int] = []  # per decode sequence its query rows, where some carry drafts
        self.drafts: list[tuple[int, int, list[int]]] = []  # (seq_id, first draft row, drafts)

    def decode_query_lens(self, num_prefills: int) -> tuple[list[int] | None, list[int]]:
        if not self.decode_q:
            return super().decode_query_lens(num_prefills)
        lens = self.cached_q_lens + self.decode_q
        return lens, [0] * num_prefills + [k - q for k, q in zip(self.seq_lens[num_prefills:], lens)]

    def add_admitted(self, m: SequenceGroupMetadata) -> None:
        """A prefill packed as a decode sequence's query rows from position 0
        (``step_plan.admits_as_decodes``): its whole decoder prompt, causal among
        themselves (``decode_q``), sampled at its last token. Its rows sit where
        a prefill's would (packed first, whole), so prompt positions asked of
        it read the same hidden rows."""
        sid, sd = next(iter(m.seq_data.items()))
        ids = sd.get_token_ids()
        self.table_rows += [len(self.tables)] * len(ids)
        self.tokens += ids
        self.positions += range(len(ids))
        self.decode_q.append(len(ids))
        self._add_table(m, sid, len(ids))
        self._add_rows(m)

    def add_decodes(self, metas: list[SequenceGroupMetadata], ahead: Collection[int] = ()) -> None:
        """One token per decoding sequence. Every step runs this for every
        decoding row, so the lists are bound once here rather than looked up per row.
        ``ahead``: sequences whose token of the step running now is not appended
        yet: one position further, their input token owed."""
        rows, table_rows, tokens, positions = self.rows, self.table_rows, self.tokens, self.positions
        seq_lens, tables, enc_lens, cross_tables = self.seq_lens, self.tables, self.enc_lens, self.cross_tables
        for m in metas:
            enc_len = len(m.encoder_seq_data.prompt_token_ids)
            for sid, sd in m.seq_data.items():
                n = sd.get_len()
                if ahead and sid in ahead:
                    n += 1
                    self.owed.append((len(tokens), sd))
                rows.append(SampledRow(sid, len(tokens), m))
                table_rows.append(len(tables))
                tokens.append(sd.get_last_token_id())
                positions.append(n - 1)
                seq_lens.append(n)
                tables.append(m.block_tables[sid])
                enc_lens.append(enc_len)
                cross_tables.append(m.cross_block_table)
