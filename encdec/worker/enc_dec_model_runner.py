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

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from encdec.attention.backends.abstract import AttentionBackend, AttentionMetadata, cache_slots, packed_slots
from encdec.beam_search.candidates import BeamCandidates, find_beam_rows, select_candidates
from encdec.cpu_threads import SMALL_STEP_ROWS, single_thread
from encdec.sample.sampler import Sampler, compute_prompt_logprobs
from encdec.sequence import Logprob, SequenceGroupMetadata
from encdec.worker.cache_engine import CacheEngine
from encdec.worker.input_batch import InputBatch


@dataclass
class SampledToken:
    seq_id: int
    token_id: int
    logprobs: dict[int, Logprob] = field(default_factory=dict)  # empty unless asked


@dataclass
class ModelRunnerOutput:
    samples: list[SampledToken]  # one per sampled decoder sequence
    prompt_logprobs: dict[str, list[dict[int, Logprob] | None]] = field(default_factory=dict)
    # request_id -> {prompt position: {token id: raw log-prob}} (SamplingParams.prompt_token_logprobs)
    prompt_token_logprobs: dict[str, dict[int, dict[int, float]]] = field(default_factory=dict)
    # beam groups (no samples): request_id -> the top continuations over its beams
    beam_candidates: dict[str, BeamCandidates] = field(default_factory=dict)


class AskedPosition(NamedTuple):
    """A decoder-prompt position a prefill asks raw log-probs at (SamplingParams.prompt_token_logprobs)."""

    request_id: str
    position: int  # as the request named it (may be negative)
    hidden_index: int  # its row in the step's packed hidden states
    token_ids: list[int]


def _prefill_spans(metas: list[SequenceGroupMetadata]) -> Iterator[tuple[SequenceGroupMetadata, Any, int]]:
    """(meta, its first sequence's data, its first row in the step's hidden
    states) per prefill: ``prepare`` packs them first, in order, each whole."""
    start = 0
    for m in metas:
        if not m.is_prompt:
            break
        sd = next(iter(m.seq_data.values()))
        yield m, sd, start
        start += sd.get_len()


def _asked_prompt_positions(metas: list[SequenceGroupMetadata]) -> list[AskedPosition]:
    out: list[AskedPosition] = []
    for m, sd, start in _prefill_spans(metas):
        asked = m.sampling_params.prompt_token_logprobs
        if asked and sd.get_output_len() == 0:  # not again after a recompute
            n = sd.get_prompt_len()
            out += [AskedPosition(m.request_id, p, start + p % n, ids) for p, ids in asked.items()]
    return out


def _prompt_token_logprobs(logits: torch.Tensor,
                           asked: list[AskedPosition]) -> dict[str, dict[int, dict[int, float]]]:
    """Raw log-softmax of each asked row (no processor has touched these rows)."""
    out: dict[str, dict[int, dict[int, float]]] = {}
    if not asked:
        return out
    lps = logits.log_softmax(dim=-1, dtype=torch.float32)
    for row, a in enumerate(asked):
        vals = lps[row, a.token_ids].tolist()
        out.setdefault(a.request_id, {})[a.position] = dict(zip(a.token_ids, vals))
    return out


class SampledRow(NamedTuple):
    """A decoder sequence sampled this step."""

    seq_id: int
    hidden_index: int  # row of the step's packed hidden states whose logits it samples from
    meta: SequenceGroupMetadata  # its group's scheduler metadata


@dataclass
class ModelInput:
    """One step's packed model inputs, built by ``prepare`` (scheduler -> model)."""

    input_ids: torch.Tensor  # (num_tokens,) int64 decoder tokens: prefill sequences', then one per decode
    positions: torch.Tensor  # (num_tokens,) int64 decoder position of each token
    attn_metadata: AttentionMetadata  # where each sequence's tokens and KV live; shared by all layers
    encoder_inputs: dict[str, Any]  # keyword args of the model's encoder for the step's prefills; {} if none
    sampled_rows: list[SampledRow]  # every sequence sampled this step, prefills first


