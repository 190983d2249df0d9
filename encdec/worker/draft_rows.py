"""The model runner's side of speculative decoding: draft tokens proposed for
the rows the scheduler gave slots (``SchedulerOutputs.spec_rows``), packed as
extra query rows of their sequence, and verified after the step.

A speculating row carries its input token and ``m`` drafts: ``1 + m`` query
rows at positions ``n - 1 .. n - 1 + m``, causal among themselves (the
attention's ``decode_query_lens``), their K/V written to the slots the
scheduler gave. The first row is the row it would be without speculation: the
sampler samples it as usual. The others are scored greedily
(``greedy_tokens``), and the step keeps the drafts up to the first that
differs from the target's token there, plus the target's token at that point
(``accept``): exactly the tokens greedy decoding without drafts would give.
That holds only where no logits processor would change a position's argmax,
so a row some processor acts on gets no drafts
(``LogitsProcessors.slots_changing_argmax``).
"""
from __future__ import annotations

from collections.abc import Collection
from typing import Any

from encdec.sequence import SequenceGroupMetadata
from encdec.spec_decode import NgramProposer
from encdec.worker.prefill_rows import SampledRow


class DraftProposer:
    """Proposes each step's drafts (the ``ngram`` method: copied from the
    encoder input and the decoder's own tokens)."""

    def __init__(self, proposer: NgramProposer):
        self.proposer = proposer

    def propose(self, metas: list[SequenceGroupMetadata], spec_rows: dict[int, int],
                input_batch: Any) -> dict[int, list[int]]:
        """seq_id -> its drafts (at most ``spec_rows[seq_id]``), for the decode
        rows no processor acts on; rows with no match are left out."""
        if not spec_rows:
            return {}
        blocked = input_batch.logitsprocs.slots_changing_argmax(max(spec_rows.values()))
        if blocked is None:
            return {}
        slots = input_batch.req_id_to_index
        out: dict[int, list[int]] = {}
        for m in metas:
            if m.is_prompt:
                continue
            for sid, sd in m.seq_data.items():
                k = spec_rows.get(sid)
                if not k or slots.get(str(sid)) in blocked:
                    continue
                drafts = self.proposer.propose(m.encoder_seq_data.prompt_token_ids, sd.get_token_ids(), k)
                if drafts:
                    out[sid] = list(drafts)
        return out


def add_draft_decodes(dec: Any, metas: list[SequenceGroupMetadata], drafts: dict[int, list[int]],
                      ahead: Collection[int] = ()) -> None:
    """``_DecoderRows.add_decodes`` for a step with drafts: each decoding
    sequence's input token and its drafts (``dec.decode_q``: its query rows;
    ``dec.drafts``: (seq_id, index of its first draft row, drafts))."""
    for m in metas:
        enc_len = len(m.encoder_seq_data.prompt_token_ids)
        for sid, sd in m.seq_data.items():
            n = sd.get_len()
            if ahead and sid in ahead:
                raise ValueError("speculative decoding runs without async scheduling")
            d = drafts.get(sid, ())
            first = len(dec.tokens)
            dec.rows.append(SampledRow(sid, first, m))
            dec.table_rows.extend([len(dec.tables)] * (1 + len(d)))
            dec.tokens.append(sd.get_last_token_id())
            dec.tokens.extend(d)
            dec.positions.extend(range(n - 1, n + len(d)))
            dec.seq_lens.append(n + len(d))
            dec.tables.append(m.block_tables[sid])
            dec.enc_lens.append(enc_len)
            dec.cross_tables.append(m.cross_block_table)
            dec.decode_q.append(1 + len(d))
            if d:
                dec.drafts.append((sid, first + 1, list(d)))


def accept(drafts: list[tuple[int, list[int]]], first: dict[int, int],
           targets: list[int]) -> tuple[dict[int, list[int]], int]:
    """Per speculating sequence the tokens it keeps: its drafts up to the first
    that differs from the target's token before it, then the target's token
    there (``first``: the sampled token of its first row; ``targets``: the
    greedy token of each draft row, in ``drafts`` order). Returns them and
    the number of drafts kept (as ``encdec.spec_decode.accept_greedy``, on
    host lists: a handful of rows)."""
    out: dict[int, list[int]] = {}
    kept = pos = 0
    for sid, d in drafts:
        target = [first[sid], *targets[pos:pos + len(d)]]
        pos += len(d)
        a = 0
        while a < len(d) and d[a] == target[a]:
            a += 1
        out[sid] = target[:a + 1]
        kept += a
    return out, kept
