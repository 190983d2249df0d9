"""Sequences and groups: the engine's bookkeeping of one request.

A request (``SequenceGroup``) holds one static encoder sequence and one or more
decoder sequences (``n > 1`` forks them). Nothing here imports torch: the block
manager and the scheduler only see token counts and ids.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from encdec.inputs import EncoderDecoderLLMInputs


class SequenceStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_IGNORED = 6

    @staticmethod
    def is_finished(status: SequenceStatus) -> bool:
        return status >= SequenceStatus.FINISHED_STOPPED

    @staticmethod
    def get_finished_reason(status: SequenceStatus) -> str | None:
        return {
            SequenceStatus.FINISHED_STOPPED: "stop",
            SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
            SequenceStatus.FINISHED_ABORTED: "abort",
            SequenceStatus.FINISHED_IGNORED: "length",
        }.get(status)


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class SequenceData:
    """Token ids of one sequence: the prompt (fixed) and the outputs (growing).

    ``output_token_ids`` is a live list: the persistent batch and the logits
    processors hold references to it and see each appended token.
    """

    def __init__(self, prompt_token_ids: list[int], output_token_ids: list[int] | None = None):
        self._prompt_token_ids = list(prompt_token_ids)
        self._output_token_ids = list(output_token_ids or [])
        self.cumulative_logprob = 0.0
        # Tokens whose KV is in the cache; the rest are computed next step.
        self._num_computed_tokens = 0
        # Whether its prefill (since admission or the last recompute) reached its
        # last token: a chunked prefill stays False through its earlier chunks,
        # which sample nothing.
        self._prefill_done = False
        # Which of its request's n / best_of samples this is: the output index and
        # the seed offset of a seeded request (vLLM's seed + index).
        self.sample_index = 0

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    def append_token_id(self, token_id: int, logprob: float) -> None:
        self._output_token_ids.append(token_id)
        self.cumulative_logprob += logprob

    def get_len(self) -> int:
        return len(self._prompt_token_ids) + len(self._output_token_ids)

    def get_prompt_len(self) -> int:
        return len(self._prompt_token_ids)

    def get_output_len(self) -> int:
        return len(self._output_token_ids)

    def get_token_ids(self) -> list[int]:
        return self._prompt_token_ids + self._output_token_ids

    def get_last_token_id(self) -> int:
        if self._output_token_ids:
            return self._output_token_ids[-1]
        return self._prompt_token_ids[-1]

    def get_num_computed_tokens(self) -> int:
        return self._num_computed_tokens

    def update_num_computed_tokens(self, n: int) -> None:
        self._num_computed_tokens += n
        assert self._num_computed_tokens <= len(self._prompt_token_ids) + len(self._output_token_ids)
        if self._num_computed_tokens == len(self._prompt_token_ids) + len(self._output_token_ids):
            self._prefill_done = True

    def is_prefilling(self) -> bool:
        """Its prefill has tokens left to compute (a chunked prefill between
        chunks, or one not started): it samples nothing yet."""
        return not self._prefill_done

    def reset_state_for_recompute(self) -> None:
        self._num_computed_tokens = 0
        self._prefill_done = False

    def copy(self) -> SequenceData:
        new = SequenceData(self._prompt_token_ids, self._output_token_ids)
        new.cumulative_logprob = self.cumulative_logprob
        new._num_computed_tokens = self._num_computed_tokens
        new._prefill_done = self._prefill_done
        new.sample_index = self.sample_index
        return new


class Sequence:
    """One token stream. Built from the decoder side of the inputs, or, for the
    group's ``encoder_seq``, from the encoder side (``from_decoder_prompt=False``)."""

    def __init__(
        self,
        seq_id: int,
        inputs: EncoderDecoderLLMInputs,
        block_size: int,
        eos_token_id: int | None = None,
        from_decoder_prompt: bool = True,
    ):
        self.seq_id = seq_id
        self.inputs = inputs
        self.block_size = block_size
        self.eos_token_id = eos_token_id
        self.from_decoder_prompt = from_decoder_prompt
        if from_decoder_prompt:
            ids, text = inputs["prompt_token_ids"], inputs.get("prompt")
        else:
            ids, text = inputs["encoder_prompt_token_ids"], inputs.get("encoder_prompt")
        self.prompt = text
        self.data = SequenceData(ids)
        self.output_logprobs: list[dict[int, Logprob] | None] = []
        self.output_text = ""
        self.status = SequenceStatus.WAITING
        self.stop_reason: int | str | None = None
        # Incremental detokenizer state (see encdec.outputs): output tokens whose
        # text output_text holds (the rest is owed, decoded when read or at the end).
        self.num_text_tokens = 0
        self.tokens: list[str] | None = None
        self.prefix_offset = 0
        self.read_offset = 0

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.data.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.data.output_token_ids

    @property
    def n_blocks(self) -> int:
        return (self.get_len() + self.block_size - 1) // self.block_size

    def append_token_id(self, token_id: int, logprobs: dict[int, Logprob] | None = None) -> None:
        # None where the request asked for no logprobs: no object per token for the
        # garbage collector to walk (a request that asks gets a dict every token).
        self.output_logprobs.append(logprobs)
        lp = logprobs.get(token_id) if logprobs else None
        self.data.append_token_id(token_id, lp.logprob if lp is not None else 0.0)

    def append_sampled(self, token_id: int, computed: int = 0) -> int:
        """``append_token_id`` of a token without logprobs (most rows of most
        steps: one call, not three), after counting ``computed`` more tokens
        computed (the step's input token, where the caller counts it here);
        returns the output length now."""
        self.output_logprobs.append(None)
        data = self.data  # SequenceData is this module's own
        out = data._output_token_ids
        if computed:
            data._num_computed_tokens += computed  # <= the length: the step computed them
        out.append(token_id)
        return len(out)

    def get_len(self) -> int:
        return self.data.get_len()

    def get_prompt_len(self) -> int:
        return self.data.get_prompt_len()

    def get_output_len(self) -> int:
        return self.data.get_output_len()

    def get_token_ids(self) -> list[int]:
        return self.data.get_token_ids()

    def get_last_token_id(self) -> int:
        return self.data.get_last_token_id()

    def get_output_token_ids(self) -> list[int]:
        return self.data.output_token_ids

    def get_cumulative_logprob(self) -> float:
        return self.data.cumulative_logprob

    def is_finished(self) -> bool:
        return self.status >= SequenceStatus.FINISHED_STOPPED  # SequenceStatus.is_finished, inlined: hot

    def reset_state_for_recompute(self) -> None:
        self.data.reset_state_for_recompute()

    def fork(self, new_seq_id: int) -> Sequence:
        child = Sequence.__new__(Sequence)
        child.__dict__.update(self.__dict__)
        child.seq_id = new_seq_id
        child.data = self.data.copy()
        child.output_logprobs = list(self.output_logprobs)
        child.tokens = list(self.tokens) if self.tokens is not None else None
        return child

    def __repr__(self) -> str:
        return f"Sequence(seq_id={self.seq_id}, status={self.status.name}, num_blocks={self.n_blocks})"


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # True when no prefill of the request ran the encoder: it read a cross
    # table another request (or its own earlier admission) had written.
    encoder_cache_hit: bool = False
    # Speculative decoding (an engine with speculative_config): why the request
    # never speculates (None: it may; see core/speculation.py), and the draft
    # tokens it kept (each a step saved). A step where a logits processor acts
    # on its row carries no drafts; its tokens are the same either way.
    spec_decode_off: str | None = None
    spec_decode_accepted_tokens: int = 0


