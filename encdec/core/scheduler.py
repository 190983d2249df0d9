"""Continuous batching over three queues: waiting, running, swapped.

Each ``schedule()``, most urgent first ("urgent": fcfs = earliest arrival;
``priority`` policy = smallest priority number, then earliest arrival):
  0. (priority policy) if the most urgent waiting group does not fit, running
     groups of strictly lower priority are preempted until it does;
  1. running groups get a slot for their next token; when the cache is full the
     least urgent group is preempted: swapped to CPU (the encoder/decoder
     default: recomputing would re-run the encoder) or recomputed;
  2. if nothing was preempted in 1, swapped groups come back before anything
     new is admitted;
  3. waiting groups are admitted while the block manager, ``max_num_seqs`` and
     the prefill token budget (encoder + decoder tokens) allow; while groups
     decode, only once ``min_admission`` sequences fit (or all that wait), under
     the fcfs policy.
A request that can never fit (too big for the whole cache, more sequences than
``max_num_seqs``, nowhere to preempt it to) finishes with ``error`` set and is
returned in ``ignored_seq_groups``; the others go on. New prefills and running
decodes share one step: the model runner packs both.

Block moves of one step reach the cache engine as three lists, run in the
order swap-out, swap-in, copy, before the forward. That order is safe because
every swap-out is decided before any swap-in or copy of the same step (a
swap-out's freed device blocks may be reused by them, never the reverse), and
a victim is never a group already given slots this step (its copy-on-write
copies would land in blocks that just left for the CPU). No torch here.
"""
from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Collection, Iterable

from encdec.block_manager import BlockSpaceManager
from encdec.config import CacheConfig, SchedulerConfig
from encdec.core import step_update
from encdec.core.outputs import ModelRunnerOutput
from encdec.core.admission import Admission
from encdec.core.chunked_prefill import ChunkedPrefill, prefill_order
from encdec.core.preemption import Preemption
from encdec.core.scheduler_outputs import (
    BeamDecider,
    EncoderWork,
    ScheduledSequenceGroup,
    SchedulerOutputs,
    SchedulerStats,
    StepBlocks,
    StructuredDecider,
)
from encdec.core.slot_room import SlotRoom
from encdec.core.speculation import Speculation, reason
from encdec.core.step_metadata import StepMetadata
from encdec.core.stop_checker import StopChecker
from encdec.sampling_params import SamplingType
from encdec.sequence import Sequence, SequenceGroup, SequenceGroupMetadata, SequenceStatus

__all__ = ["Scheduler", "ScheduledSequenceGroup", "SchedulerOutputs", "SchedulerStats"]


def _constrained(group: SequenceGroup) -> bool:
    params = group.sampling_params
    return params is not None and getattr(params, "structured_outputs", None) is not None


def _lookahead(group: SequenceGroup, ahead: Collection[int]) -> int:
    """Slots past its next token a group's rows need: one for a sequence of the
    step still running (async scheduling), which computes one position further."""
    return 1 if ahead and any(s.seq_id in ahead for s in group.seqs) else 0


