"""The ``draft_model`` method: a second model proposes each speculating row's
drafts, ``k`` greedy decode steps of its own before the target's step
verifies them (``draft_rows``), in the same engine.

Where its K/V lives. A *self-draft* (the target's own checkpoint, typically
int8 for a float32 target) has the target's layers, heads and head size, so
it reads and writes the target's paged cache through the target's block
tables: the positions before a row's last token hold the target's verified
K/V (better drafts than the draft's own would be, and nothing to keep in
step), the cross K/V is the target's (the draft never runs an encoder), and
what the draft writes at the row's newest positions (the scheduler's
lookahead slots) the target's verify step overwrites before anyone reads it.
Any other draft (another size or family with the same tokenizer) keeps its
own pool with the target's block ids (``own_cache``): it runs every step that
has prefills on the step's packed inputs (its own encoder included), mirrors
the cache's swaps and copies, and before proposing feeds the tokens it has no
K/V for yet (``_Fed``: a row whose drafts were all kept owes the last one).

On CPU, where the target's cache is float32, a self-draft reads and writes a
bfloat16 copy of its rows' K/V instead (``DraftKV``: half the bytes a draft
step streams); rows that do not fit in the copy draft from the target's cache.
On CPU a proposal whose rows feed one token each runs each draft step as one
C call where the model offers its parts (``draft_step.FusedDraft``: Whisper),
the general path's drafts (up to the final norm's rounding) without the model's forward.
A row stops drafting after it proposes one of its stop tokens: the target
either ends the sequence there or rejects that draft, so drafts past it are
never kept.

Only the rows' drafts depend on the draft model: the target decides every
kept token, so a draft's K/V that is stale (a block another request filled,
a swap the pool missed) costs acceptance, never exactness.
"""
from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import torch

from encdec.attention.backends.abstract import cache_slots_list
from encdec.platform.device_tensors import split_to_device, to_device
from encdec.sequence import SequenceGroupMetadata
from encdec.worker.draft_head import DraftHead, row_argmax
from encdec.worker.draft_kv import DraftKV
from encdec.worker.draft_step import FusedDraft
from encdec.worker.steady_decode import PaddedTables

# The most a self-draft's bfloat16 copy of its rows' K/V holds (DraftKV): tiny.en
# 12 MB a sequence of a 30-second window, base 23 MB.
DRAFT_KV_BYTES = 256 << 20


class DraftRow(NamedTuple):
    """A decoding sequence the step lets speculate: up to ``k`` drafts."""

    seq_id: int
    meta: SequenceGroupMetadata
    token_ids: list[int]  # its tokens so far (prompt + output); the last is this step's input
    k: int


class _Fed:
    """Own-pool drafts: per sequence, up to which position the draft's K/V
    is its tokens'. After a proposal, the tokens it fed past that are checked
    against what the sequence kept."""

    def __init__(self) -> None:
        self._valid: dict[int, int] = {}  # seq_id -> positions [0, n) hold its tokens' K/V
        self._fed: dict[int, tuple[int, list[int]]] = {}  # seq_id -> (first position, tokens fed there)

    def reset(self, seq_id: int, n: int) -> None:
        self._valid[seq_id] = n
        self._fed.pop(seq_id, None)

    def start(self, seq_id: int, token_ids: list[int]) -> int:
        """Positions whose K/V the draft holds for ``token_ids`` (all but the last at most)."""
        valid = self._valid.get(seq_id, 0)
        first, fed = self._fed.pop(seq_id, (valid, []))
        if first == valid:
            for tok in fed:
                if valid >= len(token_ids) - 1 or token_ids[valid] != tok:
                    break
                valid += 1
        valid = min(valid, len(token_ids) - 1)
        self._valid[seq_id] = valid
        return valid

    def fed(self, seq_id: int, first: int, tokens: list[int]) -> None:
        self._fed[seq_id] = (first, tokens)

    def forget(self, seq_ids: Any) -> None:
        for sid in seq_ids:
            self._valid.pop(sid, None)
            self._fed.pop(sid, None)


