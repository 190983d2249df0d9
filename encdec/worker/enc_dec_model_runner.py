"""Scheduler output -> packed tensors -> model -> logits -> sampled tokens.

One forward per step covers every new request's encoder (one batched call)
and every decoder sequence, prefill and decode alike. The step's tokens are
packed without padding::

    input_ids:  [ prefill seq 0 tokens | prefill seq 1 tokens | d0 | d1 | d2 ]
    encoder:    [ request 0 encoder    | request 1 encoder    ]   (prefills only)

A prefill whose cross table already holds its encoder input's KV (the
encoder cache: ``cross_kv_cached``) adds no encoder tokens and no cross
writes; its cross-attention reads the table like a decode does.

Only the rows that are sampled (the last token of each prefill, every decode
token) go through the LM head. Logits rows are then put in the persistent
batch's order, which is what the logits processors index by.
"""
from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

from encdec.attention.backends.abstract import (AttentionBackend, cache_slots,
                                                cache_slots_list, packed_slots)
from encdec.core.scheduler_outputs import SchedulerOutputs
from encdec.kernels.cpu import decoder_step_cpu
from encdec.platform.cpu_threads import SMALL_STEP_ROWS, single_thread
from encdec.platform.device_tensors import split_to_device, to_device
from encdec.sample.beam_candidates import find_beam_rows
from encdec.sample.draft_logprobs import draft_logprobs
from encdec.sample.sampler import Sampler, greedy_tokens
from encdec.sampling_params import SamplingType
from encdec.sequence import SequenceGroupMetadata
from encdec.structured_output.bitmask import batch_bitmask
from encdec.worker.cache_engine import CacheEngine
from encdec.worker.input_batch import InputBatch
from encdec.worker.encoder_pieces import EncoderPieces, encoder_kwargs
from encdec.worker.prefill_rows import DecoderRows, EncoderRows, SampledRow, split_prompts
from encdec.worker.draft_rows import DraftProposer, add_draft_decodes, verify_sampled
from encdec.worker.steady_decode import PaddedTables, SteadyDecode
from encdec.worker.step_plan import (ModelInput, StepPlan, admits_as_decodes, one_thread_prefills,
                                     splits_admission)
from encdec.worker.step_output import AsyncModelRunnerOutput, asked_prompt_positions, prompt_token_logprobs


def _i32(values: list[int], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.int32, device)


# Steps of at most this many decoder tokens compute their cache slots on the host
# lists (cache_slots_list); longer ones (prefills) in tensor ops (cache_slots).
HOST_SLOTS_MAX_TOKENS = 64


