"""Per-sequence grammar state: the scheduler's ``StructuredDecider``.

A constrained request's decoder sequences each get an xgrammar matcher, made
on their first scheduled step from the request's compiled grammar (compiled
and cached when the request was processed) and kept here, by seq_id, until
the sequence finishes or its group is freed. Each step:

    fill_masks  (schedule)  one bitmask row per constrained running sequence:
                            the tokens its grammar allows next
    accept      (update)    each appended token advances its sequence's matcher;
                            a terminated grammar ends the sequence ("stop")
    fork / free (update)    a beam forked from a parent copies the parent's
                            matcher before either appends; dropped beams free theirs

A beam whose only candidates were masked (score -inf: fewer allowed
continuations than beams) appends a token its grammar refuses (or ends it);
its matcher is marked dead (or stays terminated) and its rows allow
everything from then on. It never becomes a
returned hypothesis: its score stays -inf, below the pool's -1e9 placeholders.

Whisper (``passthrough_from``): the grammar covers the text tokens only; every
id from ``passthrough_from`` on (start-of-transcript, language, task,
no-timestamps, timestamps) is allowed as the model's own rules decide and is
never fed to the matcher, until the grammar's text is done: then one
timestamp may close the text and end-of-text (the grammar's stop token) is
all a row allows after it, so a window ends where its text does (a timestamp
pair after it would be a segment the long-form seek decodes again). The
other models' special tokens (pad, bos, unk, sentinels) are never allowed;
their eos is the stop token. A checkpoint's forced first token (mBART's,
M2M100's and NLLB's target language: ``forced_bos_token_id``, forced at
decoder length 1) is not covered either: that step's row is left to its
processor, the token not fed. The checkpoint's forced eos at ``max_tokens`` is
not applied to a constrained request (``Processor``): its grammar decides
where it ends, and one that runs out of tokens finishes with "length".
"""
from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from encdec.core.scheduler_outputs import TokenMasks
from encdec.sequence import Sequence, SequenceGroup, SequenceStatus
from encdec.structured_output.backend import GrammarCompiler, import_xgrammar, tokenizer_info
from encdec.structured_output.params import StructuredOutputsParams

logger = logging.getLogger("encdec")