class _Tables(NamedTuple):
    """Where a proposal's rows read and write K/V: the target's (or an own
    pool's, same block ids) tables, or the bfloat16 copy's (``copy``)."""

    copy: DraftKV | None

    def self_table(self, r: DraftRow) -> list[int]:
        return r.meta.block_tables[r.seq_id] if self.copy is None else self.copy.self_table(r.seq_id)

    def cross_table(self, r: DraftRow) -> list[int]:
        return r.meta.cross_block_table if self.copy is None else self.copy.cross_table(r.seq_id)


def _stop_ids(meta: SequenceGroupMetadata) -> Any:
    """The tokens that end ``meta``'s sequences (its stop ids and eos, unless ignored)."""
    return getattr(meta.sampling_params, "all_stop_token_ids", None) or ()


class _StepInputs:
    """A draft step's packed inputs and metadata fields. The next step of the
    same rows, one token each at one position further, is this one advanced in
    place on CPU (``advance``: a few stores into the same tensors, no lists or
    tensors built, the tables' tensors kept: a proposal's blocks were all
    there before its first step)."""

    def __init__(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 fields: dict[str, Any], last: torch.Tensor | None):
        self.input_ids, self.positions, self.slots, self.fields = input_ids, positions, slots, fields
        self.last = last  # each row's last token among the step's; None: one token a row

    def advances_to(self, feeds: list[tuple[DraftRow, int, list[int]]]) -> bool:
        """Whether ``feeds`` are this step's rows one token further (live rows
        only leave, so the same count is the same rows)."""
        return self.last is None and self.input_ids.device.type == "cpu" and len(feeds) == self.input_ids.shape[0]

    def advance(self, tokens: list[int], backend: Any, block_size: int) -> Any:
        """The inputs one position further, with ``tokens`` as the rows'
        inputs, in place; returns the step's attention metadata."""
        f = self.fields
        f["seq_lens"] = seq_lens = [n + 1 for n in f["seq_lens"]]
        f["max_decode_seq_len"] += 1
        self.positions += 1
        f["seq_lens_tensor"] += 1
        f["context_lens_tensor"] += 1
        self.input_ids.numpy()[:] = tokens
        self.slots.numpy()[:] = cache_slots_list(f["block_tables_list"], range(len(tokens)),
                                                 [n - 1 for n in seq_lens], block_size)
        return backend.make_metadata(**f)


