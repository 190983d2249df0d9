"""Deciding, after each new token, whether a sequence is done (vLLM V0's StopChecker).

Checks, in order, once the sequence has ``min_tokens`` outputs:
    eos (unless ignore_eos) -> stop_token_ids -> stop strings
then, always:
    max_model_len -> max_tokens
A stop wins over a length cap reached on the same token ("stop", not "length").
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from encdec.sequence import SequenceStatus

if TYPE_CHECKING:
    from encdec.sampling_params import SamplingParams


class StopChecker:
    """``get_tokenizer_len``, if given, returns the tokenizer's length: a sampled id
    at or past it (a padded-vocabulary row no tokenizer can decode) stops the
    sequence with that id as ``stop_reason`` instead of breaking detokenization.
    ``detokenizer`` (an ``encdec.outputs.Detokenizer``) and ``eos_token_id`` are
    what ``check`` uses: the scheduler calls it for every appended token."""

    def __init__(self, max_model_len: int,
                 get_tokenizer_len: Callable[[], int] | None = None, *,
                 detokenizer: Any = None, eos_token_id: int | None = None) -> None:
        self.max_model_len = max_model_len
        self.get_tokenizer_len = get_tokenizer_len
        self.detokenizer = detokenizer
        self.eos_token_id = eos_token_id

    def check(self, seq: Any, sampling_params: SamplingParams, *, defer_text: bool = False) -> None:
        """The token just appended to ``seq``: its text (when the request wants
        text and a detokenizer was given), then whether it ends the sequence.

        ``defer_text``: a request with no stop strings is decided by token ids
        alone, so a token that does not end its sequence may leave its text
        owed: decoded when someone reads it (``settle_text``: partial outputs)
        or, in one call for the whole output, when the sequence ends here. A
        sequence's text is never owed once it finished."""
        params = sampling_params
        if self.detokenizer is None or not params.detokenize:
            self.maybe_stop_sequence(seq, 0, params, self.eos_token_id)
            return
        if defer_text and not params.stop:
            self.maybe_stop_sequence(seq, 0, params, self.eos_token_id)
            if seq.is_finished():  # eos or a stop token id (not its text): as maybe_stop_sequence
                self.settle_text(seq, params, trim_last=seq.status == SequenceStatus.FINISHED_STOPPED)
            return
        added = self.detokenizer.decode_sequence_inplace(seq, params)
        self.maybe_stop_sequence(seq, added, params, self.eos_token_id)

    def quick_rule(self, seq: Any, sampling_params: SamplingParams) -> tuple[int, frozenset[int], int] | None:
        """What ``check(defer_text=True)`` decides by token ids alone, for a
        sequence without stop strings: ``(limit, stop_ids, vocab_end)``. A new
        token ``t`` at output length ``n`` leaves the sequence running, with
        nothing else for ``check`` to do, when ``n < limit`` (``max_tokens``,
        ``max_model_len``), ``t not in stop_ids`` (eos unless ignored, the stop
        ids) and ``t < vocab_end`` (the tokenizer's length); any other token goes
        to ``check``. None: every token goes to ``check`` (stop strings)."""
        params = sampling_params
        if params.stop:
            return None
        limit = self.max_model_len - seq.get_prompt_len()
        if params.max_tokens is not None:
            limit = min(limit, params.max_tokens)
        stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos and self.eos_token_id is not None:
            stop_ids.add(self.eos_token_id)
        vocab_end = self.get_tokenizer_len() if self.get_tokenizer_len is not None else 1 << 62
        return limit, frozenset(stop_ids), vocab_end

    def settle_text(self, seq: Any, sampling_params: SamplingParams, *, trim_last: bool = False) -> None:
        """Decode the text ``check`` left owed. ``trim_last``: the newest token
        ended the sequence as a stop token, so its text is cut as
        ``maybe_stop_sequence`` cuts it."""
        params = sampling_params
        if self.detokenizer is None or not params.detokenize:
            return
        if trim_last:
            self._trim_token_text(seq, self.detokenizer.decode_sequence_inplace(seq, params), params)
        else:
            self.detokenizer.decode_owed(seq, params)

    def maybe_stop_sequence(self, seq: Any, new_char_count: int, sampling_params: SamplingParams,
                            eos_token_id: int | None = None) -> None:
        """Set ``seq.status`` (and ``stop_reason``, and trim ``output_text``) if
        the token just appended ends the sequence. ``new_char_count`` is how many
        characters that token added to ``seq.output_text``."""
        params = sampling_params
        out_len = seq.get_output_len()  # read once: this runs for every token of every row
        if out_len >= params.min_tokens:
            last = seq.get_last_token_id()
            if not params.ignore_eos and eos_token_id is not None and last == eos_token_id:
                self._trim_token_text(seq, new_char_count, params)
                seq.status = SequenceStatus.FINISHED_STOPPED
                return
            if last in params.stop_token_ids or self._undecodable(last):
                self._trim_token_text(seq, new_char_count, params)
                seq.status = SequenceStatus.FINISHED_STOPPED
                seq.stop_reason = last
                return
            stop = (self.check_stop_strings(seq.output_text, new_char_count, params.stop,
                                            params.include_stop_str_in_output)
                    if new_char_count and params.stop else None)
            if stop is not None:
                stop_str, truncate_to = stop
                if truncate_to != -1:
                    seq.output_text = seq.output_text[:truncate_to]
                seq.status = SequenceStatus.FINISHED_STOPPED
                seq.stop_reason = stop_str
                return
        if seq.get_len() >= self.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
            return
        if params.max_tokens is not None and out_len >= params.max_tokens:
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED

    def _undecodable(self, token_id: int) -> bool:
        return self.get_tokenizer_len is not None and token_id >= self.get_tokenizer_len()

    @staticmethod
    def _trim_token_text(seq: Any, new_char_count: int, params: SamplingParams) -> None:
        # The stop token's own text (e.g. "</s>" when special tokens are shown) is
        # not output unless the user asked for stop strings in the output.
        if new_char_count and not params.include_stop_str_in_output:
            seq.output_text = seq.output_text[:-new_char_count]

    @staticmethod
    def check_stop_strings(output_text: str, new_char_count: int, stop: list[str],
                           include_in_output: bool) -> tuple[str, int] | None:
        """First stop string found in the new text (plus the overlap a string
        could straddle); returns it and where to cut (-1: no cut), else None."""
        if not new_char_count or not stop:
            return None
        for stop_str in stop:
            # Only text that could contain a new match: the new characters and
            # len(stop_str) - 1 before them. Earlier text was searched last step.
            start = max(0, len(output_text) - new_char_count - len(stop_str) + 1)
            index = output_text.find(stop_str, start)
            if index == -1:
                continue
            if include_in_output:
                index += len(stop_str)
                if index >= len(output_text):
                    return stop_str, -1
            return stop_str, index
        return None
