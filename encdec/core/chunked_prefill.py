"""Chunked decoder prefill (``enable_chunked_prefill``): a step's token budget
``max_num_batched_tokens`` counts one token per running decode row and the
decoder prompt tokens of its prefill chunks; a prompt longer than what is left
is computed over several steps beside the decodes. A part of ``Scheduler``
(as ``Admission`` is), working on its queues; no torch here.

Rules that keep it exact:
  * a chunk computes prompt tokens ``[c, c + k)`` over the K/V of ``[0, c)``
    (the runner packs it as the prefix cache's prefill past cached tokens);
    a chunk that is not the last samples nothing (``do_sample``), so a group
    starts decoding, and the request's generator draws, only once its whole
    prompt is computed: the same tokens as without chunks;
  * the first chunk runs the request's whole encoder input (the cross K/V must
    exist before any decoder token attends to it; an encoder pass cannot be
    split by tokens); later chunks read the cross table (``cross_kv_cached``);
  * a group between chunks holds every block of its prompt (allocated at
    admission): it asks no slots, never speculates, and may be preempted
    (swap: it resumes its chunks; recompute: it starts again from token 0);
  * a group whose last step is still running (async scheduling: its computed
    count is not updated yet) gets no chunk until it is;
  * groups that prefill whole: beam search (its candidates come from the
    prefill's row), several sequences at prefill (``n``/``best_of`` > 1: they
    share the prompt's blocks) and prompt log-prob requests (read from a
    whole prefill's rows).
"""
from __future__ import annotations

from collections.abc import Collection

from encdec.block_manager import BlockSpaceManager
from encdec.config import SchedulerConfig
from encdec.sampling_params import SamplingType
from encdec.sequence import SequenceGroup, SequenceStatus


def chunkable(group: SequenceGroup) -> bool:
    """Whether the group's prefill may be split over steps (module docstring)."""
    params = group.sampling_params
    if params is None or group.num_seqs(SequenceStatus.WAITING) != 1:
        return False
    if params.sampling_type is SamplingType.BEAM or (getattr(params, "best_of", None) or 1) > 1:
        return False
    seq = group.seqs[0]
    return (getattr(params, "prompt_logprobs", None) is None
            and not (getattr(params, "prompt_token_logprobs", None) and seq.get_output_len() == 0))


def left_to_prefill(group: SequenceGroup) -> int:
    """Decoder tokens of the group's prefill not computed yet."""
    data = group.seqs[0].data
    return data.get_len() - data.get_num_computed_tokens()


def prefill_order(prefills: list[SequenceGroup], chunks: dict[str, int]) -> list[SequenceGroup]:
    """The runner's packing order: prefills from token 0 that sample, then first
    chunks from token 0 (which sample nothing: a prompt log-prob request's rows
    before them keep their offsets), then prefills past computed tokens."""
    def key(g: SequenceGroup) -> tuple[bool, bool]:
        chunk = chunks.get(g.request_id)
        return g.seqs[0].data.get_num_computed_tokens() > 0, chunk is not None and chunk < left_to_prefill(g)
    return sorted(prefills, key=key)


class ChunkedPrefill:
    """Mixed into ``Scheduler``: ``_chunking`` holds the request ids of groups
    admitted with a partial first chunk (a superset: a group's data says
    whether it still prefills)."""

    scheduler_config: SchedulerConfig
    block_manager: BlockSpaceManager
    _chunking: set[str]

    def _register_chunk(self, group: SequenceGroup, chunk: int) -> None:
        """The prefix cache indexes the prompt blocks this chunk completes (a
        first chunk's are indexed at admission: ``BlockSpaceManager.allocate``)."""
        prefix, key = self.block_manager.prefix, group.encoder_cache_key
        if prefix is not None and key is not None:
            seq = group.seqs[0]
            prefix.register_computed(key, seq.get_token_ids(), self.block_manager.get_block_table(seq),
                                     seq.data.get_num_computed_tokens() + chunk)

    def _mid_prefill(self, group: SequenceGroup) -> bool:
        """A running (or resumed) group between chunks of its prefill."""
        return group.request_id in self._chunking and group.seqs[0].data.is_prefilling()

    def _plan_chunks(self, groups: list[SequenceGroup],
                     ahead: Collection[int]) -> tuple[list[SequenceGroup], list[SequenceGroup], dict[str, int], int]:
        """Split the step's running and resumed groups into decodes and prefills
        continuing their chunks (most urgent first, while the budget lasts); the
        chunk of each, and the budget left for new admissions."""
        budget = self.scheduler_config.max_num_batched_tokens
        decodes: list[SequenceGroup] = []
        mids: list[SequenceGroup] = []
        for group in groups:
            if self._chunking and self._mid_prefill(group):
                mids.append(group)
            else:
                decodes.append(group)
                budget -= group.num_seqs(SequenceStatus.RUNNING)
        continuing: list[SequenceGroup] = []
        chunks: dict[str, int] = {}
        for group in mids:
            if budget <= 0:
                break
            if ahead and group.seqs[0].seq_id in ahead:
                continue  # its last chunk still runs: its computed count is not known yet
            left = left_to_prefill(group)
            chunk = min(left, budget)
            budget -= chunk
            chunks[group.request_id] = chunk
            continuing.append(group)
            self._register_chunk(group, chunk)
            if chunk == left:
                self._chunking.discard(group.request_id)
        return decodes, continuing, chunks, budget
