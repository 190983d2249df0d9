"""How a group leaves the device before it finishes: preemption (swap out or
recompute) and failure (a group that can never run); and how a swapped group
comes back. A part of ``Scheduler``,
kept apart so each file reads as one concern; it works on the scheduler's own
queues, block manager and stats. No torch here.
"""
from __future__ import annotations

from collections import deque

from encdec.block_manager import AllocStatus, BlockSpaceManager
from encdec.config import CacheConfig, PreemptionMode, SchedulerConfig
from encdec.core.scheduler_outputs import SchedulerStats, StepBlocks
from encdec.core.step_metadata import StepMetadata
from encdec.sequence import SequenceGroup, SequenceStatus


class Preemption:
    """Mixed into ``Scheduler``: the attributes below are the scheduler's, and so
    are ``_key``, ``_outranks_swapped`` and ``_free_group``."""

    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    block_manager: BlockSpaceManager
    waiting: deque[SequenceGroup]
    running: list[SequenceGroup]
    swapped: deque[SequenceGroup]
    stats: SchedulerStats
    _metadata: StepMetadata

    # -- failure ---------------------------------------------------------------
    def _fail(self, group: SequenceGroup, error: str, status: SequenceStatus,
              blocks: StepBlocks) -> None:
        """Finish a group that cannot run, with ``error`` for its output. The
        caller has already taken it out of its queue."""
        for seq in group.get_seqs():
            if not seq.is_finished():
                seq.status = status
        self._free_group(group)
        group.error = error
        blocks.ignored.append(group)
        self.stats.num_ignored += 1

    def _never_fits(self, group: SequenceGroup, num_blocks: int) -> str:
        cfg = self.cache_config
        return (f"request {group.request_id} needs {num_blocks} KV cache blocks but the cache has "
                f"{cfg.num_gpu_blocks} blocks of {cfg.block_size} tokens; raise kv_cache_memory")

    def _num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.cache_config.block_size)

    # -- preemption ------------------------------------------------------------
    def _preempt(self, group: SequenceGroup, blocks: StepBlocks) -> None:
        """Take a running group off the device. The caller removes it from
        ``running``; this puts it in ``swapped`` or ``waiting``.

        Recompute drops the KV and later re-prefills ``prompt + outputs`` of the
        group's single live sequence (the runner prefills the first sequence of
        ``seq_data`` and samples every sequence from it), so it is only allowed
        for a group with one live sequence: forked siblings hold different
        tokens and would be lost. Such groups are swapped even in recompute
        mode, and a single-sequence group is recomputed when CPU swap is full.
        """
        bm = self.block_manager
        self._metadata.forget(group.request_id)  # swap-in and recompute give it new tables
        mode = self.scheduler_config.preemption_mode or PreemptionMode.SWAP
        can_recompute = group.get_max_num_running_seqs() == 1
        if mode is PreemptionMode.RECOMPUTE and not can_recompute:
            mode = PreemptionMode.SWAP
        if mode is PreemptionMode.SWAP and not bm.can_swap_out(group):
            if not can_recompute:
                self._fail(group, (
                    f"request {group.request_id} was preempted but its "
                    f"{group.num_seqs(SequenceStatus.RUNNING)} forked sequences cannot be swapped "
                    f"out: CPU swap space is full ({bm.get_num_free_cpu_blocks()} blocks free); "
                    "raise swap_space"), SequenceStatus.FINISHED_ABORTED, blocks)
                return
            mode = PreemptionMode.RECOMPUTE
        if mode is PreemptionMode.SWAP:
            pairs = bm.swap_out(group)
            blocks.swap_out.extend(pairs)
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(group)
            self.stats.num_preempted_swap += 1
            self.stats.num_blocks_swapped_out += len(pairs)
        else:
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                seq.status = SequenceStatus.WAITING
                bm.free(seq)
                seq.reset_state_for_recompute()
            bm.free_cross(group)
            self.waiting.appendleft(group)  # fcfs: it arrived before every waiting group
            self.stats.num_preempted_recompute += 1

    def _preempt_for_waiting(self, blocks: StepBlocks) -> int:
        """Priority policy (vLLM V0's priority preemption): while the most urgent
        waiting group does not fit, preempt running groups of strictly lower
        priority, least urgent first. Runs before the running groups get their
        slots, so no victim has copies queued this step."""
        if not self.waiting or not self.running:
            return 0
        group = min(self.waiting, key=self._key)
        if not self._outranks_swapped(group):
            return 0
        bm = self.block_manager
        num_seqs = group.num_seqs(SequenceStatus.WAITING)
        max_seqs = self.scheduler_config.max_num_seqs
        running = sorted(self.running, key=self._key)
        preempted = 0
        while running and running[-1].priority > group.priority:
            status = bm.can_allocate(group)
            if status is AllocStatus.NEVER or num_seqs > max_seqs:
                break  # it will fail in _schedule_waiting; preempting would not help
            running_seqs = sum(g.num_seqs(SequenceStatus.RUNNING) for g in running)
            if status is AllocStatus.OK and running_seqs + num_seqs <= max_seqs:
                break
            self._preempt(running.pop(), blocks)
            preempted += 1
        self.running = running
        self.stats.num_preempted_for_priority += preempted
        return preempted

    def _schedule_swapped(self, blocks: StepBlocks) -> list[SequenceGroup]:
        """Resume swapped groups, most urgent first, stopping at the first that
        does not fit (so a big group is not starved by smaller ones behind it).
        Under the priority policy, stop before a group a waiting one outranks."""
        bm = self.block_manager
        if self._by_priority and len(self.swapped) > 1:
            self.swapped = deque(sorted(self.swapped, key=self._key))
        best_waiting = min((g.priority for g in self.waiting), default=None) if self._by_priority else None
        resumed: list[SequenceGroup] = []
        while self.swapped:
            group = self.swapped[0]
            if best_waiting is not None and best_waiting < group.priority:
                break
            status = bm.can_swap_in(group)
            if status is AllocStatus.LATER and bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks:
                status = AllocStatus.NEVER  # the cache is empty and it still does not fit
            if status is AllocStatus.NEVER:
                self.swapped.popleft()
                live = group.get_seqs(SequenceStatus.SWAPPED)
                held = {b for s in live for b in bm.get_block_table(s)}
                need = len(held) + len(bm.get_cross_block_table(group)) + len(live)  # + next tokens
                self._fail(group, self._never_fits(group, need), SequenceStatus.FINISHED_IGNORED, blocks)
                continue
            if status is AllocStatus.LATER:
                break
            if self._num_running_seqs() + group.num_seqs(SequenceStatus.SWAPPED) > \
                    self.scheduler_config.max_num_seqs:
                break
            self.swapped.popleft()
            pairs = bm.swap_in(group)
            blocks.swap_in.extend(pairs)
            for seq in group.get_seqs(SequenceStatus.SWAPPED):
                seq.status = SequenceStatus.RUNNING
                blocks.copy.extend(bm.append_slots(seq))
            self.running.append(group)
            self._running_sorted = False
            resumed.append(group)
            self.stats.num_swapped_in += 1
            self.stats.num_blocks_swapped_in += len(pairs)
        return resumed