def _prefix_sum(lens: list[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def _decoder_rows(metas: list[SequenceGroupMetadata], prompts: list[SequenceGroupMetadata],
                  prefills: list[SequenceGroupMetadata], drafts: dict[int, list[int]] | None,
                  ahead: Collection[int], admitted: bool) -> tuple[DecoderRows, int]:
    """The step's decoder rows (``prepare``) and how many tokens its prefills from token 0 take."""
    dec = DecoderRows()
    for m in prefills:
        dec.add_prefill(m)
    num_prefill_tokens = len(dec.tokens)
    for m in prompts[len(prefills):]:
        dec.add_cached_prefill(m)
    for m in metas if admitted else ():
        if m.is_prompt:
            dec.add_admitted(m)
    if admitted:  # every decode sequence's rows counted in decode_q, as with drafts
        add_draft_decodes(dec, [m for m in metas if not m.is_prompt], drafts or {}, ahead)
    elif drafts:
        add_draft_decodes(dec, metas[len(prompts):], drafts, ahead)
    else:
        dec.add_decodes(metas[len(prompts):], ahead)
    return dec, num_prefill_tokens


class EncoderDecoderModelRunner:
    def __init__(self, model: torch.nn.Module, backend: type[AttentionBackend], cache: CacheEngine,
                 input_batch: InputBatch, device: torch.device, *,
                 generator: torch.Generator | None = None):
        self.model = model
        self.backend = backend
        self.cache = cache
        self.input_batch = input_batch
        self.device = device
        self.block_size = cache.block_size
        self.sampler = Sampler(generator)  # generator: the engine's, for unseeded rows
        self.graphs: Any = None  # DecodeGraphs (worker/cuda_graphs.py) on CUDA: decode steps replayed
        self._last_order: tuple[list[int], list[int]] | None = None  # (rows' seq_ids, batch order) of the last step
        self._self_tables, self._cross_tables = PaddedTables(), PaddedTables()
        self._steady = SteadyDecode(backend, self.block_size, HOST_SLOTS_MAX_TOKENS)
        self.drafter: DraftProposer | None = None  # speculative decoding's (the worker sets it)
        # A step's decode rows with their drafts stay within the fused CPU decode step's rows
        # (``draft_rows.row_budget``); a GPU step has no such edge
        self._draft_rows_max = decoder_step_cpu.MAX_ROWS if device.type == "cpu" else None
        # The last step's (rows, batch order, gather index, seq_ids, logprobs wanted, any beam row)
        self._rows_of_last: tuple | None = None
        # request id -> its encoder output (enc_len, d_model), computed elsewhere (an encoder
        # worker: LLMEngine.add_processed_request); taken by its prefill, which then skips the encoder
        self.encoder_outputs: dict[str, torch.Tensor] = {}
        self._d_model = getattr(getattr(model, "config", None), "d_model", None)  # one_thread_prefills
        self.encoder_pieces = EncoderPieces(self.model, self.backend, self.device, self.encoder_outputs)

    # -- inputs --------------------------------------------------------------
    def prepare(self, metas: list[SequenceGroupMetadata], moved: bool = True,
                ahead: Collection[int] = (), same_rows: bool = False,
                drafts: dict[int, list[int]] | None = None, admitted: bool = False) -> ModelInput:
        """Pack the step's prefills and decodes (see the module docstring).
        ``moved``: whether this step copied or swapped blocks (tables changed in
        place); ``ahead``: see ``DecoderRows.add_decodes``; ``same_rows``: the
        scheduler's word that the step's rows are the last step's, one token
        further (``SteadyDecode``); ``drafts``: decoding sequences' draft tokens;
        ``admitted``: the metas' prefills packed as decode rows (``admits_as_decodes``)."""
        dev = self.device
        steady = self._steady.advance(metas, dev, self._self_tables) if same_rows and not (moved or ahead) else None
        if steady is not None:
            return ModelInput(**steady, encoder_inputs={}, owed=[])
        prompts, prefills = ([], []) if admitted else split_prompts(metas)
        dec, num_prefill_tokens = _decoder_rows(metas, prompts, prefills, drafts, ahead, admitted)
        enc = EncoderRows(prefills)
        q_start = _prefix_sum(dec.q_lens)
        e_start = _prefix_sum(enc.computed)
        block_tables = self._self_tables.get(dec.tables, dev, moved)
        cross_block_tables = self._cross_tables.get(dec.cross_tables, dev, moved)
        host_slots = len(dec.tokens) <= HOST_SLOTS_MAX_TOKENS
        longs = [dec.tokens, dec.positions]
        if host_slots:
            longs.append(cache_slots_list(dec.tables, dec.table_rows, dec.positions, self.block_size))
        input_ids, pos, *slots = split_to_device(longs, torch.long, dev)
        slot_mapping = slots[0] if host_slots else cache_slots(
            block_tables.to(torch.long), _i32(dec.table_rows, dev), pos, self.block_size)
        # Written at prefill only, by the prefills that run the encoder (a cached
        # prefill's length is 0 here, so it contributes no slots).
        cross_slot_mapping = (packed_slots(cross_block_tables[: len(prefills)], enc.computed, self.block_size)
                              if e_start[-1] else torch.empty(0, dtype=torch.long, device=dev))
        seq_lens, enc_lens, n = dec.seq_lens, dec.enc_lens, len(prefills)
        query_lens, contexts = dec.decode_query_lens(n)
        seq_lens_t, q_start_t, context_t, enc_lens_t, e_start_t = split_to_device(
            [seq_lens, q_start, contexts, enc_lens, e_start], torch.int32, dev)
        kw = dict(
            num_prefills=n,
            num_prefill_tokens=num_prefill_tokens,
            num_decode_tokens=len(dec.tokens) - num_prefill_tokens,
            slot_mapping=slot_mapping,
            seq_lens=seq_lens,
            seq_lens_tensor=seq_lens_t,
            max_prefill_seq_len=max(dec.q_lens, default=0),
            max_decode_seq_len=max(seq_lens[n:], default=0),
            max_query_len=max(dec.q_lens, default=1),
            query_start_loc=q_start_t,
            seq_start_loc=q_start_t,  # whole prompts, no cached context: the same offsets
            context_lens_tensor=context_t,
            block_tables=block_tables,
            encoder_seq_lens=enc_lens,
            encoder_seq_lens_tensor=enc_lens_t,
            encoder_seq_start_loc=e_start_t,
            max_encoder_seq_len=max(enc_lens, default=0),
            num_encoder_tokens=e_start[-1],
            cross_slot_mapping=cross_slot_mapping,
            cross_block_tables=cross_block_tables,
            block_size=self.block_size,
            block_tables_list=dec.tables,
            cross_block_tables_list=dec.cross_tables,
            prefill_cross_cached=([m.cross_kv_cached for m in prefills]
                                  if len(enc.tokens) < n else None),
            decode_query_lens=query_lens,
        )
        md = self.backend.make_metadata(**kw)
        if not prompts and not ahead:  # a decode-only step: the next one may be this one, one token further
            self._steady.remember(metas, [r.meta.seq_data[r.seq_id] for r in dec.rows], dec.rows, pos, kw)
        else:
            self._steady.forget()
        enc_kwargs = encoder_kwargs(self.model, self.backend, self.device, prompts, enc, self.encoder_outputs)
        return ModelInput(input_ids=input_ids, positions=pos, attn_metadata=md, encoder_inputs=enc_kwargs,
                          sampled_rows=dec.rows, owed=dec.owed, drafts=dec.drafts)

    # -- persistent batch ----------------------------------------------------
    def _update_batch(self, sched: SchedulerOutputs, rows: list[SampledRow]) -> list[int]:
        """Apply the scheduler's leaves and joins to the persistent batch; return,
        for each batch row, the index into ``rows``."""
        ib = self.input_batch
        for seq_id in sched.seq_ids_left:
            ib.remove_request(str(seq_id))
        if not rows:
            return []
        joined = set(sched.seq_ids_joined)
        if joined:
            for row in rows:
                if row.seq_id in joined:
                    sd = row.meta.seq_data[row.seq_id]
                    ib.add_request(str(row.seq_id), row.meta.sampling_params, sd.prompt_token_ids,
                                   sd.output_token_ids, seed_index=sd.sample_index)
        ib.condense()
        # Most steps run the same rows in the same order as the last: its order holds.
        key = [row.seq_id for row in rows]
        if self._last_order is not None and not joined and not sched.seq_ids_left and key == self._last_order[0]:
            return self._last_order[1]
        index = {str(row.seq_id): i for i, row in enumerate(rows)}
        order = [index[k] for k in ib.req_ids]
        self._last_order = (key, order)
        return order

    # -- step ----------------------------------------------------------------
    def execute(self, metas: list[SequenceGroupMetadata], sched: SchedulerOutputs) -> AsyncModelRunnerOutput:
        """One step, returned once its kernels are queued and before the first
        wait for them: ``get_output()`` waits (``encdec.worker.step_output``)."""
        return self.run(self.plan(metas, sched))

    @torch.inference_mode()
    def plan(self, metas: list[SequenceGroupMetadata], sched: SchedulerOutputs,
             ahead: Collection[int] = ()) -> StepPlan:
        """Pack the step on the host. With CUDA graphs a decode step replays its
        bucket's graph, and a step that also admits requests runs only its
        prefills eagerly and its decode rows through the graph, each part packed
        on its own: ``prepare`` packs prefills first, so the two concatenate into
        the whole step's layout (eagerly, those rows would pay every layer's
        launches again). Anything else (no graphs, CPU) runs the packed step
        eagerly (``small``: on one thread), except that on CPU a step admitting
        requests runs its decode rows apart (``_splits``). ``ahead``: sequences whose token of
        the step running now is not appended yet (async scheduling)."""
        self.encoder_pieces.run(sched.encoder.pieces)  # before any prefill reads their outputs
        n = sched.num_prefill_groups  # the scheduler puts prefills first
        # Small decode steps: one thread, except the LM head (see SMALL_STEP_ROWS).
        # A decode-only step batches one token per sequence: num_batched_tokens rows.
        small = self.device.type == "cpu" and n == 0 and sched.num_batched_tokens <= SMALL_STEP_ROWS
        graphs = self.graphs
        if self.drafter:  # a draft model reads and writes the cache: the step's moves first (no async here)
            self._move_blocks(sched)
        if not metas:
            return StepPlan(metas, sched, [], None, small, self.drafter is not None)
        drafts = (self.drafter.propose(metas, sched.spec_rows, self.input_batch, self._draft_rows_max)
                  if self.drafter else None)
        if self._splits(metas, n, drafts):
            admit = not ahead and self._admits(metas, n, drafts)  # the prefills' rows ride the C call too
            return StepPlan(metas, sched, [self.prepare(metas[:n], ahead=ahead),
                                           self.prepare(metas if admit else metas[n:], True, ahead, False, drafts,
                                                        admit)],
                            None, False, self.drafter is not None, admit)
        if drafts:  # several query rows per sequence: eager (graphs hold one row each)
            inp = self.prepare(metas, True, ahead, False, drafts)
            small = self.device.type == "cpu" and n == 0 and len(inp.input_ids) <= SMALL_STEP_ROWS
            return StepPlan(metas, sched, [inp], None, small, True)
        if graphs is not None and 0 < n < len(metas):
            dec = self.prepare(metas[n:], ahead=ahead)
            bucket = graphs.bucket(dec.attn_metadata, len(dec.input_ids))
            if bucket is not None:
                return StepPlan(metas, sched, [self.prepare(metas[:n], ahead=ahead), dec], bucket, small,
                                self.drafter is not None)
        # Tables changed in place: blocks copied or swapped in, or draft slots trimmed back and regrown.
        moved = bool(sched.blocks_to_copy or sched.blocks_to_swap_in or sched.tables_regrown)
        inp = self.prepare(metas, moved, ahead, sched.same_rows)
        bucket = graphs.bucket(inp.attn_metadata, len(inp.input_ids)) if graphs is not None else None
        if self.device.type == "cpu" and n == len(metas):  # prefills alone: small ones on one thread too
            small = one_thread_prefills(inp, self._d_model)
        return StepPlan(metas, sched, [inp], bucket, small, self.drafter is not None)

    def _splits(self, metas: list[SequenceGroupMetadata], n: int, drafts: dict[int, list[int]] | None) -> bool:
        return splits_admission(self.device, self.model, metas, n, drafts, decoder_step_cpu.MAX_ROWS)

    def _admits(self, metas: list[SequenceGroupMetadata], n: int, drafts: dict[int, list[int]] | None) -> bool:
        return (not (self.drafter and self.drafter.mirrors_prefills)
                and admits_as_decodes(self.model, metas, n, drafts, decoder_step_cpu.MAX_ROWS))

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> AsyncModelRunnerOutput:
        """Queue a planned step: block moves, owed input tokens, forward, sampling."""
        metas, sched, small = plan.metas, plan.sched, plan.small
        if not plan.blocks_moved:
            self._move_blocks(sched)
        if not metas:
            self._update_batch(sched, [])
            return AsyncModelRunnerOutput.empty()
        for part in plan.parts:
            part.fill_owed()
        rows, hidden = self._forward(plan)
        if self.drafter:
            self.drafter.after_forward(plan.parts, metas)
        if not rows:  # only prefill chunks before their last: K/V written, nothing sampled
            self._update_batch(sched, [])
            return AsyncModelRunnerOutput.empty()
        same = sched.same_rows and self._rows_of_last is not None and rows is self._rows_of_last[0]
        order = self._rows_of_last[1] if same else self._update_batch(sched, rows)
        sampling_md = self.input_batch.refresh_metadata()
        sampling_md.token_bitmask = batch_bitmask(sched.token_masks, self.input_batch.req_ids, self.device)
        # Prompt positions some prefills ask about ride in the same LM-head call
        # (a memory-bound read of the whole head: an extra row costs next to nothing).
        asked = asked_prompt_positions(metas)
        # drafts ride the last part (the decode rows), after the prefills' rows
        offset = plan.decode_offset
        drafts = plan.parts[-1].drafts
        if offset and drafts:
            drafts = [(sid, first + offset, d) for sid, first, d in drafts]
        if same:  # the last step's rows (SteadyDecode): its gather, ids and wants
            _, _, index, seq_ids, wanted, any_beam = self._rows_of_last
        else:
            index = to_device([rows[i].hidden_index for i in order] + [a.hidden_index for a in asked]
                              + [i for _, first, d in drafts for i in range(first, first + len(d))],
                              torch.long, self.device)
            seq_ids = [rows[i].seq_id for i in order]
            wanted = [rows[i].meta.sampling_params.logprobs for i in order]
            any_beam = any(m.sampling_params.sampling_type is SamplingType.BEAM for m in metas)
            self._rows_of_last = (rows, order, index, seq_ids, wanted, any_beam) if not (asked or drafts) else None
        all_logits = self.model.compute_logits(hidden.index_select(0, index))
        logits = all_logits[: len(order)]  # (num_rows, vocab), the sampled rows
        token_lps = prompt_token_logprobs(all_logits[len(order):len(order) + len(asked)], asked)
        spec = self._verify(drafts, seq_ids, logits, all_logits[len(order) + len(asked):], sampling_md)
        # Beam search: its groups' rows go to candidate selection, not sampling.
        beam = (find_beam_rows(metas, {rows[i].seq_id: r for r, i in enumerate(order)}, self.device)
                if any_beam else None)
        with single_thread(small):
            out = (self.sampler(logits, sampling_md, logprob_rows=beam.row_index) if beam
                   else self.sampler(logits, sampling_md))
        return AsyncModelRunnerOutput(self.model, self.device, metas, seq_ids, wanted, out, beam, hidden, token_lps,
                                      [(sid, d) for sid, _, d in drafts], *spec)

    def _verify(self, drafts: list, seq_ids: list[int], logits: torch.Tensor, draft_logits: torch.Tensor,
                md: Any) -> tuple:
        """Draft rows of a step (before the sampler edits ``logits``): the rows
        that sample randomly verified now (``verify_sampled``: their kept
        tokens, drafts kept), the greedy token of every draft row, for the
        greedy rows to keep theirs once the step's tokens are read
        (``draft_rows.accept``), and the log-probs of every speculating row's
        positions when some row asks them (``encdec.sample.draft_logprobs``).
        A draft row is scored through every processor as at its own position
        (``LogitsProcessors.apply_at``)."""
        if not drafts:
            return None, {}, 0, None
        batch_row = {sid: r for r, sid in enumerate(seq_ids)}
        lps = draft_logprobs(drafts, batch_row, logits, draft_logits, md)
        kept, num_kept = verify_sampled(drafts, batch_row, logits, draft_logits, md, self.sampler.generator)
        slots = [batch_row[sid] for sid, _, d in drafts for _ in d]
        ahead = [d[:j + 1] for _, _, d in drafts for j in range(len(d))]
        targets = greedy_tokens(self.input_batch.logitsprocs.apply_at(draft_logits.float(), slots, ahead))
        return targets, kept, num_kept, lps

    def _move_blocks(self, sched: SchedulerOutputs) -> None:
        self.cache.swap_out(sched.blocks_to_swap_out)
        self.cache.swap_in(sched.blocks_to_swap_in)
        self.cache.copy(sched.blocks_to_copy)
        if self.drafter:
            self.drafter.before_step(sched)

    def _eager(self, inp: ModelInput) -> torch.Tensor:
        return self.model(inp.input_ids, inp.positions, self.cache.gpu_cache, inp.attn_metadata,
                          **inp.encoder_inputs)

    def _forward(self, plan: StepPlan) -> tuple[list[SampledRow], torch.Tensor]:
        """The planned step's sampled rows and hidden states (see ``plan``)."""
        graphs, bucket = self.graphs, plan.bucket
        if len(plan.parts) == 2:
            pre, dec = plan.parts
            if plan.admitted:  # cross K/V first: the C call's prefill rows read it
                with single_thread(self.device.type == "cpu" and one_thread_prefills(pre, self._d_model)):
                    self.model.write_cross_kv(self.cache.gpu_cache, pre.attn_metadata, **pre.encoder_inputs)
                return dec.sampled_rows, self._eager(dec)
            offset = len(pre.input_ids)
            rows = pre.sampled_rows + [r._replace(hidden_index=r.hidden_index + offset) for r in dec.sampled_rows]
            tail = (self._eager(dec) if bucket is None
                    else graphs.replay(dec.input_ids, dec.positions, dec.attn_metadata, bucket))
            with single_thread(self.device.type == "cpu" and one_thread_prefills(pre, self._d_model)):
                head = self._eager(pre)
            return rows, torch.cat([head, tail])
        inp = plan.parts[0]
        if bucket is not None:
            return inp.sampled_rows, graphs.replay(inp.input_ids, inp.positions, inp.attn_metadata, bucket)
        with single_thread(plan.small):
            return inp.sampled_rows, self._eager(inp)
