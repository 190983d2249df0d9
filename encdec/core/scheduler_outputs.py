"""What the scheduler hands out each step, and its counters. Nothing here
imports torch."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from encdec.core.outputs import BeamCandidates
from encdec.sequence import Sequence, SequenceGroup


@dataclass
class ScheduledSequenceGroup:
    seq_group: SequenceGroup
    token_chunk_size: int  # decoder tokens computed this step per sequence


@dataclass
class EncoderPiece:
    """Part of one waiting request's encoder pass, for this step: units
    ``[start, stop)`` of ``rows * layers``, layer after layer (unit ``u`` is row
    ``u % rows`` of layer ``u // rows``). The pass ends with the piece whose
    ``stop`` is ``rows * layers``; the request is admitted in that step."""

    request_id: str
    token_ids: list[int]  # the encoder prompt (rows = its length)
    features: Any  # model-specific encoder input (audio features), or None
    start: int
    stop: int
    layers: int

    @property
    def rows(self) -> int:
        return len(self.token_ids)

    @property
    def last(self) -> bool:
        return self.stop == self.rows * self.layers


@dataclass
class EncoderWork:
    """A step's encoder work: ``pieces`` of split passes, and ``tokens``, all of
    it in whole-pass tokens (a piece's units / layers), what the budget bounds."""

    pieces: list[EncoderPiece] = field(default_factory=list)
    tokens: float = 0.0


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
    # The persistent batch's joins and leaves, by decoder seq_id, against the
    # previous step: sequences scheduled now and not then, and the reverse
    # (finished, freed, preempted, aborted or dropped beams). Joins in the order
    # of the step's metadata.
    seq_ids_joined: list[int] = field(default_factory=list)
    seq_ids_left: list[int] = field(default_factory=list)
    # the tokens each constrained sequence may sample this step (structured
    # outputs' grammar state); None: no scheduled request is constrained
    token_masks: TokenMasks | None = None
    # The same decode rows, in the same order, as the step before, which had no
    # prefill: each row is one token further, nothing joined or left.
    same_rows: bool = False
    # Speculative decoding: decoder seq_id -> the most draft tokens its row may
    # carry this step (slots given); rows not here carry none.
    spec_rows: dict[int, int] = field(default_factory=dict)
    # draft slots this step or the last: tables grown and trimmed in place (no reuse of last step's)
    tables_regrown: bool = False
    # encoder work this step: the pieces of split passes, and the whole in tokens
    encoder: EncoderWork = field(default_factory=EncoderWork)


@dataclass
class TokenMasks:
    """One step's grammar masks, filled by the scheduler's ``StructuredDecider``,
    applied by the sampler after the other processors, before temperature."""

    rows: dict[int, int]  # decoder seq_id -> its row of bitmask
    # (len(rows), ceil(vocab / 32)) int32, 32 tokens per word, bit set = allowed
    # (xgrammar's layout); the decider's array, opaque here
    bitmask: Any


@dataclass
class BeamUpdate:
    """One running beam after a step, made from a parent sequence."""

    parent_seq_id: int  # the running sequence it extends
    seq_id: int  # the parent's own id (the first beam made from it), else a new fork's id
    token_id: int  # appended to the beam
    cumulative_logprob: float  # the beam's running score (HF's running_beam_scores)


@dataclass
class BeamDecision:
    """What beam search decided for one group this step; ``Scheduler.update``
    applies it (forks share blocks by reference; dropped beams are freed)."""

    request_id: str
    finished: bool  # the search is over: every running beam finishes and is freed
    beams: list[BeamUpdate] = field(default_factory=list)  # the new beams in order; [] if finished
    dropped: list[int] = field(default_factory=list)  # running seq_ids no new beam extends


class BeamDecider(Protocol):
    """Beam search as the scheduler uses it (``encdec.beam_search.manager``)."""

    def start(self, group: SequenceGroup) -> None:
        """A beam group enters the queues: its search state, on the group."""

    def decide(self, candidates: dict[str, BeamCandidates],
               groups: dict[str, SequenceGroup]) -> list[BeamDecision]:
        """Each candidate group's beams after this step; changes no sequence."""


class StructuredDecider(Protocol):
    """Structured outputs as the scheduler uses them (``encdec.structured_output.manager``)."""

    def fill_masks(self, groups: list[SequenceGroup]) -> TokenMasks | None:
        """The step's masks for the constrained running sequences of ``groups``."""

    def accept(self, seq: Sequence, token_id: int) -> bool:
        """``seq`` appended ``token_id``; True when its grammar ends it."""

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """A beam forked from ``parent`` continues from its grammar state."""

    def free(self, seq_ids: list[int]) -> None:
        """These sequences are done."""


@dataclass
class SchedulerStats:
    """Counters since the scheduler was built (``llm.llm_engine.scheduler.stats``)."""

    num_preempted_swap: int = 0  # preemptions that swapped a group to CPU
    num_preempted_recompute: int = 0  # preemptions that dropped a group's KV to recompute it
    num_preempted_for_priority: int = 0  # of those, made for a higher-priority waiting group
    num_swapped_in: int = 0  # swapped groups resumed
    num_blocks_swapped_out: int = 0  # device -> CPU block copies asked for
    num_blocks_swapped_in: int = 0  # CPU -> device block copies asked for
    num_ignored: int = 0  # requests finished with an error (never fit, no swap space)
    num_aborted: int = 0  # requests aborted by the user
    # Encoder cache (requests with the same encoder input share a cross table):
    encoder_cache_queries: int = 0  # prefills of requests with a cache key (cache on)
    encoder_cache_hits: int = 0  # of those, prefills that reused a cross table's KV
    num_encoder_passes: int = 0  # prefills that ran the encoder (cache on or off)
    peak_num_gpu_blocks_used: int = 0  # most device KV blocks in use after a schedule()
    # Speculative decoding: draft tokens verified, and of those the ones kept
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_drafts: int = 0
    # request id -> step it was first admitted at; the last scheduler.ADMITTED_HISTORY only
    admitted_at_step: dict[str, int] = field(default_factory=dict)

    @property
    def num_preempted(self) -> int:
        return self.num_preempted_swap + self.num_preempted_recompute


@dataclass
class StepBlocks:
    """What one ``schedule()`` accumulates for the cache engine and the engine."""

    swap_in: list[tuple[int, int]] = field(default_factory=list)  # CPU -> device
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # device -> CPU
    copy: list[tuple[int, int]] = field(default_factory=list)  # device -> device
    ignored: list[SequenceGroup] = field(default_factory=list)  # finished with an error
