"""The persistent batch: one row per running decoder sequence, kept across steps.

Rows stay put between steps, so per-row sampling tensors are written once when a
sequence joins and copied to the device only when the batch changes; a step
with no joins or leaves reuses last step's ``SamplingMetadata`` as is. Each step
the model runner calls, in this order::

    remove_request(id)...  add_request(id, ...)...  condense()  [swap_states(i, j)...]
    md = refresh_metadata()   # processors see the step's BatchUpdate here

Adds fill the lowest holes left by removes, then extend; ``condense`` moves the
highest rows down into the remaining holes (see logits_processor/state.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from encdec.platform.device_tensors import to_device
from encdec.sample.logits_processor import BatchUpdateBuilder, LogitsProcessors, MoveDirectionality
from encdec.sample.metadata import SamplingMetadata
from encdec.sampling_params import SamplingType, derive_seed

if TYPE_CHECKING:
    from encdec.sampling_params import SamplingParams

# (params, decoder prompt ids, live output ids) of one row
_Row = tuple["SamplingParams", list[int], list[int]]


class InputBatch:
    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device | str,
                 logitsprocs: LogitsProcessors | None = None, is_pin_memory: bool = False) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size  # must equal the logits' last dimension
        self.device = torch.device(device)
        self.is_pin_memory = is_pin_memory
        self.logitsprocs = logitsprocs if logitsprocs is not None else LogitsProcessors()
        self.batch_update_builder = BatchUpdateBuilder()

        self._req_ids: list[str | None] = []  # slot -> sequence key; None = hole
        self._rows: list[_Row | None] = []
        self.req_id_to_index: dict[str, int] = {}

        def buf(dtype: torch.dtype) -> torch.Tensor:  # (max_num_reqs,) CPU, one value per slot
            return torch.zeros(max_num_reqs, dtype=dtype, pin_memory=is_pin_memory)

        self.temperature_cpu = buf(torch.float32)  # 0 for greedy rows
        self.top_p_cpu = buf(torch.float32)
        self.top_k_cpu = buf(torch.int64)  # vocab_size = off
        self.frequency_penalties_cpu = buf(torch.float32)
        self.presence_penalties_cpu = buf(torch.float32)
        self.repetition_penalties_cpu = buf(torch.float32)
        self._buffers = [b.numpy() for b in (
            self.temperature_cpu, self.top_p_cpu, self.top_k_cpu, self.frequency_penalties_cpu,
            self.presence_penalties_cpu, self.repetition_penalties_cpu)]
        self._allowed_mask_cpu: torch.Tensor | None = None  # (max_num_reqs, vocab) bool, lazy

        # Keyed by sequence, not slot, so moves leave them alone.
        self._greedy: set[str] = set()
        self._random: set[str] = set()
        self._top_p: set[str] = set()
        self._top_k: set[str] = set()
        self._penalties: set[str] = set()
        self._allowed: set[str] = set()
        self._num_logprobs: dict[str, int] = {}
        self._processed_logprobs: set[str] = set()  # logprobs_mode="processed_logprobs"
        self._bad_words: dict[str, list[list[int]]] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._metadata: SamplingMetadata | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    @property
    def req_ids(self) -> list[str]:
        """Sequence keys in row order (holes show as None until ``condense``)."""
        return self._req_ids  # type: ignore[return-value]

    def add_request(self, req_id: str, params: SamplingParams, prompt_token_ids: list[int],
                    output_token_ids: list[int], *, seed_index: int = 0) -> int:
        """Put a sequence in the lowest hole, or at the end; returns its row.

        ``output_token_ids`` must be the live list the engine appends to.
        ``seed_index`` is the sequence's index within an ``n > 1`` request: its
        generator is seeded with ``derive_seed(params.seed, seed_index)``.
        """
        if req_id in self.req_id_to_index:
            raise ValueError(f"req_id {req_id!r} is already in the batch")
        self.batch_update_builder.check_no_moves("add_request")
        if params.bad_words and params.bad_words_token_ids is None:
            raise ValueError("bad_words need token ids: call params.update_from_tokenizer(tokenizer) first")
        index = self.batch_update_builder.peek_removed()
        if index is None:
            index = len(self._req_ids)
            if index >= self.max_num_reqs:
                raise RuntimeError(f"InputBatch is full ({self.max_num_reqs} rows)")
            self._req_ids.append(None)
            self._rows.append(None)
        assert self._req_ids[index] is None, "adds fill holes only"
        self._req_ids[index] = req_id
        self._rows[index] = (params, prompt_token_ids, output_token_ids)
        self.req_id_to_index[req_id] = index
        self.batch_update_builder.add(index, params, prompt_token_ids, output_token_ids)

        # beam rows rank their candidates on unscaled log-probs, as greedy rows do
        greedy = params.sampling_type in (SamplingType.GREEDY, SamplingType.BEAM)
        top_k = params.top_k if 0 < params.top_k < self.vocab_size else self.vocab_size
        values = (0.0 if greedy else params.temperature, params.top_p, top_k,
                  params.frequency_penalty, params.presence_penalty, params.repetition_penalty)
        for arr, value in zip(self._buffers, values):
            arr[index] = value
        (self._greedy if greedy else self._random).add(req_id)
        flags = ((self._top_p, params.top_p < 1.0), (self._top_k, top_k < self.vocab_size),
                 (self._penalties, params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
                  or params.repetition_penalty != 1.0),
                 (self._allowed, params.allowed_token_ids is not None))
        for group, on in flags:
            if on:
                group.add(req_id)
        if params.logprobs is not None:
            self._num_logprobs[req_id] = min(params.logprobs, self.vocab_size)
            if params.logprobs_mode == "processed_logprobs":
                self._processed_logprobs.add(req_id)
        if params.bad_words_token_ids:
            self._bad_words[req_id] = params.bad_words_token_ids
        self._set_allowed_row(index, params.allowed_token_ids)
        if params.sampling_type == SamplingType.RANDOM_SEED:
            self._generators[req_id] = self._make_generator(
                derive_seed(params.seed, seed_index), len(output_token_ids))
        return index

    def _set_allowed_row(self, index: int, allowed: list[int] | None) -> None:
        if allowed is None:
            if self._allowed_mask_cpu is not None:
                self._allowed_mask_cpu[index] = False
            return
        if self._allowed_mask_cpu is None:
            self._allowed_mask_cpu = torch.zeros(self.max_num_reqs, self.vocab_size, dtype=torch.bool)
        self._allowed_mask_cpu[index] = True
        self._allowed_mask_cpu[index, allowed] = False

    def _make_generator(self, seed: int, num_done: int) -> torch.Generator:
        """A generator at the state it would have after ``num_done`` sampled tokens
        (one single-value draw each, as ``random_sample`` makes), so a sequence
        re-added after preemption continues its seeded stream exactly."""
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        if num_done:
            scratch = torch.empty(1, dtype=torch.float32, device=self.device)
            for _ in range(num_done):
                scratch.uniform_(generator=gen)
        return gen

    def remove_request(self, req_id: str) -> int | None:
        """Free the sequence's row (leaving a hole); None if it was not here."""
        if req_id not in self.req_id_to_index:
            return None
        self.batch_update_builder.check_no_moves("remove_request")
        index = self.req_id_to_index.pop(req_id)
        self._req_ids[index] = None
        self._rows[index] = None
        self.batch_update_builder.remove(index)
        for group in (self._greedy, self._random, self._top_p, self._top_k, self._penalties,
                      self._allowed, self._processed_logprobs):
            group.discard(req_id)
        for mapping in (self._num_logprobs, self._bad_words, self._generators):
            mapping.pop(req_id, None)
        return index

    def _move(self, src: int, dst: int, direction: MoveDirectionality) -> None:
        swap = direction is MoveDirectionality.SWAP
        for slots in (self._req_ids, self._rows):
            slots[dst], slots[src] = slots[src], (slots[dst] if swap else None)
        for arr in self._buffers:
            arr[dst], arr[src] = arr[src], arr[dst]
        if self._allowed_mask_cpu is not None:
            self._allowed_mask_cpu[[dst, src]] = self._allowed_mask_cpu[[src, dst]]
        for index in (src, dst):
            if self._req_ids[index] is not None:
                self.req_id_to_index[self._req_ids[index]] = index
        self.batch_update_builder.move(src, dst, direction)

    def swap_states(self, i1: int, i2: int) -> None:
        """Exchange two rows (a reorder for the attention backend's benefit)."""
        self._move(i1, i2, MoveDirectionality.SWAP)

    def condense(self) -> None:
        """Fill holes: the highest row moves into the lowest hole, until contiguous."""
        if len(self._req_ids) == self.num_reqs:
            return
        holes = [i for i, r in enumerate(self._req_ids) if r is None]
        last = len(self._req_ids) - 1
        for hole in holes:
            while last >= 0 and self._req_ids[last] is None:
                last -= 1
            if hole >= last:
                break
            self._move(last, hole, MoveDirectionality.UNIDIRECTIONAL)
            last -= 1
        del self._req_ids[self.num_reqs:], self._rows[self.num_reqs:]

    def refresh_metadata(self) -> SamplingMetadata:
        """Condense, give every processor the step's ``BatchUpdate`` (or None),
        and return the metadata for the current rows, rebuilt only on change."""
        self.condense()
        batch_update = self.batch_update_builder.get_and_reset(self.num_reqs)
        for proc in self.logitsprocs.all:
            proc.update_state(batch_update)
        if batch_update is not None or self._metadata is None:
            self._metadata = self._make_metadata()
        return self._metadata

    def _make_metadata(self) -> SamplingMetadata:
        n = self.num_reqs
        rows: list[_Row] = self._rows  # type: ignore[assignment]  # contiguous after condense

        def rows_of(t: torch.Tensor) -> torch.Tensor:  # the pinned buffers: queued, like to_device's
            return t[:n].to(self.device, non_blocking=self.is_pin_memory, copy=True)

        all_greedy, no_penalties = not self._random, not self._penalties
        prompt_ids = None
        if not no_penalties:
            longest = max((len(r[1]) for r in rows), default=0)
            padded = [r[1] + [self.vocab_size] * (longest - len(r[1])) for r in rows]
            prompt_ids = to_device(padded, torch.int64, self.device).reshape(n, longest)
        allowed = self._allowed_mask_cpu
        return SamplingMetadata(
            temperature=None if all_greedy else rows_of(self.temperature_cpu),
            all_greedy=all_greedy,
            all_random=not self._greedy,
            top_p=rows_of(self.top_p_cpu) if self._top_p else None,
            top_k=rows_of(self.top_k_cpu) if self._top_k else None,
            generators={self.req_id_to_index[r]: g for r, g in self._generators.items()},
            max_num_logprobs=max(self._num_logprobs.values()) if self._num_logprobs else None,
            processed_logprobs_rows=to_device(sorted(self.req_id_to_index[r] for r in self._processed_logprobs),
                                              torch.int64, self.device)
            if self._processed_logprobs else None,
            raw_logprobs=len(self._num_logprobs) > len(self._processed_logprobs),
            no_penalties=no_penalties,
            prompt_token_ids=prompt_ids,
            frequency_penalties=rows_of(self.frequency_penalties_cpu),
            presence_penalties=rows_of(self.presence_penalties_cpu),
            repetition_penalties=rows_of(self.repetition_penalties_cpu),
            output_token_ids=[r[2] for r in rows],
            allowed_token_ids_mask=rows_of(allowed) if self._allowed and allowed is not None else None,
            bad_words_token_ids={self.req_id_to_index[r]: w for r, w in self._bad_words.items()},
            logitsprocs=self.logitsprocs,
        )
