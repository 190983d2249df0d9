"""How a group leaves the device before it finishes: preemption (swap out or
recompute) and failure (a group that can never run). A part of ``Scheduler``,
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