class SequenceGroup:
    """All sequences of one request, plus its encoder sequence."""

    def __init__(
        self,
        request_id: str,
        seqs: list[Sequence],
        arrival_time: float,
        sampling_params: Any = None,
        encoder_seq: Sequence | None = None,
        priority: int = 0,
        encoder_cache_key: str | None = None,
    ):
        self.request_id = request_id
        self.seqs = list(seqs)
        self.seqs_dict = {s.seq_id: s for s in seqs}
        self.arrival_time = arrival_time
        self.sampling_params = sampling_params
        self.encoder_seq = encoder_seq
        self.priority = priority
        # Content key of the encoder input: requests with equal keys share one
        # cross table and one encoder pass. None: this request shares nothing.
        self.encoder_cache_key = encoder_cache_key
        # Of its encoder pass split by the encoder budget: rows x layers run so far
        # (encdec.core.encoder_split); 0 when nothing is run, and again once admitted.
        self.encoder_units_done = 0
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        # Set when the request can never run (e.g. too long for the cache).
        self.error: str | None = None
        # Decoder-prompt logprobs, filled at prefill when asked.
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        # Raw log-probs at chosen prompt positions (SamplingParams.prompt_token_logprobs).
        self.prompt_token_logprobs: dict[int, dict[int, float]] | None = None
        # A beam request's search state beyond its running sequences (the finished
        # pool; encdec.beam_search.manager), set when the scheduler admits it to
        # its queues; None for every other request.
        self.beam_state: Any = None

    @property
    def prompt(self) -> str | None:
        return self.seqs[0].inputs.get("prompt")

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seqs[0].inputs["prompt_token_ids"]

    @property
    def encoder_prompt(self) -> str | None:
        return self.seqs[0].inputs.get("encoder_prompt")

    @property
    def encoder_prompt_token_ids(self) -> list[int]:
        return self.seqs[0].inputs["encoder_prompt_token_ids"]

    def is_encoder_decoder(self) -> bool:
        return self.encoder_seq is not None

    def get_encoder_seq(self) -> Sequence | None:
        return self.encoder_seq

    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        seqs = self.seqs
        if status is None:
            return seqs
        if len(seqs) == 1:  # most groups; called several times per sequence per step
            return [seqs[0]] if seqs[0].status == status else []
        return [s for s in seqs if s.status == status]

    def get_unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished()]

    def get_finished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if s.is_finished()]

    def num_seqs(self, status: SequenceStatus | None = None) -> int:
        return len(self.get_seqs(status))

    def add(self, seq: Sequence) -> None:
        assert seq.seq_id not in self.seqs_dict
        self.seqs.append(seq)
        self.seqs_dict[seq.seq_id] = seq

    def remove(self, seq_id: int) -> None:
        seq = self.seqs_dict.pop(seq_id)
        self.seqs.remove(seq)

    def get_max_num_running_seqs(self) -> int:
        """The most decoder sequences this group will need at once: the whole
        ``best_of`` fan-out before prefill, the unfinished ones after."""
        if self.sampling_params is not None and not self.is_prefill():
            return self.num_unfinished_seqs()
        best_of = getattr(self.sampling_params, "best_of", None) or 1
        return max(best_of, self.num_unfinished_seqs())

    def num_unfinished_seqs(self) -> int:
        return len(self.get_unfinished_seqs())

    def is_prefill(self) -> bool:
        return self.seqs[0].data.get_num_computed_tokens() == 0

    def update_num_computed_tokens(self, n: int) -> None:
        for seq in self.seqs:
            if seq.status < SequenceStatus.FINISHED_STOPPED:
                seq.data.update_num_computed_tokens(n)

    def is_finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:  # most groups; asked for every group of every step
            return seqs[0].status >= SequenceStatus.FINISHED_STOPPED
        return all(s.is_finished() for s in seqs)

    def __repr__(self) -> str:
        return f"SequenceGroup(request_id={self.request_id}, num_seqs={len(self.seqs)})"