def _i32(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def _padded(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max((len(t) for t in tables), default=0) or 1
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)


def _prefix_sum(lens: list[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


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

    # -- inputs --------------------------------------------------------------
    def prepare(self, metas: list[SequenceGroupMetadata]) -> ModelInput:
        """Pack the step's prefills and decodes (see the module docstring)."""
        dev = self.device
        prefills = [m for m in metas if m.is_prompt]
        decodes = [m for m in metas if not m.is_prompt]
        tokens: list[int] = []
        positions: list[int] = []
        table_rows: list[int] = []  # per token: its sequence's row in the block tables
        seq_lens: list[int] = []
        enc_lens: list[int] = []
        tables: list[list[int]] = []
        cross_tables: list[list[int]] = []
        rows: list[SampledRow] = []
        enc_tokens: list[list[int]] = []  # of the prefills that run the encoder
        enc_features: list = []
        enc_computed: list[int] = []  # per prefill: encoder tokens computed this step (0: cached)
        q_lens: list[int] = []
        for m in prefills:
            # A group's sequences share their prompt (n > 1 forks it): compute
            # it once, through the first sequence, and sample every sequence
            # from that last hidden state.
            sid0, sd = next(iter(m.seq_data.items()))
            ids = sd.get_token_ids()
            n = len(ids)
            table_rows += [len(tables)] * n
            tokens += ids
            positions += range(n)
            seq_lens.append(n)
            q_lens.append(n)
            tables.append(m.block_tables[sid0])
            enc = m.encoder_seq_data.prompt_token_ids
            enc_lens.append(len(enc))
            cross_tables.append(m.cross_block_table)
            enc_computed.append(0 if m.cross_kv_cached else len(enc))
            if not m.cross_kv_cached:
                enc_tokens.append(enc)
                enc_features.append(m.encoder_inputs)
            last = len(tokens) - 1
            rows += [SampledRow(sid, last, m) for sid in m.seq_data]
        num_prefill_tokens = len(tokens)
        for m in decodes:
            enc_len = len(m.encoder_seq_data.prompt_token_ids)
            for sid, sd in m.seq_data.items():
                n = sd.get_len()
                rows.append(SampledRow(sid, len(tokens), m))
                table_rows.append(len(tables))
                tokens.append(sd.get_last_token_id())
                positions.append(n - 1)
                seq_lens.append(n)
                tables.append(m.block_tables[sid])
                enc_lens.append(enc_len)
                cross_tables.append(m.cross_block_table)
        num_decode = len(tokens) - num_prefill_tokens
        q_start = _prefix_sum(q_lens)
        e_start = _prefix_sum(enc_computed)
        block_tables = _padded(tables, dev)
        cross_block_tables = _padded(cross_tables, dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        slot_mapping = cache_slots(block_tables.to(torch.long), _i32(table_rows, dev), pos, self.block_size)
        # Written at prefill only, by the prefills that run the encoder (a cached
        # prefill's length is 0 here, so it contributes no slots).
        cross_slot_mapping = (packed_slots(cross_block_tables[: len(prefills)], enc_computed, self.block_size)
                              if e_start[-1] else torch.empty(0, dtype=torch.long, device=dev))
        md = self.backend.make_metadata(
            num_prefills=len(prefills),
            num_prefill_tokens=num_prefill_tokens,
            num_decode_tokens=num_decode,
            slot_mapping=slot_mapping,
            seq_lens=seq_lens,
            seq_lens_tensor=_i32(seq_lens, dev),
            max_prefill_seq_len=max(q_lens, default=0),
            max_decode_seq_len=max(seq_lens[len(prefills):], default=0),
            max_query_len=max(q_lens, default=1),
            query_start_loc=_i32(q_start, dev),
            seq_start_loc=_i32(q_start, dev),
            context_lens_tensor=_i32([0] * len(prefills) + [n - 1 for n in seq_lens[len(prefills):]], dev),
            block_tables=block_tables,
            encoder_seq_lens=enc_lens,
            encoder_seq_lens_tensor=_i32(enc_lens, dev),
            encoder_seq_start_loc=_i32(e_start, dev),
            max_encoder_seq_len=max(enc_lens, default=0),
            num_encoder_tokens=e_start[-1],
            cross_slot_mapping=cross_slot_mapping,
            cross_block_tables=cross_block_tables,
            block_size=self.block_size,
            block_tables_list=tables,
            cross_block_tables_list=cross_tables,
            prefill_cross_cached=([m.cross_kv_cached for m in prefills]
                                  if len(enc_tokens) < len(prefills) else None),
        )
        enc_kwargs = self.model.build_encoder_inputs(enc_tokens, enc_features, dev) if enc_tokens else {}
        return ModelInput(input_ids=torch.tensor(tokens, dtype=torch.long, device=dev), positions=pos,
                          attn_metadata=md, encoder_inputs=enc_kwargs, sampled_rows=rows)

    # -- persistent batch ----------------------------------------------------
    def _update_batch(self, rows: list[SampledRow]) -> list[int]:
        """Make the persistent batch hold exactly this step's sequences; return,
        for each batch row, the index into ``rows``."""
        ib = self.input_batch
        key_to_row = {str(sid): i for i, (sid, _, _) in enumerate(rows)}
        for key in list(ib.req_ids):
            if key is not None and key not in key_to_row:
                ib.remove_request(key)
        for key, i in key_to_row.items():
            if key not in ib.req_id_to_index:
                sid, _, m = rows[i]
                sd = m.seq_data[sid]
                ib.add_request(key, m.sampling_params, sd.prompt_token_ids, sd.output_token_ids,
                               seed_index=sd.sample_index)
        ib.condense()
        return [key_to_row[key] for key in ib.req_ids]

    # -- step ----------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, metas: list[SequenceGroupMetadata], *, blocks_to_swap_in=(), blocks_to_swap_out=(),
                blocks_to_copy=()) -> ModelRunnerOutput:
        self.cache.swap_out(list(blocks_to_swap_out))
        self.cache.swap_in(list(blocks_to_swap_in))
        self.cache.copy(list(blocks_to_copy))
        if not metas:
            return ModelRunnerOutput(samples=[])
        inp = self.prepare(metas)
        rows = inp.sampled_rows
        # Small decode steps: one thread, except the LM head (see SMALL_STEP_ROWS).
        small = (self.device.type == "cpu" and inp.attn_metadata.num_prefill_tokens == 0
                 and len(rows) <= SMALL_STEP_ROWS)
        with single_thread(small):
            hidden = self.model(inp.input_ids, inp.positions, self.cache.gpu_cache, inp.attn_metadata,
                                **inp.encoder_inputs)
        order = self._update_batch(rows)
        sampling_md = self.input_batch.refresh_metadata()
        # Prompt positions some prefills ask about ride in the same LM-head call
        # (a memory-bound read of the whole head: an extra row costs next to nothing).
        asked = _asked_prompt_positions(metas)
        index = torch.tensor([rows[i][1] for i in order] + [a.hidden_index for a in asked],
                             dtype=torch.long, device=self.device)
        all_logits = self.model.compute_logits(hidden.index_select(0, index))
        logits = all_logits[: len(order)]  # (num_rows, vocab), the sampled rows
        token_lps = _prompt_token_logprobs(all_logits[len(order):], asked)
        # Beam search: its groups' rows go to candidate selection, not sampling.
        beam = find_beam_rows(metas, {rows[i][0]: r for r, i in enumerate(order)}, self.device)
        with single_thread(small):
            out = (self.sampler(logits, sampling_md, logprob_rows=beam.row_index) if beam
                   else self.sampler(logits, sampling_md))
        candidates = select_candidates(beam, out.processed_logprobs) if beam else {}
        beam_seqs = beam.seq_ids if beam else ()
        sampled = out.sampled_token_ids.view(len(order), -1)[:, 0].tolist()
        lp = self._logprobs(out.logprobs_tensors, [rows[i][2].sampling_params.logprobs for i in order])
        samples = [SampledToken(rows[i][0], tok, lp[r] if lp else {})
                   for r, (i, tok) in enumerate(zip(order, sampled)) if rows[i][0] not in beam_seqs]
        return ModelRunnerOutput(samples=samples, prompt_logprobs=self._prompt_logprobs(metas, hidden),
                                 prompt_token_logprobs=token_lps, beam_candidates=candidates)

    def _prompt_logprobs(self, metas: list[SequenceGroupMetadata],
                         hidden: torch.Tensor) -> dict[str, list[dict[int, Logprob] | None]]:
        """Decoder-prompt logprobs for prefills that ask: position i's hidden
        state scores prompt token i + 1; the first token has none (None)."""
        out: dict[str, list[dict[int, Logprob] | None]] = {}
        for m, sd, start in _prefill_spans(metas):
            k = m.sampling_params.prompt_logprobs
            n_prompt = sd.get_prompt_len()
            if k is not None and sd.get_output_len() == 0:  # not again after a recompute
                targets = torch.tensor(sd.prompt_token_ids[1:], dtype=torch.long, device=self.device)
                logits = self.model.compute_logits(hidden[start: start + n_prompt - 1]).float()
                lp = compute_prompt_logprobs(logits, targets, k)
                ids, vals = lp.logprob_token_ids.tolist(), lp.logprobs.tolist()
                ranks = lp.selected_token_ranks.tolist()
                rows: list[dict[int, Logprob] | None] = [None]
                for r in range(n_prompt - 1):
                    d = {ids[r][0]: Logprob(vals[r][0], rank=ranks[r])}
                    for j in range(1, 1 + k):
                        d.setdefault(ids[r][j], Logprob(vals[r][j], rank=j))
                    rows.append(d)
                out[m.request_id] = rows
        return out

    @staticmethod
    def _logprobs(tensors, wanted: list[int | None]) -> list[dict[int, Logprob]] | None:
        """Per row: the sampled token first, then that request's own top-k."""
        if tensors is None:
            return None
        ids = tensors.logprob_token_ids.tolist()
        vals = tensors.logprobs.tolist()
        ranks = tensors.selected_token_ranks.tolist()
        out = []
        for r, k in enumerate(wanted):
            d = {ids[r][0]: Logprob(vals[r][0], rank=ranks[r])}
            for j in range(1, 1 + (k or 0)):
                d.setdefault(ids[r][j], Logprob(vals[r][j], rank=j))
            out.append(d)
        return out
