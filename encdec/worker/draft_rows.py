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

import torch

from encdec.sampling_params import SamplingType
from encdec.sequence import SequenceGroupMetadata
from encdec.spec_decode import NgramProposer
from encdec.worker.draft_model import DraftModel, DraftRow
from encdec.worker.prefill_rows import SampledRow


class DraftProposer:
    """Proposes each step's drafts: ``ngram`` (copied from the encoder input
    and the decoder's own tokens) or ``draft_model`` (a second model's greedy
    tokens: ``worker/draft_model.py``), for the rows no processor acts on."""

    def __init__(self, proposer: NgramProposer | DraftModel):
        self.proposer = proposer
        self.model = proposer if isinstance(proposer, DraftModel) else None

    def propose(self, metas: list[SequenceGroupMetadata], spec_rows: dict[int, int],
                input_batch: Any, max_rows: int | None = None) -> dict[int, list[int]]:
        """seq_id -> its drafts (at most ``spec_rows[seq_id]``), for the decode
        rows no processor acts on; rows with no match are left out.
        ``max_rows``: the most query rows the step's decode rows may take with
        their drafts (``row_budget``), or None."""
        if not spec_rows:
            return {}
        if max_rows is not None:
            spec_rows = row_budget(spec_rows, sum(len(m.seq_data) for m in metas if not m.is_prompt), max_rows)
            if not spec_rows:
                return {}
        procs, lookahead = input_batch.logitsprocs, max(spec_rows.values())
        blocked = procs.slots_changing_argmax(lookahead)  # greedy rows
        blocked_sampled = procs.slots_changing_probs(lookahead)  # and sampled ones
        if blocked is None:
            return {}
        slots = input_batch.req_id_to_index
        rows: list[DraftRow] = []
        for m in metas:
            if m.is_prompt:
                continue
            greedy = m.sampling_params.sampling_type is SamplingType.GREEDY
            for sid, sd in m.seq_data.items():
                k, slot = spec_rows.get(sid), slots.get(str(sid))
                if not k or slot in blocked or (not greedy and (blocked_sampled is None or slot in blocked_sampled)):
                    continue
                rows.append(DraftRow(sid, m, sd.get_token_ids(), k))
        if self.model is not None:
            return self.model.propose_rows(rows, procs.apply_static) if rows else {}
        out: dict[int, list[int]] = {}
        for r in rows:
            drafts = self.proposer.propose(r.meta.encoder_seq_data.prompt_token_ids, r.token_ids, r.k)
            if drafts:
                out[r.seq_id] = list(drafts)
        return out

    @property
    def mirrors_prefills(self) -> bool:
        """A draft model with its own pool: it runs the step's prefills on its own."""
        return self.model is not None and self.model.own_cache is not None

    def before_step(self, sched: Any) -> None:
        """A draft model's own pool follows the step's block moves and leaves."""
        if self.model is not None:
            self.model.move_blocks(sched)
            self.model.forget(sched.seq_ids_left)

    def after_forward(self, parts: list[Any], metas: list[SequenceGroupMetadata]) -> None:
        """A step with prefills: a draft model with its own pool runs them too."""
        if self.model is not None and metas and metas[0].is_prompt:
            self.model.mirror(parts, metas)


def row_budget(spec_rows: dict[int, int], num_rows: int, max_rows: int) -> dict[int, int]:
    """``spec_rows`` with each row's drafts cut so that ``num_rows`` decode rows
    and their drafts stay within ``max_rows`` query rows (an even share per
    speculating row; none where no row could take one). On a CPU the fused
    decode step runs at most ``decoder_step_cpu.MAX_ROWS`` rows; a step past
    it runs op by op, several times slower a row, so 64 rows at k = 5 cost
    more than the steps their drafts saved (measured: 0.81x against 0.94x at
    k = 3, which fits). Many rows also make a step compute-bound, where each
    draft row costs what a row of its own costs: fewer drafts per row as the
    batch grows is vLLM's practice too (``disable_by_batch_size``)."""
    share = (max_rows - num_rows) // max(1, len(spec_rows))
    if share <= 0:
        return {}
    if all(k <= share for k in spec_rows.values()):
        return spec_rows
    return {sid: min(k, share) for sid, k in spec_rows.items()}