class Scheduler(Admission, ChunkedPrefill, Preemption):
    """``lora_config``: vLLM's argument, accepted for its shape; LoRA is not
    supported (anything but None is refused). ``stop_checker``: what ends a
    sequence after each appended token (``update``); the default knows token
    ids only (no detokenizer, no eos). ``beams``: decides each step's beams of
    ``SamplingType.BEAM`` groups (``update`` applies them); without it such a
    group is refused. ``structured``: grammar masks and matchers of requests with
    structured outputs (masks each ``schedule``, tokens accepted in ``update``)."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 lora_config: object | None = None, *, stop_checker: StopChecker | None = None,
                 beams: BeamDecider | None = None, structured: StructuredDecider | None = None,
                 speculation: Speculation | None = None):
        if lora_config is not None:
            raise ValueError("lora_config: LoRA adapters are not supported by encdec")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.stop_checker = stop_checker or StopChecker(scheduler_config.max_model_len)
        self.beams = beams
        self.structured = structured
        self.block_manager = BlockSpaceManager(
            block_size=cache_config.block_size,
            num_gpu_blocks=cache_config.num_gpu_blocks,
            num_cpu_blocks=cache_config.num_cpu_blocks,
            sliding_window=cache_config.sliding_window,
            enable_caching=cache_config.enable_prefix_caching,
            warm_gpu_blocks=cache_config.num_warm_gpu_blocks,
        )
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: deque[SequenceGroup] = deque()
        self.stats = SchedulerStats()
        self.num_steps = 0
        self._by_priority = scheduler_config.policy == "priority"
        # The one index of unfinished requests, whichever queue holds them:
        # request_id -> (the order groups were added: the tie-break for equal
        # arrival times, the group). In at add_seq_group, out when freed.
        self._requests: dict[str, tuple[int, SequenceGroup]] = {}
        self._counter = itertools.count()
        self._batch_seq_ids: dict[int, None] = {}  # last step's scheduled seq_ids, in order
        self._running_sorted = True  # running is in _key order (groups appended since: False)
        self.num_appended = 0  # tokens the last update appended (beams' excepted)
        # Unfinished requests with structured outputs: none, and no step asks the
        # structured-output manager anything (it would look at every row).
        self._num_constrained = 0
        self._metadata = StepMetadata(self.block_manager)
        self._room = SlotRoom()
        self.speculation = speculation
        self.spec_rows: dict[int, int] = {}  # this step: seq_id -> the most draft tokens its row may carry
        self._drafted_last = False  # the last step gave draft slots
        # seq_id -> StopChecker.quick_rule of its request; the last update's
        # running sequences, reused while a step has the same rows.
        self._stop_rules: dict[int, tuple[int, frozenset[int], int] | None] = {}
        self._seqs: dict[int, tuple[Sequence, SequenceGroup]] | None = None
        self._chunking: set[str] = set()  # request ids admitted with a partial prefill (chunked_prefill.py)
        self._encoder_work = EncoderWork()  # this step's (encoder_split.py)

    # -- queues ----------------------------------------------------------------
    def add_seq_group(self, seq_group: SequenceGroup) -> None:
        if seq_group.sampling_params is not None and seq_group.sampling_params.sampling_type is SamplingType.BEAM:
            if self.beams is None:
                raise ValueError(f"request {seq_group.request_id} asks for beam search but this "
                                 "scheduler has no beam search (Scheduler(..., beams=...))")
            self.beams.start(seq_group)
        self._requests[seq_group.request_id] = (next(self._counter), seq_group)
        self._num_constrained += _constrained(seq_group)
        if self.speculation is not None:
            seq_group.metrics.spec_decode_off = reason(seq_group.sampling_params)
        self.waiting.append(seq_group)

    def get_seq_group(self, request_id: str) -> SequenceGroup | None:
        """The unfinished request's group, whichever queue holds it; None if unknown or finished."""
        entry = self._requests.get(request_id)
        return entry[1] if entry is not None else None

    def get_seq_groups(self) -> list[SequenceGroup]:
        """Every unfinished request's group, in the order they were added."""
        return [group for _, group in self._requests.values()]

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def get_num_unfinished_seq_groups(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def abort_seq_group(self, request_id: str | Iterable[str]) -> list[SequenceGroup]:
        """Abort in whichever queue the group is; its self and cross blocks are
        freed on whichever device holds them. Unknown ids are ignored."""
        ids = {request_id} if isinstance(request_id, str) else set(request_id)
        aborted = []
        for queue in (self.waiting, self.running, self.swapped):
            for group in [g for g in queue if g.request_id in ids]:
                queue.remove(group)
                for seq in group.get_seqs():
                    if not seq.is_finished():
                        seq.status = SequenceStatus.FINISHED_ABORTED
                self._free_group(group)
                aborted.append(group)
        self.stats.num_aborted += len(aborted)
        return aborted

    def _free_group(self, group: SequenceGroup) -> None:
        """Every block the group holds, self and cross, on either device."""
        for seq in group.get_seqs():
            self.block_manager.free(seq)
            self._stop_rules.pop(seq.seq_id, None)
        self.block_manager.free_cross(group)
        if self._requests.pop(group.request_id, None) is not None:
            self._num_constrained -= _constrained(group)
        self._chunking.discard(group.request_id)
        self._metadata.forget(group.request_id)
        if self.structured is not None:
            self.structured.free([s.seq_id for s in group.get_seqs()])

    def update(self, scheduler_outputs: SchedulerOutputs, runner_output: ModelRunnerOutput) -> list[SequenceGroup]:
        """Apply one step's results to its sequences (``encdec.core.step_update``):
        sampled tokens appended and stop-checked, beam groups' candidates decided
        (``beams``) and the decisions applied, finished sequences and groups freed
        and out of ``running``. Returns the groups that finished in this step, the
        ones ``schedule`` could never run first."""
        sched = scheduler_outputs
        # The same decode rows as the last step: its seq map holds, and each row's
        # computed token is counted as its sample is appended (one pass, not two).
        same = sched.same_rows and self._seqs is not None
        if not same:
            step_update.mark_computed(sched)
            self._seqs = step_update.running_seqs(sched)
        ended, self.num_appended = step_update.append_samples(
            runner_output, self._seqs, self.block_manager, self.stop_checker,
            self.structured if self._num_constrained else None, self._stop_rules, int(same))
        for sample in runner_output.samples if sched.spec_rows else ():  # kept drafts, per request
            if len(sample.sampled_token_ids) > 1:
                self._seqs[sample.seq_id][1].metrics.spec_decode_accepted_tokens += len(sample.sampled_token_ids) - 1
        for seq_id in sched.spec_rows:  # rejected drafts' slots past a block boundary go back
            seq = self._seqs[seq_id][0]
            if not seq.is_finished():
                self.block_manager.trim(seq)
        self.stats.spec_draft_tokens += runner_output.num_draft_tokens
        self.stats.spec_accepted_tokens += runner_output.num_accepted_tokens
        self.stats.spec_drafts += runner_output.num_drafts
        groups: dict[str, SequenceGroup] = {}
        if runner_output.prompt_logprobs or runner_output.prompt_token_logprobs or runner_output.beam_candidates:
            groups = {s.seq_group.request_id: s.seq_group for s in sched.scheduled_seq_groups}
        step_update.keep_prompt_logprobs(runner_output, groups)
        decisions = self.beams.decide(runner_output.beam_candidates, groups) if runner_output.beam_candidates else []
        for decision in decisions:
            step_update.apply_beam_decision(decision, groups[decision.request_id], self.block_manager,
                                            self.structured)
        ended += [groups[d.request_id] for d in decisions]  # beams end groups in their decisions only
        finished = list(sched.ignored_seq_groups)
        done = {id(g): g for g in ended if g.is_finished()}
        if done:
            finished += [s.seq_group for s in sched.scheduled_seq_groups if id(s.seq_group) in done]
            self.running = [g for g in self.running if id(g) not in done]
            for group in done.values():
                self._free_group(group)
        return finished

    def free_finished_seq_groups(self) -> None:
        still = []
        for group in self.running:
            if group.is_finished():
                self._free_group(group)
            else:
                still.append(group)
        self.running = still

    # -- ordering --------------------------------------------------------------
    def _key(self, g: SequenceGroup) -> tuple:
        """Ascending = more urgent: scheduled first, preempted last. fcfs ignores
        ``priority``; the priority policy ranks by it first."""
        return (g.priority if self._by_priority else 0, g.arrival_time,
                self._requests.get(g.request_id, (0,))[0])

    def _outranks_swapped(self, group: SequenceGroup) -> bool:
        """Swapped groups resume before new ones are admitted; under the priority
        policy a waiting group of strictly higher priority may go first."""
        if not self.swapped:
            return True
        return self._by_priority and group.priority < min(g.priority for g in self.swapped)

    # -- schedule --------------------------------------------------------------
    def _schedule_running(self, blocks: StepBlocks, ahead: Collection[int] = ()) -> tuple[list[SequenceGroup], int]:
        """Give each running group, most urgent first, the slot of its next token.
        When the cache is full, preempt from the least urgent end, which is the
        group itself once it is the least urgent one left."""
        bm = self.block_manager
        if not self._running_sorted:  # keys never change: sorted stays sorted as groups leave
            self.running.sort(key=self._key)
            self._running_sorted = True
        # A row needs at most a copy of a shared block and two new ones (one lookahead
        # slot): with that many free for every row, no one is preempted and the order
        # does not matter. Most steps, where the cache is not nearly full.
        running, free = self.running, bm.get_num_free_gpu_blocks()
        lookahead = 1 if ahead else 0
        spec = self.speculation
        mid = self._mid_prefill if self._chunking else None  # groups between prefill chunks: no slots
        self.spec_rows = ({g.seqs[0].seq_id: m for g in running if not (mid and mid(g)) and (m := spec.max_drafts(g))}
                          if spec and spec.active(len(running)) else {})
        due = self._room.due(running, lookahead) if free >= 3 * len(running) and not (spec or mid) else None
        if due is not None:  # the same single-sequence rows as the last step: only full blocks
            for i in due:
                seq = running[i].seqs[0]
                blocks.copy.extend(bm.append_slots(seq, lookahead))
                self._room.set(i, self._room_of(seq, lookahead))
            return list(running), 0
        per_row = 3 + (spec.k // self.cache_config.block_size if spec else 0)  # + draft slots' blocks
        if free >= per_row * sum(map(len, (g.seqs for g in running))):
            for group in running:
                if not (mid and mid(group)) and not self._slot_ready(group, self._lookahead(group, ahead)):
                    for seq in group.get_seqs(SequenceStatus.RUNNING):
                        blocks.copy.extend(bm.append_slots(seq, self._lookahead(group, ahead)))
            self._record_room(ahead)
            return list(running), 0
        self._room.forget()
        queue = deque(self.running)
        kept: list[SequenceGroup] = []
        preempted = 0
        while queue:
            group = queue.popleft()
            lookahead = self._lookahead(group, ahead)
            if (mid and mid(group)) or self._slot_ready(group, lookahead):
                kept.append(group)
                continue
            while not bm.can_append_slots(group, lookahead):
                victim = queue.pop() if queue else group
                self._preempt(victim, blocks)
                preempted += 1
                if victim is group:
                    break
            else:
                for seq in group.get_seqs(SequenceStatus.RUNNING):
                    blocks.copy.extend(bm.append_slots(seq, lookahead))
                kept.append(group)
        self.running = kept
        return list(kept), preempted  # a copy: running grows with resumed and new groups

    def _lookahead(self, group: SequenceGroup, ahead: Collection[int]) -> int:
        """Slots past its next token a group's row needs: one if it is ahead
        (``_lookahead``), plus its draft tokens' (``spec_rows``)."""
        extra = self.spec_rows.get(group.seqs[0].seq_id, 0) if self.spec_rows else 0
        return _lookahead(group, ahead) + extra

    def _room_of(self, seq: Sequence, lookahead: int) -> int:
        return len(self.block_manager.get_block_table(seq)) * self.cache_config.block_size - seq.get_len() - lookahead

    def _record_room(self, ahead: Collection[int]) -> None:
        """After a full pass: each row's room (``SlotRoom``), where every row is one
        sequence, not a beam search's, and all share one lookahead."""
        lookahead = 1 if ahead else 0
        room = []
        if self.speculation is not None or self._chunking:  # rows take several tokens a step, or none
            self._room.forget()
            return
        for group in self.running:
            seqs = group.seqs
            if (len(seqs) != 1 or group.sampling_params is None or _lookahead(group, ahead) != lookahead
                    or group.sampling_params.sampling_type is SamplingType.BEAM):
                self._room.forget()
                return
            room.append(self._room_of(seqs[0], lookahead))
        self._room.record(self.running, room, lookahead)

    def _slot_ready(self, group: SequenceGroup, lookahead: int) -> bool:
        """Most rows of most steps: one sequence whose next token lands in a block
        it alone holds; the block manager has nothing to do for it."""
        seqs = group.seqs
        return (len(seqs) == 1 and seqs[0].status is SequenceStatus.RUNNING
                and self.block_manager.slot_is_ready(seqs[0], lookahead))

    def schedule(self, ahead: Collection[int] = ()) -> tuple[list[SequenceGroupMetadata], SchedulerOutputs]:
        """The next step. ``ahead``: the decoder sequences of a step still running
        whose token is not appended yet (async scheduling): each gets the slot of
        the position after it. The caller makes sure nothing it holds would be
        preempted (``LLMEngine``: enough free blocks for every running row)."""
        blocks = StepBlocks()
        idle = self.block_manager.swap_out_idle_cross()  # first: this step may reuse their blocks
        blocks.swap_out.extend(idle)
        self.stats.num_blocks_swapped_out += len(idle)
        preempted = self._preempt_for_waiting(blocks) if self._by_priority else 0
        decodes, num_out_of_slots = self._schedule_running(blocks, ahead)
        preempted += num_out_of_slots
        prefills: list[SequenceGroup] = []
        chunks: dict[str, int] = {}  # chunked prefill: request id -> prompt tokens this step
        continuing: set[str] = set()  # of those, groups past their first chunk
        if not num_out_of_slots:  # the cache was just short for running groups: add nothing
            decodes += self._schedule_swapped(blocks)
        if self.scheduler_config.enable_chunked_prefill:
            decodes, prefills, chunks, budget = self._plan_chunks(decodes, ahead)
            continuing = {g.request_id for g in prefills}
            if not num_out_of_slots:
                prefills = prefill_order(prefills + self._schedule_waiting(blocks, budget, chunks), chunks)
        elif not num_out_of_slots:
            prefills = self._schedule_waiting(blocks)
        self.num_steps += 1
        bm = self.block_manager
        cross = self._cross_kv_cached  # a continuing chunk's cross K/V is its first chunk's
        metas, scheduled = self._metadata.build(
            prefills, decodes, (lambda g: g.request_id in continuing or cross(g)) if continuing else cross, chunks)
        used = bm.num_total_gpu_blocks - bm.get_num_free_gpu_blocks()
        self.stats.peak_num_gpu_blocks_used = max(self.stats.peak_num_gpu_blocks_used, used)
        # Draft slots grow and trim tables in place: no steady step during or right after them.
        regrown, self._drafted_last = bool(self.spec_rows) or self._drafted_last, bool(self.spec_rows)
        same = self._metadata.unchanged and not blocks.swap_out and not regrown
        if same:  # last step's rows (single sequences), one token further
            num_tokens, joined, left = len(metas), [], []
        else:
            num_tokens = sum(s.token_chunk_size for s in scheduled[: len(prefills)])
            num_tokens += sum(len(m.seq_data) for m in metas[len(prefills):])  # one per decode row
            batch = dict.fromkeys(sid for m in metas if m.do_sample for sid in m.seq_data)  # rows that sample
            joined = [sid for sid in batch if sid not in self._batch_seq_ids]
            left = [sid for sid in self._batch_seq_ids if sid not in batch]
            self._batch_seq_ids = batch
        return metas, SchedulerOutputs(
            scheduled_seq_groups=scheduled,
            num_prefill_groups=len(prefills),
            num_batched_tokens=num_tokens,
            blocks_to_swap_in=blocks.swap_in,
            blocks_to_swap_out=blocks.swap_out,
            blocks_to_copy=blocks.copy,
            preempted=preempted,
            ignored_seq_groups=blocks.ignored,
            seq_ids_joined=joined,
            seq_ids_left=left,
            same_rows=same,
            tables_regrown=regrown, encoder=self._take_encoder_work(),
            spec_rows={sid: m for sid, m in self.spec_rows.items() if sid in batch} if self.spec_rows else {},
            token_masks=(self.structured.fill_masks(prefills + decodes)
                         if self.structured and self._num_constrained else None),
        )