@dataclass
class SequenceGroupMetadata:
    """What the scheduler tells the model runner about one request this step."""

    request_id: str
    is_prompt: bool  # True: prefill (encoder runs and cross cache written, unless cross_kv_cached)
    seq_data: dict[int, SequenceData]  # decoder seq_id -> its data
    sampling_params: Any
    block_tables: dict[int, list[int]]  # decoder seq_id -> device block numbers
    token_chunk_size: int | None = None  # decoder tokens to compute this step per sequence
    encoder_seq_data: SequenceData | None = None  # encoder prompt tokens (static)
    cross_block_table: list[int] | None = None  # device block numbers of the cross KV
    encoder_inputs: Any = None  # model-specific encoder input (e.g. audio features)
    # Prefill only: the cross table already holds this input's KV, or another
    # prefill of this step writes it; the runner skips this request's encoder.
    cross_kv_cached: bool = False
    # False for a chunk of a prefill that is not its last (chunked prefill): its
    # tokens' K/V are computed and nothing is sampled (vLLM's name).
    do_sample: bool = True

    def __post_init__(self) -> None:
        if self.token_chunk_size is None:
            if self.is_prompt:
                self.token_chunk_size = next(iter(self.seq_data.values())).get_len()
            else:
                self.token_chunk_size = 1