class DraftModel:
    """``model``: the draft, loaded (``Worker``); ``kv_caches``: the target's
    cache tensors (a self-draft) or the draft's own ``CacheEngine``
    (``own_cache``), with the target's block size and block ids;
    ``head_ids``: the token ids the draft's LM head keeps (``DraftHead``), None for all."""

    def __init__(self, model: torch.nn.Module, backend: Any, device: torch.device, block_size: int, *,
                 target_cache: Any, own_cache: Any = None, head_ids: list[int] | None = None,
                 copy_bytes: int = DRAFT_KV_BYTES):  # the most its K/V copy holds (CacheConfig.draft_kv_bytes)
        self.model, self.backend, self.device, self.block_size = model, backend, device, block_size
        self.head = DraftHead(model, head_ids) if head_ids is not None else None
        self.own_cache = own_cache
        self.cache = own_cache if own_cache is not None else target_cache
        self._fed = _Fed() if own_cache is not None else None
        self._tables, self._cross = PaddedTables(), PaddedTables()
        self._copy = (DraftKV(target_cache.gpu_cache, block_size, copy_bytes)
                      if own_cache is None and DraftKV.wanted(target_cache.gpu_cache) else None)
        self._copy_set = False  # its cross format chosen (_kv_copy)
        self._fused: FusedDraft | None | bool = False  # False: not looked for yet (_fused_draft)

    # -- proposing ---------------------------------------------------------------
    def propose_rows(self, rows: list[DraftRow], apply_static: Any = None) -> dict[int, list[int]]:
        """Each row's drafts: the draft's greedy tokens after its last, ``k`` of
        them, fewer after a stop token (its first step also feeds the tokens an
        own pool lacks). ``apply_static``: the processors' row-independent part
        (suppressed tokens), so drafts the target could never pick are not proposed."""
        starts = {r.seq_id: (self._fed.start(r.seq_id, r.token_ids) if self._fed else len(r.token_ids) - 1)
                  for r in rows}
        copy = self._kv_copy()
        kv = _Tables(copy if copy is not None and copy.prepare(rows) else None)
        stops = {r.seq_id: _stop_ids(r.meta) for r in rows}
        out = None
        if self._fused_draft() is not None and all(starts[r.seq_id] == len(r.token_ids) - 1 for r in rows):
            out = self._fused.propose(rows, kv.copy.caches if kv.copy is not None else self.cache.gpu_cache,
                                      [kv.self_table(r) for r in rows], [kv.cross_table(r) for r in rows],
                                      apply_static, stops, cross_i8=kv.copy is not None and kv.copy.cross_int8)
        if out is None:  # the general path reads no int8 records: the target's cache then
            out = self._stepped(rows, starts, kv if kv.copy is None or not kv.copy.cross_int8 else _Tables(None),
                                stops, apply_static)
        if self._fed:
            for r in rows:
                s, d = starts[r.seq_id], out[r.seq_id]
                self._fed.fed(r.seq_id, s, r.token_ids[s:] + d[:-1])
        return out

    def _kv_copy(self) -> DraftKV | None:
        """The K/V copy (``DraftKV``), its cross format chosen at the first
        proposal: int8 where the fused step reads it (``_fused_draft``), which
        is known once the model has run."""
        if self._copy is not None and not self._copy_set:
            self._copy.choose_cross_int8(self._fused_draft() is not None)
            self._copy_set = True
        return self._copy

    def _fused_draft(self) -> FusedDraft | None:
        """The proposals' C path (``draft_step``), taken at the first (a CPU
        model's fused weights are packed at its first step), or None."""
        if self._fused is False:
            self._fused = FusedDraft.build(self.model, self.head) if self.device.type == "cpu" else None
        return self._fused

    def _stepped(self, rows: list[DraftRow], starts: dict[int, int], kv: _Tables, stops: dict[int, Any],
                 apply_static: Any) -> dict[int, list[int]]:
        """The general path: each step through the model's forward and LM head."""
        out: dict[int, list[int]] = {r.seq_id: [] for r in rows}
        live = list(rows)
        step, inputs = 0, None
        while live:
            feeds = []
            for r in live:
                n = len(r.token_ids)
                if step == 0:
                    s = starts[r.seq_id]
                    feeds.append((r, s, r.token_ids[s:]))
                else:
                    feeds.append((r, n - 1 + step, [out[r.seq_id][-1]]))
            if inputs is not None and inputs.advances_to(feeds):
                md = inputs.advance([f[2][0] for f in feeds], self.backend, self.block_size)
            else:
                inputs, md = self._inputs(feeds, kv)
            tokens = self._greedy(inputs, md, apply_static, kv)
            for (r, _, _), tok in zip(feeds, tokens):
                out[r.seq_id].append(tok)
            step += 1
            live = [r for r in live if len(out[r.seq_id]) < r.k and out[r.seq_id][-1] not in stops[r.seq_id]]
        return out

    def _inputs(self, feeds: list[tuple[DraftRow, int, list[int]]], kv: _Tables) -> tuple[_StepInputs, Any]:
        """A draft step's inputs and attention metadata: each row's tokens
        ``feed`` at positions ``first ..`` (causal among themselves)."""
        tokens, positions, table_rows, seq_lens, q_lens, tables, cross, enc_lens = [], [], [], [], [], [], [], []
        for i, (r, first, feed) in enumerate(feeds):
            tokens += feed
            positions += range(first, first + len(feed))
            table_rows += [i] * len(feed)
            seq_lens.append(first + len(feed))
            q_lens.append(len(feed))
            tables.append(kv.self_table(r))
            cross.append(kv.cross_table(r))
            enc_lens.append(len(r.meta.encoder_seq_data.prompt_token_ids))
        dev = self.device
        slots = cache_slots_list(tables, table_rows, positions, self.block_size)
        input_ids, pos, slot_mapping = split_to_device([tokens, positions, slots], torch.long, dev)
        moved = kv.copy is None  # the target's tables change in place (copy-on-write, swap-in); the copy's only grow
        fields = decode_metadata_fields(
            seq_lens, q_lens, enc_lens, slot_mapping, self._tables.get(tables, dev, moved),
            self._cross.get(cross, dev, moved), tables, cross, self.block_size, dev)
        last = (None if len(tokens) == len(feeds)
                else to_device([e - 1 for e in itertools.accumulate(q_lens)], torch.long, dev))
        return _StepInputs(input_ids, pos, slot_mapping, fields, last), self.backend.make_metadata(**fields)

    def _greedy(self, inputs: _StepInputs, md: Any, apply_static: Any, kv: _Tables) -> list[int]:
        """One decode step of the draft: the argmax after each row's last token."""
        caches = kv.copy.caches if kv.copy is not None else self.cache.gpu_cache
        hidden = self.model(inputs.input_ids, inputs.positions, caches, md)
        if inputs.last is not None:
            hidden = hidden.index_select(0, inputs.last)
        if self.head is not None:
            return self.head.greedy(hidden, apply_static)
        logits = self.model.compute_logits(hidden).float()
        if apply_static is not None:
            logits = apply_static(logits)
        return row_argmax(logits)

    # -- an own pool: kept beside the target's ----------------------------------
    def move_blocks(self, sched: Any) -> None:
        """The scheduler's swaps and copies, on the draft's own pool too."""
        if self.own_cache is not None:
            self.own_cache.swap_out(sched.blocks_to_swap_out)
            self.own_cache.swap_in(sched.blocks_to_swap_in)
            self.own_cache.copy(sched.blocks_to_copy)

    def forget(self, seq_ids: Any) -> None:
        if self._fed is not None:
            self._fed.forget(seq_ids)
        if self._copy is not None:
            self._copy.forget(seq_ids)

    def mirror(self, parts: list[Any], metas: list[SequenceGroupMetadata]) -> None:
        """An own pool: run the draft on a step with prefills (``parts``: the
        target's packed inputs, whose encoder inputs the draft takes as they
        are: ``compat`` checked they mean the same to it), so its cross K/V
        and the prompts' K/V are in its pool; each prefilled sequence's
        tokens then have the draft's K/V. An encoder output computed
        elsewhere (an encoder worker) is the target's, not the draft's: those
        steps are left out (their rows' drafts read stale K/V: acceptance only)."""
        if self.own_cache is None or any("encoder_hidden" in p.encoder_inputs for p in parts):
            return
        for inp in parts[:1]:  # two parts: prefills, then decode rows a CUDA graph replays
            self.model(inp.input_ids, inp.positions, self.own_cache.gpu_cache, inp.attn_metadata,
                       **inp.encoder_inputs)
        for m in metas:
            if m.is_prompt:
                for sid, sd in m.seq_data.items():
                    self._fed.reset(sid, sd.get_len())