def add_draft_decodes(dec: Any, metas: list[SequenceGroupMetadata], drafts: dict[int, list[int]],
                      ahead: Collection[int] = ()) -> None:
    """``DecoderRows.add_decodes`` for a step with drafts: each decoding
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


def accept(drafts: list[tuple[int, list[int]]], first: dict[int, int], targets: list[int],
           skip: Collection[int] = ()) -> tuple[dict[int, list[int]], int]:
    """Per speculating sequence the tokens it keeps: its drafts up to the first
    that differs from the target's token before it, then the target's token
    there (``first``: the sampled token of its first row; ``targets``: the
    greedy token of each draft row, in ``drafts`` order). Returns them and
    the number of drafts kept (as ``encdec.spec_decode.accept_greedy``, on
    host lists: a handful of rows). ``skip``: rows verified otherwise (sampled:
    ``verify_sampled``)."""
    out: dict[int, list[int]] = {}
    kept = pos = 0
    for sid, d in drafts:
        target = [first[sid], *targets[pos:pos + len(d)]]
        pos += len(d)
        if sid in skip:
            continue
        a = 0
        while a < len(d) and d[a] == target[a]:
            a += 1
        out[sid] = target[:a + 1]
        kept += a
    return out, kept


def verify_sampled(drafts: list[tuple[int, int, list[int]]], batch_row: dict[int, int], logits: torch.Tensor,
                   draft_logits: torch.Tensor, md: Any, generator: torch.Generator | None
                   ) -> tuple[dict[int, list[int]], int]:
    """The tokens each speculating row that samples randomly keeps: rejection
    sampling (``encdec.spec_decode.rejection_sample``, point-mass drafts) on
    the target's distributions at its first row and its draft rows, made as
    the sampler makes them (the processors as at each position: ``apply_at``, temperature,
    top-k, top-p; no processor acts on these rows), so the output keeps the
    target's distribution. ``batch_row``: seq_id -> its row of ``logits`` and
    of the sampling metadata ``md``; ``draft_logits``: the draft rows, in
    ``drafts`` order. Call before the sampler edits ``logits`` in place.
    Greedy rows are left out (``accept``). Returns the kept tokens and the
    number of drafts kept."""
    from encdec.sample.sampler import apply_top_k_top_p
    from encdec.spec_decode import rejection_sample

    if md.temperature is None:
        return {}, 0
    temps = md.temperature.tolist()
    picked, offset = [], 0
    for sid, _, d in drafts:
        r = batch_row[sid]
        if temps[r] >= 1e-5:  # the sampler's greedy threshold (_SAMPLING_EPS)
            picked.append((sid, r, d, offset))
        offset += len(d)
    if not picked:
        return {}, 0
    k_max, vocab = max(len(d) for _, _, d, _ in picked), logits.shape[-1]
    rows = torch.full((len(picked), k_max + 1, vocab), float("-inf"), dtype=torch.float32, device=logits.device)
    ids = torch.full((len(picked), k_max), -1, dtype=torch.long, device=logits.device)
    for b, (sid, r, d, off) in enumerate(picked):
        rows[b, 0] = logits[r]
        rows[b, 1:1 + len(d)] = draft_logits[off:off + len(d)]
        rows[b, 1 + len(d):, 0] = 0.0  # padding rows: any finite distribution (never read)
        ids[b, :len(d)] = torch.tensor(d, dtype=torch.long)
    index = torch.tensor([r for _, r, _, _ in picked], device=logits.device).repeat_interleave(k_max + 1)
    at = [(r, d[:j]) if j <= len(d) else (-1, ()) for _, r, d, _ in picked for j in range(k_max + 1)]  # -1: padding
    flat = md.logitsprocs.apply_at(rows.view(-1, vocab), [s for s, _ in at], [a for _, a in at])
    flat = flat / md.temperature[index].unsqueeze(1)
    flat = apply_top_k_top_p(flat, None if md.top_k is None else md.top_k[index],
                             None if md.top_p is None else md.top_p[index])
    probs = flat.softmax(dim=-1).view(len(picked), k_max + 1, vocab)
    gens = [md.generators.get(r, generator) for _, r, _, _ in picked]
    out, accepted = rejection_sample(probs, ids, [len(d) for _, _, d, _ in picked], generators=gens)
    kept = {}
    for b, (sid, _, _, _) in enumerate(picked):
        a = int(accepted[b])
        kept[sid] = out[b, :a + 1].tolist()
    return kept, int(accepted.sum())
