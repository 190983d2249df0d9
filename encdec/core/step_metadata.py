"""The runner's view of one step: a ``SequenceGroupMetadata`` (and the
scheduler's ``ScheduledSequenceGroup``) per scheduled group, prefills first.

A decode row of a single-sequence group keeps one pair across steps: its
sequence data and its self and cross tables are live objects that grow in
place, and a decode always computes one token, so last step's pair still says
everything. The pair is dropped when the group is preempted (swap-in and
recompute give it new tables), prefills again or is freed, and rebuilt when
the block manager holds another self table than the one it names. Building it
afresh for every row of every step cost a few microseconds each: at 256 rows,
a large share of a small model's step.

A step whose decodes are last step's decodes, the same groups in the same
order, with no prefill in either step and nothing forgotten since, is last
step's lists again (``unchanged``): the scheduler and the model runner then
skip their per-row work on the batch's shape. No torch here.
"""
from __future__ import annotations

import operator
from collections.abc import Callable

from encdec.block_manager import BlockSpaceManager
from encdec.core.scheduler_outputs import ScheduledSequenceGroup
from encdec.sampling_params import SamplingType
from encdec.sequence import SequenceGroup, SequenceGroupMetadata, SequenceStatus

Entry = tuple[ScheduledSequenceGroup, SequenceGroupMetadata]


class StepMetadata:
    def __init__(self, block_manager: BlockSpaceManager):
        self._bm = block_manager
        self._decodes: dict[str, Entry] = {}  # request_id -> its decode pair
        # The last step: its decode groups, their metadata and scheduled groups, and
        # whether it had prefills; None once anything was forgotten since.
        self._last: tuple[list[SequenceGroup], list[SequenceGroupMetadata],
                          list[ScheduledSequenceGroup], bool] | None = None
        self.unchanged = False  # the step built last: the same rows as the one before

    def forget(self, request_id: str) -> None:
        """The group is freed (finished, aborted) or preempted: its pair goes."""
        self._decodes.pop(request_id, None)
        self._last = None

    def build(self, prefills: list[SequenceGroup], decodes: list[SequenceGroup],
              cross_kv_cached: Callable[[SequenceGroup], bool],
              chunks: dict[str, int] | None = None) -> tuple[list[SequenceGroupMetadata],
                                                             list[ScheduledSequenceGroup]]:
        """The step's metadata and scheduled groups, prefills first.
        ``cross_kv_cached(group)``: whether a prefill reuses its cross table's KV
        (asked once per prefill: the scheduler counts it). ``chunks``: request id
        -> the prompt tokens a chunked prefill computes this step (others: all left)."""
        last = self._last
        if (not prefills and last is not None and len(decodes) == len(last[0])
                and all(map(operator.is_, decodes, last[0]))):
            self.unchanged = not last[3]
            self._last = (last[0], last[1], last[2], False)
            return list(last[1]), list(last[2])
        self.unchanged = False
        metas, scheduled = [], []
        for group in prefills:
            self._decodes.pop(group.request_id, None)
            sched, meta = self._entry(group, True, cross_kv_cached(group),
                                      chunks.get(group.request_id) if chunks else None)
            scheduled.append(sched)
            metas.append(meta)
        decoded = self._decodes
        for group in decodes:
            entry = decoded.get(group.request_id)
            if entry is None or not self._current(group, entry[1]):
                entry = self._entry(group, False, False)
                if len(group.seqs) == 1:
                    decoded[group.request_id] = entry
            scheduled.append(entry[0])
            metas.append(entry[1])
        # A beam search forks and drops its group's sequences between steps: never the same rows.
        beam = SamplingType.BEAM
        single = all(len(g.seqs) == 1 and getattr(g.sampling_params, "sampling_type", None) is not beam
                     for g in decodes)
        self._last = ((list(decodes), metas[len(prefills):], scheduled[len(prefills):], bool(prefills))
                      if single else None)
        return metas, scheduled

    def _current(self, group: SequenceGroup, meta: SequenceGroupMetadata) -> bool:
        seqs = group.seqs
        if len(seqs) != 1:
            return False
        seq = seqs[0]
        # Preemption forgets the pair (its tables are replaced when it comes back);
        # this guards what else could replace them: another sequence, another table.
        return (seq.status is SequenceStatus.RUNNING and meta.seq_data.get(seq.seq_id) is seq.data
                and meta.block_tables.get(seq.seq_id) is self._bm.get_block_table(seq))

    def _entry(self, group: SequenceGroup, is_prompt: bool, cached: bool, chunk: int | None = None) -> Entry:
        bm = self._bm
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        # A prefill (first, or after recompute) computes prompt + outputs so far,
        # less the leading tokens whose K/V the prefix cache holds (or a chunk of them).
        left = seqs[0].get_len() - seqs[0].data.get_num_computed_tokens() if is_prompt else 1
        chunk = left if chunk is None else chunk
        meta = SequenceGroupMetadata(
            request_id=group.request_id,
            is_prompt=is_prompt,
            seq_data={s.seq_id: s.data for s in seqs},
            sampling_params=group.sampling_params,
            block_tables={s.seq_id: bm.get_block_table(s) for s in seqs},
            token_chunk_size=chunk,
            encoder_seq_data=group.encoder_seq.data,
            cross_block_table=bm.get_cross_block_table(group),
            encoder_inputs=(group.encoder_seq.inputs.get("encoder_features")
                            if is_prompt and not cached else None),
            cross_kv_cached=cached,
            do_sample=chunk >= left,
        )
        return ScheduledSequenceGroup(group, chunk), meta