class StructuredOutputManager:
    """``vocab_size``: the logits' width. Builds nothing until the first
    constrained request (then xgrammar's view of ``tokenizer``, once)."""

    def __init__(self, tokenizer: Any, *, vocab_size: int, eos_token_id: int | None,
                 passthrough_from: int | None = None):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.passthrough_from = passthrough_from
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._states: dict[int, _SeqState] = {}  # seq_id -> its grammar state
        self._fixed: tuple[Any, Any] | None = None  # (bits to clear, bits to set) in every row
        self._bitmask: Any = None  # the step's masks (_buffer)
        self._eos_row: Any = None  # (words,) int32: eos alone (a grammar whose text is done)

    @property
    def compiler(self) -> GrammarCompiler:
        """Built on first use, once (callers off the engine thread may race to it)."""
        with self._lock:
            if self._compiler is None:
                stop = [] if self.eos_token_id is None else [self.eos_token_id]
                self._compiler = GrammarCompiler(tokenizer_info(self._tokenizer, self.vocab_size, stop))
        return self._compiler

    def compile(self, params: StructuredOutputsParams) -> None:
        """The processor's check, before a request is queued: compiles (or finds
        cached) the grammar; a constraint xgrammar refuses is a ``ValueError``."""
        self.compiler.compile(params)

    # -- the scheduler's hooks -------------------------------------------------
    def fill_masks(self, groups: list[SequenceGroup]) -> TokenMasks | None:
        """This step's masks for the constrained running sequences of ``groups``;
        None when no group is constrained."""
        seqs = [(seq, g) for g in groups if g.sampling_params is not None
                and g.sampling_params.structured_outputs is not None
                for seq in g.get_seqs(SequenceStatus.RUNNING)]
        if not seqs:
            return None
        bitmask = self._buffer(len(seqs))  # (rows, words) int32, all allowed
        filled = []
        for i, (seq, group) in enumerate(seqs):
            state = self._state(seq, group)
            if state.forcing(seq):  # the checkpoint's forced first token: its processor decides
                continue
            if state.matcher is not None and not state.matcher.is_terminated():  # a -inf beam may append eos
                state.matcher.fill_next_token_bitmask(bitmask, i)
            filled.append(i)
        clear, add = self._fixed_bits()
        for i in filled:  # in place, row by row (an indexed update copies the rows twice)
            bitmask[i] &= clear
            # pass-through tokens; once the text is done, one closing timestamp
            if add is not None and (not torch.equal(bitmask[i], self._eos_row)
                                    or not self._passes(seqs[i][0].get_last_token_id())):
                bitmask[i] |= add
        return TokenMasks({seq.seq_id: i for i, (seq, _) in enumerate(seqs)}, bitmask)

    def accept(self, seq: Sequence, token_id: int) -> bool:
        """Advance ``seq``'s matcher by its appended token; True when its grammar
        is done (terminated) or refused the token: the sequence must end."""
        state = self._states.get(seq.seq_id)
        if state is None or state.matcher is None or self._passes(token_id):
            return False
        if seq.get_len() == 2 and token_id == state.forced_bos:  # appended at length 1: forced
            return False
        if state.matcher.is_terminated():  # a -inf beam that appended eos and runs on
            return True
        if not state.matcher.accept_token(token_id):
            # a beam's -inf candidate (module docstring); else the processors left no allowed token
            logger.debug("structured outputs: sequence %d appended token %d its grammar refuses",
                         seq.seq_id, token_id)
            state.matcher = None
            return True
        return state.matcher.is_terminated()

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` (a beam forked from ``parent``, same tokens) continues from the parent's grammar state."""
        state = self._states.get(parent.seq_id)
        if state is not None:
            matcher = None if state.matcher is None else state.matcher.fork()
            self._states[child.seq_id] = _SeqState(matcher, state.forced_bos)

    def free(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._states.pop(seq_id, None)

    # -- internals -------------------------------------------------------------
    def _passes(self, token_id: int) -> bool:
        return self.passthrough_from is not None and token_id >= self.passthrough_from

    def _state(self, seq: Sequence, group: SequenceGroup) -> _SeqState:
        """``seq``'s grammar state, made on its first step (its outputs so far replayed)."""
        state = self._states.get(seq.seq_id)
        if state is not None:
            return state
        xgr = import_xgrammar()
        params = group.sampling_params
        state = _SeqState(xgr.GrammarMatcher(self.compiler.compile(params.structured_outputs)),
                          (params.extra_args or {}).get("forced_bos_token_id"))
        for i, token_id in enumerate(seq.get_output_token_ids()):
            if self._passes(token_id) or i == 0 and seq.get_prompt_len() == 1 and token_id == state.forced_bos:
                continue
            if not state.matcher.accept_token(token_id):
                state.matcher = None
                break
        self._states[seq.seq_id] = state
        return state

    def _buffer(self, rows: int) -> Any:
        """``rows`` rows of all-allowed words. One buffer, grown as needed, reused
        each step: the runner copies its rows out before the next ``fill_masks``."""
        have = 0 if self._bitmask is None else len(self._bitmask)
        if have < rows:
            self._bitmask = import_xgrammar().allocate_token_bitmask(max(rows, 2 * have), self.vocab_size)
        return self._bitmask[:rows].fill_(-1)

    def _fixed_bits(self) -> tuple[Any, Any]:
        """(a row that clears the special tokens a grammar never allows, a row
        that sets the pass-through tokens or None), both (words,) int32."""
        if self._fixed is None:
            xgr = import_xgrammar()
            clear = xgr.allocate_token_bitmask(1, self.vocab_size)[0]
            specials = set(getattr(self._tokenizer, "all_special_ids", ()) or ()) - {self.eos_token_id}
            for t in specials:
                if 0 <= t < self.vocab_size and not self._passes(t):
                    clear[t // 32] &= ~_bit(t)
            add = None
            self._eos_row = xgr.allocate_token_bitmask(1, self.vocab_size)[0].zero_()
            if self.eos_token_id is not None:
                self._eos_row[self.eos_token_id // 32] = _bit(self.eos_token_id)
            if self.passthrough_from is not None:
                add = xgr.allocate_token_bitmask(1, self.vocab_size)[0].zero_()
                for t in range(self.passthrough_from, self.vocab_size):
                    add[t // 32] |= _bit(t)
            self._fixed = (clear, add)
        return self._fixed


class _SeqState:
    """One sequence's matcher (None: dead, see the module docstring) and the
    checkpoint's forced first token, which the grammar does not cover."""

    __slots__ = ("matcher", "forced_bos")

    def __init__(self, matcher: Any, forced_bos: int | None):
        self.matcher = matcher
        self.forced_bos = forced_bos

    def forcing(self, seq: Sequence) -> bool:
        """The step whose token the forced-BOS processor chooses (HF's rule: at decoder length 1)."""
        return self.forced_bos is not None and seq.get_len() == 1


def _bit(token_id: int) -> int:
    """The token's bit in its int32 word, as a signed value (bit 31 is the sign)."""
    b = 1 << (token_id % 32)
    return b - (1 << 32) if b >= 1 << 31 else b