def decode_metadata_fields(seq_lens: list[int], q_lens: list[int], enc_lens: list[int], slot_mapping: torch.Tensor,
                           block_tables: torch.Tensor, cross_block_tables: torch.Tensor,
                           tables: list[list[int]], cross_tables: list[list[int]], block_size: int,
                           device: torch.device) -> dict[str, Any]:
    """The attention metadata's fields of a decode-only step whose sequences
    have ``q_lens`` query rows each (their newest positions, causal among
    themselves): what the runner's ``prepare`` fills for such a step."""
    seq_lens_t, context_t, enc_lens_t, zero = split_to_device(
        [seq_lens, [k - q for k, q in zip(seq_lens, q_lens)], enc_lens, [0]], torch.int32, device)
    return dict(
        num_prefills=0, num_prefill_tokens=0, num_decode_tokens=sum(q_lens), slot_mapping=slot_mapping,
        seq_lens=seq_lens, seq_lens_tensor=seq_lens_t, max_prefill_seq_len=0,
        max_decode_seq_len=max(seq_lens), max_query_len=1, query_start_loc=zero, seq_start_loc=zero,
        context_lens_tensor=context_t, block_tables=block_tables, encoder_seq_lens=enc_lens,
        encoder_seq_lens_tensor=enc_lens_t, encoder_seq_start_loc=zero, max_encoder_seq_len=max(enc_lens),
        num_encoder_tokens=0, cross_slot_mapping=torch.empty(0, dtype=torch.long, device=device),
        cross_block_tables=cross_block_tables, block_size=block_size, block_tables_list=tables,
        cross_block_tables_list=cross_tables, prefill_cross_cached=None,
        decode_query_lens=q_lens if any(q != 1 for q in q_lens) else None)

