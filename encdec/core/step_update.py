"""What a step's results do to its sequences, applied by ``Scheduler.update``
(the one owner of sequence state, as nano-vllm's ``Scheduler.postprocess``):

    sampled tokens   appended in order; the stop checker ends the sequence on
                     eos, a stop id or string, max_tokens or max_model_len (the
                     tokens after one that ends it are dropped); a finished
                     sequence's blocks are freed at once
    beam decisions   parents kept by one new beam append in place, by m > 1
                     beams fork m - 1 times first (shared blocks, copy-on-write
                     of the last one later), kept by none are freed; a finished
                     search finishes and frees every beam
    prompt logprobs  kept on the group the first time a prefill reports them
    grammars         (structured outputs) each appended token advances its
                     sequence's matcher; a grammar that terminates ends the
                     sequence ("stop"); forks copy their parent's matcher
                     before either appends; dropped and finished beams free theirs

Pure bookkeeping on ``encdec.core.outputs``' types, no torch.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from encdec.core.outputs import ModelRunnerOutput
from encdec.core.scheduler_outputs import BeamDecision, SchedulerOutputs, StructuredDecider
from encdec.sequence import Sequence, SequenceGroup, SequenceStatus

if TYPE_CHECKING:
    from encdec.block_manager import BlockSpaceManager
    from encdec.core.stop_checker import StopChecker


def mark_computed(sched: SchedulerOutputs) -> None:
    """The scheduled tokens are computed; a prefill's first token time is now
    (its last chunk's, under chunked prefill: the earlier ones sample nothing)."""
    now = time.time()
    for i, s in enumerate(sched.scheduled_seq_groups):
        group = s.seq_group
        group.update_num_computed_tokens(s.token_chunk_size)
        if (i < sched.num_prefill_groups and group.metrics.first_token_time is None
                and not group.seqs[0].data.is_prefilling()):
            group.metrics.first_token_time = now


def running_seqs(sched: SchedulerOutputs) -> dict[int, tuple[Sequence, SequenceGroup]]:
    """seq_id -> (sequence, group) of the step's running decoder sequences."""
    return {s.seq_id: (s, g.seq_group) for g in sched.scheduled_seq_groups
            for s in g.seq_group.get_seqs(SequenceStatus.RUNNING)}


def append_samples(output: ModelRunnerOutput, seqs: dict[int, tuple[Sequence, SequenceGroup]],
                   block_manager: BlockSpaceManager, stop_checker: StopChecker,
                   structured: StructuredDecider | None = None,
                   rules: dict[int, tuple[int, frozenset[int], int] | None] | None = None,
                   computed: int = 0) -> tuple[list[SequenceGroup], int]:
    """Each sequence's tokens (``output.samples`` and ``output.single``; ``seqs``:
    ``running_seqs`` of the step), stop-checked one by one; their text may be
    left owed (``StopChecker.check(defer_text=True)``) where no stop string
    needs it. ``rules``: each sequence's ``StopChecker.quick_rule``, filled in
    as met: a token without logprobs that the rule passes is appended with no
    further call (most rows of most steps). ``computed``: tokens each row's
    sequence computed this step that ``mark_computed`` did not count (a step
    of decode rows only: 1). Returns the groups a sequence of which finished
    (each once) and the number of tokens appended. A sample of a sequence no
    longer running (it ended in the step before, which ran after this one was
    scheduled: async scheduling) is dropped."""
    ended: dict[int, SequenceGroup] = {}
    appended = 0
    single = output.single
    if single is not None:
        quick = rules is not None and structured is None
        for seq_id, t in zip(single.seq_ids, single.token_ids):
            entry = seqs.get(seq_id)
            if entry is None or entry[0].status is not SequenceStatus.RUNNING:
                continue  # finished (or aborted) after this step was scheduled ahead: its row was spare
            seq, group = entry
            rule = rules.get(seq_id, False) if quick else None
            if rule is False:
                rule = rules[seq_id] = stop_checker.quick_rule(seq, group.sampling_params)
            if rule is not None:
                n = seq.append_sampled(t, computed)
                appended += 1
                if n < rule[0] and t < rule[2] and t not in rule[1]:
                    continue
                stop_checker.check(seq, group.sampling_params, defer_text=True)
                if seq.is_finished():
                    block_manager.free(seq)
                    ended[id(group)] = group
                continue
            appended += _append(seq, group, [t], [], computed, block_manager, stop_checker, structured, ended)
    quick = rules is not None and structured is None
    for sample in output.samples:
        entry = seqs.get(sample.seq_id)
        if entry is None or entry[0].status is not SequenceStatus.RUNNING:
            continue
        rule = None
        if quick and not sample.logprobs:  # a speculating row's kept tokens: as ``single``'s rows
            rule = rules.get(sample.seq_id, False)
            if rule is False:
                rule = rules[sample.seq_id] = stop_checker.quick_rule(entry[0], entry[1].sampling_params)
        if rule is not None:
            appended += _append_quick(*entry, sample.sampled_token_ids, rule, computed, block_manager,
                                      stop_checker, ended)
        else:
            appended += _append(*entry, sample.sampled_token_ids, sample.logprobs, computed,
                                block_manager, stop_checker, structured, ended)
    return list(ended.values()), appended


def _append_quick(seq: Sequence, group: SequenceGroup, tokens: list[int], rule: tuple[int, frozenset[int], int],
                  computed: int, block_manager: BlockSpaceManager, stop_checker: StopChecker,
                  ended: dict[int, SequenceGroup]) -> int:
    """``_append`` of tokens without log-probs or grammar, for a sequence with a
    ``StopChecker.quick_rule``: a token the rule passes is appended with no
    further call; any other goes to ``check`` (several a step where drafts
    were kept: a check per token cost a speculating row more than its step saved)."""
    limit, stop_ids, vocab_end = rule
    if computed:
        seq.data.update_num_computed_tokens(computed)
    for i, t in enumerate(tokens):
        n = seq.append_sampled(t)
        if n < limit and t < vocab_end and t not in stop_ids:
            continue
        stop_checker.check(seq, group.sampling_params, defer_text=True)
        if _ended(seq, group, block_manager, ended):
            return i + 1
    return _all_kept(seq, tokens)


def _append(seq: Sequence, group: SequenceGroup, tokens: list[int], logprobs: list, computed: int,
            block_manager: BlockSpaceManager, stop_checker: StopChecker, structured: StructuredDecider | None,
            ended: dict[int, SequenceGroup]) -> int:
    """One sequence's tokens, each stop-checked (and grammar-checked); returns how many were appended."""
    if computed:
        seq.data.update_num_computed_tokens(computed)
    for i, token_id in enumerate(tokens):
        seq.append_token_id(token_id, logprobs[i] if logprobs else None)
        stop_checker.check(seq, group.sampling_params, defer_text=True)
        if structured is not None and structured.accept(seq, token_id) and not seq.is_finished():
            seq.status = SequenceStatus.FINISHED_STOPPED  # the grammar is done (ignore_eos kept it going)
            stop_checker.settle_text(seq, group.sampling_params)  # a finished sequence's text is never owed
        if _ended(seq, group, block_manager, ended):
            return i + 1
    return _all_kept(seq, tokens)


def _ended(seq: Sequence, group: SequenceGroup, block_manager: BlockSpaceManager,
           ended: dict[int, SequenceGroup]) -> bool:
    """Whether the token just appended finished the sequence; if so its blocks
    are freed and its group noted."""
    if not seq.is_finished():
        return False
    block_manager.free(seq)
    ended[id(group)] = group
    return True


def _all_kept(seq: Sequence, tokens: list[int]) -> int:
    """Every token was appended: verified drafts' K/V is computed too (all but the newest token's)."""
    if len(tokens) > 1:
        seq.data.update_num_computed_tokens(len(tokens) - 1)
    return len(tokens)


def keep_prompt_logprobs(runner_output: ModelRunnerOutput, groups: dict[str, SequenceGroup]) -> None:
    """A recomputed prefill reports them again; the first report stays."""
    for request_id, lps in runner_output.prompt_logprobs.items():
        group = groups.get(request_id)
        if group is not None and group.prompt_logprobs is None:
            group.prompt_logprobs = lps
    for request_id, lps in runner_output.prompt_token_logprobs.items():
        group = groups.get(request_id)
        if group is not None and group.prompt_token_logprobs is None:
            group.prompt_token_logprobs = lps


def apply_beam_decision(decision: BeamDecision, group: SequenceGroup, block_manager: BlockSpaceManager,
                        structured: StructuredDecider | None = None) -> None:
    running = {s.seq_id: s for s in group.get_seqs(SequenceStatus.RUNNING)}
    if decision.finished:
        for seq in running.values():
            seq.status = SequenceStatus.FINISHED_STOPPED
            block_manager.free(seq)
        if structured is not None:
            structured.free(list(running))
        return
    beams: list[Sequence] = []
    for b in decision.beams:  # every fork before any parent appends its own token
        seq = running[b.parent_seq_id]
        if b.seq_id != seq.seq_id:
            child = seq.fork(b.seq_id)
            block_manager.fork(seq, child)
            if structured is not None:
                structured.fork(seq, child)
            group.add(child)
            seq = child
        beams.append(seq)
    for seq_id in decision.dropped:
        seq = running[seq_id]
        seq.status = SequenceStatus.FINISHED_STOPPED
        block_manager.free(seq)
        group.remove(seq_id)
    if structured is not None:
        structured.free(decision.dropped)
    for seq, b in zip(beams, decision.beams):
        seq.append_token_id(b.token_id)
        seq.data.cumulative_logprob = b.cumulative_logprob
        if structured is not None:  # a beam's end is the beam search's to decide (eos is its grammar's end)
            structured.accept(seq, b.token_id)
    position = {seq.seq_id: j for j, seq in enumerate(beams)}
    group.seqs.sort(key=lambda s: position.get(s.seq_id, -1))
