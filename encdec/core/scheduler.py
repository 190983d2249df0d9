"""Continuous batching over three queues: waiting, running, swapped.

Each ``schedule()``:
  1. running groups get a slot for their next token; when the cache is full the
     lowest-priority, latest-arrived group is preempted (swapped to CPU by
     default: recomputing would re-run the encoder);
  2. swapped groups come back before anything new is admitted;
  3. waiting groups are admitted while the block manager, ``max_num_seqs`` and
     the prefill token budget (encoder + decoder tokens) allow.
New prefills and running decodes share one step: the model runner packs both.
Nothing here imports torch.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from encdec.block_manager import AllocStatus, BlockSpaceManager
from encdec.config import CacheConfig, PreemptionMode, SchedulerConfig
from encdec.sequence import SequenceGroup, SequenceGroupMetadata, SequenceStatus


@dataclass
class ScheduledSequenceGroup:
    seq_group: SequenceGroup
    token_chunk_size: int  # decoder tokens computed this step per sequence


@dataclass
class SchedulerOutputs:
    scheduled_seq_groups: list[ScheduledSequenceGroup]  # prefills first, then decodes
    num_prefill_groups: int
    num_batched_tokens: int  # decoder tokens this step
    blocks_to_swap_in: list[tuple[int, int]]  # CPU -> device block number
    blocks_to_swap_out: list[tuple[int, int]]  # device -> CPU block number
    blocks_to_copy: list[tuple[int, int]]  # device -> device (copy-on-write)
    preempted: int  # groups preempted this step
    ignored_seq_groups: list[SequenceGroup]  # can never run; finished with an error

    def is_empty(self) -> bool:
        return not (self.scheduled_seq_groups or self.blocks_to_swap_in
                    or self.blocks_to_swap_out or self.blocks_to_copy)


@dataclass
class SchedulerStats:
    num_preempted_swap: int = 0
    num_preempted_recompute: int = 0
    num_swapped_in: int = 0
    num_ignored: int = 0
    admitted_at_step: dict[str, int] = field(default_factory=dict)  # request id -> step


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, lora_config=None):
        if lora_config is not None:
            raise NotImplementedError("LoRA is not supported")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.block_manager = BlockSpaceManager(
            block_size=cache_config.block_size,
            num_gpu_blocks=cache_config.num_gpu_blocks,
            num_cpu_blocks=cache_config.num_cpu_blocks,
            sliding_window=cache_config.sliding_window,
            enable_caching=cache_config.enable_prefix_caching,
        )
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: deque[SequenceGroup] = deque()
        self.finished: list[SequenceGroup] = []  # to be freed by free_finished_seq_groups
        self.stats = SchedulerStats()
        self.num_steps = 0

    # -- queues ----------------------------------------------------------------
    def add_seq_group(self, seq_group: SequenceGroup) -> None:
        self.waiting.append(seq_group)

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def get_num_unfinished_seq_groups(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def abort_seq_group(self, request_id: str | Iterable[str]) -> list[SequenceGroup]:
        """Abort in whichever queue the group is; its self and cross blocks are freed."""
        ids = {request_id} if isinstance(request_id, str) else set(request_id)
        aborted = []
        for queue in (self.waiting, self.running, self.swapped):
            for group in [g for g in queue if g.request_id in ids]:
                queue.remove(group)
                for seq in group.get_seqs():
                    if not seq.is_finished():
                        seq.status = SequenceStatus.FINISHED_ABORTED
                    self.block_manager.free(seq)
                self._free_seq_group_cross_attn_blocks(group)
                aborted.append(group)
        return aborted

    def _free_seq_group_cross_attn_blocks(self, seq_group: SequenceGroup) -> None:
        if seq_group.is_encoder_decoder():
            self.block_manager.free_cross(seq_group)

    def free_seq(self, seq) -> None:
        self.block_manager.free(seq)

    def free_finished_seq_groups(self) -> None:
        still = []
        for group in self.running:
            if group.is_finished():
                for seq in group.get_seqs():
                    self.block_manager.free(seq)
                self._free_seq_group_cross_attn_blocks(group)
            else:
                still.append(group)
        self.running = still

    # -- preemption ------------------------------------------------------------
    def _victim_key(self, g: SequenceGroup):
        # Highest key is preempted first: lowest priority (largest number), latest arrival.
        return (g.priority, g.arrival_time)

    def _preempt(self, group: SequenceGroup, blocks_to_swap_out: list[tuple[int, int]]) -> None:
        mode = self.scheduler_config.preemption_mode or PreemptionMode.SWAP
        single = group.get_max_num_running_seqs() == 1
        if mode == PreemptionMode.SWAP and not self.block_manager.can_swap_out(group):
            mode = PreemptionMode.RECOMPUTE
        if mode == PreemptionMode.RECOMPUTE and not single:
            # Recompute restarts from one prompt; forked sequences must be swapped.
            if not self.block_manager.can_swap_out(group):
                raise RuntimeError(
                    f"request {group.request_id} cannot be preempted: not enough CPU swap space "
                    "(raise swap_space)")
            mode = PreemptionMode.SWAP
        if mode == PreemptionMode.SWAP:
            blocks_to_swap_out.extend(self.block_manager.swap_out(group))
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(group)
            self.stats.num_preempted_swap += 1
        else:
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                seq.status = SequenceStatus.WAITING
                self.block_manager.free(seq)
                seq.reset_state_for_recompute()
            self._free_seq_group_cross_attn_blocks(group)
            self.waiting.appendleft(group)
            self.stats.num_preempted_recompute += 1

    # -- schedule --------------------------------------------------------------
    def _schedule_running(self, blocks_to_swap_out, blocks_to_copy) -> tuple[list[SequenceGroup], int]:
        bm = self.block_manager
        keep: list[SequenceGroup] = []
        preempted = 0
        queue = sorted(self.running, key=self._victim_key) if self.scheduler_config.policy == "priority" \
            else list(self.running)
        while queue:
            group = queue.pop(0)
            while not bm.can_append_slots(group):
                if queue:
                    victim = max(queue, key=self._victim_key)
                    queue.remove(victim)
                else:
                    victim = group
                self._preempt(victim, blocks_to_swap_out)
                preempted += 1
                if victim is group:
                    break
            else:
                for seq in group.get_seqs(SequenceStatus.RUNNING):
                    blocks_to_copy.extend(bm.append_slots(seq))
                keep.append(group)
        self.running = keep
        return keep, preempted

    def _num_running_seqs(self) -> int:
        return sum(g.num_seqs(SequenceStatus.RUNNING) for g in self.running)

    def _schedule_swapped(self, blocks_to_swap_in, blocks_to_copy) -> list[SequenceGroup]:
        bm = self.block_manager
        resumed = []
        while self.swapped:
            group = self.swapped[0]
            if bm.can_swap_in(group) != AllocStatus.OK:
                break
            if self._num_running_seqs() + group.num_seqs(SequenceStatus.SWAPPED) > \
                    self.scheduler_config.max_num_seqs:
                break
            self.swapped.popleft()
            blocks_to_swap_in.extend(bm.swap_in(group))
            for seq in group.get_seqs(SequenceStatus.SWAPPED):
                seq.status = SequenceStatus.RUNNING
                blocks_to_copy.extend(bm.append_slots(seq))
            self.running.append(group)
            resumed.append(group)
            self.stats.num_swapped_in += 1
        return resumed

    def _schedule_waiting(self, ignored: list[SequenceGroup]) -> list[SequenceGroup]:
        bm = self.block_manager
        cfg = self.scheduler_config
        budget = cfg.max_num_batched_tokens
        admitted: list[SequenceGroup] = []
        if cfg.policy == "priority" and len(self.waiting) > 1:
            self.waiting = deque(sorted(self.waiting, key=lambda g: (g.priority, g.arrival_time)))
        while self.waiting:
            group = self.waiting[0]
            status = bm.can_allocate(group)
            if status == AllocStatus.NEVER:
                self.waiting.popleft()
                group.error = (f"request {group.request_id} needs more KV cache blocks than the "
                               f"cache has ({self.cache_config.num_gpu_blocks} blocks of "
                               f"{self.cache_config.block_size} tokens); raise kv_cache_memory")
                for seq in group.get_seqs():
                    seq.status = SequenceStatus.FINISHED_IGNORED
                ignored.append(group)
                self.stats.num_ignored += 1
                continue
            if status == AllocStatus.LATER:
                break
            seqs = group.get_seqs(SequenceStatus.WAITING)
            tokens = seqs[0].get_len() + group.encoder_seq.get_len()
            if admitted and tokens > budget:
                break
            if self._num_running_seqs() + len(seqs) > cfg.max_num_seqs:
                break
            self.waiting.popleft()
            bm.allocate(group)
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            budget -= tokens
            self.running.append(group)
            admitted.append(group)
            self.stats.admitted_at_step.setdefault(group.request_id, self.num_steps)
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = time.time()
        return admitted

    def schedule(self) -> tuple[list[SequenceGroupMetadata], SchedulerOutputs]:
        swap_in: list[tuple[int, int]] = []
        swap_out: list[tuple[int, int]] = []
        copy: list[tuple[int, int]] = []
        ignored: list[SequenceGroup] = []
        decodes, preempted = self._schedule_running(swap_out, copy)
        prefills: list[SequenceGroup] = []
        if not preempted:
            decodes = decodes + self._schedule_swapped(swap_in, copy)
            if not self.swapped:
                prefills = self._schedule_waiting(ignored)
        self.num_steps += 1
        bm = self.block_manager
        metas, scheduled = [], []
        for group, is_prompt in [(g, True) for g in prefills] + [(g, False) for g in decodes]:
            seqs = group.get_seqs(SequenceStatus.RUNNING)
            chunk = seqs[0].get_len() if is_prompt else 1
            scheduled.append(ScheduledSequenceGroup(group, chunk))
            metas.append(SequenceGroupMetadata(
                request_id=group.request_id,
                is_prompt=is_prompt,
                seq_data={s.seq_id: s.data for s in seqs},
                sampling_params=group.sampling_params,
                block_tables={s.seq_id: bm.get_block_table(s) for s in seqs},
                token_chunk_size=chunk,
                encoder_seq_data=group.encoder_seq.data,
                cross_block_table=bm.get_cross_block_table(group),
                encoder_inputs=group.encoder_seq.inputs.get("encoder_features") if is_prompt else None,
            ))
        num_tokens = sum(s.token_chunk_size for s in scheduled[: len(prefills)]) + \
            sum(g.num_seqs(SequenceStatus.RUNNING) for g in decodes)
        return metas, SchedulerOutputs(
            scheduled_seq_groups=scheduled,
            num_prefill_groups=len(prefills),
            num_batched_tokens=num_tokens,
            blocks_to_swap_in=swap_in,
            blocks_to_swap_out=swap_out,
            blocks_to_copy=copy,
            preempted=preempted,
            ignored_seq_groups=ignored,
        )
