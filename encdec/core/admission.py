"""How waiting groups are admitted to a step: ``max_num_seqs``, the prefill
token budget and the block manager decide who goes in, most urgent first;
``min_admission`` batches admissions while groups decode; each prefill asks
whether its cross KV is cached. A part of ``Scheduler``, kept apart so each
file reads as one concern; it works on the scheduler's own queues, block
manager and stats. No torch here.
"""
from __future__ import annotations

import time
from collections import deque

from encdec.block_manager import AllocStatus, BlockSpaceManager
from encdec.config import SchedulerConfig
from encdec.core.chunked_prefill import chunkable, left_to_prefill
from encdec.core.encoder_split import EncoderSplit
from encdec.core.scheduler_outputs import SchedulerStats, StepBlocks
from encdec.sequence import SequenceGroup, SequenceStatus

# Admissions SchedulerStats.admitted_at_step remembers (oldest dropped first).
ADMITTED_HISTORY = 4096


class Admission(EncoderSplit):
    """Mixed into ``Scheduler``: the attributes below are the scheduler's, and so
    are ``_key``, ``_outranks_swapped``, ``_record_admission``'s history and
    (from ``Preemption``) ``_fail``, ``_never_fits`` and ``_num_blocks``."""

    scheduler_config: SchedulerConfig
    block_manager: BlockSpaceManager
    waiting: deque[SequenceGroup]
    running: list[SequenceGroup]
    stats: SchedulerStats
    num_steps: int
    _by_priority: bool
    _running_sorted: bool
    _chunking: set[str]

    def _num_running_seqs(self) -> int:
        return sum(g.num_seqs(SequenceStatus.RUNNING) for g in self.running)

    def _schedule_waiting(self, blocks: StepBlocks, token_budget: int | None = None,
                          chunks: dict[str, int] | None = None) -> list[SequenceGroup]:
        """Admit waiting groups, most urgent first, while they fit. ``token_budget``
        (chunked prefill): the step's decoder tokens left, the first chunk of each
        admitted prompt written into ``chunks``; None: the prefills' decoder and
        encoder tokens count against ``max_num_batched_tokens``."""
        bm = self.block_manager
        cfg = self.scheduler_config
        chunked = token_budget is not None
        budget = token_budget if chunked else cfg.max_num_batched_tokens
        # None: no limit. Chunked, the token budget bounds encoder work too unless the
        # encoder has its own: the CUDA profile run sizes memory for that step.
        encoder_budget = full_encoder_budget = (cfg.max_num_encoder_input_tokens
                                                or (cfg.max_num_batched_tokens if chunked else None))
        admitted: list[SequenceGroup] = []
        if not self._admission_due():
            return admitted
        if self._by_priority and len(self.waiting) > 1:
            self.waiting = deque(sorted(self.waiting, key=self._key))
        num_running = self._num_running_seqs() if self.waiting else 0  # counted once, kept as groups are admitted
        urgent = self._most_urgent_running() if self._by_priority and self.waiting else None
        while self.waiting:
            group = self.waiting[0]
            if not self._outranks_swapped(group) or (chunked and budget <= 0):
                break
            if urgent is not None and group.priority > urgent and bm.encoder_tokens_to_run(group):
                break  # its encoder pass would stretch each step of a more urgent request
            seqs = group.get_seqs(SequenceStatus.WAITING)
            status = self._admissible(group, seqs, blocks)
            if status is None:
                continue  # failed and out of the queue
            if status is AllocStatus.LATER:
                break
            split = chunked and chunkable(group)
            tokens = 0 if split else seqs[0].get_len() + (0 if chunked else group.encoder_seq.get_len())
            if admitted and tokens > budget:
                break
            if num_running + len(seqs) > cfg.max_num_seqs:
                break
            # Cache hits cost nothing. A pass over what is left of the budget while
            # others run goes a piece a step, and its request in the step after its
            # last piece (encoder_split.py); else the first admission always goes (an
            # oversize input runs alone: the budget is then below zero).
            encoder_tokens = bm.encoder_tokens_to_run(group)
            left = self._encoder_left(group, encoder_tokens)
            if self._splits(group, left, encoder_budget, bool(self.running or admitted)):
                fresh = encoder_budget == full_encoder_budget
                units = self._piece_units(group, encoder_tokens, encoder_budget, fresh)
                if units:
                    self._run_piece(group, units)
                break
            if admitted and encoder_budget is not None and left > encoder_budget:
                break
            self.waiting.popleft()
            spent = self._admit(group, seqs, budget if split else None, chunks)
            self._encoder_admitted(group, encoder_tokens)
            budget -= spent if chunked else tokens
            if encoder_budget is not None:
                encoder_budget -= left
            num_running += len(seqs)
            admitted.append(group)
            if group.priority < 0 and (urgent is None or group.priority < urgent):
                urgent = group.priority
        # Prefills that skip cached tokens last: the runner packs whole prefills
        # first and runs those as rows over their cached K/V after them.
        return sorted(admitted, key=lambda g: g.seqs[0].data.get_num_computed_tokens() > 0)

    def _most_urgent_running(self) -> int | None:
        """The priority policy's hold on encoder work: the smallest negative
        priority among running groups, None if none has one. Negative priorities
        mark latency-bound requests (a live turn's final pass); while one runs, a
        less urgent request waits before its encoder pass, which would otherwise
        run in one of its steps and delay every token after. Priority 0 (every
        ordinary request) holds nothing back."""
        urgent = min((g.priority for g in self.running), default=0)
        return urgent if urgent < 0 else None

    def _admissible(self, group: SequenceGroup, seqs: list, blocks: StepBlocks) -> AllocStatus | None:
        """The block manager's answer; None (the group fails, out of the queue)
        where it can never run: more sequences than ``max_num_seqs``, or more
        blocks than the cache."""
        cfg = self.scheduler_config
        if len(seqs) > cfg.max_num_seqs:
            self.waiting.popleft()
            self._fail(group, (f"request {group.request_id} has {len(seqs)} sequences (best_of) "
                               f"but max_num_seqs is {cfg.max_num_seqs}; raise max_num_seqs"),
                       SequenceStatus.FINISHED_IGNORED, blocks)
            return None
        status = self.block_manager.can_allocate(group)
        if status is AllocStatus.NEVER:
            self.waiting.popleft()
            need = self._num_blocks(seqs[0].get_len()) + self._num_blocks(group.encoder_seq.get_len())
            self._fail(group, self._never_fits(group, need), SequenceStatus.FINISHED_IGNORED, blocks)
            return None
        return status

    def _admit(self, group: SequenceGroup, seqs: list, budget: int | None,
               chunks: dict[str, int] | None) -> int:
        """Allocate the group's blocks and make it run; returns the decoder tokens
        its prefill computes this step. ``budget``: the step's decoder tokens
        left, where its prompt may be split (its first chunk goes in ``chunks``)."""
        bm = self.block_manager  # cached: prompt tokens the prefix cache holds
        cached = bm.allocate(group) if budget is None else bm.allocate(group, budget)
        for seq in seqs:
            seq.status = SequenceStatus.RUNNING
            if cached:
                seq.data.update_num_computed_tokens(cached)
        tokens = left_to_prefill(group)
        self._chunking.discard(group.request_id)  # a recomputed group is planned afresh
        if budget is not None and tokens > budget:
            tokens = chunks[group.request_id] = budget
            self._chunking.add(group.request_id)
        self.running.append(group)
        self._running_sorted = False
        self._record_admission(group.request_id)
        if group.metrics.first_scheduled_time is None:
            group.metrics.first_scheduled_time = time.time()
        return tokens

    def _admission_due(self) -> bool:
        """Where a step with prefills costs far more than a decode step (CUDA: a
        decode step replays a graph, a step with prefills runs eagerly), admitting
        each request as one finishes makes nearly every step the costly kind. So
        while groups decode, admission waits until ``min_admission`` sequences
        fit in ``max_num_seqs`` (fewer if fewer wait). Never under the priority
        policy: an urgent request goes in at once."""
        want = self.scheduler_config.min_admission
        if want <= 1 or self._by_priority or not self.running or not self.waiting:
            return True
        waiting = 0
        for group in self.waiting:
            waiting += group.num_seqs(SequenceStatus.WAITING)
            if waiting >= want:
                break
        return self.scheduler_config.max_num_seqs - self._num_running_seqs() >= min(want, waiting)

    def _cross_kv_cached(self, group: SequenceGroup) -> bool:
        """Whether a prefill reuses its cross table's KV (no encoder pass); counts
        passes, queries and hits; ``metrics.encoder_cache_hit``: False once its encoder ran."""
        cached, stats = not self.block_manager.claim_cross_write(group), self.stats
        if group.encoder_cache_key is not None:
            stats.encoder_cache_queries += 1
            stats.encoder_cache_hits += cached
        stats.num_encoder_passes += not cached
        first = group.metrics.first_token_time is None  # not a prefill after a recompute
        group.metrics.encoder_cache_hit = cached and (first or group.metrics.encoder_cache_hit)
        return cached

    def _record_admission(self, request_id: str) -> None:
        admitted = self.stats.admitted_at_step
        if request_id not in admitted:  # a recomputed group keeps its first step
            admitted[request_id] = self.num_steps
            if len(admitted) > ADMITTED_HISTORY:
                del admitted[next(iter(admitted))]
